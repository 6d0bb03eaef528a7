"""The one record of a parameter: which slice of the full tensor a rank
holds, and who else holds, sums, counts and writes it, as data.

Every parameter a mode creates carries a `ShardSpec`: for each dimension the
ranges of the (padded) full tensor it holds, which ranks of the grid hold
identical copies (whole, or run by run of rows) and whether those copies'
gradients are partial sums; the pipeline adds a tied weight's stage copies
(cut.py), the rewrite the data-parallel replicas (`record_replicas`), and a
ZeRO chunk is a sub-box that one replica owns (`rows`). Asked with a rank
(nothing here asks torch which rank it is), it answers who holds an element
(`holders`), over which groups its gradient is summed (`partial_parts`,
`stage_parts`, `dp_parts`), whether that rank counts it in the gradient norm
(`norm_parts`) and whether it writes it, box by box, into a checkpoint
(`boxes`, `writes`, `writes_origin`). Initialisation and pretrained loading
read slices of it (`slice`, `read`).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

Ranges = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class RowReplicas:
    """Rows [start, stop) of a shard (local positions along dim 0) that the
    global ranks `ranks` hold alike, each a partial gradient: a key/value
    head shared by several blocks of query heads, next to rows of its own
    in one fused projection."""

    start: int
    stop: int
    ranks: tuple[int, ...]
    group: Optional[dist.ProcessGroup] = field(default=None, repr=False, compare=False)


@dataclass
class ShardSpec:
    full_shape: tuple[int, ...]
    # Per dim: None (the whole dim) or the (start, stop) ranges held, in
    # order. Indices at or past full_shape[d] are padding (zeros).
    index: tuple[Optional[Ranges], ...]
    # Global ranks holding an identical copy of this shard inside the
    # tensor-parallel group, this rank included (sorted).
    replica_ranks: tuple[int, ...] = ()
    # True when each replica's gradient covers only its own rows, so the
    # replicas' gradients must be summed; False when they are already equal.
    partial_grad: bool = False
    replica_group: Optional[dist.ProcessGroup] = field(default=None, repr=False, compare=False)
    # Where rows of one shard have different replicas (a fused projection
    # holding its own query heads and a shared key/value head): every local
    # row in exactly one entry, which then replaces replica_ranks and
    # partial_grad for those rows.
    row_replicas: tuple[RowReplicas, ...] = ()
    # A weight two pipeline stages hold (an embedding tied to the LM head):
    # the global ranks of its copies, the first stage's first, this rank
    # included; each copy's gradient is partial (summed over stage_group).
    stage_ranks: tuple[int, ...] = ()
    stage_group: Optional[dist.ProcessGroup] = field(default=None, repr=False, compare=False)
    # The data-parallel replicas holding the same values, this rank
    # included (replica 0 first); none in a ZeRO chunk, which one replica owns.
    dp_ranks: tuple[int, ...] = ()
    dp_group: Optional[dist.ProcessGroup] = field(default=None, repr=False, compare=False)

    def local_shape(self) -> tuple[int, ...]:
        return tuple(
            full if ranges is None else sum(b - a for a, b in ranges)
            for full, ranges in zip(self.full_shape, self.index)
        )

    def slice(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the whole tensor `full` (padding zero-filled)."""
        return self.read(lambda box: full[tuple(slice(a, b) for a, b in box)], full.dtype)

    def read(self, read_box: Callable[[tuple], torch.Tensor], dtype=None) -> torch.Tensor:
        """This rank's shard, assembled from `read_box(((start, stop), ...))`
        blocks of the full tensor (e.g. slices of a file): no rank ever needs
        the whole tensor. Ranges past the full shape are zero padding."""
        def assemble(dim: int, prefix: tuple) -> torch.Tensor:
            if dim == len(self.full_shape):
                return read_box(prefix)
            full, ranges = self.full_shape[dim], self.index[dim]
            pieces = []
            for a, b in ((0, full),) if ranges is None else ranges:
                if min(b, full) > a:
                    pieces.append(assemble(dim + 1, prefix + ((a, min(b, full)),)))
                pad = b - max(a, full)
                if pad > 0:
                    shape = [b - a for a, b in prefix] + [pad] + list(self.local_shape()[dim + 1:])
                    pieces.append(torch.zeros(shape, dtype=pieces[0].dtype if pieces else dtype))
            return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)

        return assemble(0, ()).contiguous()

    def rows(self, start: int, stop: int) -> "ShardSpec":
        """The sub-box of this shard made of its local rows [start, stop)
        (first dimension): a data-parallel replica's chunk under ZeRO
        (parallel/data_parallel/zero.py), which that replica alone holds. The same tensor
        replicas and stage copies hold the same sub-box."""
        full = self.full_shape[0]
        held = self.index[0] if self.index[0] is not None else ((0, full),)
        out, pos = [], 0
        for a, b in held:
            lo, hi = max(start, pos), min(stop, pos + b - a)
            if lo < hi:
                out.append((a + lo - pos, a + hi - pos))
            pos += b - a
        # Rows with replicas of their own keep them, in the chunk's local rows.
        row_replicas = tuple(dataclasses.replace(r, start=max(r.start, start) - start, stop=min(r.stop, stop) - start)
                             for r in self.row_replicas if max(r.start, start) < min(r.stop, stop))
        return dataclasses.replace(self, index=(_merge(out),) + tuple(self.index[1:]), row_replicas=row_replicas,
                                   dp_ranks=(), dp_group=None)

    # ---- who holds, sums, counts and writes: the rank asking is passed in ----------
    def tensor_replicas(self, rank: int, row: int = 0) -> tuple[int, ...]:
        """The ranks of the tensor-parallel grid holding local row `row` of
        this shard alike (`rank` alone where none other does)."""
        run = next((r for r in self.row_replicas if r.start <= row < r.stop), None)
        ranks = run.ranks if run is not None else self.replica_ranks
        return ranks or (rank,)

    def holders(self, rank: int, row: int = 0) -> tuple[int, ...]:
        """Every global rank holding the elements of local row `row` that
        `rank` holds: its tensor replicas, each on every stage holding a
        copy, in every data-parallel replica holding the same values. A
        global rank is a sum of per-axis strides (Layout.rank_of), so a
        holder is `rank` moved along each axis independently."""
        tp = self.tensor_replicas(rank, row)
        return tuple(sorted(t + s + d - 2 * rank for t in tp for s in self.stage_ranks or (rank,)
                            for d in self.dp_ranks or (rank,)))

    def first_on_stages(self, rank: int) -> bool:
        """Whether `rank` holds the first stage's copy (or the only one)."""
        return not self.stage_ranks or self.stage_ranks[0] == rank

    def counts(self, rank: int, row: int = 0) -> bool:
        """Whether `rank` counts local row `row` in the gradient norm: the
        first of the tensor replicas on the first stage. Every data-parallel
        replica computes the norm alike (its group spans the grid and the
        stages; a ZeRO chunk has no replicas)."""
        return self.first_on_stages(rank) and self.tensor_replicas(rank, row)[0] == rank

    def writes(self, rank: int, row: Optional[int] = None) -> bool:
        """Whether `rank` writes local row `row` (None: any row) of its shard
        into a checkpoint: the first of its holders along every axis (tensor
        replicas, stage copies, data-parallel replicas), so each element is
        written once whatever the layout."""
        rows = [r.start for r in self.row_replicas] or [0] if row is None else [row]
        first_replica = not self.dp_ranks or self.dp_ranks[0] == rank
        return first_replica and self.first_on_stages(rank) and any(self.tensor_replicas(rank, r)[0] == rank for r in rows)

    def writes_origin(self, rank: int) -> bool:
        """Whether `rank` writes the element at the global origin (the one
        writer of what a tensor has once, e.g. AdamW's step count)."""
        row = 0
        for dim, (full, ranges) in enumerate(zip(self.full_shape, self.index)):
            held = ((0, full),) if ranges is None else ranges
            pos = 0
            for a, b in held:
                if a == 0 and min(b, full) > 0:
                    break
                pos += b - a
            else:
                return False
            if dim == 0:
                row = pos
        return self.writes(rank, row)

    def boxes(self, local_shape: Sequence[int]) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
        """(global offsets, sizes, where it starts in the local tensor) of
        each box of the full tensor this shard holds (padding clipped)."""
        per_dim = []
        for full, ranges in zip(self.full_shape, self.index):
            pieces, pos = [], 0
            for a, b in (ranges if ranges is not None else ((0, full),)):
                stop = min(b, full)
                if stop > a:
                    pieces.append((a, stop - a, pos))
                pos += b - a
            per_dim.append(pieces)
        return [(tuple(p[0] for p in combo), tuple(p[1] for p in combo), tuple(p[2] for p in combo))
                for combo in itertools.product(*per_dim)]

    def partial_parts(self, grad: torch.Tensor) -> list[tuple[torch.Tensor, dist.ProcessGroup]]:
        """(piece of `grad`, group) for each piece that is a partial sum over
        its tensor replicas: the pieces to all-reduce, each over its group, once."""
        if self.row_replicas:
            return [(grad.narrow(0, r.start, r.stop - r.start), r.group) for r in self.row_replicas if len(r.ranks) > 1]
        if self.partial_grad and len(self.replica_ranks) > 1:
            return [(grad, self.replica_group)]
        return []

    def stage_parts(self, grad: torch.Tensor) -> list[tuple[torch.Tensor, dist.ProcessGroup]]:
        """(grad, group) where the stage copies' gradients are summed (a tied
        weight between the end stages); none otherwise."""
        return [(grad, self.stage_group)] if len(self.stage_ranks) > 1 else []

    def dp_parts(self, grad: torch.Tensor) -> list[tuple[torch.Tensor, dist.ProcessGroup]]:
        """(grad, group) where the data-parallel replicas' gradients are
        summed (each replica's covers its own rows of the batch); none in a
        ZeRO chunk (its reduction is the bucket engine's reduce-scatter)."""
        return [(grad, self.dp_group)] if len(self.dp_ranks) > 1 else []

    def norm_parts(self, tensor: torch.Tensor, rank: int) -> list[torch.Tensor]:
        """The pieces of `rank`'s `tensor` it counts (a gradient's norm):
        each element once over all its tensor replicas and stage copies."""
        if self.row_replicas:
            return [tensor.narrow(0, r.start, r.stop - r.start) for r in self.row_replicas if self.counts(rank, r.start)]
        return [tensor] if self.counts(rank) else []


