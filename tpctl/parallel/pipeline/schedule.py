"""Pipeline parallelism (pp > 1): one stage of the model on each rank of the
pp axis (cut.py cuts it), and the schedule that runs a step's micro-batches
through the stages.

The pipeline is a component beside the tensor-parallel mode and the
data-parallel replicas (`Parallelism.pipeline`): the mode rewrites the
layers of a stage as it rewrites a whole model, and never sees the cut.

The schedules are torch.distributed.pipelining's (GPipe, 1F1B, interleaved
1F1B) on `PipelineStage`s with static shapes; the loss function scales each
micro-batch's summed loss by the global batch's token count, never a mean of
means, and the point-to-point sends are counted by comm.py.

The stage exchange over a backend that cannot carry device tensors (gloo
with device=cuda: ranks sharing one GPU) goes through host buffers
(`host_staging`): a send is copied to the host first, a receive lands in a
host buffer copied to the stage's device buffer before the stage reads it.
NCCL (and the CPU) send the tensors themselves.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from tpctl.parallel import comm
from tpctl.parallel.comm import host_staging, to_host  # (comm holds the rule: the ring stages by it too)
from tpctl.parallel.mesh import Mesh
from tpctl.parallel.pipeline.cut import Chunk, PipelineRefused, StageCut, StageOutput, StageStack, StandIn, compute_weight
from tpctl.parallel.pipeline.stage_map import StageMap
from tpctl.parallel.pipeline.stages import PipelineSpec
from tpctl.parallel.roles.plan import logits_of

__all__ = ["Pipeline", "PipelineRefused", "StageOutput", "StageStack", "StandIn", "Chunk", "StageMap"]

@dataclass
class _Step:
    """One step's inputs (forward_backward's arguments) and the loss sums
    the last stage collects during it."""

    criterion: Optional[Callable] = None
    tokens: int = 1
    autocast: Callable[[], Any] = contextlib.nullcontext
    loss_sums: list = field(default_factory=list)


class Pipeline:
    """This rank's stage (`stage`, a StageCut: what it holds, cut and
    wired) and the schedule that runs a step through the stages:
    `forward_backward`. `spec` is the schedule's (the stage's places the
    blocks: the planner reads a cut's record under other schedules and
    micro-batch counts, cost/dry_run.py)."""

    # Tests set it to run the host staging on a CPU (where host_staging says no).
    force_host_staging = False

    def __init__(self, mesh: Mesh, spec: PipelineSpec, weigh: Callable[[nn.Module], float] = compute_weight):
        self.mesh, self.spec = mesh, spec
        self.size, self.rank = spec.stages, mesh.pp_rank
        self.stage = StageCut(mesh, spec, weigh)
        self.group = mesh.groups.get("pp")
        import torch.distributed as dist

        backend = dist.get_backend(self.group) if self.group is not None else None
        self.host_staging = self.force_host_staging or host_staging(torch.device(mesh.device), backend)
        self.staged_bytes = 0  # what crossed through host buffers (sent and received)
        self._schedule = None
        self._stages: list = []
        # The step running now, from forward_backward's arguments (torch's
        # schedule calls the chunks and the loss without them).
        self._step = _Step()
        # The idle fraction, measured: busy seconds in this rank's chunks
        # (forward, backward, loss) against each step's wall time.
        self.timings: list[tuple[float, float]] = []  # (busy, wall) seconds of each step
        self.busy_s = 0.0

    # ---- the stage: what this rank holds (StageCut's) ---------------------------------
    def assign(self, model: nn.Module) -> StageMap:
        """Where the stages cut `model` (StageCut.assign): read once, the record returned."""
        return self.stage.assign(model)

    def adopt(self, stage_map: StageMap) -> StageMap:
        """StageCut.adopt: another cut's record of the same model, taken without a trace."""
        return self.stage.adopt(stage_map)

    def cut(self, model: nn.Module, plan):
        """The whole (meta) model trimmed to this rank's stage (StageCut.cut); its role plan."""
        return self.stage.cut(model, plan)

    def install(self, model: nn.Module) -> None:
        """The rewritten stage wired (StageCut.install)."""
        self.stage.install(model)

    def holds(self, name: str) -> bool:
        return self.stage.holds(name)

    def stage_of(self, name: str) -> Optional[int]:
        return self.stage.stage_of(name)

    @property
    def stage_map(self) -> Optional[StageMap]:
        return self.stage.stage_map

    @property
    def chunks(self) -> list[Chunk]:
        return self.stage.chunks

    @property
    def blocks_of(self) -> list[range]:
        return self.stage.blocks_of

    @property
    def first(self) -> bool:
        return self.stage.first

    @property
    def last(self) -> bool:
        return self.stage.last

    @property
    def model(self) -> Optional[nn.Module]:
        """The rewritten stage (once installed)."""
        return self.stage.model

    @property
    def micro_batches(self) -> int:
        """Micro-batches a step's batch is cut into."""
        return self.spec.microbatches

    def forward_chunk(self, chunk: Chunk, stream: Optional[torch.Tensor], ids: torch.Tensor,
                      autocast: Callable[[], Any] = contextlib.nullcontext) -> torch.Tensor:
        """The chunk's forward (under `autocast()`): its output stream, or
        the logits (last chunk)."""
        with self.stage.running(chunk, stream), autocast():
            try:
                out = self.model(ids)
            except StageOutput as end:
                # The boundary's dtype is fixed (the receive buffers are made
                # before any step): the fp32 of tpctl's master weights.
                return end.stream.to(torch.float32)
        return logits_of(out)

    def stream_shape(self, rows: int, seq: int, mode) -> tuple[int, ...]:
        """This rank's piece of the stream between two stages, for a
        micro-batch of which it reads `rows` rows of `seq` tokens."""
        return tuple(mode.shard_hidden(torch.empty(rows, seq, self.stage_map.hidden, device="meta")).shape)

    # ---- one step ----------------------------------------------------------------
    def forward_backward(self, micro_batches: list, criterion: Callable, tokens: int, stream: tuple,
                         autocast: Callable[[], Any] = contextlib.nullcontext, step: Optional[int] = None) -> torch.Tensor:
        """Forward and backward of every micro-batch through the stages,
        the forwards and the loss under `autocast()`, the dropout masks
        keyed by `step` (None: as the mesh last drew) and each micro-batch. `criterion(logits,
        targets)` is a micro-batch's summed loss; each is divided by
        `tokens` (the global batch's) before its backward, so the
        accumulated gradients are those of the global mean. Returns the
        summed loss of this rank's rows on every stage (the last stage's,
        sent to the others), detached."""
        xs = [x for x, _ in micro_batches]
        ys = [y for _, y in micro_batches]
        schedule = self._schedule_for(xs[0], stream)
        self._step = _Step(criterion, tokens, autocast)
        if step is not None:
            self.mesh.draw_step = step
        x = torch.cat(xs)
        self.busy_s, start = 0.0, time.perf_counter()
        if self.first:
            schedule.step(x, target=torch.cat(ys), ids=x)
        else:
            schedule.step(target=torch.cat(ys), ids=x)
        sums = self._step.loss_sums
        total = torch.stack(sums).sum() if sums else torch.zeros((), device=self.mesh.device)
        total = comm.all_reduce(total.detach().reshape(1).clone(), self.group)[0]
        # The step's wall ends where every stage is done (this all-reduce
        # returns once the last backward, the first stage's, has run), as
        # the plan's bubble counts it: a later stage finishes its own
        # schedule earlier and then waits for the drain.
        self.timings.append((self.busy_s, time.perf_counter() - start))
        return total

    def loss_sums(self, micro_batches: list, criterion: Callable, stream: tuple,
                  autocast: Callable[[], Any] = contextlib.nullcontext) -> torch.Tensor:
        """Forward only (evaluation): the summed loss of this rank's rows,
        on every stage. Micro-batch by micro-batch, chunk by chunk in
        pipeline order: blocking sends never cross."""
        total = torch.zeros((), device=self.mesh.device)
        mine = {c.index: c for c in self.chunks}
        with torch.no_grad():
            for x, y in micro_batches:
                out = None
                for index in range(self.spec.chunks):
                    chunk = mine.get(index)
                    if chunk is None:
                        continue
                    inp = None
                    if not chunk.first:
                        inp = self._receive(stream, self._global(self.spec.rank_of(index - 1)))
                    out = self.forward_chunk(chunk, inp, x, autocast)
                    if chunk.last:
                        with autocast():
                            total = total + criterion(out, y)
                    else:
                        sent = to_host(out) if self.host_staging else out
                        self.staged_bytes += sent.nbytes if self.host_staging else 0
                        comm.send(sent, self._global(self.spec.rank_of(index + 1)), self.group)
        return comm.all_reduce(total.reshape(1).clone(), self.group)[0]

    def _receive(self, shape: tuple, peer: int) -> torch.Tensor:
        """A blocking receive of the stream from `peer`, on this stage's device."""
        where = "cpu" if self.host_staging else self.mesh.device
        got = comm.recv(torch.empty(shape, device=where), peer, self.group)
        self.staged_bytes += got.nbytes if self.host_staging else 0
        return got.to(self.mesh.device)

    def bubble(self) -> Optional[float]:
        """This rank's measured idle fraction: 1 - busy / wall over the
        steps after the first (which pays for warm-up)."""
        timed = self.timings[1:] or self.timings
        wall = sum(w for _, w in timed)
        return max(0.0, 1.0 - sum(b for b, _ in timed) / wall) if wall > 0 else None

    def _global(self, pp_rank: int) -> int:
        import torch.distributed as dist

        return dist.get_global_rank(self.group, pp_rank) if self.group is not None else pp_rank

    def _schedule_for(self, x: torch.Tensor, stream: tuple):
        """torch's schedule over this rank's chunks, built on first use
        with static shapes (no shape-inference forward, whose draws and
        collectives would differ from a step's)."""
        if self._schedule is not None:
            return self._schedule
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        device = self.mesh.device
        meta_stream = torch.empty(stream, device="meta", requires_grad=True)
        for chunk in self.chunks:
            inputs = torch.empty(x.shape, dtype=x.dtype, device="meta") if chunk.first else meta_stream
            outputs = torch.empty(1, device="meta", requires_grad=True) if chunk.last else meta_stream
            self._stages.append(_stage_class()(self, chunk, _ChunkModule(self, chunk), chunk.index, self.spec.chunks,
                                               device, input_args=(inputs,), output_args=(outputs,), group=self.group))
        m, loss = self.spec.microbatches, self._loss
        if self.spec.schedule == "interleaved":
            self._schedule = ScheduleInterleaved1F1B(self._stages, m, loss_fn=loss, scale_grads=False)
        else:
            kind = ScheduleGPipe if self.spec.schedule == "gpipe" else Schedule1F1B
            self._schedule = kind(self._stages[0], m, loss_fn=loss, scale_grads=False)
        return self._schedule

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        step = self._step
        with step.autocast():
            total = step.criterion(logits, targets)
        step.loss_sums.append(total.detach())
        self.busy_s += time.perf_counter() - start
        return total / step.tokens


