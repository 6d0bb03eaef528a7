"""Data parallelism as a component: `dp` replicas of the model (each a
whole tensor-parallel grid, or pipeline) that read other rows of every
micro-batch and agree on one gradient.

Everything that concerns replicas lives here, and nothing else does: which
rows of a micro-batch a replica reads, the reduction of gradients across
replicas, and which replica writes the state they share into a checkpoint.
The tensor-parallel mode sums only its own replicas (2.5d depth, norms,
biases: a parameter's `ShardSpec`) and never sees the dp axis; the training
step calls the mode's sums first and this reduction second, as Megatron's
`finalize_model_grads` does with its DDP buckets.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from . import comm
from .mesh import Mesh
from .shard import ShardSpec


class DataParallel:
    """The dp axis of `mesh`: this rank's replica and the group of its
    counterparts in the other replicas (the same grid position)."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.size = mesh.layout.dp
        self.rank = mesh.dp_rank
        self.group = mesh.groups["dp"]

    def share(self, batch_size: int, grad_accum: int, micro: int) -> range:
        """Rows of the global batch that this replica reads for micro-batch
        `micro`: its contiguous `1/dp` of that micro-batch."""
        per_micro = batch_size // grad_accum
        per_replica = per_micro // self.size
        start = micro * per_micro + self.rank * per_replica
        return range(start, start + per_replica)

    def reduce_grads(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Sum every gradient over the replicas (in one flattened
        all-reduce: the replicas' gradients of a parameter are partial sums
        over their rows)."""
        if self.size == 1:
            return
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            all_reduce_coalesced(grads, self.group)

    def writes(self, spec: Optional[ShardSpec]) -> bool:
        """Whether this rank writes a tensor described by `spec` into a
        checkpoint: replica 0 alone (the others hold the same values), and
        there the first of the grid's copies (rows with replicas of their
        own are decided box by box: ShardSpec.writes_rows)."""
        if spec is not None and spec.row_replicas:
            return self.rank == 0
        return self.rank == 0 and (spec is None or not spec.replica_ranks or self.mesh.rank == spec.replica_ranks[0])


def all_reduce_coalesced(tensors: list[torch.Tensor], group) -> None:
    """Sum `tensors` over `group` in one call, through one flat buffer."""
    flat = _flatten_dense_tensors(tensors)
    comm.all_reduce(flat, group)
    for t, synced in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
        t.copy_(synced)
