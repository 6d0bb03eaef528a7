"""What a pipeline's cut reads from a model, once (`StageMap`, a frozen
record): the repeated blocks, what runs before and after them, the stream's
width, each block's weight in the balance of the stages, and the blocks
every chunk holds. Names, indices and numbers only, no module or tensor of
the model, so a record outlives the model it was read from: the planner
keeps one per model and reuses it for every cut (cost/dry_run.py), and a
record read under one cut is placed under another without a trace
(`StageMap.placed`). cut.py acts on a model with it; the weights the stages
are balanced by are here too (`compute_weight`), as the planner counts them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn

from tpctl.parallel.dropout import ParallelDropout
from tpctl.parallel.pipeline.stages import PipelineSpec
from tpctl.parallel.roles.plan import named_stack
from tpctl.parallel.roles.tracing import TRACE_BATCH, TRACE_SEQ, trace


class PipelineRefused(ValueError):
    """A model the pipeline cannot cut (one line: why); `key` is the
    setting to change ("pp" when there are too few blocks, else "model")."""

    def __init__(self, message: str, key: str = "model"):
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class Chunk:
    """One stage of the pipeline (a chunk of a rank's, with interleaving)."""

    index: int  # in the whole pipeline, first stage 0
    first: bool
    last: bool
    blocks: tuple[int, ...]  # whole-model indices of its blocks


@dataclass(frozen=True)
class Beside:
    """A module beside the stack: where it runs relative to the blocks."""

    name: str
    where: str  # "before", "after" or "every" (no parameters: runs on every stage)
    # (name inside, the parameter's first name in the whole model: a weight
    # two modules share, as an embedding tied to the LM head, has one)
    params: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class StageMap:
    """Where the pieces of one model go in a pipeline: what a cut reads
    from the whole model and the blocks each chunk holds under `spec`."""

    model: str  # the model's class name (the refusals name it)
    stack_name: str  # the module holding the repeated blocks ("" : the model itself)
    block_keys: tuple[str, ...]  # the stack's children, in order
    beside: tuple[Beside, ...]  # every module beside the stack, and where it runs
    hidden: int  # the stream's width between stages (whole)
    block_weights: tuple[int, ...]  # each block's weight in the balance of the stages
    before: int  # what runs before the blocks (embeddings), weighed alike
    after: int  # what runs after them (final norm, LM head and its loss)
    # The cut it is placed under: stages, virtual stages, split and seq_len
    # (the weights' attention cost); schedule and micro-batches blanked,
    # as they place nothing (`placing`).
    spec: PipelineSpec
    blocks_of: tuple[range, ...]  # each chunk's blocks (positions in block_keys), first chunk first

    @property
    def weights(self) -> tuple[tuple[int, ...], int, int]:
        """(per block, before, after): what the stages are balanced by."""
        return self.block_weights, self.before, self.after

    def placed(self, spec: PipelineSpec) -> "StageMap":
        """This model's record under the cut `spec`: itself when placed so,
        else its blocks placed again from its weights (nothing of the model
        read); PipelineRefused as `read`. The weights must be those of
        `spec`'s seq_len."""
        spec = placing(spec)
        if spec == self.spec:
            return self
        if spec.seq_len != self.spec.seq_len:
            raise ValueError(f"a stage map weighed at seq_len={self.spec.seq_len} placed at seq_len={spec.seq_len}")
        return dataclasses.replace(self, spec=spec, blocks_of=_place(self.model, spec, self.weights))

    def chunks(self, pp_rank: int) -> tuple[Chunk, ...]:
        """The chunks pipeline rank `pp_rank` runs, in order."""
        last = self.spec.chunks - 1
        return tuple(Chunk(c, c == 0, c == last, tuple(int(self.block_keys[i]) for i in self.blocks_of[c]))
                     for c in self.spec.chunks_of(pp_rank))

    def chunk_of_block(self, index: int) -> int:
        """The chunk holding block `index` (its position in the stack)."""
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


def placing(spec: PipelineSpec) -> PipelineSpec:
    """What of `spec` places the blocks (its schedule and micro-batches blanked)."""
    return dataclasses.replace(spec, schedule="", microbatches=0)


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


# --------------------------------------------------------------------------
# Reading a model


def read(model: nn.Module, spec: PipelineSpec, weigh: Callable[[nn.Module], float] = compute_weight) -> StageMap:
    """Trace the whole `model` (on any device, meta included) and place its
    blocks under `spec`: its stack, what runs beside it, the stream's
    width, the blocks' weights (`weigh`; the default, compute_weight, also
    costs each block's attention at the spec's seq_len and the loss over the
    logits). PipelineRefused (one line) for a model that cannot be cut."""
    what = type(model).__name__
    found = named_stack(model)
    if found is None:
        raise PipelineRefused(f"pp={spec.stages} cuts a model at its repeated blocks, and {what} has none "
                              "(an nn.ModuleList of blocks of one class)")
    stack_name, stack = found
    first_call: dict = {}
    nodes, out, calls = trace(model, vocab_size=_vocab(model), inputs=first_call)
    prefix = f"{stack_name}." if stack_name else ""
    inside = [i for name, ids in calls.items() if name.startswith(prefix) for i in ids]
    if not inside:
        raise PipelineRefused(f"{what}'s forward never runs its blocks ({stack_name})")
    block0 = f"{prefix}0" if "0" in stack._modules else f"{prefix}{next(iter(stack._modules))}"
    stream = first_tensor(first_call.get(block0))
    if stream is None or not stream.is_floating_point():
        raise PipelineRefused(f"the first block of {what} ({block0}) takes no floating tensor first; "
                              "a pipeline stage sends its blocks' first input")
    beside = _beside_of(model, stack_name, calls, min(inside), max(inside))
    loose = [pn for pn, _ in model.named_parameters(recurse=False)]
    if loose:
        raise PipelineRefused(f"{what} holds parameter {loose[0]!r} itself, outside any module: a pipeline "
                              "stage cannot tell where it is used")
    blocks = list(stack._modules.values())
    if weigh is compute_weight:  # FLOPs: each block's attention, the loss over the logits
        ends_at = [max((i for n_, ids in calls.items() if n_.startswith(f"{prefix}{k}.") for i in ids), default=0)
                   for k in stack._modules]  # a block's last layer call
        widths = _attention_widths(nodes, ends_at)
        per_block = [compute_weight(b, seq_len=spec.seq_len, attention_width=w) for b, w in zip(blocks, widths)]
        vocab = next((nodes[i].shape[-1] for i in out if nodes[i].shape), 0)
        ends = {"before": 0, "after": compute_weight(nn.Module(), logits=vocab)}
    else:
        per_block, ends = [weigh(b) for b in blocks], {"before": 0, "after": 0}
    before, after = (ends[where] + sum(weigh(model.get_submodule(b.name)) for b in beside if b.where == where)
                     for where in ("before", "after"))
    weights = (tuple(per_block), before, after)
    spec = placing(spec)
    return StageMap(what, stack_name, tuple(stack._modules), beside, stream.shape[-1], *weights, spec,
                    _place(what, spec, weights))


def _beside_of(model: nn.Module, stack_name: str, calls: dict, lo: int, hi: int) -> tuple[Beside, ...]:
    """Every module beside the stack and where it runs: before the blocks'
    first call `lo`, after their last `hi`, or (no parameters, no dropout)
    on every stage."""
    first_name: dict[int, str] = {}  # a parameter's first name in the model: tied ones share it
    for pn, p in model.named_parameters(remove_duplicate=False):
        first_name.setdefault(id(p), pn)
    out = []
    for name, module in _beside(model, stack_name):
        ids = [i for n_, ids in calls.items() if n_ == name or n_.startswith(name + ".") for i in ids]
        params = tuple((pn, first_name[id(p)]) for pn, p in module.named_parameters(remove_duplicate=False))
        active = params or any(isinstance(m, (nn.Dropout, ParallelDropout)) for m in module.modules())
        if not active:
            where = "every"
        elif not ids or max(ids) < lo:
            where = "before"  # (never called: kept with the embedding, as the model holds it)
        elif min(ids) > hi:
            where = "after"
        else:
            raise PipelineRefused(f"{name} runs both before and after the blocks of {type(model).__name__}: a "
                                  "pipeline stage cannot hold it (the first and last stage would both run it)")
        out.append(Beside(name, where, params))
    return tuple(out)


def _place(what: str, spec: PipelineSpec, weights: tuple) -> tuple[range, ...]:
    """The blocks of each chunk of `spec`, balanced by `weights` (or its split)."""
    n = len(weights[0])
    if spec.chunks > n:
        raise PipelineRefused(f"{spec.describe_chunks()}, more than the {n} blocks of {what}: expected at most {n} stages",
                              "pp" if spec.virtual == 1 else "pipeline.virtual_stages")
    try:
        return tuple(spec.cut(*weights))
    except ValueError as e:
        raise PipelineRefused(f"{what}: {e}", "pipeline.split") from None


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


def first_tensor(call) -> Optional[torch.Tensor]:
    """The first tensor of a call's (args, kwargs), looking into tuples,
    lists and Hugging Face outputs (else its `hidden_states` keyword)."""
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