class _ChunkModule(nn.Module):
    """What torch's PipelineStage runs for one chunk: the rank's stage
    model, its forward fed `x` (the received stream; ids on the first)."""

    def __init__(self, pipeline: Pipeline, chunk: Chunk):
        super().__init__()
        object.__setattr__(self, "_pipeline", pipeline)  # the model's parameters stay the model's
        self.chunk = chunk

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        pipeline = self._pipeline
        return pipeline.forward_chunk(self.chunk, None if self.chunk.first else x, ids, pipeline._step.autocast)


class _HostStaging:
    """torch's PipelineStage methods around its exchange, through host
    buffers where `self.pipeline.host_staging` (see `host_staging`). torch's
    schedule waits on a micro-batch's receives before the stage reads them
    (_retrieve_recv_*), which is where a host buffer is copied into the
    device buffer torch's stage owns."""

    def get_fwd_recv_ops(self, fwd_chunk_id):
        return self._staged_recvs(super().get_fwd_recv_ops(fwd_chunk_id), ("fwd", fwd_chunk_id))

    def get_bwd_recv_ops(self, bwd_chunk_id):
        return self._staged_recvs(super().get_bwd_recv_ops(bwd_chunk_id), ("bwd", bwd_chunk_id))

    def _retrieve_recv_activations(self, fwd_chunk_id):
        self._land(("fwd", fwd_chunk_id))
        return super()._retrieve_recv_activations(fwd_chunk_id)

    def _retrieve_recv_grads(self, bwd_chunk_id):
        self._land(("bwd", bwd_chunk_id))
        return super()._retrieve_recv_grads(bwd_chunk_id)

    def _staged_sends(self, ops):
        if not self.pipeline.host_staging:
            return ops
        import torch.distributed as dist

        staged = [dist.P2POp(op.op, to_host(op.tensor), op.peer, op.group, op.tag) for op in ops]
        self.pipeline.staged_bytes += sum(op.tensor.nbytes for op in staged)
        return staged

    def _staged_recvs(self, ops, key):
        if not self.pipeline.host_staging or not ops:
            return ops
        import torch.distributed as dist

        hosts = [torch.empty(op.tensor.shape, dtype=op.tensor.dtype, device="cpu") for op in ops]
        self._landing = getattr(self, "_landing", {})
        self._landing[key] = [(host, op.tensor) for host, op in zip(hosts, ops)]
        return [dist.P2POp(op.op, host, op.peer, op.group, op.tag) for host, op in zip(hosts, ops)]

    def _land(self, key):
        with torch.no_grad():  # the device buffer may already be an autograd leaf
            for host, buffer in getattr(self, "_landing", {}).pop(key, ()):
                buffer.copy_(host)
                self.pipeline.staged_bytes += host.nbytes

    # torch's start-up exchanges (the warm-up vote, shape metadata, the
    # neighbours' first ops) make their tensors on the stage's device: on the host instead.
    def _warmup_forward_vote(self, *args, **kwargs):
        with self._on_host():
            return super()._warmup_forward_vote(*args, **kwargs)

    def _warmup_backward_result(self, *args, **kwargs):
        with self._on_host():
            return super()._warmup_backward_result(*args, **kwargs)

    def _get_init_p2p_neighbors_ops(self):
        with self._on_host():
            return super()._get_init_p2p_neighbors_ops()

    @contextlib.contextmanager
    def _on_host(self):
        device = self.device
        if self.pipeline.host_staging:
            self.device = torch.device("cpu")
        try:
            yield
        finally:
            self.device = device


