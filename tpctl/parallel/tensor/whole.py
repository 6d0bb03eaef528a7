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

import torch.nn as nn

from tpctl.parallel import comm
from tpctl.parallel.roles.tracing import hidden_arg


def gather_hidden(module, args, kwargs, group, dim: int = -1):
    """Pre-hook: a module's hidden states (its first argument, or
    `hidden_states`) gathered along `dim` over `group` (a router's and a
    module run whole's: whole rows of this rank's rows)."""
    whole = comm.gather_along(hidden_arg(args, kwargs), group, dim)
    return ((whole, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": whole})


def run_whole(mode, module: nn.Module, ctx) -> nn.Module:
    """`module` placed whole by `mode` (a tensor.mode.ParallelMode) on
    every rank of its grid, gathered and cut as its stream is split
    (mode.whole_split)."""
    if not mode.rewrites:
        return module
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
