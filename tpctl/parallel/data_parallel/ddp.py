"""Data parallelism as a component: `dp` replicas of the model (each a
whole tensor-parallel grid, or pipeline) that read other rows of every
micro-batch and agree on one gradient, and with ZeRO (`zero` = 1, 2, 3)
share the optimizer state, the gradients and the parameters between them.

Everything that concerns replicas lives here and in zero.py, its engine,
and nothing else does: which rows of a micro-batch a replica reads, the
reduction of gradients across replicas (in buckets, during the backward),
which part of each parameter a replica owns, and which replica writes what
into a checkpoint. The tensor-parallel mode sums only its own replicas
(2.5d depth, norms, biases: a parameter's `ShardSpec`) and never sees the
dp axis; the training step finishes this reduction first and the mode's
sums second, as Megatron's `finalize_model_grads` does with its DDP buckets.
"""

from __future__ import annotations

from typing import Iterator, NamedTuple, Optional

import torch
import torch.nn as nn

from tpctl.parallel import comm
from tpctl.parallel.data_parallel.zero import Zero, storage_bytes
from tpctl.parallel.data_parallel.zero_plan import BUCKET_BYTES
from tpctl.parallel.mesh import Mesh
from tpctl.parallel.shard import ShardSpec, spec_of


class Held(NamedTuple):
    """One parameter as a checkpoint sees it on this rank: the tensor the
    optimizer steps (its AdamW state is keyed by it), the values this rank
    owns and their ShardSpec, and whether this rank writes them."""

    name: str
    param: nn.Parameter
    values: torch.Tensor
    spec: Optional[ShardSpec]
    write: bool


class DataParallel:
    """The dp axis of `mesh`: this rank's replica and the group of its
    counterparts in the other replicas (the same grid position). With
    context parallelism (cp > 1) the ranks that split a sequence hold the
    same parameters too, each a partial gradient over its tokens: the
    reduction (and ZeRO) runs over dp x cp (`size`, `rank`, `group`), while
    rows are read by replica (`replicas`, `replica`)."""

    def __init__(self, mesh: Mesh, bucket_bytes: int = BUCKET_BYTES):
        self.mesh = mesh
        self.replicas, self.replica = mesh.layout.dp, mesh.dp_rank
        self.size = mesh.layout.dp * mesh.layout.cp
        self.rank = mesh.dp_rank * mesh.layout.cp + mesh.cp_rank
        self.group = mesh.groups["dp_cp"]
        # ZeRO over one replica has nothing to shard: stage 0.
        self.stage = mesh.layout.zero if self.size > 1 else 0
        self.bucket_bytes = bucket_bytes
        self.zero: Optional[Zero] = None
        self.overlap = True  # train.overlap: bucket reductions run during the backward (False: waited at once)

    def share(self, batch_size: int, grad_accum: int, micro: int) -> range:
        """Rows of the global batch that this replica reads for micro-batch
        `micro`: its contiguous `1/dp` of that micro-batch."""
        per_micro = batch_size // grad_accum
        per_replica = per_micro // self.replicas
        start = micro * per_micro + self.replica * per_replica
        return range(start, start + per_replica)

    # ---- the training step's side ------------------------------------------------
    def attach(self, model_parts: list[nn.Module], micro_batches: int) -> list[nn.Parameter]:
        """Reduce gradients in buckets during each backward of `model_parts`
        (whose gradients are final after `micro_batches` backwards), and
        under ZeRO keep this replica's chunks; returns the parameters the
        optimizer steps. One replica: nothing to reduce, the model's own."""
        if self.size == 1:
            return [p for part in model_parts for p in part.parameters()]
        self.zero = Zero(self.group, self.size, self.rank, self.stage, self.bucket_bytes)
        self.zero.overlap = self.overlap
        return self.zero.attach(model_parts, micro_batches)

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        if self.zero is None:
            optimizer.zero_grad(set_to_none=True)
        else:
            self.zero.zero_grad(optimizer)

    def finish_grads(self, model_parts: list[nn.Module]) -> list[nn.Parameter]:
        """After the step's backwards: the optimizer's parameters, their
        gradients summed over the replicas. With buckets (the training
        step), waiting for their reductions; without (a custom loop: no
        `attach`), one flattened all-reduce of every gradient now (the
        replicas' gradients of a parameter are partial sums over their rows)."""
        if self.zero is not None:
            return self.zero.finish()
        params = [p for part in model_parts for p in part.parameters()]
        if self.size == 1:  # nothing to sum: no per-parameter walk each step
            return params
        by_group: dict[int, tuple] = {}
        for p in params:
            spec = spec_of(p)
            # (A tensor without a record is whole, and every replica's gradient partial.)
            parts = spec.dp_parts(p.grad) if spec is not None else [(p.grad, self.group)] if self.size > 1 else []
            for grad, group in parts if p.grad is not None else ():
                by_group.setdefault(id(group), (group, []))[1].append(grad)
        for group, grads in by_group.values():
            comm.all_reduce_coalesced(grads, group)
        return params

    def after_step(self) -> None:
        """After the optimizer: ZeRO 1 and 2 gather the updated chunks."""
        if self.zero is not None:
            self.zero.after_step()

    def after_load(self) -> None:
        if self.zero is not None:
            self.zero.after_load()

    # ---- checkpoints and memory ------------------------------------------------------
    def held(self, model: nn.Module) -> Iterator[Held]:
        """Each parameter of `model` (tied ones once) as this rank holds it:
        the parameter itself, or under ZeRO this replica's chunk (a sub-box
        its record describes). Whether this rank writes it is the record's
        answer (ShardSpec.writes: the first holder along every axis)."""
        for name, p in model.named_parameters():
            if self.zero is None or not self.stage or not p.requires_grad:  # (a frozen one: whole, Zero holds none)
                param, values, spec = p, p.data, spec_of(p)
            else:
                param, values, spec = self.zero.held(self.zero.index_of(p))
            # (A tensor without a record is whole and the same on every replica.)
            write = self.rank == 0 if spec is None else spec.writes(self.mesh.rank)
            yield Held(name, param, values, spec, write)

    def memory(self, model_parts: list[nn.Module], optimizer: Optional[torch.optim.Optimizer]) -> dict[str, int]:
        """Bytes this rank holds of parameters, of gradients kept for the
        optimizer and of optimizer state, counted from the tensors' storages
        (views of one buffer once, a freed storage as 0)."""
        params = [p for part in model_parts for p in part.parameters()]
        chunks = self.zero.param_chunks if self.zero is not None and self.stage == 3 else []
        main = self.zero.main if self.zero is not None else params
        state = optimizer.state.values() if optimizer is not None else []
        return {"param_bytes": storage_bytes([*params, *chunks]),
                "grad_bytes": storage_bytes([p.grad for p in params] + [p.grad for p in main]),
                "optimizer_bytes": storage_bytes(t for s in state for t in s.values() if isinstance(t, torch.Tensor))}
