"""Where each parameter's gradient lies in the data-parallel buckets and,
under ZeRO, which chunk of its rows each replica owns (docs/DESIGN.md,
"Data parallelism and ZeRO"): the `Plan`, pure arithmetic on shapes.

The engine (zero.py) lays its buffers out by it on a rank; the planner
(cost/planner.py) builds the same Plan from a dry run's parameters and
counts its collectives with `Plan.count` (tests/test_plan.py holds the two
to each other); `tpctl inspect` shows it.

**Chunks.** Under ZeRO every parameter's local tensor (its tensor-parallel
shard, as its ShardSpec says) is cut along its first dimension into `dp`
chunks of `c = ceil(rows / dp)` rows; replica r owns rows [r c, (r+1) c),
the last chunks padded with zero rows so that every replica holds, sends
and receives the same number of elements.

**Buckets.** Parameters are grouped in the reverse of their definition
order (the order the backward finishes them in) into buckets of at most
`BUCKET_BYTES`; stage 3 groups by unit instead (the model's root, and each
block of its repeated stack, `roles.repeated_blocks`). A bucket's
per-replica segment holds chunk r of each member in member order; what
crosses the group is `dp` segments, replica-major.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Optional

import torch
import torch.nn as nn

from tpctl.parallel.roles.plan import repeated_blocks

# DDP's default bucket size: big enough for few calls, small enough that the
# first buckets' reductions overlap with the rest of the backward.
BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True)
class Cut:
    """How one parameter's local tensor is cut into `dp` chunks of rows."""

    rows: int
    row_numel: int  # elements of one row (the product of the other dimensions)
    dp: int

    @property
    def per_rank(self) -> int:
        return -(-self.rows // self.dp)

    @property
    def padded_rows(self) -> int:
        return self.per_rank * self.dp

    @property
    def chunk_numel(self) -> int:
        return self.per_rank * self.row_numel

    def held(self, r: int) -> tuple[int, int]:
        """The real (unpadded) rows [start, stop) of replica r's chunk."""
        return min(r * self.per_rank, self.rows), min((r + 1) * self.per_rank, self.rows)


def cut_of(name: str, shape: tuple[int, ...], dp: int) -> Cut:
    if not shape:
        raise ValueError(f"parameter {name!r} is a scalar: ZeRO cuts parameters along their first dimension")
    return Cut(shape[0], math.prod(shape[1:]), dp)


@dataclass
class Bucket:
    """Members (indices into Plan.params) and where each lies: `whole` is
    the param-major flat gradient buffer of stages 0 and 1 (each member's
    rows padded to a multiple of dp under ZeRO), `chunk` the per-replica
    segment of stages 1 to 3."""

    members: list[int]
    whole_offsets: list[int] = field(default_factory=list)
    whole_numel: int = 0
    chunk_offsets: list[int] = field(default_factory=list)
    chunk_numel: int = 0
    root: bool = False  # stage 3: the unit that holds what no block owns


@dataclass
class Plan:
    """Which parameters go in which bucket and where, for `stage` over `dp`
    replicas: the same on every replica, and in the planner's dry run."""

    names: list[str]
    shapes: list[tuple[int, ...]]
    dtypes: list[torch.dtype]
    dp: int
    stage: int
    buckets: list[Bucket]

    @cached_property  # (grad_numel asks for one cut at every parameter)
    def cuts(self) -> list[Cut]:
        return [cut_of(n, s, self.dp) for n, s in zip(self.names, self.shapes)]

    # ---- what a replica holds, in elements ------------------------------------
    def held_numel(self) -> dict[str, int]:
        """Elements of parameters, gradients and each AdamW moment one
        replica holds between steps (padding included: it is allocated)."""
        cuts = self.cuts
        whole = sum(math.prod(s) for s in self.shapes)
        padded = sum(c.padded_rows * c.row_numel for c in cuts)
        chunks = sum(c.chunk_numel for c in cuts)
        if self.stage == 0:
            return {"param": whole, "grad": whole, "moment": whole}
        return {"param": padded if self.stage < 3 else chunks, "grad": padded if self.stage == 1 else chunks,
                "moment": chunks}

    def unit_numel(self) -> int:
        """Stage 3: the most elements gathered whole at once (the root and
        the largest block)."""
        if self.stage != 3:
            return 0
        cuts = self.cuts
        sizes = [sum(cuts[i].padded_rows * cuts[i].row_numel for i in b.members) for b in self.buckets]
        root = sum(s for s, b in zip(sizes, self.buckets) if b.root)
        return root + max((s for s, b in zip(sizes, self.buckets) if not b.root), default=0)

    # ---- what a step sends ----------------------------------------------------
    def count(self, add: Callable, micro_batches: int) -> None:
        """The dp collectives of one optimizer step, as `add(kind, group,
        numel, times)` (cost/planner.py's counter; group "dp")."""
        for b in self.buckets:
            if self.stage <= 1:
                add("all_reduce", "dp", b.whole_numel)
            else:
                add("reduce_scatter", "dp", self.dp * b.chunk_numel)
            if self.stage in (1, 2):
                add("all_gather", "dp", self.dp * b.chunk_numel)
            elif self.stage == 3:
                # The root is gathered once a step; a block before its
                # forward and before its backward in every micro-batch.
                add("all_gather", "dp", self.dp * b.chunk_numel, times=1 if b.root else 2 * micro_batches)

    def grad_numel(self, i: int) -> int:
        """Elements of parameter i's gradient the optimizer sees (what the
        tensor-parallel replica sums reduce)."""
        return math.prod(self.shapes[i]) if self.stage == 0 else self.cuts[i].chunk_numel


def plan(named: list[tuple[str, torch.Tensor]], dp: int, stage: int, bucket_bytes: int = BUCKET_BYTES,
         units: Optional[list[list[int]]] = None) -> Plan:
    """The buckets of `named` (a model's parameters in definition order, tied
    ones once; meta tensors will do). Stage 3 takes `units` (index lists,
    the root's first; `units_of`) as its buckets."""
    names = [n for n, _ in named]
    shapes = [tuple(p.shape) for _, p in named]
    dtypes = [p.dtype for _, p in named]
    out = Plan(names, shapes, dtypes, dp, stage, [])
    cuts = out.cuts if stage else None
    roots = []
    if stage == 3:  # the root's unit first, when it holds anything
        groups = [sorted(u, reverse=True) for u in units if u]
        roots = [bool(units[0])] + [False] * len(groups)
    else:
        groups, size = [], 0
        for i in reversed(range(len(named))):
            nbytes = math.prod(shapes[i]) * dtypes[i].itemsize
            if not groups or size + nbytes > bucket_bytes or dtypes[i] != dtypes[groups[-1][-1]]:
                groups.append([])
                size = 0
            groups[-1].append(i)
            size += nbytes
    for k, members in enumerate(groups):
        b = Bucket(members, root=bool(roots) and roots[k])
        for i in members:
            b.whole_offsets.append(b.whole_numel)
            b.whole_numel += cuts[i].padded_rows * cuts[i].row_numel if stage else math.prod(shapes[i])
            if stage:
                b.chunk_offsets.append(b.chunk_numel)
                b.chunk_numel += cuts[i].chunk_numel
        out.buckets.append(b)
    return out


def plan_of(model_parts: list[nn.Module], dp: int, stage: int, bucket_bytes: int = BUCKET_BYTES) -> Plan:
    """The Plan of a model's parts (a dry run's will do: tpctl inspect and
    the planner lay out the chunks a rank would hold)."""
    named = named_parameters(model_parts)
    units = units_of(model_parts, [p for _, p in named]) if stage == 3 else None
    return plan(named, dp, stage, bucket_bytes, units)


def named_parameters(model_parts: list[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """Every trained parameter of the parts in definition order, tied ones
    once. A frozen one (requires_grad=False: Ernie 4.5's router statistics)
    has no gradient to reduce nor state to step: it stays whole on every
    replica, as it was built."""
    named, seen = [], set()
    for part in model_parts:
        for name, p in part.named_parameters():
            if id(p) not in seen and p.requires_grad:
                seen.add(id(p))
                named.append((name, p))
    return named


def units_of(model_parts: list[nn.Module], params: list[torch.Tensor]) -> list[list[int]]:
    """Stage 3's units as indices into `params`: the root (everything no
    single block owns: embeddings, the last norm, the head, tied weights;
    possibly empty) first, then each block of every part's repeated stack."""
    index = {id(p): i for i, p in enumerate(params)}
    owner: dict[int, int] = {}
    blocks = [block for part in model_parts for block in (repeated_blocks(part) or [])]
    for k, block in enumerate(blocks):
        for p in block.parameters():
            owner[id(p)] = k if owner.get(id(p), k) == k else -1  # shared between blocks: the root's
    units: list[list[int]] = [[] for _ in range(len(blocks) + 1)]
    for p in params:
        units[owner.get(id(p), -1) + 1].append(index[id(p)])
    return [units[0]] + [u for u in units[1:] if u]
