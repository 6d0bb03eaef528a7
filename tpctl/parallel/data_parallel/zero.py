"""The gradient buckets of data parallelism and the ZeRO stages
(docs/DESIGN.md, "Data parallelism and ZeRO"); owned by
data_parallel.DataParallel, which is its only user.

**Chunks.** Under ZeRO every parameter's local tensor (its tensor-parallel
shard, as its ShardSpec says) is cut along its first dimension into `dp`
chunks of `c = ceil(rows / dp)` rows; replica r owns rows [r c, (r+1) c),
the last chunks padded with zero rows so that every replica holds, sends
and receives the same number of elements. A chunk is a sub-box of the
shard (`ShardSpec.rows`), so checkpoints, the gradient norm and the
tensor-parallel replica sums treat it like any other shard. AdamW is
elementwise: stepping each chunk is stepping the whole.

**Buckets.** Parameters are grouped in the reverse of their definition
order (the order the backward finishes them in) into buckets of at most
`BUCKET_BYTES`. A parameter's gradient is final once it has been
accumulated once per micro-batch (a post-accumulate-grad hook counts); when
every gradient of a bucket is final its collective starts, asynchronously,
while the backward goes on. Buckets start in bucket order on every replica,
so the replicas' collectives always pair up. Stage 3 groups by unit
instead (the model's root, and each block of its repeated stack,
`roles.repeated_blocks`): the granularity at which parameters are gathered.
A bucket's per-replica segment holds chunk r of each member in member
order; what crosses the group is `dp` segments, replica-major.

  stage 0  gradients all-reduced in place in a flat buffer per bucket
           (p.grad is a view of it); the optimizer steps the parameters
  stage 1  the same all-reduce; AdamW steps chunk r only (its state is
           1/dp), then each bucket's updated chunks are all-gathered
  stage 2  a bucket's gradients are reduce-scattered: a replica keeps only
           its chunk's gradient (p.grad is freed); the same all-gather
  stage 3  between uses a replica keeps only its chunk of each parameter;
           a unit is all-gathered before its forward and again before its
           backward, its storage freed after each; gradients as stage 2

Where each piece lies (the buckets, the chunks) is zero_plan.py's `Plan`,
which the planner (cost/planner.py) builds from a dry run and counts.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.nn as nn

from tpctl.parallel import comm
from tpctl.parallel.data_parallel.zero_plan import BUCKET_BYTES, Bucket, Plan, named_parameters, plan_of
from tpctl.parallel.roles.plan import repeated_blocks
from tpctl.parallel.shard import ShardSpec, spec_of

# Buckets in flight at once in the reduce-scatters of stages 2 and 3 and the
# all-gathers after the optimizer of stages 1 and 2: each holds a bucket's
# whole gradient (or weights) in its buffer, so an unbounded queue would
# hold the whole model's worth again (FSDP2 bounds its reduce-scatters too).
IN_FLIGHT = 2


# --------------------------------------------------------------------------
# On a rank


class Zero:
    """Data parallelism of one rank at ZeRO stage `stage` (0: buckets only)
    over `group` (dp replicas, this one `rank`)."""

    overlap = True  # DataParallel sets train.overlap

    def __init__(self, group, dp: int, rank: int, stage: int, bucket_bytes: int = BUCKET_BYTES):
        self.group, self.dp, self.rank, self.stage = group, dp, rank, stage
        self.bucket_bytes = bucket_bytes
        self.plan: Optional[Plan] = None

    # ---- set-up ------------------------------------------------------------------
    def attach(self, model_parts: list[nn.Module], micro_batches: int) -> list[nn.Parameter]:
        """Install the buckets (and, by stage, the chunks) on the model's
        parameters; returns what the optimizer steps."""
        self.plan = plan_of(model_parts, self.dp, self.stage, self.bucket_bytes)
        self.params = [p for _, p in named_parameters(model_parts)]
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.micro_batches = micro_batches
        self.bucket_of = {i: k for k, b in enumerate(self.plan.buckets) for i in b.members}
        self.specs = [spec_of(p) for p in self.params]
        self.main: list[nn.Parameter] = list(self.params)
        self.whole: list[torch.Tensor] = []  # stages 0, 1: each bucket's flat gradient buffer
        self.grad_chunks: list[torch.Tensor] = []  # stages 2, 3: each bucket's gradient segment
        self.param_chunks: list[torch.Tensor] = []  # stage 3: each bucket's parameter segment
        self.full: dict[int, torch.Tensor] = {}  # stages 1-3: each parameter's padded whole storage
        if self.stage:
            self._cut_parameters()
        for k, b in enumerate(self.plan.buckets):
            dtype, device = self.params[b.members[0]].dtype, self.params[b.members[0]].device
            if self.stage <= 1:
                self.whole.append(torch.zeros(b.whole_numel, dtype=dtype, device=device))
            else:
                self.grad_chunks.append(torch.zeros(b.chunk_numel, dtype=dtype, device=device))
        if self.stage == 3:
            self._install_units(model_parts)
        self.hooks = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(self.params)]
        self.zero_grad(None)
        return self.main

    def _cut_parameters(self) -> None:
        """Each parameter's data moves into a storage padded to dp chunks
        (the padding rows stay zero), and chunk `rank` of it becomes the
        optimizer's parameter, tagged with its sub-box of the shard."""
        cuts = self.plan.cuts
        self.main = []
        for k, b in enumerate(self.plan.buckets):
            if self.stage == 3:
                self.param_chunks.append(torch.zeros(b.chunk_numel, dtype=self.params[b.members[0]].dtype,
                                                     device=self.params[b.members[0]].device))
        for i, p in enumerate(self.params):
            cut = cuts[i]
            full = torch.zeros((cut.padded_rows, *p.shape[1:]), dtype=p.dtype, device=p.device)
            full[:cut.rows].copy_(p.data)
            p.data = full[:cut.rows]  # (the unpadded storage goes)
            self.full[i] = full
            mine = full[self.rank * cut.per_rank:(self.rank + 1) * cut.per_rank]
            if self.stage == 3:  # the chunk moves to the unit's segment; the whole is gathered before each use
                chunk = self._slot(self.param_chunks, i)
                chunk.copy_(mine)
                full.untyped_storage().resize_(0)
            else:
                chunk = mine
            main = nn.Parameter(chunk, requires_grad=p.requires_grad)
            if self.specs[i] is not None:
                main.tpctl_spec = self.specs[i].rows(*cut.held(self.rank))
            self.main.append(main)

    # ---- stage 3: units ---------------------------------------------------------
    def _install_units(self, model_parts: list[nn.Module]) -> None:
        """Gather each unit before its forward; a block frees its parameters
        after its forward and gathers them again before its backward (a hook
        on its outputs' gradients). The root stays gathered from the
        model's forward to the end of the step's backward (FSDP2 does the
        same: its backward starts at once)."""
        self.gathered = [False] * len(self.plan.buckets)
        if self.plan.buckets and self.plan.buckets[0].root:
            for part in model_parts:
                part.register_forward_pre_hook(lambda module, args: self._unshard(0))
        blocks = [block for part in model_parts for block in (repeated_blocks(part) or [])]
        for k, b in enumerate(self.plan.buckets):
            if b.root:
                continue
            first = self.params[b.members[0]]
            block = next(block for block in blocks if any(q is first for q in block.parameters()))
            block.register_forward_pre_hook(lambda module, args, k=k: self._unshard(k))
            block.register_forward_hook(lambda module, args, out, k=k: self._after_forward(k, out))

    def _after_forward(self, k: int, out) -> None:
        """A block's forward is done: free its gathered parameters (unless
        the forward is a recomputation inside the backward) and have its
        backward gather them first."""
        if self.in_backward[k]:
            return
        self._reshard(k)
        if torch.is_grad_enabled():
            for t in (out if isinstance(out, tuple) else (out,)):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad, k=k: self._before_backward(k))

    def _before_backward(self, k: int) -> None:
        self.in_backward[k] = True
        self._unshard(k)

    def _unshard(self, k: int) -> None:
        """All-gather unit k's chunks into its parameters' whole storage."""
        if self.gathered[k]:
            return
        b = self.plan.buckets[k]
        segment = self.param_chunks[k]
        recv = torch.empty(self.dp * b.chunk_numel, dtype=segment.dtype, device=segment.device)
        comm.all_gather_flat(recv, segment, self.group)
        recv = recv.view(self.dp, b.chunk_numel)
        cuts = self.plan.cuts
        for i, off in zip(b.members, b.chunk_offsets):
            full = self.full[i]
            full.untyped_storage().resize_(full.numel() * full.element_size())
            full.view(self.dp, -1).copy_(recv[:, off:off + cuts[i].chunk_numel])
        self.gathered[k] = True

    def _reshard(self, k: int) -> None:
        if not self.gathered[k]:
            return
        for i in self.plan.buckets[k].members:
            self.full[i].untyped_storage().resize_(0)
        self.gathered[k] = False

    # ---- the backward -------------------------------------------------------------
    def _hook(self, i: int):
        def on_grad(p: torch.Tensor) -> None:
            self.count[i] += 1
            k = self.bucket_of[i]
            self.accumulated[k] += 1
            members = len(self.plan.buckets[k].members)
            if self.stage == 3:
                if self.accumulated[k] % members == 0:  # the unit's backward of one micro-batch is done
                    self.micro_done[k] = self.accumulated[k] // members
                    self.in_backward[k] = False
                    if self.micro_done[k] == self.micro_batches:
                        self._launch(k)
                        self._reshard(k)
                    elif not self.plan.buckets[k].root:
                        self._reshard(k)
                return
            if self.count[i] == self.micro_batches:
                self.ready[k] += 1
                while self.next < len(self.plan.buckets) and \
                        self.ready[self.next] == len(self.plan.buckets[self.next].members):
                    self._launch(self.next)
                    self.next += 1
        return on_grad

    def _launch(self, k: int) -> None:
        """Start bucket k's reduction (its gradients are final)."""
        b = self.plan.buckets[k]
        if self.stage <= 1:
            flat = self.whole[k]
            for i in b.members:  # a gradient someone replaced (zero_grad(set_to_none)) comes back into the buffer
                view, grad = self._grad_view(i), self.params[i].grad
                if grad is None or grad.data_ptr() != view.data_ptr():
                    view.copy_(grad if grad is not None else torch.zeros_like(view))
                    self.params[i].grad = view
            self._started(comm.all_reduce_flat(flat, self.group, async_op=True))
            self.launched[k] = True
            return
        cuts = self.plan.cuts
        send = torch.zeros(self.dp, b.chunk_numel, dtype=self.grad_chunks[k].dtype, device=self.grad_chunks[k].device)
        for i, off in zip(b.members, b.chunk_offsets):
            p, cut = self.params[i], cuts[i]
            if p.grad is not None:
                # row j of the gradient goes to replica j // c's segment (the padding rows stay zero)
                dst = send[:, off:off + cut.chunk_numel].view(self.dp, cut.per_rank, cut.row_numel)
                grad = p.grad.reshape(cut.rows, cut.row_numel)
                whole = cut.rows // cut.per_rank
                dst[:whole].copy_(grad[:whole * cut.per_rank].view(whole, cut.per_rank, cut.row_numel))
                if cut.rows > whole * cut.per_rank:
                    dst[whole, :cut.rows - whole * cut.per_rank].copy_(grad[whole * cut.per_rank:])
                p.grad = None  # the whole gradient goes: only the chunk is kept
        self._started(comm.reduce_scatter_flat(self.grad_chunks[k], send.view(-1), self.group, async_op=True))
        self.launched[k] = True
        while len(self.works) > IN_FLIGHT:  # the oldest send buffer goes once its reduction is done
            work = self.works.pop(0)
            if work is not None:
                work.wait()

    def _started(self, work) -> None:
        """A bucket's reduction in flight during the backward (overlap=False,
        train.overlap=false: waited for at once, to measure what the backward
        hides of it)."""
        if work is not None and not self.overlap:
            work.wait()
            work = None
        self.works.append(work)

    def finish(self) -> list[nn.Parameter]:
        """Wait for every bucket's reduction (starting those the backward did
        not complete: a parameter without a gradient counts as zeros);
        returns the optimizer's parameters, their gradients summed over the
        replicas."""
        if self.stage == 3:
            for k in range(len(self.plan.buckets)):
                if not self.launched[k]:
                    self._launch(k)
                self._reshard(k)
        else:
            while self.next < len(self.plan.buckets):
                self._launch(self.next)
                self.next += 1
        for work in self.works:
            if work is not None:
                work.wait()
        self.works = []
        return self.main

    def after_load(self) -> None:
        """A checkpoint was loaded into the chunks: stages 1 and 2 gather
        them into the parameters, stage 3 drops what it had gathered."""
        if self.stage == 3:
            for k in range(len(self.plan.buckets)):
                self._reshard(k)
        self.after_step()

    def after_step(self) -> None:
        """Stages 1 and 2: every replica's updated chunks, all-gathered into
        every parameter (bucket by bucket, IN_FLIGHT gathers at a time)."""
        if self.stage not in (1, 2):
            return
        cuts, pending = self.plan.cuts, []

        def place(b: Bucket, recv: torch.Tensor, work) -> None:
            if work is not None:
                work.wait()
            recv = recv.view(self.dp, b.chunk_numel)
            for i, off in zip(b.members, b.chunk_offsets):
                self.full[i].view(self.dp, -1).copy_(recv[:, off:off + cuts[i].chunk_numel])

        for b in self.plan.buckets:
            segment = torch.empty(b.chunk_numel, dtype=self.params[b.members[0]].dtype,
                                  device=self.params[b.members[0]].device)
            for i, off in zip(b.members, b.chunk_offsets):
                segment[off:off + cuts[i].chunk_numel].copy_(self.main[i].detach().reshape(-1))
            recv = torch.empty(self.dp * b.chunk_numel, dtype=segment.dtype, device=segment.device)
            pending.append((b, recv, comm.all_gather_flat(recv, segment, self.group, async_op=True)))
            if len(pending) > IN_FLIGHT:
                place(*pending.pop(0))
        for gathered in pending:
            place(*gathered)

    def zero_grad(self, optimizer: Optional[torch.optim.Optimizer]) -> None:
        """Before a step's first backward: gradients zero, views in place,
        the counts of the hooks reset."""
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        n = len(self.plan.buckets)
        self.count = [0] * len(self.params)
        self.accumulated = [0] * n
        self.ready = [0] * n
        self.launched = [False] * n
        self.micro_done = [0] * n
        self.in_backward = [False] * n
        self.next = 0
        self.works = []
        for flat in self.whole:
            flat.zero_()
        for i, p in enumerate(self.params):
            if self.stage <= 1:
                p.grad = self._grad_view(i)
            else:
                p.grad = None
            if self.stage:
                self.main[i].grad = self._main_grad_view(i)

    def _grad_view(self, i: int) -> torch.Tensor:
        """Stages 0, 1: parameter i's gradient, a view of its bucket's buffer."""
        k = self.bucket_of[i]
        b = self.plan.buckets[k]
        off = b.whole_offsets[b.members.index(i)]
        p = self.params[i]
        if self.stage == 0:
            return self.whole[k][off:off + p.numel()].view_as(p)
        cut = self.plan.cuts[i]
        return self.whole[k][off:off + cut.padded_rows * cut.row_numel].view(cut.padded_rows, *p.shape[1:])[:cut.rows]

    def _main_grad_view(self, i: int) -> torch.Tensor:
        """Stages 1-3: the gradient of this replica's chunk of parameter i."""
        if self.stage > 1:
            return self._slot(self.grad_chunks, i)
        k = self.bucket_of[i]
        b = self.plan.buckets[k]
        cut, shape = self.plan.cuts[i], self.params[i].shape[1:]
        off = b.whole_offsets[b.members.index(i)]
        padded = self.whole[k][off:off + cut.padded_rows * cut.row_numel].view(cut.padded_rows, *shape)
        return padded[self.rank * cut.per_rank:(self.rank + 1) * cut.per_rank]

    def _slot(self, segments: list[torch.Tensor], i: int) -> torch.Tensor:
        """Parameter i's chunk in its bucket's segment of `segments` (one flat
        buffer per bucket), shaped as the chunk."""
        k = self.bucket_of[i]
        b = self.plan.buckets[k]
        cut = self.plan.cuts[i]
        off = b.chunk_offsets[b.members.index(i)]
        return segments[k][off:off + cut.chunk_numel].view(cut.per_rank, *self.params[i].shape[1:])

    # ---- what a rank holds ------------------------------------------------------
    def held(self, i: int) -> tuple[nn.Parameter, torch.Tensor, Optional[ShardSpec]]:
        """(the optimizer's parameter, the tensor of its values this replica
        owns, their ShardSpec) of parameter i: under ZeRO the real rows of
        its chunk, a sub-box of the shard."""
        if not self.stage:
            return self.params[i], self.params[i].data, self.specs[i]
        main = self.main[i]
        start, stop = self.plan.cuts[i].held(self.rank)
        return main, main.data[:stop - start], spec_of(main)

    def index_of(self, p: torch.Tensor) -> int:
        return self.index[id(p)]


def storage_bytes(tensors: Iterable[Optional[torch.Tensor]]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer
    count once; a freed storage counts 0)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if storage.nbytes() and key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total
