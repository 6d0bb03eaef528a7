"""Every collective tpctl issues goes through this module.

One place means one place to count: `CommStats` records the bytes each rank
sends into each kind of collective, so a cost model can be checked against
what the code actually does. The autograd functions at the bottom are the
small differentiable building blocks the parallel layers are made of; each
names its forward and backward collective.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Optional

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from tpctl.parallel.geometry import WIRE_FACTOR

Group = Optional[dist.ProcessGroup]

# torch 2.10 renamed the tensor-in/tensor-out collectives; keep both working.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CommStats:
    """What this rank hands to collectives, per kind of collective: calls,
    payload bytes (the full tensor of the collective) and wire bytes (what a
    ring algorithm sends per rank, the unit of docs/DESIGN.md's cost table);
    and the seconds its thread spent in them (issuing, or waiting for one)
    -- the communication not hidden behind compute -- by the wrapper that
    issued it (`*_flat`: data parallelism's buckets)."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)
        self.wire_bytes: dict[str, float] = defaultdict(float)
        self.exposed_s: dict[str, float] = defaultdict(float)

    def add(self, op: str, full: torch.Tensor, group_size: int) -> None:
        nbytes = full.numel() * full.element_size()
        self.calls[op] += 1
        self.bytes[op] += nbytes
        self.wire_bytes[op] += WIRE_FACTOR[op](group_size) * nbytes

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()
        self.wire_bytes.clear()
        self.exposed_s.clear()

    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def total_wire_bytes(self) -> float:
        return sum(self.wire_bytes.values())


STATS = CommStats()


class _Timed:
    """An async collective's work handle whose wait counts as exposed."""

    __slots__ = ("work", "name")

    def __init__(self, work, name: str):
        self.work, self.name = work, name

    def wait(self):
        start = time.perf_counter()
        try:
            return self.work.wait()
        finally:
            STATS.exposed_s[self.name] += time.perf_counter() - start


def _issue(name: str, collective, *args, async_op: bool = False, **kwargs):
    """Run torch's `collective`, timing what the caller waits for: the whole
    call when synchronous, the issue now and the wait later when async."""
    start = time.perf_counter()
    try:
        work = collective(*args, async_op=async_op, **kwargs)
    finally:
        STATS.exposed_s[name] += time.perf_counter() - start
    return _Timed(work, name) if async_op and work is not None else work


# `None` means "this rank alone" (a collective over it is a no-op), never
# torch's implicit WORLD: the whole world is always named, dist.group.WORLD.


def group_size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce(tensor: torch.Tensor, group: Group, op=dist.ReduceOp.SUM, async_op: bool = False):
    """In-place all-reduce; a group of one is free. Returns the tensor (async:
    with the work handle to wait on)."""
    work = None
    if group_size(group) > 1:
        STATS.add("all_reduce", tensor, group_size(group))
        work = _issue("all_reduce", dist.all_reduce, tensor, op=op, group=group, async_op=async_op)
    return (tensor, work) if async_op else tensor


def all_reduce_coalesced(tensors: list[torch.Tensor], group) -> None:
    """Sum `tensors` over `group` in one call, through one flat buffer."""
    flat = _flatten_dense_tensors(tensors)
    all_reduce(flat, group)
    for t, synced in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
        t.copy_(synced)



def _blocks_first(shape, dim: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A fresh tensor of `shape` laid out with `dim` outermost, and the
    contiguous view of it with `dim` moved first: the collective writes the
    view, the caller gets the tensor itself -- no view returned, no copy
    into the usual layout (a custom Function's view output could not be
    modified in place)."""
    order = [dim] + [d for d in range(len(shape)) if d != dim]
    strides, step = [0] * len(shape), 1
    for d in reversed(order):
        strides[d], step = step, step * shape[d]
    out = torch.empty_strided(shape, strides, dtype=like.dtype, device=like.device)
    return out, out.movedim(dim, 0)


def all_gather(tensor: torch.Tensor, group: Group, dim: int = 0, async_op: bool = False):
    """Concatenate every rank's `tensor` along `dim`, in group-rank order,
    into a fresh tensor (async: with the work handle to wait on)."""
    world = group_size(group)
    if world == 1:
        return (tensor, None) if async_op else tensor
    dim %= tensor.dim()
    shape = list(tensor.shape)
    shape[dim] *= world
    out, flat = _blocks_first(shape, dim, tensor)
    STATS.add("all_gather", flat, world)
    work = _issue("all_gather", _all_gather_tensor, flat, tensor.movedim(dim, 0).contiguous(), group=group,
                  async_op=async_op)
    return (out, work) if async_op else out


def reduce_scatter(tensor: torch.Tensor, group: Group, dim: int = 0, async_op: bool = False):
    """Sum over the group, then keep this rank's block of `dim`, in a fresh
    tensor (async: with the work handle to wait on)."""
    world = group_size(group)
    if world == 1:
        return (tensor, None) if async_op else tensor
    dim %= tensor.dim()
    shape = list(tensor.shape)
    shape[dim] //= world
    out, flat = _blocks_first(shape, dim, tensor)
    full = tensor.movedim(dim, 0).contiguous()  # the blocks in rank order: the collective's input layout
    STATS.add("reduce_scatter", full, world)
    work = _issue("reduce_scatter", _reduce_scatter_tensor, flat, full, group=group, async_op=async_op)
    return (out, work) if async_op else out


# ---- flat buffers of the data-parallel component (parallel/data_parallel/zero.py): in
# place, optionally asynchronous (a work handle to wait on), so a bucket's
# reduction runs while the backward goes on.

def all_reduce_flat(flat: torch.Tensor, group: Group, async_op: bool = False):
    """Sum `flat` over the group in place; returns a work handle when async."""
    if group_size(group) == 1:
        return None
    STATS.add("all_reduce", flat, group_size(group))
    return _issue("all_reduce_flat", dist.all_reduce, flat, group=group, async_op=async_op)


def reduce_scatter_flat(out: torch.Tensor, flat: torch.Tensor, group: Group, async_op: bool = False):
    """`out` = group-rank r's segment of the sum of every rank's `flat`
    ([segment 0 | segment 1 | ...], each `out.numel()` long)."""
    if group_size(group) == 1:
        out.copy_(flat)
        return None
    STATS.add("reduce_scatter", flat, group_size(group))
    return _issue("reduce_scatter_flat", _reduce_scatter_tensor, out, flat, group=group, async_op=async_op)


def all_gather_flat(out: torch.Tensor, segment: torch.Tensor, group: Group, async_op: bool = False):
    """`out` = every rank's `segment`, concatenated in group-rank order."""
    if group_size(group) == 1:
        out.copy_(segment)
        return None
    STATS.add("all_gather", out, group_size(group))
    return _issue("all_gather_flat", _all_gather_tensor, out, segment, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Group, async_op: bool = False):
    """Broadcast from global rank `src`; returns a work handle when async."""
    if group_size(group) == 1:
        return None
    STATS.add("broadcast", tensor, group_size(group))
    return _issue("broadcast", dist.broadcast, tensor, src=src, group=group, async_op=async_op)


def reduce(tensor: torch.Tensor, dst: int, group: Group, async_op: bool = False):
    """Sum into global rank `dst`; returns a work handle when async."""
    if group_size(group) == 1:
        return None
    STATS.add("reduce", tensor, group_size(group))
    return _issue("reduce", dist.reduce, tensor, dst=dst, group=group, async_op=async_op)


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


# ---- host staging: gloo's point-to-point reads and writes a tensor's memory
# from the host (a CUDA tensor's fails: `writev ... Bad address`), so with
# device=cuda over gloo (ranks sharing one GPU) a send goes as a host copy
# and a receive lands in a host buffer first. The pipeline's stage exchange
# (pipeline/schedule.py) and the ring (`ring_pass`) use this one rule.

# Backends whose point-to-point carries CUDA tensors themselves.
DEVICE_BACKENDS = ("nccl",)


def host_staging(device: torch.device, backend: Optional[str]) -> bool:
    """Whether a point-to-point exchange on `device` over `backend` goes
    through host buffers: a device tensor over a backend that cannot send it."""
    return device.type != "cpu" and backend is not None and backend not in DEVICE_BACKENDS


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of `tensor` (always a copy, the CPU's too: a send must not
    see later writes to what it sends)."""
    return tensor.to("cpu", copy=True)


class RingStaging:
    """The ring's host staging on this rank: `force` (tests stage on a CPU,
    where host_staging says no) and `bytes`, what crossed through host
    buffers, sent and received (a test's proof that the staged path ran;
    kept out of STATS, whose counts must equal the planner's)."""

    def __init__(self) -> None:
        self.force, self.bytes = False, 0


RING_STAGING = RingStaging()


class _Landing:
    """A host-staged ring pass's handle: its wait waits for the exchange,
    then copies the host buffer into the device tensor ring_pass returned
    (so the caller's compute meanwhile still overlaps the exchange)."""

    __slots__ = ("works", "sent", "host", "out")

    def __init__(self, works, sent: torch.Tensor, host: torch.Tensor, out: torch.Tensor):
        # `sent` is held until the send completes: gloo reads it until then.
        self.works, self.sent, self.host, self.out = works, sent, host, out

    def wait(self):
        if self.host is not None:
            for work in self.works:
                work.wait()  # bounded by the group's timeout, as every collective
            self.out.copy_(self.host)
            RING_STAGING.bytes += self.sent.nbytes + self.host.nbytes
            self.works, self.sent, self.host = (), None, None  # landed once; the host buffers freed
        return True


# ---- context parallelism (parallel/context/attention.py): the ring step
# and the all-to-all between a sequence split and a head split.

def ring_pass(flat: torch.Tensor, group: Group, ranks: list[int]):
    """Send `flat` to the next rank of the ring `ranks` (global ranks, in
    group order) and receive the previous rank's into a fresh tensor;
    returns (received, work handles to wait on): the caller computes on
    what it holds meanwhile. Through host buffers where RING_STAGING
    applies (a CUDA tensor over gloo); counted alike either way."""
    me = ranks.index(dist.get_rank())
    nxt, prev = ranks[(me + 1) % len(ranks)], ranks[me - 1]
    out = torch.empty_like(flat)
    STATS.add("ring_pass", flat, len(ranks))
    backend = dist.get_backend(group) if group is not None else None
    if not (RING_STAGING.force or host_staging(flat.device, backend)):
        ops = [dist.P2POp(dist.isend, flat, nxt, group), dist.P2POp(dist.irecv, out, prev, group)]
        return out, [_Timed(w, "ring_pass") for w in dist.batch_isend_irecv(ops)]
    # Through host buffers (see host_staging): the device copy of what
    # arrives is made in the handle's wait, after the caller's compute.
    sent, host = to_host(flat), torch.empty(flat.shape, dtype=flat.dtype, device="cpu")
    ops = [dist.P2POp(dist.isend, sent, nxt, group), dist.P2POp(dist.irecv, host, prev, group)]
    return out, [_Timed(_Landing(dist.batch_isend_irecv(ops), sent, host, out), "ring_pass")]


def all_to_all(blocks: torch.Tensor, group: Group) -> torch.Tensor:
    """Block i of `blocks` (dim 0 = the group's size) to group rank i;
    returns the blocks received, block j from group rank j."""
    blocks = blocks.contiguous()  # (before empty_like, which would copy a view's strides)
    out = torch.empty_like(blocks)
    STATS.add("all_to_all", blocks, group_size(group))
    _issue("all_to_all", dist.all_to_all_single, out, blocks, group=group)
    return out


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
                "reduce_scatter_flat", "all_gather_flat", "ring_pass", "all_to_all")


# Functions of other modules that issue collectives inside autograd
# functions of their own (1d's and 3d's fused linears): (module globals, name).
_ALSO_EAGER: list[tuple[dict, str]] = []


def also_eager(module_globals: dict, name: str) -> None:
    """Have keep_collectives_eager leave `name` of that module to eager mode too."""
    _ALSO_EAGER.append((module_globals, name))


def keep_collectives_eager() -> None:
    """Make torch.compile leave every collective above to eager mode (a graph
    break at each): dynamo never traces into them, so each call still runs
    once per step and STATS counts it. Called by training.compile before a
    model is compiled (not at import: torch._dynamo costs seconds to load);
    idempotent."""
    for module, name in [(globals(), n) for n in _COLLECTIVES] + _ALSO_EAGER:
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
    """Each forward and backward collective returns a fresh tensor of its own
    (never a view, never its input), so no output needs a defensive copy."""

    @staticmethod
    def forward(ctx, x, group, forward, backward):
        ctx.group, ctx.backward_fn = group, backward
        return forward(x, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_fn(grad, ctx.group), None, None, None


def _owned(x: torch.Tensor) -> bool:
    """Whether an in-place collective may overwrite `x` (marked dirty, so
    autograd refuses loudly if anything saved it): a dense non-view result
    of another operation, not a leaf."""
    return x.is_contiguous() and x._base is None and x.grad_fn is not None


class _SumInPlace(torch.autograd.Function):
    """All-reduce a fresh partial result in place (Megatron's `g`; with
    both_ways also the backward, for statistics each rank then uses for its
    own slice)."""

    @staticmethod
    def forward(ctx, x, group, both_ways: bool):
        ctx.group, ctx.both_ways = group, both_ways
        ctx.mark_dirty(x)
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return (_summed(grad, ctx.group) if ctx.both_ways else grad), None, None


def _summed(x, group):
    # The collective's own buffer: all_reduce works in place, and a tensor
    # handed in by autograd (a gradient two branches share) or by the
    # caller may still be needed as it is.
    return all_reduce(x.clone(memory_format=torch.contiguous_format), group)


def _sum_partial(x, group, both_ways: bool):
    if group_size(group) == 1:
        return x
    if _owned(x):
        return _SumInPlace.apply(x, group, both_ways)
    return _Adjoint.apply(x, group, _summed, _summed if both_ways else lambda t, g: t)


def _apply(x, group, forward, backward):
    return _Adjoint.apply(x, group, forward, backward) if group_size(group) > 1 else x


def copy_to_group(x, group):
    """Forward identity, backward all-reduce (Megatron's `f`): the input is
    replicated over the group and each rank uses it for a different slice.
    The identity is an ordinary view (a model may modify it in place); the
    all-reduce hooks its gradient (1d's linears fuse theirs, see one_d.py)."""
    if group_size(group) == 1:
        return x
    out = x.view_as(x)
    if out.requires_grad:
        out.register_hook(lambda grad: _summed(grad, group))
    return out


def reduce_to_replicated(x, group):
    """Forward all-reduce of partial sums, backward identity (Megatron's `g`):
    every rank then computes the same thing from the replicated sum. A
    partial sum the caller produced and no longer reads is summed in place."""
    return _sum_partial(x, group, both_ways=False)


def sum_shared(x, group):
    """All-reduce both ways: for statistics (norm moments) that every rank
    then uses for its *own* slice, so the gradient contributions sum back."""
    return _sum_partial(x, group, both_ways=True)


def gather_along(x, group, dim):
    """Forward all-gather along `dim`, backward reduce-scatter."""
    return _apply(x, group, lambda t, g: all_gather(t, g, dim), lambda t, g: reduce_scatter(t, g, dim))


def reduce_scatter_along(x, group, dim):
    """Forward reduce-scatter along `dim`, backward all-gather."""
    return _apply(x, group, lambda t, g: reduce_scatter(t, g, dim), lambda t, g: all_gather(t, g, dim))


def _own_block(t, g, dim):
    # This rank's block in a buffer of its own: a slice would be a view.
    return t.narrow(dim, group_rank(g) * (t.shape[dim] // group_size(g)),
                    t.shape[dim] // group_size(g)).clone(memory_format=torch.contiguous_format)


def split_along(x, group, dim):
    """Forward keep this rank's block of `dim` of a replicated tensor,
    backward all-gather the blocks' gradients (every rank's replicated
    computation before the split needs the whole gradient)."""
    return _apply(x, group, lambda t, g: _own_block(t, g, dim), lambda t, g: all_gather(t, g, dim))


def gather_to_replicated(x, group, dim):
    """Forward all-gather along `dim` into a tensor every rank then uses
    whole and alike; backward keep this rank's block of the (identical)
    gradient. The adjoint of split_along."""
    return _apply(x, group, lambda t, g: all_gather(t, g, dim), lambda t, g: _own_block(t, g, dim))