def block(n: int, blocks: int, index: int) -> Ranges:
    """Contiguous block `index` of `blocks` equal blocks of range(n)."""
    size = n // blocks
    return ((index * size, (index + 1) * size),)


def fused_block(n: int, parts: int, shards: int, blocks: int, index: int) -> Ranges:
    """Block `index` of `blocks` of a fused dimension made of `parts` equal
    parts (e.g. [q|k|v]), reordered so that each of `shards` compute shards
    holds the same slice of every part (whole heads of q, k and v).

    `blocks` may be a multiple of `shards` (3d stores a compute shard in
    q sub-blocks); each block then lies inside one shard's reordered range.
    """
    part = n // parts
    order = []
    for s in range(shards):
        for p in range(parts):
            lo = p * part + s * (part // shards)
            order.append((lo, lo + part // shards))
    flat_lo, flat_hi = index * (n // blocks), (index + 1) * (n // blocks)
    out, pos = [], 0
    for a, b in order:
        lo, hi = max(a, a + flat_lo - pos), min(b, a + flat_hi - pos)
        if lo < hi:
            out.append((lo, hi))
        pos += b - a
    return _merge(out)


def _merge(ranges: Sequence[tuple[int, int]]) -> Ranges:
    merged: list[tuple[int, int]] = []
    for a, b in ranges:
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    return tuple(merged)


def make_param(local: torch.Tensor, spec: ShardSpec) -> torch.nn.Parameter:
    """A new parameter holding `local`, the slice `spec` of a full tensor,
    tagged with `spec`."""
    if tuple(local.shape) != spec.local_shape():
        raise ValueError(f"a shard of shape {tuple(local.shape)} where {spec.local_shape()} was expected")
    param = torch.nn.Parameter(local.detach().clone())  # a copy: the full tensor may be freed
    param.tpctl_spec = spec
    return param


def spec_of(param: torch.Tensor) -> Optional[ShardSpec]:
    return getattr(param, "tpctl_spec", None)


def record_replicas(model: torch.nn.Module, dp_ranks: Sequence[int], dp_group: Optional[dist.ProcessGroup] = None) -> None:
    """Record on each parameter's ShardSpec the data-parallel replicas that
    hold its values (`dp_ranks`, replica 0 first, summed over `dp_group`),
    so the record answers who holds each element across the whole world."""
    for p in model.parameters():
        spec = spec_of(p)
        if spec is not None:
            p.tpctl_spec = dataclasses.replace(spec, dp_ranks=tuple(dp_ranks), dp_group=dp_group)
