"""The planner's dry runs, reused: `plan_split` rewrites the meta model for
each rank it costs, and a pipeline's cut traces the whole model first --
most of a plan's time. layout=auto costs the same rewrite under every ZeRO
stage, schedule and micro-batch count, and the same cut under every mode,
so with a cache each is done once; the model's trace is read once for every
cut (any pp, schedule and chunk count), and each rewrite starts from a copy
of one meta model rather than building it again."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Optional

from tpctl.parallel.layout import Layout
from tpctl.parallel.stages import PipelineSpec

# What StageCut.assign sets: names, block indices and shapes, no tensor of the model it read.
_ASSIGNED = ("stack_name", "block_keys", "blocks_of", "beside", "hidden", "weights", "chunks")
# What of it depends on the model and seq_len only (StageCut._read): the same for every cut.
_READ = ("stack_name", "block_keys", "beside", "hidden", "weights")


def stage_rewrite(shape: Any, layout: Layout, rank: int, pipeline: Optional[PipelineSpec], cache: Optional[dict]):
    """(the Parallelism of `rank`, its pipeline read with `pipeline`'s
    schedule and micro-batches, the model rewritten on it, shapes only).
    `shape`: planner.ModelShape; `cache`: a dict kept between calls (for
    one shape), or None."""
    from tpctl.parallel.parallelism import parallelism

    cut = pipeline and dataclasses.replace(pipeline, schedule="", microbatches=0)
    key = (layout.replace(zero=0), rank, cut)
    if cache is None or key not in cache:
        par = parallelism(layout, groups=False, rank=rank, pipeline=pipeline)
        pipe = par.pipeline
        if pipe is not None and cache is not None:
            # Where the blocks go depends on the model and the cut, not on the
            # mode: a stage assigned once is copied (StageCut.assign then
            # returns at once); another cut of the model skips its trace.
            assigned = cache.setdefault(("cut", cut, pipe.rank), pipe)
            read = cache.setdefault(("read", cut.seq_len), pipe)
            if assigned is not pipe:
                pipe.__dict__.update({a: getattr(assigned, a) for a in _ASSIGNED})
            elif read is not pipe:
                pipe.__dict__.update({a: getattr(read, a) for a in _READ})
                pipe.assign(_whole(shape, cache))  # places the blocks (reads nothing of the model)
        found = (par, par.parallelize(_original(shape, cache, pipe), shape.plan, dry_run=True, stage=True))
        if cache is None:
            return par, pipe, found[1]
        cache[key] = found
    par, model = cache[key]
    pipe = par.pipeline
    if pipe is not None and pipe.spec != pipeline:  # a cached cut, read with this schedule and micro-batches
        pipe = copy.copy(pipe)
        pipe.spec = pipeline
    return par, pipe, model


def _whole(shape: Any, cache: dict):
    if "model" not in cache:
        cache["model"] = shape.original()
    return cache["model"]


def _original(shape: Any, cache: Optional[dict], pipe=None):
    """The whole model on the meta device, as a rewrite takes it: built, or
    (with a cache) a copy of the one built -- each rewrite changes its own.
    A pipeline stage whose blocks are placed gets only those: the cut
    drops the others, and copying the model is most of a dry run's time.
    The parameters' initial values are no dry run's: their source is shared."""
    if cache is None:
        return shape.original()
    model = _whole(shape, cache)
    memo = {id(model.tpctl_init): model.tpctl_init} if hasattr(model, "tpctl_init") else {}
    if pipe is not None and pipe.blocks_of:
        stack = model.get_submodule(pipe.stack_name)
        held = {str(i) for c in pipe.chunks for i in c.blocks}
        trimmed = copy.copy(stack)  # (a new module sharing the stack's dicts: its blocks replaced below)
        trimmed.__dict__["_modules"] = type(stack._modules)((k, m) for k, m in stack._modules.items() if k in held)
        memo[id(stack)] = copy.deepcopy(trimmed, memo)
    return copy.deepcopy(model, memo)
