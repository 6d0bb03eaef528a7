"""Cutting a model into this rank's pipeline stage (pp > 1), without knowing
the model (docs/DESIGN.md, "Pipeline parallelism"); running the stages is
pipeline.py's.

  * The repeated blocks (`roles.repeated_blocks`, the stack activation
    checkpointing and the start-up check use) are cut into contiguous chunks
    (`stages.PipelineSpec.cut`, balanced by a weight per block: its
    training FLOPs with attention's scores, parameters breaking ties, unless
    told otherwise; what runs before and after the blocks weighed alike: an
    embedding costs nothing, the LM head and its loss about five GPT-2
    blocks). A rank keeps only its chunks'
    blocks, under their whole-model indices (`StageStack`), so every
    parameter keeps its name: checkpoints and exports reshard.
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
    last stage. Both copies are recorded on the weight's ShardSpec
    (`stage_ranks`, the `pp_ends` group): the gradient finalisation sums
    them (Parallelism.finish_grads), as Megatron does, so both apply the
    same update; the first stage's copy alone is counted by the gradient
    norm and written to checkpoints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn as nn

from tpctl.parallel.dropout import ParallelDropout
from tpctl.parallel.mesh import Mesh
from tpctl.parallel.pipeline.stages import PipelineSpec
from tpctl.parallel.roles.plan import RolePlan, repeated_blocks
from tpctl.parallel.roles.tracing import TRACE_BATCH, TRACE_SEQ, trace
from tpctl.parallel.shard import spec_of


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


def parameter_count(block: nn.Module) -> int:
    """A block's parameters: the tie-break of the stages' balance."""
    return sum(p.numel() for p in block.parameters())


# The vocab-parallel cross entropy's work per logit (parallel/tensor/loss.py): max,
# subtract, exp and sum forward; subtract, exp and the scale backward.
LOSS_FLOPS_PER_LOGIT = 7


def training_flops(module: nn.Module, seq_len: int = 0, attention_width: int = 0) -> int:
    """FLOPs per token of a module's forward and backward, as the planner
    counts them: 6 per weight of every matrix that multiplies activations
    (2 forward, 4 backward); a lookup table (nn.Embedding) none; attention
    over `attention_width` query features (heads x head width) at `seq_len`
    tokens: scores and weighted sum, 4 x seq_len x width forward, 3 times
    that with the backward."""
    weights = sum(6 * p.numel() for m in module.modules() if not isinstance(m, nn.Embedding)
                  for p in m.parameters(recurse=False) if p.dim() == 2)
    return weights + 12 * seq_len * attention_width


def compute_weight(module: nn.Module, tie_break: int = 1 << 40, seq_len: int = 0, attention_width: int = 0,
                   logits: int = 0) -> int:
    """A module's weight in the balance of the stages: its training FLOPs
    (with `logits` per token: the loss over them), then its parameters
    breaking ties (`tie_break` above any count)."""
    flops = training_flops(module, seq_len, attention_width) + LOSS_FLOPS_PER_LOGIT * logits
    return flops * tie_break + parameter_count(module)


class StageCut:
    """Which chunks of the pp axis of `mesh` (with `spec`) this rank runs
    and what they hold. Built before the rewrite: `assign` reads the whole
    model, `cut` trims it to this rank's stage, `install` wires the
    rewritten stage. `weigh` gives each repeated block its weight in the
    balance of the stages (the default, compute_weight, also costs each
    block's attention at the spec's seq_len and the loss over the logits)."""

    def __init__(self, mesh: Mesh, spec: PipelineSpec, weigh: Callable[[nn.Module], float] = compute_weight):
        self.mesh, self.spec = mesh, spec
        self.size, self.rank = spec.stages, mesh.pp_rank
        self.weigh = weigh
        self.run = _Run()
        self.chunks: list[Chunk] = []
        self.stack_name: Optional[str] = None
        self.blocks_of: list[range] = []  # every chunk's blocks
        self.beside: list[_Beside] = []
        self.hidden = 0  # the stream's width (whole)
        self.model: Optional[nn.Module] = None
        self.stack: Optional[StageStack] = None
        self.block_keys, self.weights = None, None  # the stack's module keys; (per block, before, after) balanced

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
        what = type(model).__name__
        # A model that picks a block's mask by the loop's position (Hugging
        # Face's `config.layer_types[i]` in `for i, layer in enumerate(...)`)
        # would give a stage's first block the first layer's type: refused,
        # never run with another layer's sliding window.
        kinds = getattr(getattr(model, "config", None), "layer_types", None)
        if isinstance(kinds, (list, tuple)) and len(set(kinds)) > 1:
            raise PipelineRefused(f"{what} mixes layer types ({', '.join(sorted(set(map(str, kinds))))}) that its "
                                  "forward picks by the loop's position, which a pipeline stage does not keep: use pp=1", "pp")
        if self.weights is None:  # (a cut of the same model at the same seq_len may have read it: cost/dry_run.py)
            self._read(model, what)
        n = len(self.block_keys)
        if self.spec.chunks > n:
            raise PipelineRefused(f"{self.spec.describe_chunks()}, more than the {n} blocks of {what}: expected at most {n} stages",
                                  "pp" if self.spec.virtual == 1 else "pipeline.virtual_stages")
        try:
            self.blocks_of = self.spec.cut(*self.weights)
        except ValueError as e:
            raise PipelineRefused(f"{what}: {e}", "pipeline.split") from None
        self.chunks = [Chunk(c, c == 0, c == self.spec.chunks - 1, [int(self.block_keys[i]) for i in self.blocks_of[c]])
                       for c in self.spec.chunks_of(self.rank)]

    def _read(self, model: nn.Module, what: str) -> None:
        """Trace the whole model: its stack, what runs beside it, the stream's width, the blocks' weights."""
        stack = repeated_blocks(model)
        if stack is None:
            raise PipelineRefused(f"pp={self.size} cuts a model at its repeated blocks, and {what} has none "
                                  "(an nn.ModuleList of blocks of one class)")
        self.stack_name, self.block_keys = next(n for n, m in model.named_modules() if m is stack), list(stack._modules)
        first_call: dict = {}
        nodes, out, calls = trace(model, vocab_size=_vocab(model), inputs=first_call)
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
        blocks = list(stack._modules.values())
        if self.weigh is compute_weight:  # FLOPs: each block's attention, the loss over the logits
            ends_at = [max((i for n_, ids in calls.items() if n_.startswith(f"{prefix}{k}.") for i in ids), default=0)
                       for k in stack._modules]  # a block's last layer call
            widths = _attention_widths(nodes, ends_at)
            seq = self.spec.seq_len
            per_block = [compute_weight(b, seq_len=seq, attention_width=w) for b, w in zip(blocks, widths)]
            vocab = next((nodes[i].shape[-1] for i in out if nodes[i].shape), 0)
            ends = {"before": 0, "after": compute_weight(nn.Module(), logits=vocab)}
        else:
            per_block, ends = [self.weigh(b) for b in blocks], {"before": 0, "after": 0}
        before, after = (ends[where] + sum(self.weigh(model.get_submodule(b.name)) for b in self.beside if b.where == where)
                         for where in ("before", "after"))
        self.weights = (per_block, before, after)  # (tests compare it with the plan's FLOPs)

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
        # What is still in the cut model, and not a stand-in (every path, as get_submodule finds them).
        present = {n for n, m in model.named_modules(remove_duplicate=False) if not isinstance(m, StandIn)}
        roles, heads, problems, units, layouts = ({k: v for k, v in d.items() if k in present} for d in
                                                  (plan.roles, plan.heads, plan.problems, plan.units, plan.layouts))
        return RolePlan(roles, plan.source, heads, problems, plan.blocks, units, layouts)

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
                                                       stage_group=self.mesh.groups.get("pp_ends"))
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
            raise StageOutput(_first_tensor(((out,), {})))
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


def _attention_widths(nodes: list, block_nodes: list[int]) -> list[int]:
    """Per block (the node id of its last layer's call, in order), the
    query features of the first attention the trace saw inside it (0:
    none): a product of two activations (queries first) after the previous
    block's last layer."""
    widths, start = [], -1
    for end in block_nodes:
        first = next((n for n in nodes[start + 1:end] if n.kind == "attention" and n.shape), None)
        widths.append(math.prod(first.shape) // (TRACE_BATCH * TRACE_SEQ) if first is not None else 0)
        start = end
    return widths


def _vocab(model: nn.Module) -> int:
    return min((m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)), default=2)


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _ensure_path(model: nn.Module, name: str) -> nn.Module:
    """The module at `name`, made empty where a stand-in holds a tied parameter deeper than itself."""
    node = model
    for part in name.split(".") if name else []:
        child = node._modules.get(part)
        if child is None:
            child = nn.Module()
            node.add_module(part, child)
        node = child
    return node
