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
from collections import OrderedDict
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
    drops the others, and copying the model is most of a dry run's time."""
    if cache is None:
        return shape.original()
    model = _whole(shape, cache)
    memo: dict = {}
    if pipe is not None and pipe.blocks_of:
        stack = model.get_submodule(pipe.stack_name)
        held = {str(i) for c in pipe.chunks for i in c.blocks}
        memo[id(stack)] = _clone(stack, memo, keep=held)
    return _clone(model, memo)


def _clone(module, memo: dict, keep: Optional[set] = None):
    """A copy of `module`'s tree of modules (with `keep`: of those of its
    children only): each module new, with its own dicts of parameters,
    children and hooks, and its own meta parameters (a rewrite records a
    ShardSpec on each, and swaps children); buffers and other attributes (a
    config, the parameters' initial values) shared, which a dry run only
    reads. `memo`: id -> copy, so a module or parameter held twice stays one.
    Faster than copy.deepcopy, which copies each module's every dict and
    attribute through its generic protocol."""
    if id(module) in memo:
        return memo[id(module)]
    new = object.__new__(type(module))
    new.__dict__.update({k: v.copy() if type(v) in _CONTAINERS else v for k, v in module.__dict__.items()})
    params = new.__dict__["_parameters"]
    for name, p in params.items():
        if p is not None:
            if id(p) not in memo:
                memo[id(p)] = copy.deepcopy(p)
            params[name] = memo[id(p)]
    children = new.__dict__["_modules"]
    for name in list(children):
        if keep is not None and name not in keep:
            del children[name]
        elif children[name] is not None:
            children[name] = _clone(children[name], memo)
    memo[id(module)] = new
    return new


_CONTAINERS = (dict, OrderedDict, set, list)
