"""A module run whole on every rank (role `whole`, parallel/roles/whole.py):
its parameters whole, its input gathered to whole rows of the rows this
rank holds, its output cut back to this rank's piece of the stream.

Why the gradients come out right: the output's cut keeps this rank's block
and its backward pads the others with zeros, so each rank back-propagates
only its own block through the module; the gather's backward (a
reduce-scatter) sums those input gradients over the ranks that ran it, and
each parameter's gradient is this rank's part (its rows, its output block),
summed over the tensor-parallel group like any partial gradient. Where the
stream is whole and replicated (1d without sequence parallelism) nothing is
gathered or cut: every rank computes the same gradient.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn as nn

from tpctl.parallel import comm
from tpctl.parallel.roles.experts import routing_weights_arg
from tpctl.parallel.roles.mixers import REPLICA, heads_split
from tpctl.parallel.roles.probes import norm_eps, norm_offset
from tpctl.parallel.roles.tracing import hidden_arg
from tpctl.parallel.tensor.layers import SplitNorm


def gather_hidden(module, args, kwargs, group, dim: int = -1):
    """Pre-hook: a module's hidden states (its first argument, or
    `hidden_states`) gathered along `dim` over `group` (a router's and a
    module run whole's: whole rows of this rank's rows)."""
    return with_hidden(args, kwargs, comm.gather_along(hidden_arg(args, kwargs), group, dim))


def with_hidden(args, kwargs, hidden):
    """(args, kwargs) of a call with its hidden states (the first argument,
    or `hidden_states`: tracing.hidden_arg) replaced by `hidden`."""
    return ((hidden, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})


def run_whole(mode, module: nn.Module, ctx) -> nn.Module:
    """`module` placed whole by `mode` (a tensor.mode.ParallelMode) on
    every rank of its grid, gathered and cut as its stream is split
    (mode.whole_split)."""
    if not mode.rewrites:
        return module
    if heads_split(mode, mode.layouts.get(ctx.name)):  # a mixer (Mamba-2, gated delta rule), split by heads
        return mode.convert_mixer(module, ctx)
    split = mode.whole_split(ctx)
    for name, full in list(module.named_parameters()):
        owner, _, leaf = name.rpartition(".")
        spec = mode.split_spec(full, replicas="tp", partial=split is not None)
        setattr(module.get_submodule(owner), leaf, ctx.shard(full, spec))
    if split is None or ctx.shapes_only:  # (a dry run's mesh has no groups to gather over)
        return module
    group, dim = split
    ctx_name = ctx.name

    def exit(mod, args, kwargs, out):
        first = out[0] if isinstance(out, tuple) else out
        if dim != -1 and first.dim() != 3:  # (the sequence dimension of rows flattened is no block of it)
            raise ValueError(f"{ctx_name} runs whole and returns its rows flattened ({tuple(first.shape)}): "
                             "sequence parallelism cannot cut the sequence back out of it; use seq_parallel=false")
        first = comm.split_block(first, group, dim)
        return (first, *out[1:]) if isinstance(out, tuple) else first

    module.register_forward_pre_hook(functools.partial(gather_hidden, group=group, dim=dim), with_kwargs=True)
    module.register_forward_hook(exit, with_kwargs=True)
    return module


def shard_own_forward(mode, module: nn.Module, ctx, split, shards: int, s: int,
                      replicas: Optional[str] = None) -> tuple[str, ...]:
    """`module`, run by its own forward, made to hold shard s of `shards` of
    `split` (a mixers.MixerSplit: per tensor its dimension and ranges, or
    held whole; integer attributes (owner, attribute, full) set to
    full / shards), each shard held alike by the ranks of mesh group
    `replicas` (ranks with other rows in 2d/3d: gradients summed over
    them). A parameter held whole is a replica over the
    tensor-parallel group with a partial gradient: the forward reads it as
    1/shards of itself (hold_whole_scaled), so the shards' summed outputs
    add it once and each rank's gradient is 1/shards of it; one of dim
    REPLICA (a norm weight every head multiplies by) is read as itself,
    each rank's gradient its heads' part, summed the same way. A buffer
    (FalconH1's mup_vector) keeps this rank's entries. The names held whole."""
    whole = split.whole()
    for name, _, _ in split.dims:
        owner, _, leaf = name.rpartition(".")
        held = module.get_submodule(owner)
        full = getattr(held, leaf)
        dim, ranges = split.ranges(name, shards, s)
        if (name in whole or dim == REPLICA) and leaf not in held._parameters:
            continue  # (a buffer held whole: FalconMamba's weightless norms' ones)
        if name in whole or dim == REPLICA:  # (REPLICA: read as itself, each rank's heads' gradient summed)
            spec = mode.split_spec(full, replicas="tp", partial=True)
        else:
            if leaf not in held._parameters:
                held._buffers[leaf] = torch.cat([full.narrow(dim, a, b - a) for a, b in ranges], dim)
                continue
            spec = mode.split_spec(full, dim, ranges, replicas=replicas)
        setattr(held, leaf, ctx.shard(full, spec))
    for owner, attr, value in split.shard_attrs(shards):  # (full / shards; a Kept part, one group's B and C, whole)
        setattr(module.get_submodule(owner), attr, value)
    return whole


def hold_whole_scaled(module: nn.Module, whole: tuple[str, ...], shards: Optional[int]) -> None:
    """For one call, each parameter of `whole` read by the module's forward
    as 1/shards of itself (an instance attribute shadows the registered
    parameter); shards None: the shadows removed."""
    for name in whole:
        owner, _, leaf = name.rpartition(".")
        held = module.get_submodule(owner)
        if shards is None:
            held.__dict__.pop(leaf, None)
        else:
            held.__dict__[leaf] = held._parameters[leaf] / shards


def split_mixer(mode, module: nn.Module, ctx, group, shards: int, s: int, dim: Optional[int],
                replicas: Optional[str] = None) -> nn.Module:
    """A mixer split by heads (roles/mixers.py) over `group`, this
    rank shard s of `shards`, its own forward run on this rank's heads: the
    input whole rows of every rank (replicated: its gradient, each rank's
    heads' part, summed over the group by copy_to_group; or pieces of the
    rows gathered along `dim`, 1d's sequence shards or 2d/3d's hidden
    blocks, whose backward reduce-scatters), out_proj's partial outputs
    summed (all-reduce; or reduce-scattered onto this rank's piece); a norm
    over the whole inner width (split.moments: MiniMax's) summing its
    moments over the group. `replicas`: shard_own_forward's."""
    split = mode.layouts[ctx.name]
    # (each norm's arithmetic probed whole, before its weight is cut: a one-group norm's group is the whole width)
    arithmetic = {name: (norm_eps(norm), norm_offset(norm, moments == 1))
                  for name, moments, _ in split.moments for norm in [module.get_submodule(name)]}
    whole = shard_own_forward(mode, module, ctx, split, shards, s, replicas)
    if ctx.shapes_only:  # (a dry run's mesh has no groups to communicate over)
        return module
    for name, _ in split.reduced:  # (Mamba-1's x_proj: [dt | B | C] from every rank's channels)
        module.get_submodule(name).register_forward_hook(functools.partial(_sum_reduced, group=group))
    for name, moments, width in split.moments:
        weighted = any(n == f"{name}.weight" for n, _, _ in split.dims)
        _sum_moments(module, name, moments, width, group, arithmetic[name],
                     split.ranges(f"{name}.weight", shards, s)[1] if weighted else None)
    torch_path = split.torch_path()  # (Mamba-1's x_proj sum; a Mamba-2 gated norm's moments)
    if torch_path and hasattr(type(module), "slow_forward"):  # (releases choosing the kernel by device)
        module.forward = module.slow_forward

    def entry(mod, args, kwargs):
        if torch_path:
            _torch_path(mod, True)
        hold_whole_scaled(mod, whole, shards)
        x = hidden_arg(args, kwargs)
        x = comm.copy_to_group(x, group) if dim is None else comm.gather_along(x, group, dim)
        return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})

    def exit(mod, args, out):
        if torch_path:
            _torch_path(mod, False)
        hold_whole_scaled(mod, whole, None)
        first = out[0] if isinstance(out, tuple) else out
        first = comm.reduce_to_replicated(first, group) if dim is None else \
            comm.reduce_scatter_along(first, group, dim)
        return (first, *out[1:]) if isinstance(out, tuple) else first

    module.register_forward_pre_hook(entry, with_kwargs=True)
    module.register_forward_hook(exit)
    return module


def _sum_reduced(module, args, out, group):
    """Forward hook of a Linear whose input features a rank holds a block
    of (Mamba-1's x_proj): its partial product summed over `group`, and,
    since every rank then reads the sum for its own channels (dt_proj's
    rows, the scan's B and C), the sum's gradient summed over the group in
    the backward too (comm.sum_shared: an all-reduce both ways)."""
    return comm.sum_shared(out, group)


def _sum_moments(module: nn.Module, name: str, moments: int, width: int, group, arithmetic, features) -> None:
    """The norm `name` inside a split mixer (its weight already this rank's
    `features` of the whole `width`; `moments`: 1 an RMSNorm's, 2 a
    LayerNorm's; `arithmetic`: its eps and weight offset, probed whole) made
    a layers.SplitNorm over `group`: the moments of this
    rank's features summed over the ranks splitting the mixer
    (comm.sum_shared, both ways) and divided by the whole width, as a 2d
    norm over the stream's hidden blocks; its parameters kept. A gated
    norm (Mamba-2's, called with its gate) gates as its own forward does:
    before the norm, or after it where it says norm_before_gate (FalconH1's)."""
    norm = module.get_submodule(name)
    gate = "after" if getattr(norm, "norm_before_gate", False) else "before"
    eps, offset = arithmetic
    split = SplitNorm(getattr(norm, "weight", None), getattr(norm, "bias", None), width, eps, group,
                      rms=moments == 1, offset=offset, features=features, gate=gate)
    owner, _, leaf = name.rpartition(".")
    setattr(module.get_submodule(owner), leaf, split)


def _torch_path(module: nn.Module, on: bool) -> None:
    """Around a call of a mixer with an inner reduction (Mamba-1's): its
    torch path forced. transformers' fused CUDA kernel (mamba_ssm's
    mamba_inner_fn, taken only when the mixer's own `training` is set and
    no cache is passed) reads x_proj's, dt_proj's and out_proj's weights
    directly and would never sum x_proj's partial product over the ranks:
    the mixer's own flag (not its children's: none reads it) is cleared
    for the call (older releases, choosing it by device, are given their
    slow_forward by split_mixer). The torch path is the one measured
    (roles/mixers.py)."""
    if on:
        module.__dict__["_tpctl_training"] = module.training
        module.training = False
    else:
        module.training = module.__dict__.pop("_tpctl_training", module.training)


def split_own_experts(mode, module: nn.Module, ctx) -> nn.Module:
    """Experts in a model's own module (experts.OwnSplit), run by its own
    forward on whole rows: the ranks holding a row's hidden features
    (all of 1d's, which hold whole rows) each hold a block of every
    expert's inner features, and their partial outputs are summed (in
    2d/3d onto each rank's hidden block). Ranks with other rows hold
    replicas (rewrite.py shares them)."""
    split, whole_rows = mode.layouts[ctx.name], mode.replicated_activations
    group = mode.mesh.tp_group if whole_rows else mode.stream_group()
    shards, s = mode.own_forward_ways(), comm.group_rank(group)  # (also in a dry run)
    whole = split.whole()
    for name, full in list(module.named_parameters()):
        if name in whole:  # held whole, its gradient each rank's part (of 1/shards of its rows' terms):
            owner, _, leaf = name.rpartition(".")  # every rank of the grid a replica (rewrite shares them)
            setattr(module.get_submodule(owner), leaf, ctx.shard(full, mode.split_spec(full)))
            continue
        dim, ranges = split.ranges(name, shards, s)
        owner, _, leaf = name.rpartition(".")
        setattr(module.get_submodule(owner), leaf, ctx.shard(full, mode.split_spec(full, dim, ranges)))
    for owner, attr in split.attrs:
        setattr(module.get_submodule(owner), attr, split.inner // shards)

    def entry(mod, args, kwargs):
        # A parameter held whole is read by the forward as 1/shards of
        # itself (an instance attribute shadows the registered one for
        # this call): the shards' partial outputs then add it once.
        hold_whole_scaled(mod, whole, shards)
        args, kwargs = list(args), dict(kwargs)
        if not whole_rows:
            return (comm.gather_along(args[0], group, -1), *args[1:]), kwargs
        # Whole replicated rows: the input's and the routing weights'
        # gradients (each rank's a part) summed over the group (Llama 4's
        # experts have no routing weights: its rows come scaled by them).
        at = routing_weights_arg(args, kwargs)
        for where in (0, at) if at is not None else (0,):
            box = args if isinstance(where, int) else kwargs
            box[where] = comm.copy_to_group(box[where], group)
        return tuple(args), kwargs

    def exit(mod, args, out):
        hold_whole_scaled(mod, whole, None)
        return comm.reduce_to_replicated(out, group) if whole_rows else comm.reduce_scatter_along(out, group, -1)

    module.register_forward_pre_hook(entry, with_kwargs=True)
    module.register_forward_hook(exit)
    return module


def run_untrained(mode, module: nn.Module, ctx) -> nn.Module:
    """A module returning indices only (role `untrained`: DeepSeek's
    sparse-attention indexer), whose parameters no gradient reaches, in
    mode=none either: held whole on every rank and run as written on whole
    rows of the rows its attention holds (its other inputs, the q latent's,
    are whole there already; 1d with sequence parallelism: its attention's
    entry gathered the sequence), so every rank picks mode=none's indices
    for them. The gather runs without autograd: nothing flows back through
    indices (the planner counts its forward half: cost_untrained)."""
    for param in module.parameters():
        mode.replicated(param, "tp", partial=False)
    gathered = any(ctx.name.startswith(owner + ".") for owner in getattr(mode, "gathered_owners", ()))

    def entry(mod, args, kwargs):
        with torch.no_grad():
            return with_hidden(args, kwargs, mode.attention_rows(hidden_arg(args, kwargs), gathered))

    module.register_forward_pre_hook(entry, with_kwargs=True)
    return module