@functools.cache
def _stage_class():
    """torch's PipelineStage, counting and timing (its module is imported on
    first use: a run without stages never pays for it)."""
    from torch.distributed.pipelining import PipelineStage

    class CountedStage(_HostStaging, PipelineStage):
        """torch's stage, with its sends counted by comm.py, the busy time of
        its chunk timed, and the micro-batch a forward runs told to the
        mesh (dropout streams are keyed by it)."""

        def __init__(self, pipeline: Pipeline, chunk: Chunk, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.pipeline, self.chunk = pipeline, chunk

        def get_fwd_send_ops(self, fwd_chunk_id):
            ops = super().get_fwd_send_ops(fwd_chunk_id)
            for op in ops:
                comm.count_send(op.tensor)
            return self._staged_sends(ops)

        def get_bwd_send_ops(self, bwd_chunk_id):
            ops = super().get_bwd_send_ops(bwd_chunk_id)
            for op in ops:
                comm.count_send(op.tensor)
            return self._staged_sends(ops)

        def _validate_fwd_outputs(self, outputs):
            # torch before 2.13 also checks the last stage's output against
            # output_args; nothing receives it (the loss reads it on this
            # rank), so its declared shape is a placeholder.
            if not self.is_last:
                super()._validate_fwd_outputs(outputs)

        def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):
            self.pipeline.mesh.draw_micro = fwd_chunk_id
            start = time.perf_counter()
            try:
                return super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
            finally:
                self.pipeline.busy_s += time.perf_counter() - start

        def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
            start = time.perf_counter()
            try:
                return super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
            finally:
                self.pipeline.busy_s += time.perf_counter() - start

    return CountedStage
