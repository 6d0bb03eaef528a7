"""The planner's dry runs, reused: `plan_split` rewrites the meta model for
each rank it costs, and a pipeline's cut traces the whole model first --
most of a plan's time. layout=auto costs the same rewrite under every ZeRO
stage, schedule and micro-batch count, and the same cut under every mode,
so with a cache each is done once."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Optional

from tpctl.parallel.layout import Layout
from tpctl.parallel.stages import PipelineSpec

# What StageCut.assign sets: names, block indices and shapes, no tensor of the model it read.
_ASSIGNED = ("stack_name", "blocks_of", "beside", "hidden", "weights", "chunks")


def stage_rewrite(shape: Any, layout: Layout, rank: int, pipeline: Optional[PipelineSpec], cache: Optional[dict]):
    """(the Parallelism of `rank`, its pipeline read with `pipeline`'s
    schedule and micro-batches, the model rewritten on it, shapes only).
    `shape`: planner.ModelShape; `cache`: a dict kept between calls, or None."""
    from tpctl.parallel.parallelism import parallelism

    cut = pipeline and dataclasses.replace(pipeline, schedule="", microbatches=0)
    key = (layout.replace(zero=0), rank, cut)
    if cache is None or key not in cache:
        par = parallelism(layout, groups=False, rank=rank, pipeline=pipeline)
        pipe = par.pipeline
        if pipe is not None and cache is not None:
            # Where the blocks go depends on the model and the cut, not on the
            # mode: a stage assigned once is copied (StageCut.assign then
            # returns at once), which saves its trace of the model.
            assigned = cache.setdefault(("cut", cut, pipe.rank), pipe)
            if assigned is not pipe:
                pipe.__dict__.update({a: getattr(assigned, a) for a in _ASSIGNED})
        found = (par, shape.rewritten(par))
        if cache is None:
            return par, pipe, found[1]
        cache[key] = found
    par, model = cache[key]
    pipe = par.pipeline
    if pipe is not None and pipe.spec != pipeline:  # a cached cut, read with this schedule and micro-batches
        pipe = copy.copy(pipe)
        pipe.spec = pipeline
    return par, pipe, model
