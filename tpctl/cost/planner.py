"""The planner's engine: what each layout of N ranks costs (see `tpctl
plan --help`, tpctl/commands/plan.py, for what it computes).

For every valid layout of a world of N ranks (parallel.layout.layouts_of),
computed from the model's shapes (built on the meta device, nothing
materialised) with the code that trains it, not a copy of it: each
parameter's local size and replicas come from the ShardSpecs a dry run of
the rewrite leaves (Parallelism.rewrite(dry_run=True) on a
process-group-free mesh), each mode's communication from its own `cost_*`
methods (next to its layers), the data-parallel reduction and the step's
reductions from the groups they use. Per rank: memory, FLOPs of one
optimizer step, per-step communication (exact: `tests/test_plan.py` checks
it against comm's counts), and with a hardware profile the predicted step
time.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Optional

from tpctl.config import check_layout
from tpctl.errors import ConfigError
from tpctl.parallel.context.split import attention_path, cost_context
from tpctl.parallel.geometry import WIRE_FACTOR, padded_vocab
from tpctl.parallel.layout import ZERO_STAGES, Layout, layouts_of
from tpctl.parallel.pipeline.cut import LOSS_FLOPS_PER_LOGIT
from tpctl.parallel.pipeline.stages import PipelineSpec
from tpctl.parallel.registry import check_costed
from tpctl.parallel.tensor.cost_hooks import kv_replicas_size

from .dry_run import members, stage_held, stage_rewrite
from .hardware import Hardware, load_hardware  # noqa: F401  (re-exported: callers name the planner)
from .layer_comm import count_layers, held_out_features, kv_shared, layer_shapes, repeated
from .timing import LATENCY_STEPS, _spans_nodes, mark_fits_by_zero, predict, sent_s  # noqa: F401  (re-exported)

F32 = 4  # bytes of an fp32 element: parameters, activations, gradients
F64 = 8  # the gradient norm and the global loss mean are reduced in float64

KIND_ABBREV = {"all_reduce": "ar", "all_gather": "ag", "reduce_scatter": "rs", "broadcast": "bc", "reduce": "re",
               "send": "p2p", "ring_pass": "ring", "all_to_all": "a2a"}
LINEAR_ROLES = ("qkv", "attn_in", "attn_out", "mlp_in", "mlp_out", "lm_head")


# --------------------------------------------------------------------------
# The model, as shapes


@dataclass
class Param:
    name: str
    role: Optional[str]  # the role of the module owning it (None: no role)
    kind: str  # weight / bias / table
    shape: tuple[int, ...]


@dataclass
class ModelShape:
    """What the planner needs of a model: its parameters by role, its
    linears (out, in) in call order, attention's width, and how to build it
    again for a dry run of the rewrite (its config and resolved roles)."""

    params: list[Param]
    linears: list[tuple[str, str, int, int, bool]]  # (name, role, out, in, bias)
    roles: dict[str, str]
    embeddings: dict[str, tuple[int, int]]  # name -> (rows, dim) for embedding / pos_embedding roles
    vocab_size: int
    n_embd: int
    n_head: int
    attention_layers: int
    model_cfg: Any = None
    seed: int = 0
    plan: Any = None  # parallel.roles.RolePlan
    layers: Any = None  # layer_comm.LayerShapes: the layers other than Linears
    dropout: bool = False  # a dropout with p > 0 (it saves its mask: what a recomputation must reach)

    def original(self):
        """The model on the meta device, as the rewrite sees it."""
        from tpctl.models import build_model
        from tpctl.parallel.roles.probes import linearize

        model = build_model(self.model_cfg, self.seed, lazy=True)
        linearize(model)
        return model


def model_shape(model_cfg, seed: int = 0, built: Optional[tuple] = None) -> ModelShape:
    """Build the model on the meta device and read its shapes and roles.
    `built`: (model, plan) of this config already built on the meta device
    and traced (what config.validate returned), read instead."""
    from torch import nn

    from tpctl.models import build_model
    from tpctl.parallel.roles.inference import resolve_plan
    from tpctl.parallel.roles.probes import linearize

    model, plan = built if built is not None else (build_model(model_cfg, seed, lazy=True), None)
    before = len(getattr(model, "tpctl_transposed", ()))
    linearize(model)  # as the rewrite sees it
    if plan is None or len(model.tpctl_transposed) != before:  # (a Conv1D made a Linear: traced again)
        plan = resolve_plan(model, getattr(model_cfg, "plan", None))
    roles = plan.roles
    owner = {}
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            owner.setdefault(id(p), (mname, pname))
    params, linears, embeddings = [], [], {}
    for name, role in roles.items():
        module = model.get_submodule(name)
        if role in LINEAR_ROLES:
            out_f, in_f = _linear_dims(module)
            linears.append((name, role, out_f, in_f, getattr(module, "bias", None) is not None))
        elif role in ("embedding", "pos_embedding"):
            embeddings[name] = tuple(module.weight.shape)
    for pname, p in model.named_parameters():  # tied parameters once
        mname, leaf = owner[id(p)]
        role = roles.get(mname)
        kind = "table" if role in ("embedding", "pos_embedding") else ("bias" if leaf == "bias" else "weight")
        params.append(Param(pname, role, kind, tuple(p.shape)))
    attention = [lin for lin in linears if lin[1] == "attn_out"]  # one per attention layer
    layers = layer_shapes(model, plan, model_cfg)
    dropout = any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())
    return ModelShape(params, linears, roles, embeddings, model_cfg.vocab_size, layers.hidden,
                      layers.heads, len(attention), model_cfg, seed, plan, layers, dropout)


def _linear_dims(module) -> tuple[int, int]:
    if hasattr(module, "out_features"):
        return module.out_features, module.in_features
    out_f, in_f = module.weight.shape  # nn.Linear's (out, in) layout
    return out_f, in_f


# --------------------------------------------------------------------------
# One layout


@dataclass
class Comm:
    """Collectives of one kind over one mesh group, per step, for one rank."""

    calls: int = 0
    bytes: int = 0  # payload, as comm.CommStats counts it
    wire_bytes: float = 0.0
    group_size: int = 1
    # issued beside compute under train.overlap: add(hidden=True), and data parallelism's buckets
    hidden_calls: int = 0
    hidden_wire_bytes: float = 0.0


@dataclass
class SplitPlan:
    layout: Layout
    param_bytes: int  # held between steps (under ZeRO: the chunks, padding included)
    grad_bytes: int  # kept after the backward for the optimizer
    optim_bytes: int
    activation_bytes: int
    flops: float
    comm: dict[tuple[str, str], Comm]  # (kind, group) -> Comm
    gathered_bytes: int = 0  # ZeRO-3: parameters gathered whole at once (the root and the largest block)
    # the largest Linear's blocks in flight and partial products, for a moment
    # (not in memory_bytes: the memory check's peak adds it, cost/auto.py)
    temporary_bytes: int = 0
    step_time_s: Optional[float] = None
    compute_s: Optional[float] = None
    comm_s: Optional[float] = None
    fits: Optional[bool] = None  # memory_bytes within the hardware's memory per rank
    # pp > 1: the plan of every pipeline rank (this plan is the one holding
    # the most memory), and the schedule's planned bubble.
    stages: list["SplitPlan"] = dataclasses.field(default_factory=list)
    bubble: Optional[float] = None
    # A ZeRO stage that fits where the same layout with zero=0 does not.
    fits_by_zero: bool = False
    hidden_s: float = 0.0  # communication predicted to run beside compute (not in step_time_s)
    # by kind, the share of the grid's collectives a recomputed forward
    # issues again (the mode's CostHooks.recompute_comm_share)
    recompute_shares: dict[str, float] = dataclasses.field(default_factory=dict)
    # The ranks of the plan's stage do not all send `comm` (its first
    # rank's) where they sum different sets of shared key/value replicas
    # (replicas.holder_pieces cuts each rank's): position in the tensor
    # group -> that rank's own, for each position whose count differs.
    tp_comm: dict[int, dict[tuple[str, str], Comm]] = dataclasses.field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.layout.label()

    def comm_of(self, rank: int) -> dict[tuple[str, str], Comm]:
        """What `rank` (of the plan's stage) sends: its tensor-group position's (tp_comm), else `comm`."""
        if not self.tp_comm:
            return self.comm
        return self.tp_comm.get(members(self.layout, "tp", rank).index(rank), self.comm)

    def by_kind(self, rank: Optional[int] = None) -> dict[str, dict[str, float]]:
        """Calls, bytes and wire bytes of each kind of collective, of the plan's rank (of `rank`: comm_of)."""
        out: dict[str, dict[str, float]] = defaultdict(lambda: {"calls": 0, "bytes": 0, "wire_bytes": 0.0})
        for (kind, _), c in (self.comm if rank is None else self.comm_of(rank)).items():
            out[kind]["calls"] += c.calls
            out[kind]["bytes"] += c.bytes
            out[kind]["wire_bytes"] += c.wire_bytes
        return dict(out)

    @property
    def comm_bytes(self) -> int:
        return sum(c.bytes for c in self.comm.values())

    @property
    def wire_bytes(self) -> float:
        return sum(c.wire_bytes for c in self.comm.values())

    @property
    def memory_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optim_bytes + self.activation_bytes + self.gathered_bytes

    def to_json(self) -> dict[str, Any]:
        d = self.layout.to_dict()
        d.update(label=self.label, param_bytes=self.param_bytes, grad_bytes=self.grad_bytes,
                 optim_bytes=self.optim_bytes, activation_bytes=self.activation_bytes, gathered_bytes=self.gathered_bytes,
                 memory_bytes=self.memory_bytes, flops=self.flops, comm_bytes=self.comm_bytes,
                 wire_bytes=self.wire_bytes, step_time_s=self.step_time_s, compute_s=self.compute_s,
                 comm_s=self.comm_s, hidden_s=self.hidden_s, fits=self.fits, fits_by_zero=self.fits_by_zero, by_kind=self.by_kind(),
                 bubble=self.bubble,
                 comm=[{"kind": k, "group": g, **dataclasses.asdict(c)} for (k, g), c in sorted(self.comm.items())],
                 tp_comm={str(t): [{"kind": k, "group": g, **dataclasses.asdict(c)} for (k, g), c in sorted(comm.items())]
                          for t, comm in self.tp_comm.items()})
        return d


class _Counter:
    """Accumulates collectives over named mesh groups; a group of one is
    free (as in comm.py)."""

    def __init__(self, layout: Layout, rank: int = 0):
        self.layout, self.rank = layout, rank
        self.sizes: dict[str, int] = {}
        self.comm: dict[tuple[str, str], Comm] = {}

    def size(self, group: str) -> int:
        if group not in self.sizes:
            self.sizes[group] = kv_replicas_size(group) or len(members(self.layout, group, self.rank))
        return self.sizes[group]

    def add(self, kind: str, group: str, numel: int, times: int = 1, elem: int = F32, hidden: bool = False) -> None:
        p = self.size(group)
        if p <= 1 or times == 0:
            return
        c = self.comm.setdefault((kind, group), Comm(group_size=p))
        c.calls += times
        c.bytes += times * numel * elem
        c.wire_bytes += times * WIRE_FACTOR[kind](p) * numel * elem
        if hidden or (group in ("dp", "dp_cp") and kind in ("all_reduce", "reduce_scatter")):
            c.hidden_calls += times
            c.hidden_wire_bytes += times * WIRE_FACTOR[kind](p) * numel * elem

    def merge(self, other: "_Counter", times: int) -> None:
        for key, c in other.comm.items():
            total = self.comm.setdefault(key, Comm(group_size=c.group_size))
            for f in ("calls", "bytes", "wire_bytes", "hidden_calls", "hidden_wire_bytes"):
                setattr(total, f, getattr(total, f) + times * getattr(c, f))


def plan_split(shape: ModelShape, layout: Layout, batch_size: int, seq_len: int, grad_accum: int = 1,
               bucket_bytes: Optional[int] = None, pipeline: Optional[PipelineSpec] = None,
               stage: Optional[int] = None, cache: Optional[dict] = None, context: str = "ring") -> SplitPlan:
    """Memory, FLOPs and communication of one optimizer step on rank 0 of `layout` (`bucket_bytes`:
    the data-parallel buckets' size, zero_plan.BUCKET_BYTES unless given). With pp > 1 (schedule
    `pipeline`, default 1F1B over pp micro-batches): on the first rank of stage `stage`; None: every
    stage's plan (`.stages`), the one holding the most memory returned. Where the model shares
    key/value heads, the other ranks of the tensor group are planned too: those that send
    otherwise are the plan's `tp_comm` (`comm_of(rank)`: any rank's). `cache`: see dry_run.py;
    `context`: context.impl, with cp > 1."""
    if layout.pp > 1:  # the cut costs attention at this length
        pipeline = dataclasses.replace(pipeline or PipelineSpec.plain(layout.pp), seq_len=seq_len)
    if layout.pp > 1 and stage is None:
        stages = [plan_split(shape, layout, batch_size, seq_len, grad_accum, bucket_bytes, pipeline, s, cache, context)
                  for s in range(layout.pp)]
        worst = max(stages, key=lambda p: p.memory_bytes)  # its bubble: the stages' FLOPs, as the cut left them
        return dataclasses.replace(worst, stages=stages, bubble=pipeline.bubble_for([p.flops for p in stages]))
    first = layout.rank_of({"pp": stage or 0})
    shares = layout.size > 1 and bool(kv_shared(shape.plan, layout.geo.head_split))
    if shares and cache is None:
        cache = {}  # (every rank's plan reads every tensor rank's dry run: each once)
    args = (shape, layout, batch_size, seq_len, grad_accum, bucket_bytes, pipeline, stage, cache, context)
    plan = _plan_rank(first, *args)
    for t, rank in enumerate(members(layout, "tp", first) if shares else ()):
        # (sets of holders differ by rank: rank 4 of gpt_bigcode's 3d-8 sums one more than rank 0)
        comm = plan.comm if rank == first else _plan_rank(rank, *args).comm
        if comm != plan.comm:
            plan.tp_comm[t] = comm
    return plan


def _plan_rank(rank: int, shape: ModelShape, layout: Layout, batch_size: int, seq_len: int, grad_accum: int,
               bucket_bytes: Optional[int], pipeline: Optional[PipelineSpec], stage: Optional[int],
               cache: Optional[dict], context: str) -> SplitPlan:
    """plan_split's plan of one rank (of stage `stage`)."""
    par, pipe, model = stage_rewrite(shape, layout, rank, pipeline, cache)
    mode = par.mode
    holds: Any = lambda name: True  # noqa: E731
    if pipe is not None:  # what the stage holds (its blocks, its ends), as the cut placed them
        holds, grad_accum = pipe.holds, pipe.spec.microbatches
    vp = padded_vocab(shape.vocab_size, layout.geo.vocab_multiple)
    tokens = batch_size // (grad_accum * layout.dp) * seq_len // layout.cp  # a micro-batch's tokens per replica and cp rank
    key = ("held", layout, bucket_bytes, id(model))  # (the cached model: one per rewrite)
    held = cache.get(key) if cache is not None else None
    if held is None:
        held = stage_held(shape, layout, rank, mode, model, holds, bucket_bytes, pipeline, cache)
        if cache is not None:
            cache[key] = held
    dp_plan, linears, holds = held.dp_plan, held.linears, held.holds

    # ---- forward and backward of one micro-batch, layer by layer (the mode's own counts)
    counter = _Counter(layout, rank)
    key = ("micro", id(model), tokens, seq_len, context)  # (every ZeRO stage and schedule with these micro-batches)
    found = cache.get(key) if cache is not None else None
    if found is None:
        found = _micro(shape, layout, rank, mode, linears, holds, tokens, seq_len, vp, context)
        if cache is not None:
            cache[key] = found
    micro, flops, act, rows, temporary = found
    counter.merge(micro, grad_accum)
    flops *= 3 * grad_accum  # backward = two products per forward product
    if any(lin[1] == "lm_head" for lin in linears):  # the cross entropy over the rank's logits
        flops += LOSS_FLOPS_PER_LOGIT * rows * mode.cost_vocab(vp) * grad_accum
    if pipe is not None:  # micro-batches in flight: their activations are held at once
        act = int(act * pipe.spec.in_flight(stage))

    # ---- the data-parallel buckets (during the backward, and ZeRO's
    # gathers); after the backward (training/step.py's finish): the grid's
    # replica sums, the global norm, the logged loss
    if dp_plan:
        dp_group = "dp_cp" if layout.cp > 1 else "dp"
        dp_plan.count(lambda kind, _, *a, **k: counter.add(kind, dp_group, *a, **k), grad_accum)
    for group, numel in held.early:
        counter.add("all_reduce", group, numel, hidden=True)
    for group, numel in held.sums:
        counter.add("all_reduce", group, numel)
    counter.add("all_reduce", "grad_norm", 1, elem=F64)
    counter.add("all_reduce", "batch", 1, elem=F64)
    if pipe is not None:
        _plan_pipeline(counter, pipe, par, batch_size, seq_len // layout.cp, held.tied_numel)
    n = held.numel
    return SplitPlan(layout, n["param"] * F32, n["grad"] * F32, 2 * n["moment"] * F32 + held.tensors * F32,
                     act * F32, flops, counter.comm, gathered_bytes=held.gathered * F32, temporary_bytes=temporary * F32,
                     bubble=pipe.spec.bubble() if pipe is not None else None,
                     recompute_shares={kind: mode.recompute_comm_share(shape.dropout, kind) for kind, _ in counter.comm})


def _micro(shape: ModelShape, layout: Layout, rank: int, mode, linears: list, holds, tokens: int, seq_len: int, vp: int,
           context: str) -> tuple[_Counter, float, int, int, int]:
    """One micro-batch of `tokens` rows through the layers the stage holds:
    its collectives (the mode's own counts), forward FLOPs, activation
    elements kept, the rows the mode's loss sees, and the elements of the
    largest temporary of a Linear (the mode's cost_linear_temporary)."""
    micro = _Counter(layout, rank)
    flops, act, calls = 0.0, 0, shape.layers.calls  # (a module called c times a forward: counted c times)
    for name, (_, dim) in shape.embeddings.items():
        if shape.roles[name] == "embedding" and holds(name):
            mode.cost_embedding(repeated(micro.add, calls.get(name, 1)), tokens, vp, dim)
    act += count_layers(shape.layers, mode, micro.add, tokens, holds)  # norms, latent attention, experts
    rows = mode.cost_rows(tokens)
    temporary = 0
    for name, role, out_f, in_f, _ in linears:
        n = vp if role == "lm_head" else held_out_features(shape.plan, name, layout.geo.head_split, out_f)
        c = calls.get(name, 1)
        flops += c * 2 * tokens * n * in_f / layout.size
        act += c * mode.cost_linear(repeated(micro.add, c), role, tokens, n, in_f)
        temporary = max(temporary, mode.cost_linear_temporary(role, tokens, n, in_f))
        if role == "lm_head":
            act += 2 * rows * mode.cost_vocab(vp)  # logits and the loss's saved probabilities
    # attention: scores and weighted sum over the rank's heads and rows
    heads_width = shape.n_embd // layout.geo.head_split
    attention_layers = sum(1 for lin in linears if lin[1] == "attn_out")
    flops += attention_layers * 2 * 2 * rows * seq_len * heads_width
    act += attention_layers * (5 if layout.cp > 1 and context == "ulysses" else 4) * rows * heads_width  # q, k, v, out (+ Ulysses' head-split out)
    cost_context(micro.add, layout.cp, context, tokens // layout.geo.batch_split * heads_width, attention_layers)
    if any(lin[1] == "lm_head" for lin in linears) or not shape.linears:
        mode.cost_loss(micro.add, tokens)
    return micro, flops, act, rows, temporary


def _plan_pipeline(counter: _Counter, pipe, par, batch_size: int, seq_len: int, tied_numel: int) -> None:
    """What the pipeline (parallel/pipeline/schedule.py) sends in a step on this
    rank: each chunk's stream to the next stage and its gradient back, once
    per micro-batch; the tied weight's gradient summed between the end
    stages; the last stage's loss to every stage."""
    m = pipe.spec.microbatches
    stream = math.prod(pipe.stream_shape(len(par.rows(batch_size, m)), seq_len, par.mode))
    for chunk in pipe.chunks:
        sends = (not chunk.last) + (not chunk.first)  # forward to the next, backward to the previous
        counter.add("send", "pp", stream, times=m * sends)
    if tied_numel:
        counter.add("all_reduce", "pp_ends", tied_numel)
    counter.add("all_reduce", "pp", 1)


# --------------------------------------------------------------------------
# Every layout of a world


def splits_of(world: int, cfg) -> list[tuple[Layout, Optional[str]]]:
    """Every layout of `world` ranks the modes offer, with every number of
    pipeline stages that divides it (up to the model's blocks, where the
    config says how many), each ZeRO stage of those with replicas, with None
    or the reason it is invalid for `cfg` (heads, hidden sizes, the batch,
    the micro-batches)."""
    m = cfg.model
    blocks = m.get("n_layer") if m.get("arch") != "custom" and not m.get("pretrained") else None
    out, cp = [], cfg.get("cp", 1)  # context parallelism as asked: the other axes split world / cp
    rest = world // cp if world % cp == 0 else 0
    for layout in (l.replace(cp=cp) for pp in range(1, rest + 1) if rest % pp == 0 and pp <= (blocks or rest)
                   for l in layouts_of(rest, pp)):
        try:
            check_layout(cfg, layout)
            out += [(layout.replace(zero=zero), None) for zero in (ZERO_STAGES if layout.dp > 1 else (0,))]
        except ConfigError as e:
            out.append((layout, str(e).removeprefix("invalid config: ")))
    return out


# --------------------------------------------------------------------------
# The command


def plan_world(cfg, world: int, hw: Optional[Hardware]) -> tuple[list[SplitPlan], list[tuple[Layout, str]]]:
    check_costed()  # not a mode planned as free of communication
    shape = model_shape(cfg.model, cfg.seed)
    t = cfg.train
    from tpctl.config.pipeline import check_pipeline

    plans, invalid = [], []
    for layout, why in splits_of(world, cfg):
        if why is not None:
            invalid.append((layout, why))
            continue
        try:
            p = plan_split(shape, layout, t.batch_size, t.seq_len, t.grad_accum, pipeline=check_pipeline(layout, cfg),
                           context=attention_path(cfg.get("context", {}).get("impl", "ring"), cfg.model.dropout))
        except ValueError as e:
            invalid.append((layout, str(e)))
            continue
        plans.append(predict(p, hw) if hw else p)
    if hw:  # the fastest first, among those that fit in memory
        mark_fits_by_zero(plans)
        plans.sort(key=lambda p: (not p.fits, p.step_time_s))
    return plans, invalid
