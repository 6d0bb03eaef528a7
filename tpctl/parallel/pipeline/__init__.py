"""Pipeline parallelism: the stage layout (stages.py), what a cut reads of a model (stage_map.py), a model
cut into stages (cut.py) and the schedule that runs micro-batches through them (schedule.py)."""
