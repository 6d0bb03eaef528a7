"""The planner's count of the layers that are not Linears of a linear role:
norms over the stream (a LayerNorm's two moments or an RMSNorm's one), a
latent attention's down-projections (their entry makes whole rows of the
attention's rows), mixture-of-experts routers and modules run whole (fed
whole rows; a mixer split by heads: its input's gradient
and its partial output summed, and a sum inside it, Mamba-1's x_proj) and experts
modules (in 3-d Linear weights, or run by a model's own forward), each by
its mode's `cost_*` hook (parallel/tensor/cost_hooks.py). Read once from the model
on the meta device and its role plan, never by running it; a module the
traced forward calls several times (RolePlan.calls) counted that many
times (`repeated`).

Norms over all heads of q or k (`proj_norm`, OLMo-2's) are counted by the
role of the projection they normalise (`cost_proj_norm`). Key/value heads
shared by several ranks are summed over those (`kv_replica_sums`: the sets
of holders cut from dry runs of every rank of the tensor group, as
replicas.share_slices cuts them), and a Linear holding them sends blocks of
its whole heads (`held_out_features`). Not counted: with
1d sequence parallelism the gather an attention or MLP module's entry makes
for all its Linears (Hugging Face families).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import torch.nn as nn

from tpctl.parallel.roles.experts import OwnSplit, experts_layout
from tpctl.parallel.roles.fused import FusedLayout
from tpctl.parallel.roles.mixers import MixerSplit, heads_split, kept_rows
from tpctl.parallel.roles.probes import is_rms_norm, norm_width
from tpctl.parallel.shard import spec_of
from tpctl.parallel.tensor.cost_hooks import KV_REPLICAS, ExpertsShape
from tpctl.parallel.tensor.replicas import holder_pieces, shard_key, shared_params
from tpctl.parallel.tensor.rewrite import held_by_heads_or_slices, per_head_params


@dataclass
class LayerShapes:
    hidden: int  # the residual stream's width
    heads: int  # query heads of the first attention (0: none found)
    norms: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (width, moments)
    # norms over all heads of q or k -> (their projection's role, moments)
    proj_norms: dict[str, tuple[str, int]] = field(default_factory=dict)
    latents: list[str] = field(default_factory=list)
    routers: list[str] = field(default_factory=list)
    untrained: list[str] = field(default_factory=list)  # modules returning indices (role `untrained`)
    wholes: list[str] = field(default_factory=list)  # modules run whole (role `whole`)
    mixers: dict = field(default_factory=dict)  # those of them with a split by heads (roles/mixers.py)
    experts: dict[str, ExpertsShape] = field(default_factory=dict)
    # per-head reductions (`head_reduce`) -> (their source projection's role, their outputs: one per head)
    head_reduces: dict[str, tuple[str, int]] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)  # modules called more than once a forward (RolePlan.calls)


def layer_shapes(model: nn.Module, plan, model_cfg) -> LayerShapes:
    """The shapes of `model`'s (meta device, linearized) layers other than
    Linears, by their roles in `plan` (a roles.RolePlan); the stream's
    width is the token embedding's, the config's without one."""
    roles = plan.roles
    tables = [model.get_submodule(n).weight for n, r in roles.items() if r == "embedding"]
    heads = next(iter(plan.heads.values())).heads if plan.heads else getattr(model_cfg, "n_head", 0)
    out = LayerShapes(tables[0].shape[1] if tables else getattr(model_cfg, "n_embd", 0), heads,
                      calls=dict(getattr(plan, "calls", {})))
    for name, role in roles.items():
        module = model.get_submodule(name)
        if role == "norm":
            out.norms[name] = (norm_width(module), 1 if is_rms_norm(module) else 2)
        elif role == "proj_norm":
            out.proj_norms[name] = (roles[plan.sources[name]], 1 if is_rms_norm(module) else 2)
        elif role == "head_reduce":
            out.head_reduces[name] = (roles[plan.sources[name]], module.out_features)
        elif role == "latent":
            out.latents.append(name)
        elif role == "router":
            out.routers.append(name)
        elif role == "untrained":
            out.untrained.append(name)
        elif role == "whole":
            out.wholes.append(name)
            if isinstance(plan.layouts.get(name), MixerSplit):
                out.mixers[name] = plan.layouts[name]
        elif role == "experts":
            routed, rows = plan.routed.get(name, 0), plan.expert_rows.get(name, 1)
            if isinstance(plan.layouts.get(name), OwnSplit):
                out.experts[name] = ExpertsShape(0, 0, 0, routed, own=True, rows=rows)
            else:
                gate_up, down, _ = experts_layout(module)
                (experts, n, _), inner = getattr(module, gate_up).shape, getattr(module, down).shape[2]
                out.experts[name] = ExpertsShape(experts, n, inner, routed, own=False, rows=rows)
    return out


def repeated(add, calls: int):
    """`add` (planner._Counter.add) counting every collective `calls` times:
    those of a module the forward calls `calls` times (RolePlan.calls), each
    call sending what one does."""
    if calls == 1:
        return add
    return lambda kind, group, numel, times=1, **k: add(kind, group, numel, times=times * calls, **k)


def count_layers(layers: LayerShapes, mode, add, tokens: int, holds: Callable[[str], bool]) -> int:
    """Count one micro-batch of `tokens` rows through the layers of
    `layers` this rank (`holds`: its pipeline stage) holds, with `add`
    (planner._Counter.add), each as many times as the forward calls it
    (`layers.calls`); the activation elements they keep."""
    act, hidden = 0, layers.hidden
    for name, (width, moments) in layers.norms.items():
        if holds(name):
            n = layers.calls.get(name, 1)
            act += n * mode.cost_norm(repeated(add, n), tokens, width, moments=moments)
    for name, (role, moments) in layers.proj_norms.items():
        if holds(name):
            mode.cost_proj_norm(repeated(add, layers.calls.get(name, 1)), tokens, role, moments)
    for name, (role, heads) in layers.head_reduces.items():
        if holds(name):
            mode.cost_head_reduce(repeated(add, layers.calls.get(name, 1)), tokens, role, heads)
    for name in filter(holds, layers.latents):
        mode.cost_latent(repeated(add, layers.calls.get(name, 1)), tokens, hidden)
    for name in filter(holds, layers.routers):
        mode.cost_router(repeated(add, layers.calls.get(name, 1)), tokens, hidden)
    for name in filter(holds, layers.untrained):
        mode.cost_untrained(repeated(add, layers.calls.get(name, 1)), tokens, hidden)
    for name in filter(holds, layers.wholes):
        each = repeated(add, layers.calls.get(name, 1))
        if heads_split(mode, layers.mixers.get(name)):  # a mixer split by heads (convert_mixer)
            mode.cost_mixer(each, tokens, hidden)
            for _, width in layers.mixers[name].reduced:  # (Mamba-1's x_proj: summed inside it)
                mode.cost_mixer_reduce(each, tokens, width)
            for _, moments, _ in layers.mixers[name].moments:  # (a norm over its whole inner width: MiniMax's)
                mode.cost_mixer_reduce(each, tokens, moments)
        else:
            mode.cost_whole(each, tokens, hidden)
    for name, e in layers.experts.items():
        if holds(name):
            n = layers.calls.get(name, 1)
            # (its rows: the stream's, or more where every row is fed to every expert)
            act += n * mode.cost_experts(repeated(add, n), tokens * e.rows, hidden, e)
    return act


def sliced_sums(plan, mode, named: list, dp_plan=None) -> list[tuple[str, int]]:
    """[(mesh group, gradient elements)], a call each: the parameters of latent
    up-projections (held by heads) and of experts run by their own forward
    (held by slices), which ranks with other rows hold alike. A real
    rewrite learns those replicas by communicating (replicas.share_slices),
    a dry run does not; the mode names the group they span
    (`cost_sliced_replicas`), and sync_replicas sums them in a call of their
    own (their process group is not the mesh's group of the same ranks).
    `named`: the rewritten stage's (name, parameter) in order; `dp_plan`:
    its data-parallel plan (the gradient elements each holds), if any."""
    owners = {name: mode.cost_sliced_replicas(plan.roles[name]) for name in held_by_heads_or_slices(plan)}
    owners.update({name: mode.cost_sliced_replicas("latent_up") for name in per_head_params(plan)})  # by heads
    # An experts module's parameters held whole (OwnSplit.whole: a bias
    # added once per expert) are alike on every rank of the grid: a call of
    # their own over all of it.
    whole = {f"{owner}.{p}" for owner in owners if isinstance(plan.layouts.get(owner), OwnSplit)
             for p in plan.layouts[owner].whole()}
    out: dict[str, int] = defaultdict(int)
    everywhere = 0
    for i, (name, p) in enumerate(named):
        owner = next((o for o in owners if name == o or name.startswith(o + ".")), None)
        numel = dp_plan.grad_numel(i) if dp_plan else math.prod(spec_of(p).local_shape())
        if name in whole and mode.geo.size > 1:
            everywhere += numel
        elif owner is not None and owners[owner] is not None:
            out[owners[owner]] += numel
    return [*out.items(), *([("tp", everywhere)] if everywhere else [])]


def kv_shared(plan, split: int, mode=None) -> list[str]:
    """The modules holding key/value heads several of `split` blocks of
    query heads share (fewer heads than the split), and the norms over such
    a projection's output features (`proj_norm`); given `mode`, the
    parameters of mixers it splits by heads with rows held whole on every
    rank of the split (mixers.kept_rows: one group's B and C): what the
    rewrite hands replicas.share_slices for them (rewrite.py)."""
    names = [name for name, layout in getattr(plan, "layouts", {}).items() if layout.shares(split)]
    names += [norm for norm, src in getattr(plan, "sources", {}).items() if src in names]
    return names + (kept_rows(plan, mode) if mode is not None else [])


def held_out_features(plan, name: str, split: int, n: int) -> int:
    """The output features of Linear `name` (of `n`) its `split` blocks of
    query heads hold in all: n, or with shared key/value heads each block's
    whole heads, more (a mode's Linear sends blocks of those)."""
    layout = getattr(plan, "layouts", {}).get(name)
    if isinstance(layout, FusedLayout) and layout.shares(split):
        return split * sum(b - a for a, b in layout.shard_features(split, 0))
    return n


def kv_keys(model: nn.Module, shared: list[str]) -> dict:
    """{parameter name: replicas.shard_key} of the parameters of `model` (a
    dry run's rewrite, of its pipeline stage) under the modules `shared`
    it holds, collected as the rewrite hands them to share_slices."""
    held = dict(model.named_modules()).keys() | dict(model.named_parameters()).keys()
    return {name: shard_key(spec_of(p)) for name, p in shared_params(model, [s for s in shared if s in held]).items()}


def kv_replica_sums(everyone: list[dict], t: int, named: list, dp_plan=None) -> list[tuple[str, int]]:
    """[(group, gradient elements)], a call each: the rows of key/value heads
    several ranks hold alike (fewer heads than the split), and of the norms
    over such a projection's output features, summed over the ranks holding
    them, one call per set of holders (replicas.sync_replicas: each set's
    process group is share_slices', made from what every rank holds: the
    sets are cut by replicas.holder_pieces, as there). `everyone`: each tp
    rank's kv_keys; `t`: this rank's position in the group; `named`,
    `dp_plan`: as sliced_sums'. A group is named KV_REPLICAS and its size."""
    sums: dict[tuple[int, ...], int] = defaultdict(int)
    for i, (name, p) in enumerate(named):
        if name not in everyone[t]:
            continue
        shape = spec_of(p).local_shape()
        numel = dp_plan.grad_numel(i) if dp_plan else math.prod(shape)
        for lo, hi, holders in holder_pieces(everyone, name, t):  # (a fused projection's own query rows: one holder)
            if len(holders) > 1:
                sums[holders] += numel * (hi - lo) // shape[0]
    return [(f"{KV_REPLICAS}{len(holders)}", numel) for holders, numel in sorted(sums.items())]
