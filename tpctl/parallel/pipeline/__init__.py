"""Pipeline parallelism: the stage layout (stages.py), a model cut into stages (cut.py) and the
schedule that runs micro-batches through them (schedule.py)."""
