"""Every refusal of a run config's `pipeline.*` keys (and of what pp > 1
asks of train.*), one ConfigError naming the key, before any worker starts.
Reading the keys into a `PipelineSpec` is the stages' own
(parallel/pipeline/stages.py `pipeline_of`), which a worker calls on a
config this module has accepted."""

from __future__ import annotations

from typing import Any, Optional

from tpctl.errors import ConfigError
from tpctl.parallel.layout import Layout
from tpctl.parallel.pipeline.stages import (
    SCHEDULES,
    TARGET_BUBBLE,
    PipelineSpec,
    default_microbatches,
    least_microbatches,
    pipeline_key,
    pipeline_of,
    schedule_takes,
)


def check_pipeline(layout: Layout, cfg: Any) -> Optional[PipelineSpec]:
    """The pipeline of `cfg` in `layout` (stages.pipeline_of; None without
    stages), once its keys are accepted: ConfigError names the first bad
    key. The keys' values are checked as written whatever pp is: a bad
    value is refused even where this run does not use it."""
    _check(cfg, layout.pp, layout.dp * layout.geo.batch_split)
    return pipeline_of(layout, cfg)


def _check(cfg: Any, pp: int, row_split: int) -> None:
    """Refuse the first key of a run config with `pp` stages whose every
    micro-batch is split into `row_split` row blocks (dp x the mode's
    batch split) that the pipeline cannot take."""
    schedule = pipeline_key(cfg, "schedule")
    if schedule not in SCHEDULES:
        raise ConfigError("pipeline.schedule", schedule, f"expected one of {', '.join(SCHEDULES)}")
    # The counts are checked as written whatever pp is: a bad value is
    # refused even where this run does not use it.
    virtual, m = pipeline_key(cfg, "virtual_stages"), pipeline_key(cfg, "microbatches")
    if type(virtual) is not int or virtual < 2:
        raise ConfigError("pipeline.virtual_stages", virtual, "the interleaved schedule runs several chunks per rank: expected 2 or more")
    if m is not None and (type(m) is not int or m < 1):
        raise ConfigError("pipeline.microbatches", m, "expected a positive number of micro-batches (or null)")
    if pp == 1:  # one stage: nothing below applies
        return
    virtual = virtual if schedule == "interleaved" else 1
    split = pipeline_key(cfg, "split")
    if split is not None:
        split = tuple(split)
        if len(split) != pp * virtual or any(type(s) is not int or s < 1 for s in split):
            where = f"pp={pp}" + (f" x virtual_stages={virtual}" if virtual > 1 else "")
            raise ConfigError("pipeline.split", list(split), f"expected {pp * virtual} positive numbers of blocks ({where}), first stage first")
    t = cfg.train
    if t.grad_accum != 1:
        raise ConfigError("train.grad_accum", t.grad_accum, "with pp > 1 the pipeline's micro-batches split the batch: "
                          "expected train.grad_accum=1 (set pipeline.microbatches)")
    least = least_microbatches(schedule, pp, virtual)
    spec = PipelineSpec(pp, schedule, virtual, 1, split)  # (its label, for the message)
    if m is None:
        m = default_microbatches(schedule, pp, virtual, t.batch_size, row_split)
        if m is None:
            raise ConfigError("pipeline.microbatches", None,
                              f"by default the fewest micro-batches that keep the bubble of {spec.label_without_m()} at or below "
                              f"{TARGET_BUBBLE:.0%} (at least {least}) and divide train.batch_size={t.batch_size} into "
                              f"{row_split}-row blocks (dp x the mode's batch split): none does; set pipeline.microbatches "
                              f"or train.batch_size (a multiple of {least * row_split})")
    else:
        if schedule == "1f1b" and m < pp:
            raise ConfigError("pipeline.microbatches", m, f"1f1b keeps one micro-batch per stage in flight: expected at least pp={pp}")
        if not schedule_takes(schedule, pp, m):
            rounds = max(1, m // pp)
            raise ConfigError("pipeline.microbatches", m, f"the interleaved schedule runs micro-batches in rounds of pp={pp}: "
                              f"expected a multiple of {rounds} rounds (e.g. {rounds * pp})")
    if t.batch_size % (m * row_split):
        raise ConfigError("train.batch_size", t.batch_size,
                          f"the global batch is split into pipeline.microbatches({m}) x {row_split} row blocks "
                          f"(dp x the mode's batch split): expected a positive multiple of {m * row_split}")

