"""Pipeline parallelism (pp > 1): one stage of the model on each rank of the
pp axis, and the schedule that runs a step's micro-batches through them.

The pipeline is a component beside the tensor-parallel mode and the
data-parallel replicas (`Parallelism.pipeline`): the mode rewrites the
layers of a stage as it rewrites a whole model, and never sees the cut.

How a stage is cut, without knowing the model (docs/DESIGN.md, "Pipeline
parallelism"):

  * The repeated blocks (`roles.repeated_blocks`, the stack activation
    checkpointing and the start-up check use) are cut into contiguous chunks
    (`stages.PipelineSpec.cut`, balanced by parameters). A rank keeps only
    its chunks' blocks, under their whole-model indices (`StageStack`), so
    every parameter keeps its name: checkpoints and exports reshard.
  * The modules beside the stack are placed by one traced forward: what runs
    before the first block (embeddings) goes to the first chunk, what runs
    after the last (final norm, LM head) to the last. Elsewhere each is a
    parameter-free `StandIn`. Modules without parameters (rotary tables,
    masks) run on every stage: what a model computes outside its stack is
    there for every stage.
  * Every stage runs the model's own forward, so positions, masks and rotary
    tables are computed as the model computes them: a stage that does not
    hold the embedding gets zeros shaped like the stream from its StandIn,
    its first block takes the stream the previous stage sent (a pre-hook),
    and after its last block the forward stops (`StageOutput`) unless it is
    the last stage, which goes on to the logits.
  * An embedding tied to the LM head (GPT-2) is held by the first and the
    last stage; after each backward their gradients are summed over the
    two (the `pp_ends` group), as Megatron does, so both apply the same
    update. Both copies are recorded on the weight's ShardSpec
    (`stage_ranks`): the first stage's copy alone is counted by the
    gradient norm and written to checkpoints.

The schedules are torch.distributed.pipelining's (GPipe, 1F1B, interleaved
1F1B) on `PipelineStage`s with static shapes; the loss function scales each
micro-batch's summed loss by the global batch's token count, never a mean of
means, and the point-to-point sends are counted by comm.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from . import comm
from .layers import ParallelDropout
from .mesh import Mesh
from .roles import RolePlan, logits_of, repeated_blocks, trace
from .shard import spec_of
from .stages import PipelineSpec


class StageOutput(Exception):
    """Raised by the hook on a stage's last block: the stream to send on
    (the rest of the model's forward belongs to later stages)."""

    def __init__(self, stream: torch.Tensor):
        super().__init__("the end of a pipeline stage")
        self.stream = stream


class PipelineRefused(ValueError):
    """A model the pipeline cannot cut (one line: why); `key` is the
    setting to change ("pp" when there are too few blocks, else "model")."""

    def __init__(self, message: str, key: str = "model"):
        super().__init__(message)
        self.key = key


@dataclass
class Chunk:
    """One stage of the pipeline (a chunk of a rank's, with interleaving)."""

    index: int  # in the whole pipeline, first stage 0
    first: bool
    last: bool
    blocks: list[int]  # whole-model indices of its blocks


@dataclass
class _Run:
    """What the chunk running now needs: the chunk, and the stream it got."""

    chunk: Optional[Chunk] = None
    received: Optional[torch.Tensor] = None

    def stand_in(self, args: tuple, kwargs: dict) -> torch.Tensor:
        """A StandIn's output: its floating input as it is (a norm, a
        dropout), or for ids (an embedding, a position table) zeros shaped
        like the stream this chunk received: the model's own code after
        the embedding reads only its shape, dtype and device, and the first
        block of the chunk takes the received stream instead."""
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if first is not None and first.is_floating_point():
            return first
        if self.received is None:
            raise RuntimeError("a pipeline stage's stand-in ran outside a stage's forward")
        return self.received.new_zeros(self.received.shape)


class StageStack(nn.ModuleList):
    """The repeated blocks a rank holds, registered under their indices in
    the whole model (`blocks.4` stays `blocks.4`); iterating, indexing and
    len() see the blocks of the chunk running now (the model's own loop
    `for block in self.blocks` runs exactly those). `children()` and the
    parameter walks see every block the rank holds."""

    tpctl_stage_stack = True

    def __init__(self, blocks: dict[int, nn.Module]):
        super().__init__()
        for index, block in blocks.items():
            self.add_module(str(index), block)
        self.active: list[nn.Module] = list(self._modules.values())

    def show(self, indices: list[int]) -> None:
        self.active = [self._modules[str(i)] for i in indices]

    def __iter__(self):
        return iter(self.active)

    def __len__(self) -> int:
        return len(self.active)

    def __getitem__(self, idx):
        return self.active[idx]


class StandIn(nn.Module):
    """A module beside the stack on a stage that does not run it: no
    parameters (but a tied one the stage holds elsewhere, registered under
    its own name so names stay those of the whole model)."""

    def __init__(self, name: str, run: _Run):
        super().__init__()
        self.tpctl_stand_in_for = name
        object.__setattr__(self, "_run", run)  # not a submodule, not state

    def forward(self, *args, **kwargs):
        return self._run.stand_in(args, kwargs)

    def extra_repr(self) -> str:
        return f"stand-in for {self.tpctl_stand_in_for} (another pipeline stage runs it)"


@dataclass
class _Beside:
    """A module beside the stack: where it runs relative to the blocks."""

    name: str
    where: str  # "before", "after" or "every" (no parameters: runs on every stage)
    params: list[tuple[str, int]] = field(default_factory=list)  # (name inside, id of the parameter)


class Pipeline:
    """The pp axis of `mesh` with `spec`: which chunks this rank runs and
    what they hold, and the schedule. Built before the rewrite; `assign`
    reads the model, `cut` trims it to this rank's stage, `install` wires
    the rewritten stage; `forward_backward` runs a step."""

    def __init__(self, mesh: Mesh, spec: PipelineSpec):
        self.mesh, self.spec = mesh, spec
        self.size, self.rank = spec.stages, mesh.pp_rank
        self.group = mesh.groups.get("pp")
        self.ends = mesh.groups.get("pp_ends")
        self.run = _Run()
        self.chunks: list[Chunk] = []
        self.stack_name: Optional[str] = None
        self.blocks_of: list[range] = []  # every chunk's blocks
        self.beside: list[_Beside] = []
        self.hidden = 0  # the stream's width (whole)
        self.model: Optional[nn.Module] = None
        self.stack: Optional[StageStack] = None
        self._schedule = None
        self._stages: list = []
        self._criterion: Optional[Callable] = None
        self._loss_sums: list[torch.Tensor] = []
        self.autocast: Callable[[], Any] = contextlib.nullcontext
        # The idle fraction, measured: busy seconds in this rank's chunks
        # (forward, backward, loss) against each step's wall time.
        self.timings: list[tuple[float, float]] = []  # (busy, wall) seconds of each step
        self.busy_s = 0.0

    @property
    def first(self) -> bool:
        return any(c.first for c in self.chunks)

    @property
    def last(self) -> bool:
        return any(c.last for c in self.chunks)

    # ---- where everything goes ------------------------------------------------
    def assign(self, model: nn.Module) -> None:
        """Read the whole model (on any device, meta included): its stack,
        what runs before and after it, and which blocks each chunk holds.
        PipelineRefused (one line) for a model that cannot be cut."""
        if self.blocks_of:
            return
        stack = repeated_blocks(model)
        what = type(model).__name__
        if stack is None:
            raise PipelineRefused(f"pp={self.size} cuts a model at its repeated blocks, and {what} has none "
                                  "(an nn.ModuleList of blocks of one class)")
        self.stack_name = next(n for n, m in model.named_modules() if m is stack)
        n = len(stack)
        if self.spec.chunks > n:
            raise PipelineRefused(f"{self.spec.describe_chunks()}, more than the {n} blocks of {what}: expected at most {n} stages",
                                  "pp" if self.spec.virtual == 1 else "pipeline.virtual_stages")
        first_call: dict = {}
        _, _, calls = trace(model, vocab_size=_vocab(model), inputs=first_call)
        prefix = f"{self.stack_name}." if self.stack_name else ""
        inside = [i for name, ids in calls.items() if name.startswith(prefix) for i in ids]
        if not inside:
            raise PipelineRefused(f"{what}'s forward never runs its blocks ({self.stack_name})")
        lo, hi = min(inside), max(inside)
        block0 = f"{prefix}0" if "0" in stack._modules else f"{prefix}{next(iter(stack._modules))}"
        stream = _first_tensor(first_call.get(block0))
        if stream is None or not stream.is_floating_point():
            raise PipelineRefused(f"the first block of {what} ({block0}) takes no floating tensor first; "
                                  "a pipeline stage sends its blocks' first input")
        self.hidden = stream.shape[-1]
        self.beside = []
        for name, module in _beside(model, self.stack_name):
            ids = [i for n_, ids in calls.items() if n_ == name or n_.startswith(name + ".") for i in ids]
            params = [(pn, id(p)) for pn, p in module.named_parameters(remove_duplicate=False)]
            active = params or any(isinstance(m, (nn.Dropout, ParallelDropout)) for m in module.modules())
            if not active:
                where = "every"
            elif not ids or max(ids) < lo:
                where = "before"  # (never called: kept with the embedding, as the model holds it)
            elif min(ids) > hi:
                where = "after"
            else:
                raise PipelineRefused(f"{name} runs both before and after the blocks of {what}: a pipeline stage "
                                      "cannot hold it (the first and last stage would both run it)")
            self.beside.append(_Beside(name, where, params))
        loose = [pn for pn, _ in model.named_parameters(recurse=False)]
        if loose:
            raise PipelineRefused(f"{what} holds parameter {loose[0]!r} itself, outside any module: a pipeline "
                                  "stage cannot tell where it is used")
        weight = {id(p): p.numel() for p in model.parameters()}
        blocks = list(stack._modules.values())
        per_block = [sum(p.numel() for p in b.parameters()) for b in blocks]
        before = sum(weight.get(i, 0) for b in self.beside if b.where == "before" for _, i in b.params)
        after = sum(weight.get(i, 0) for b in self.beside if b.where == "after" for _, i in b.params)
        try:
            self.blocks_of = self.spec.cut(per_block, before, after)
        except ValueError as e:
            raise PipelineRefused(f"{what}: {e}", "pipeline.split") from None
        keys = list(stack._modules)
        last = self.spec.chunks - 1
        self.chunks = [Chunk(c, c == 0, c == last, [int(keys[i]) for i in self.blocks_of[c]])
                       for c in self.spec.chunks_of(self.rank)]

    def chunk_of_block(self, index: int) -> int:
        return next(c for c, r in enumerate(self.blocks_of) if index in r)

    def stage_of(self, name: str) -> Optional[int]:
        """The pipeline rank that holds module `name` of the whole model
        (None: every stage, or a name above the stack)."""
        prefix = f"{self.stack_name}." if self.stack_name else ""
        if name.startswith(prefix) and name != self.stack_name:
            index = name[len(prefix):].split(".")[0]
            if index.isdigit():
                return self.spec.rank_of(self.chunk_of_block(int(index)))
        for b in self.beside:
            if name == b.name or name.startswith(b.name + "."):
                if b.where == "every":
                    return None
                return self.spec.rank_of(0 if b.where == "before" else self.spec.chunks - 1)
        return None

    def holds(self, name: str) -> bool:
        """Whether this rank holds module `name` of the whole model."""
        stage = self.stage_of(name)
        return stage is None or stage == self.rank

    # ---- before the rewrite: keep this rank's stage --------------------------------
    def cut(self, model: nn.Module, plan: RolePlan) -> RolePlan:
        """Trim the whole (meta) model to this rank's stage, in place, and
        return the role plan of what is left."""
        self.assign(model)
        stack = model.get_submodule(self.stack_name)
        mine = {i: stack._modules[str(i)] for c in self.chunks for i in c.blocks}
        self.stack = StageStack(mine)
        _set(model, self.stack_name, self.stack)
        # Parameters this rank keeps, beside the stack: the tied ones among
        # them are held by both end stages.
        held = {i for b in self.beside if self.holds(b.name) for _, i in b.params}
        self._tied: list[tuple[str, str]] = []  # (stand-in's parameter, the holder's parameter) names
        for b in self.beside:
            if self.holds(b.name) or b.where == "every":
                continue
            stand_in = StandIn(b.name, self.run)
            for pn, pid in b.params:
                if pid in held:
                    holder = next(f"{o.name}.{on}" for o in self.beside if self.holds(o.name)
                                  for on, oid in o.params if oid == pid)
                    self._tied.append((f"{b.name}.{pn}", holder))
            _set(model, b.name, stand_in)
        keep = {name: role for name, role in plan.roles.items() if _present(model, name)}
        return RolePlan(keep, plan.source, {k: v for k, v in plan.heads.items() if _present(model, k)},
                        {k: v for k, v in plan.problems.items() if _present(model, k)}, plan.blocks,
                        {k: v for k, v in plan.units.items() if _present(model, k)},
                        {k: v for k, v in plan.layouts.items() if _present(model, k)})

    # ---- after the rewrite: wire the stage ----------------------------------------
    def install(self, model: nn.Module) -> None:
        """Hooks and stand-ins of the rewritten stage; tied parameters
        registered where the whole model has them."""
        self.model = model
        model.tpctl_stage = self
        for stand_in_param, holder in self._tied:
            owner, _, attr = stand_in_param.rpartition(".")
            param = model.get_parameter(holder)
            _ensure_path(model, owner).register_parameter(attr, param)
            if not (self.first and self.last):  # (one rank holding both ends has nothing to sum)
                # The end stages' copies, recorded where every question about
                # the weight is asked: the first stage's counts and writes it.
                param.tpctl_spec = dataclasses.replace(spec_of(param), stage_ranks=tuple(self.mesh.group_ranks["pp_ends"]),
                                                       stage_group=self.ends)
        if len(self.chunks) > 1:  # a rank with the first or last chunk runs others too: gate those modules
            for b in self.beside:
                if b.where != "every" and self.holds(b.name) and not isinstance(model.get_submodule(b.name), StandIn):
                    _gate(model.get_submodule(b.name), self.run, b.where)
        stack = model.get_submodule(self.stack_name)
        for chunk in self.chunks:
            if not chunk.first:
                stack._modules[str(chunk.blocks[0])].register_forward_pre_hook(
                    _TakeStream(self.run, chunk), with_kwargs=True, prepend=True)
            if not chunk.last:
                stack._modules[str(chunk.blocks[-1])].register_forward_hook(_EndStage(self.run, chunk))

    # ---- running a chunk --------------------------------------------------------
    @contextlib.contextmanager
    def running(self, chunk: Chunk, received: Optional[torch.Tensor]):
        """Chunk `chunk` is the one running, fed `received` (None: the first)."""
        self.run.chunk, self.run.received = chunk, received
        self.stack.show(chunk.blocks)
        try:
            yield
        finally:
            self.run.chunk, self.run.received = None, None
            self.stack.show([i for c in self.chunks for i in c.blocks])

    def forward_chunk(self, chunk: Chunk, stream: Optional[torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
        """The chunk's forward: its output stream, or the logits (last chunk)."""
        with self.running(chunk, stream), self.autocast():
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
        return tuple(mode.shard_hidden(torch.empty(rows, seq, self.hidden, device="meta")).shape)

    # ---- one step ----------------------------------------------------------------
    def forward_backward(self, micro_batches: list, criterion: Callable, tokens: int, stream: tuple) -> torch.Tensor:
        """Forward and backward of every micro-batch through the stages.
        `criterion(logits, targets)` is a micro-batch's summed loss; each
        is divided by `tokens` (the global batch's) before its backward,
        so the accumulated gradients are those of the global mean. Returns
        the summed loss of this rank's rows on every stage (the last stage's,
        sent to the others), detached."""
        xs = [x for x, _ in micro_batches]
        ys = [y for _, y in micro_batches]
        schedule = self._schedule_for(xs[0], stream)
        self._criterion, self._tokens, self._loss_sums = criterion, tokens, []
        x = torch.cat(xs)
        self.busy_s, start = 0.0, time.perf_counter()
        if self.first:
            schedule.step(x, target=torch.cat(ys), ids=x)
        else:
            schedule.step(target=torch.cat(ys), ids=x)
        self.timings.append((self.busy_s, time.perf_counter() - start))
        total = torch.stack(self._loss_sums).sum() if self._loss_sums else torch.zeros((), device=self.mesh.device)
        return comm.all_reduce(total.detach().reshape(1).clone(), self.group)[0]

    def loss_sums(self, micro_batches: list, criterion: Callable, stream: tuple) -> torch.Tensor:
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
                        inp = comm.recv(torch.empty(stream, device=self.mesh.device),
                                        self._global(self.spec.rank_of(index - 1)), self.group)
                    out = self.forward_chunk(chunk, inp, x)
                    if chunk.last:
                        with self.autocast():
                            total = total + criterion(out, y)
                    else:
                        comm.send(out, self._global(self.spec.rank_of(index + 1)), self.group)
        return comm.all_reduce(total.reshape(1).clone(), self.group)[0]

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
        with self.autocast():
            total = self._criterion(logits, targets)
        self._loss_sums.append(total.detach())
        self.busy_s += time.perf_counter() - start
        return total / self._tokens


class _ChunkModule(nn.Module):
    """What torch's PipelineStage runs for one chunk: the rank's stage
    model, its forward fed `x` (the received stream; ids on the first)."""

    def __init__(self, pipeline: Pipeline, chunk: Chunk):
        super().__init__()
        object.__setattr__(self, "_pipeline", pipeline)  # the model's parameters stay the model's
        self.chunk = chunk

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self._pipeline.forward_chunk(self.chunk, None if self.chunk.first else x, ids)


@functools.cache
def _stage_class():
    """torch's PipelineStage, counting and timing (its module is imported on
    first use: a run without stages never pays for it)."""
    from torch.distributed.pipelining import PipelineStage

    class CountedStage(PipelineStage):
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
            return ops

        def get_bwd_send_ops(self, bwd_chunk_id):
            ops = super().get_bwd_send_ops(bwd_chunk_id)
            for op in ops:
                comm.count_send(op.tensor)
            return ops

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


class _TakeStream:
    """Pre-hook of a chunk's first block: its first tensor argument (the
    stream the model's own forward computed from stand-ins) becomes the
    stream the previous stage sent."""

    def __init__(self, run: _Run, chunk: Chunk):
        self.run, self.chunk = run, chunk

    def __call__(self, module, args, kwargs):
        if self.run.chunk is not self.chunk:
            return None
        stream = self.run.received
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                return (*args[:i], stream, *args[i + 1:]), kwargs
        if isinstance(kwargs.get("hidden_states"), torch.Tensor):
            return args, {**kwargs, "hidden_states": stream}
        raise RuntimeError(f"block {type(module).__name__} has no tensor argument to take the stage's stream")


class _EndStage:
    """Hook of a chunk's last block: its output is the stage's."""

    def __init__(self, run: _Run, chunk: Chunk):
        self.run, self.chunk = run, chunk

    def __call__(self, module, args, out):
        if self.run.chunk is self.chunk:
            stream = _first_tensor(((out,), {}))
            raise StageOutput(stream)
        return None


def _gate(module: nn.Module, run: _Run, where: str) -> None:
    """A module beside the stack on a rank that also runs chunks where it
    does not belong: there it acts as a StandIn (the instance's forward is
    wrapped; names and parameters stay)."""
    original = module.forward

    def forward(*args, **kwargs):
        chunk = run.chunk
        if chunk is None or (chunk.first if where == "before" else chunk.last):
            return original(*args, **kwargs)
        return run.stand_in(args, kwargs)

    module.forward = forward


def _beside(model: nn.Module, stack_name: str) -> list[tuple[str, nn.Module]]:
    """The modules beside the stack: the other children of every module on
    the path from the model to the stack."""
    out, path = [], stack_name.split(".") if stack_name else []
    node, prefix = model, ""
    for part in path:
        for name, child in node.named_children():
            if name != part:
                out.append((f"{prefix}{name}", child))
        node, prefix = getattr(node, part), f"{prefix}{part}."
    return out


def _first_tensor(call) -> Optional[torch.Tensor]:
    if call is None:
        return None
    args, kwargs = call
    def find(value):
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (tuple, list)):
            for v in value:
                found = find(v)
                if found is not None:
                    return found
        if hasattr(value, "to_tuple"):  # a Hugging Face ModelOutput
            return find(value.to_tuple())
        return None
    return find(tuple(args)) if find(tuple(args)) is not None else (
        kwargs.get("hidden_states") if isinstance(kwargs.get("hidden_states"), torch.Tensor) else None)


def _vocab(model: nn.Module) -> int:
    return min((m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)), default=2)


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _present(model: nn.Module, name: str) -> bool:
    """Whether module `name` is still in the (cut) model, and not a stand-in."""
    try:
        module = model.get_submodule(name)
    except AttributeError:
        return False
    return not isinstance(module, StandIn)


def _ensure_path(model: nn.Module, name: str) -> nn.Module:
    """The module at `name`, making empty ones on the way where a stand-in
    holds a tied parameter deeper than itself."""
    node = model
    for part in name.split(".") if name else []:
        child = node._modules.get(part)
        if child is None:
            child = nn.Module()
            node.add_module(part, child)
        node = child
    return node
