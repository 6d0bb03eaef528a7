"""The planner's dry runs, reused: `plan_split` rewrites the meta model for
each rank it costs, and a pipeline's cut traces the whole model first --
most of a plan's time. layout=auto costs the same rewrite under every ZeRO
stage, schedule and micro-batch count, and the same cut under every mode,
so with a cache each is done once; the model's trace is read once for every
cut (any pp, schedule and chunk count), and each rewrite starts from a copy
of one meta model rather than building it again. What a rewritten stage
holds (`stage_held`: its parameters' shards, ZeRO plan and replica sums) is
counted once per split too, whatever its schedule and micro-batches."""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Optional

from tpctl.parallel.layout import Layout
from tpctl.parallel.pipeline.stages import PipelineSpec

from .layer_comm import kv_keys, kv_replica_sums, kv_shared, sliced_sums

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
            # mode: the record a cut read (a frozen StageMap) is adopted by
            # every later one, as it is under the same cut, its blocks placed
            # again under another (what a trace reads depends on the model
            # and seq_len only).
            known = cache.get(("cut", cut)) or cache.get(("read", cut.seq_len))
            if known is not None:
                pipe.adopt(known)
        found = (par, par.rewrite(_original(shape, cache, pipe), shape.plan, dry_run=True, stage=True).model)
        if cache is None:
            return par, pipe, found[1]
        if pipe is not None:  # (read by the cut of the rewrite, where no record was known)
            cache[("cut", cut)] = cache[("read", cut.seq_len)] = pipe.stage_map
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
    if pipe is not None and pipe.stage_map is not None:
        stack = model.get_submodule(pipe.stage_map.stack_name)
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


# --------------------------------------------------------------------------
# What a rewritten stage holds


@dataclass
class Held:
    """What a rank's rewritten stage holds, whatever the batch and its
    micro-batches (the dry-run cache keeps it: layout=auto costs a split
    under every schedule and micro-batch count)."""

    linears: list  # shape.linears the stage holds
    holds: Callable[[str], bool]  # whether it holds a module of the model's layers (asked at every micro-batch size)
    dp_plan: Any  # zero_plan.Plan, with data parallelism
    early: list[tuple[str, int]]  # (group, numel) of each gradient summed during the backward
    sums: list[tuple[str, int]]  # (group, numel) the grid's replica sums reduce after it
    numel: dict[str, int]  # elements of parameters, gradients and each AdamW moment held
    tensors: int  # AdamW's step counts (one fp32 scalar each)
    tied_numel: int
    gathered: int  # ZeRO-3's largest gathered unit


def stage_held(shape: Any, layout: Layout, rank: int, mode, model, holds, bucket_bytes: Optional[int],
               pipeline: Optional[PipelineSpec] = None, cache: Optional[dict] = None) -> Held:
    """Parameters: this rank's shard of each (ShardSpec), those of its
    pipeline stage only (the stage a worker holds, cut by the dry run;
    tied ones once); with data parallelism the buckets and ZeRO chunks
    the training step makes of them (parallel/data_parallel/zero_plan.py, the same
    plan); and the replica buckets sync_replicas all-reduces. Shared
    key/value heads (their replicas are learnt from what every rank of the
    tensor group holds, replicas.share_slices): from the dry runs of those
    ranks (stage_rewrite with `pipeline` and `cache`), only where a model
    shares some."""
    from tpctl.parallel.data_parallel import zero_plan
    from tpctl.parallel.shard import spec_of

    named = list(model.named_parameters())
    # A weight the end stages both hold (an embedding tied to the LM head): its record says so.
    tied_numel = sum(math.prod(spec_of(p).local_shape()) for _, p in named if len(spec_of(p).stage_ranks) > 1)
    dp_plan = None
    if layout.dp * layout.cp > 1:  # (cp ranks hold the same parameters: replicas of the reduction)
        units = zero_plan.units_of([model], [p for _, p in named]) if layout.zero == 3 else None
        dp_plan = zero_plan.plan(named, layout.dp * layout.cp, layout.zero, bucket_bytes or zero_plan.BUCKET_BYTES, units)
    kv_sums, kv_held = [], {}
    if shared := kv_shared(shape.plan, mode.geo.head_split, mode):
        tp = members(layout, "tp", rank)
        everyone = [_kv_keys(model if r == rank else stage_rewrite(shape, layout, r, pipeline, cache)[2], shared, cache)
                    for r in tp]
        kv_held = everyone[tp.index(rank)]  # (their ShardSpecs are share_slices', not the dry run's)
        kv_sums = kv_replica_sums(everyone, tp.index(rank), named, dp_plan)
    param_numel = 0
    buckets: dict[str, int] = defaultdict(int)
    early: list[tuple[str, int]] = []
    for i, (name, p) in enumerate(named):
        spec = spec_of(p)
        param_numel += (numel := math.prod(spec.local_shape()))
        if spec.partial_grad and len(spec.replica_ranks) > 1 and name not in kv_held:
            group = _replica_group(layout, spec, rank)
            if group is None:
                raise ValueError(f"parameter {name!r}: its replicas {spec.replica_ranks} are no group of the mesh")
            if mode.sums_during_backward(spec):  # issued as its gradient is final, beside the backward
                early.append((group, numel))
            else:
                buckets[group] += dp_plan.grad_numel(i) if dp_plan else numel
    sums = [*buckets.items(), *sliced_sums(shape.plan, mode, named, dp_plan), *kv_sums]
    numel = dp_plan.held_numel() if dp_plan else {"param": param_numel, "grad": param_numel, "moment": param_numel}
    layers = shape.layers
    names = [*shape.embeddings, *layers.norms, *layers.proj_norms, *layers.latents, *layers.routers, *layers.untrained,
             *layers.wholes, *layers.experts, *layers.head_reduces]
    return Held([lin for lin in shape.linears if holds(lin[0])], frozenset(filter(holds, names)).__contains__, dp_plan,
                early, sums, numel, len(named), tied_numel, dp_plan.unit_numel() if dp_plan else 0)


def _kv_keys(model, shared: list[str], cache: Optional[dict]) -> dict:
    """layer_comm.kv_keys of a rank's dry run, once per cached rewrite (the
    planner plans every rank of the tensor group, each reading them all)."""
    if cache is None:
        return kv_keys(model, shared)
    key = ("kv_keys", id(model))  # (the cached model: one per rewrite)
    if key not in cache:
        cache[key] = kv_keys(model, shared)
    return cache[key]


def _replica_group(layout: Layout, spec, rank: int = 0) -> Optional[str]:
    """The mesh group whose members are exactly `spec`'s replicas (`rank`'s view)."""
    replicas = tuple(sorted(spec.replica_ranks))
    names = (*layout.mode_class.grid_groups, "tp")
    return next((name for name in names if members(layout, name, rank) == replicas), None)


@functools.lru_cache(maxsize=1 << 16)
def members(layout: Layout, group: str, rank: int) -> tuple[int, ...]:
    """The ranks of `rank`'s group `group`, sorted (cached: a search asks for
    them at every parameter of every split)."""
    return tuple(sorted(layout.group_of(group, rank)))
