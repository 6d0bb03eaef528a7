"""Every collective tpctl issues goes through this module.

One place means one place to count: `CommStats` records the bytes each rank
sends into each kind of collective, so a cost model can be checked against
what the code actually does. The autograd functions at the bottom are the
small differentiable building blocks the parallel layers are made of; each
names its forward and backward collective.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Optional

import torch
import torch.distributed as dist

from .geometry import WIRE_FACTOR

Group = Optional[dist.ProcessGroup]

# torch 2.10 renamed the tensor-in/tensor-out collectives; keep both working.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CommStats:
    """What this rank hands to collectives, per kind of collective: calls,
    payload bytes (the full tensor of the collective) and wire bytes (what a
    ring algorithm sends per rank, the unit of docs/DESIGN.md's cost table)."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)
        self.wire_bytes: dict[str, float] = defaultdict(float)

    def add(self, op: str, full: torch.Tensor, group_size: int) -> None:
        nbytes = full.numel() * full.element_size()
        self.calls[op] += 1
        self.bytes[op] += nbytes
        self.wire_bytes[op] += WIRE_FACTOR[op](group_size) * nbytes

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()
        self.wire_bytes.clear()

    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def total_wire_bytes(self) -> float:
        return sum(self.wire_bytes.values())


STATS = CommStats()


# `None` means "this rank alone" (a collective over it is a no-op), never
# torch's implicit WORLD: the whole world is always named, dist.group.WORLD.


def group_size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce(tensor: torch.Tensor, group: Group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce; a group of one is free."""
    if group_size(group) > 1:
        STATS.add("all_reduce", tensor, group_size(group))
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def all_gather(tensor: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's `tensor` along `dim`, in group-rank order."""
    world = group_size(group)
    if world == 1:
        return tensor
    tensor = tensor.movedim(dim, 0).contiguous()
    out = torch.empty((world * tensor.shape[0],) + tensor.shape[1:], dtype=tensor.dtype, device=tensor.device)
    STATS.add("all_gather", out, world)
    _all_gather_tensor(out, tensor, group=group)
    return out.movedim(0, dim)


def reduce_scatter(tensor: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """Sum over the group, then keep this rank's block of `dim`."""
    world = group_size(group)
    if world == 1:
        return tensor
    tensor = tensor.movedim(dim, 0).contiguous()
    out = torch.empty((tensor.shape[0] // world,) + tensor.shape[1:], dtype=tensor.dtype, device=tensor.device)
    STATS.add("reduce_scatter", tensor, world)
    _reduce_scatter_tensor(out, tensor, group=group)
    return out.movedim(0, dim)


# ---- flat buffers of the data-parallel component (parallel/zero.py): in
# place, optionally asynchronous (a work handle to wait on), so a bucket's
# reduction runs while the backward goes on.

def all_reduce_flat(flat: torch.Tensor, group: Group, async_op: bool = False):
    """Sum `flat` over the group in place; returns a work handle when async."""
    if group_size(group) == 1:
        return None
    STATS.add("all_reduce", flat, group_size(group))
    return dist.all_reduce(flat, group=group, async_op=async_op)


def reduce_scatter_flat(out: torch.Tensor, flat: torch.Tensor, group: Group, async_op: bool = False):
    """`out` = group-rank r's segment of the sum of every rank's `flat`
    ([segment 0 | segment 1 | ...], each `out.numel()` long)."""
    if group_size(group) == 1:
        out.copy_(flat)
        return None
    STATS.add("reduce_scatter", flat, group_size(group))
    return _reduce_scatter_tensor(out, flat, group=group, async_op=async_op)


def all_gather_flat(out: torch.Tensor, segment: torch.Tensor, group: Group, async_op: bool = False):
    """`out` = every rank's `segment`, concatenated in group-rank order."""
    if group_size(group) == 1:
        out.copy_(segment)
        return None
    STATS.add("all_gather", out, group_size(group))
    return _all_gather_tensor(out, segment, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Group, async_op: bool = False):
    """Broadcast from global rank `src`; returns a work handle when async."""
    if group_size(group) == 1:
        return None
    STATS.add("broadcast", tensor, group_size(group))
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def reduce(tensor: torch.Tensor, dst: int, group: Group, async_op: bool = False):
    """Sum into global rank `dst`; returns a work handle when async."""
    if group_size(group) == 1:
        return None
    STATS.add("reduce", tensor, group_size(group))
    return dist.reduce(tensor, dst=dst, group=group, async_op=async_op)


def count_send(tensor: torch.Tensor) -> None:
    """Count a point-to-point send that another library issues (torch's
    pipeline schedules batch their own); receives are the sender's count."""
    STATS.add("send", tensor, 2)


def send(tensor: torch.Tensor, dst: int, group: Group) -> None:
    """Send to global rank `dst` of `group` and wait (bounded by the
    group's timeout, as every collective)."""
    count_send(tensor)
    dist.isend(tensor.contiguous(), dst=dst, group=group).wait()


def recv(tensor: torch.Tensor, src: int, group: Group) -> torch.Tensor:
    """Receive into `tensor` from global rank `src` of `group`."""
    dist.irecv(tensor, src=src, group=group).wait()
    return tensor


# ---- the control plane: Python objects and barriers between steps (not
# counted: no training step sends them). `group` None is the whole world here,
# as in torch.distributed: these are never issued over a layer's group.

def barrier(group: Group = None) -> None:
    dist.barrier(group=group)


def all_gather_object(obj, group: Group = None) -> list:
    """Every rank's `obj`, in rank order."""
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj, src: int = 0, group: Group = None):
    """Rank `src`'s `obj`, on every rank (the others pass anything)."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_reduce_flat",
                "reduce_scatter_flat", "all_gather_flat")


def keep_collectives_eager() -> None:
    """Make torch.compile leave every collective above to eager mode (a graph
    break at each): dynamo never traces into them, so each call still runs
    once per step and STATS counts it. Called by training.compile before a
    model is compiled (not at import: torch._dynamo costs seconds to load);
    idempotent."""
    module = globals()
    for name in _COLLECTIVES:
        fn = module[name]
        if not getattr(fn, "_tpctl_eager", False):
            eager = torch.compiler.disable(fn)
            eager._tpctl_eager = True
            module[name] = eager


def split_block(tensor: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """This rank's block of `dim` (no communication)."""
    world = group_size(group)
    if world == 1:
        return tensor
    return tensor.chunk(world, dim=dim)[group_rank(group)].contiguous()


# --------------------------------------------------------------------------
# Differentiable collectives. Each is a pair (forward, backward) of
# collectives whose matrices are transposes of each other; one autograd
# function runs any pair.


class _Adjoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, forward, backward):
        ctx.group, ctx.backward_fn = group, backward
        out = forward(x, group)
        # A view returned from a custom Function may not be modified in
        # place, and a model may (Falcon: `mlp_output += attention_output`).
        return out.clone() if out._base is not None or out is x else out

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_fn(grad, ctx.group), None, None, None


def _identity(x, group):
    return x


def _sum(x, group):
    # A fresh buffer: all_reduce works in place, and autograd may still
    # need the tensor it was handed.
    return all_reduce(x.clone(memory_format=torch.contiguous_format), group)


def _apply(x, group, forward, backward):
    return _Adjoint.apply(x, group, forward, backward) if group_size(group) > 1 else x


def copy_to_group(x, group):
    """Forward identity, backward all-reduce (Megatron's `f`): the input is
    replicated over the group and each rank uses it for a different slice."""
    return _apply(x, group, _identity, _sum)


def reduce_to_replicated(x, group):
    """Forward all-reduce of partial sums, backward identity (Megatron's `g`):
    every rank then computes the same thing from the replicated sum."""
    return _apply(x, group, _sum, _identity)


def sum_shared(x, group):
    """All-reduce both ways: for statistics (norm moments) that every rank
    then uses for its *own* slice, so the gradient contributions sum back."""
    return _apply(x, group, _sum, _sum)


def gather_along(x, group, dim):
    """Forward all-gather along `dim`, backward reduce-scatter."""
    return _apply(x, group, lambda t, g: all_gather(t, g, dim), lambda t, g: reduce_scatter(t, g, dim))


def reduce_scatter_along(x, group, dim):
    """Forward reduce-scatter along `dim`, backward all-gather."""
    return _apply(x, group, lambda t, g: reduce_scatter(t, g, dim), lambda t, g: all_gather(t, g, dim))


def split_along(x, group, dim):
    """Forward keep this rank's block of `dim` of a replicated tensor,
    backward all-gather the blocks' gradients (every rank's replicated
    computation before the split needs the whole gradient)."""
    return _apply(x, group, lambda t, g: split_block(t, g, dim), lambda t, g: all_gather(t, g, dim))


def gather_to_replicated(x, group, dim):
    """Forward all-gather along `dim` into a tensor every rank then uses
    whole and alike; backward keep this rank's block of the (identical)
    gradient. The adjoint of split_along."""
    return _apply(x, group, lambda t, g: all_gather(t, g, dim), lambda t, g: split_block(t, g, dim))
