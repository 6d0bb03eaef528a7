"""`layout=auto`: every way tpctl can run a model on N ranks, the ones that
fit, ranked by predicted step time (`tpctl plan --auto`, `tpctl train
layout=auto world=N`).

The planner (planner.py) costs a split: a layout (mode, size, depth, pp, dp,
zero, sequence parallelism, from parallel.layout.layouts_of) at one pipeline
schedule and micro-batch count. The search adds the axes the planner does
not vary -- the pipeline's schedule and micro-batches, gradient
accumulation for pp=1, activation checkpointing -- and turns the planner's
counted bytes into a predicted peak (`peak_parts`). A split is costed once
(`plan_split` memoised on what it reads), so a choice that differs only in
checkpointing costs nothing more.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from tpctl.config import check_layout
from tpctl.errors import ConfigError
from tpctl.parallel.layout import ZERO_STAGES, Layout, layouts_of
from tpctl.parallel.pipeline.stages import DEFAULT_SCHEDULE, PipelineSpec
from tpctl.parallel.tensor.loss import CHUNK_ELEMENTS

from .hardware import Hardware
from .planner import F32, ModelShape, SplitPlan, model_shape, plan_split, predict

TOP = 5
# Recomputing a block's forward in the backward adds one forward (a third of
# its forward + backward FLOPs) to the blocks' share of the step.
RECOMPUTE_SHARE = 1 / 3
MAX_VIRTUAL = 4  # interleaved chunks per rank searched (2..4, as the blocks allow)


@dataclass(frozen=True)
class Choice:
    """One runnable configuration: a layout, how its batch is cut into
    micro-batches (the pipeline's, or train.grad_accum at pp=1), and
    whether blocks are recomputed."""

    layout: Layout
    microbatches: int = 1
    schedule: str = DEFAULT_SCHEDULE  # pp > 1 only
    virtual: int = 1  # interleaved only
    checkpointing: bool = False

    @property
    def name(self) -> str:
        if self.layout.pp > 1:
            v = f" v={self.virtual}" if self.schedule == "interleaved" else ""
            cut = f" {self.schedule}{v} M={self.microbatches}"
        else:
            cut = f" accum={self.microbatches}" if self.microbatches > 1 else ""
        return self.layout.name + cut + (" ckpt" if self.checkpointing else "")

    def overrides(self) -> list[str]:
        """The `tpctl train` overrides that run this choice."""
        out = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in self.layout.to_dict().items()]
        if self.layout.pp > 1:
            out += [f"pipeline.schedule={self.schedule}", f"pipeline.microbatches={self.microbatches}", "train.grad_accum=1"]
            if self.schedule == "interleaved":
                out.append(f"pipeline.virtual_stages={self.virtual}")
        else:
            out.append(f"train.grad_accum={self.microbatches}")
        return out + [f"train.activation_checkpointing={str(self.checkpointing).lower()}"]

    def apply(self, cfg: Any) -> Any:
        """`cfg` (an OmegaConf run config) set to this choice, in place."""
        self.layout.write_to(cfg)
        cfg.train.activation_checkpointing = self.checkpointing
        if self.layout.pp > 1:
            cfg.train.grad_accum = 1
            cfg.pipeline.schedule, cfg.pipeline.microbatches = self.schedule, self.microbatches
            cfg.pipeline.virtual_stages = max(2, self.virtual)
        else:
            cfg.train.grad_accum = self.microbatches
        return cfg


@dataclass
class Candidate:
    choice: Choice
    plan: SplitPlan  # predicted (step_time_s, comm_s, bubble, flops of the stage holding the most memory)
    peak_bytes: int
    parts: dict[str, int]  # what the peak is made of
    step_time_s: float = 0.0
    flops: float = 0.0
    fits: bool = True
    exposed_comm_s: float = 0.0  # the communication in step_time_s (the recomputation's included)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.choice.name, "layout": self.choice.layout.name, "overrides": self.choice.overrides(),
                "predicted_ms": self.step_time_s * 1e3, "predicted_peak_bytes": self.peak_bytes, "fits": self.fits,
                "exposed_comm_ms": self.exposed_comm_s * 1e3, "bubble": self.plan.bubble, "flops": self.flops,
                "parts": self.parts}


@dataclass
class Search:
    ranked: list[Candidate]  # fits, fastest first
    unfit: list[Candidate]  # smallest peak first
    invalid: list[tuple[str, str]]  # (name, why)
    splits: int = 0  # distinct plan_split calls

    @property
    def pick(self) -> Candidate:
        return self.ranked[0]


# --------------------------------------------------------------------------
# The choices


def choices_of(cfg: Any, world: int) -> tuple[list[tuple[Choice, Optional[PipelineSpec]]], list[tuple[str, str]]]:
    """Every choice for `world` ranks that `check_layout` accepts, each with
    its pipeline (None at pp=1), and the refused ones with why."""
    from omegaconf import OmegaConf

    from tpctl.config.pipeline import check_pipeline

    m, t = cfg.model, cfg.train
    blocks = m.get("n_layer") if m.get("arch") != "custom" and not m.get("pretrained") else None
    work = OmegaConf.create(OmegaConf.to_container(cfg))  # one copy, set to each choice in turn (a copy each is slow)
    ok, invalid = [], []
    for pp in (p for p in range(1, world + 1) if world % p == 0 and p <= (blocks or world)):
        for layout in layouts_of(world, pp):
            for zero in (z for z in (ZERO_STAGES if layout.dp > 1 else (0,)) if pp == 1 or z <= 1):
                lay = layout.replace(zero=zero)
                split = lay.dp * lay.geo.batch_split
                per_replica = t.batch_size // split if t.batch_size % split == 0 else 0
                cuts = _cuts(pp, per_replica, blocks) if per_replica else []
                if not cuts:
                    invalid.append((lay.name, f"train.batch_size={t.batch_size} is no multiple of {split} row blocks"))
                for micro, schedule, virtual in cuts:
                    choice = Choice(lay, micro, schedule, virtual)
                    try:
                        check_layout(choice.apply(work), lay)
                        pipe = check_pipeline(lay, work)
                    except ConfigError as e:
                        invalid.append((choice.name, str(e).removeprefix("invalid config: ")))
                        continue
                    ok += [(dataclasses.replace(choice, checkpointing=ck), pipe) for ck in (False, True)]
    return ok, invalid


def _cuts(pp: int, rows: int, blocks: Optional[int]) -> list[tuple[int, str, int]]:
    """(micro-batches, schedule, virtual chunks) for a replica's `rows`
    sequences: at pp=1 every accumulation that divides them; with stages,
    each schedule at every count of micro-batches it takes."""
    counts = [k for k in range(1, rows + 1) if rows % k == 0]
    if pp == 1:
        return [(k, "1f1b", 1) for k in counts]
    out = [(k, "gpipe", 1) for k in counts] + [(k, "1f1b", 1) for k in counts if k >= pp]
    for v in range(2, MAX_VIRTUAL + 1):
        if blocks is None or pp * v <= blocks:
            out += [(k, "interleaved", v) for k in counts if k % max(1, k // pp) == 0]
    return out


# --------------------------------------------------------------------------
# Memory predicted


def peak_parts(plan: SplitPlan, shape: ModelShape, choice: Choice, cfg: Any, hw: Optional[Hardware]) -> dict[str, int]:
    """The bytes one rank holds at its peak (the pipeline stage holding the
    most): the planner's counted state, activations as the schedule holds
    them (with checkpointing: each block's input per micro-batch in flight,
    and one block's whole activations while it is recomputed), the step's
    largest temporary (the loss's chunk, or a Linear's blocks in flight:
    2d's SUMMA at the LM head), the data-parallel bucket being reduced, ZeRO-3's
    gathered block, the allocator's slack over what a step makes and frees
    (hw.heap_slack), and the process itself (hw.process_bytes: a `tpctl
    train` worker's interpreter and libraries, for a tpctl or a Hugging Face
    model, measured by `tpctl plan --calibrate` on CPU)."""
    from tpctl.parallel.data_parallel import zero_plan

    lay, t = choice.layout, cfg.train
    rows = t.batch_size // (choice.microbatches * lay.dp) * t.seq_len  # a micro-batch's token rows per replica
    stage_blocks = max(1, _stage_blocks(plan, shape))
    in_flight = _in_flight(plan, choice)
    act = plan.activation_bytes
    vocab_cols = max(1, shape.vocab_size // lay.size if lay.mode != "none" else shape.vocab_size)
    loss_tmp = min(rows * vocab_cols, CHUNK_ELEMENTS) * F32 if _holds_head(plan, shape) else 0
    # The loss's chunk and a Linear's blocks in flight are never held at once
    # (the loss's backward is done before the LM head's starts): the larger.
    temporary = max(loss_tmp, plan.temporary_bytes)
    if choice.checkpointing:
        per_mb = act / in_flight
        head = 2 * rows * vocab_cols * F32 if _holds_head(plan, shape) else 0
        block = max(0.0, per_mb - head) / stage_blocks
        block_input = rows * shape.n_embd * F32 / (1 if lay.mode in ("none", "1d") and not lay.seq_parallel else lay.size)
        act = int(in_flight * (stage_blocks * block_input + head) + block)
    bucket = min(zero_plan.BUCKET_BYTES, plan.grad_bytes) if lay.dp > 1 else 0
    return {"params": plan.param_bytes, "grads": plan.grad_bytes, "optimizer": plan.optim_bytes,
            "activations": int(act), "temporary": int(temporary), "comm_buffer": int(bucket),
            "zero_gathered": plan.gathered_bytes, "heap": int((hw.heap_slack if hw else 0) * (act + temporary)),
            "process": int(hw.process_bytes(_hf(cfg)) if hw else 0)}


def _hf(cfg: Any) -> bool:
    from tpctl.schema import is_hf_arch

    arch = cfg.model.get("arch")
    return arch is not None and is_hf_arch(arch)


def _stage_blocks(plan: SplitPlan, shape: ModelShape) -> int:
    if plan.layout.pp == 1:
        return shape.attention_layers
    return round(shape.attention_layers * plan.flops / max(1.0, sum(s.flops for s in plan.stages)))


def _worst_stage(plan: SplitPlan) -> int:
    """The pipeline stage whose plan `plan` is (the one holding the most memory)."""
    return next((i for i, s in enumerate(plan.stages) if s.memory_bytes == plan.memory_bytes), 0)


def _holds_head(plan: SplitPlan, shape: ModelShape) -> bool:
    return plan.layout.pp == 1 or _worst_stage(plan) == plan.layout.pp - 1


def _in_flight(plan: SplitPlan, choice: Choice) -> float:
    if choice.layout.pp == 1:
        return 1.0
    spec = PipelineSpec(choice.layout.pp, choice.schedule, choice.virtual, choice.microbatches)
    return max(1e-9, spec.in_flight(_worst_stage(plan)))


# --------------------------------------------------------------------------
# The search


def search(cfg: Any, world: int, hw: Hardware, shape: Optional[ModelShape] = None, reuse: bool = True) -> Search:
    """Every choice of `world` ranks costed and predicted on `hw`; those
    within hw.memory_bytes ranked fastest first. `reuse`: the dry runs'
    cache (cost/dry_run.py); without it every split is dry-run afresh, as
    `tpctl plan` does (tests hold the two equal)."""
    from tpctl.parallel.registry import check_costed

    check_costed()
    shape = shape or model_shape(cfg.model, cfg.seed)
    t = cfg.train
    memo: dict[tuple, Optional[SplitPlan]] = {}
    rewrites: Optional[dict] = {} if reuse else None
    ranked, unfit = [], []
    choices, invalid = choices_of(cfg, world)
    for choice, pipe in choices:
        key = (choice.layout, pipe, choice.microbatches)
        if key not in memo:
            try:
                memo[key] = predict(plan_split(shape, choice.layout, t.batch_size, t.seq_len,
                                               1 if pipe else choice.microbatches, pipeline=pipe, cache=rewrites), hw)
            except ValueError as e:
                invalid.append((choice.name, str(e)))
                memo[key] = None
        plan = memo[key]
        if plan is None:
            continue
        parts = peak_parts(plan, shape, choice, cfg, hw)
        peak = sum(parts.values())
        step_s, comm_s = _step_s(plan, choice, shape, hw)
        cand = Candidate(choice, plan, peak, parts, step_s, plan.flops * (1 + RECOMPUTE_SHARE * choice.checkpointing),
                         not hw.memory_bytes or peak <= hw.memory_bytes, comm_s)
        (ranked if cand.fits else unfit).append(cand)
    ranked.sort(key=lambda c: (c.step_time_s, c.peak_bytes))
    unfit.sort(key=lambda c: c.peak_bytes)
    return Search(ranked, unfit, invalid, sum(1 for p in memo.values() if p is not None))


def _step_s(plan: SplitPlan, choice: Choice, shape: ModelShape, hw: Hardware) -> tuple[float, float]:
    """The predicted step -- `predict`'s compute and exposed communication,
    checkpointing's recomputation, the blocks' fixed cost -- and the
    communication in it. Ranks beyond a CPU's cores take turns (predict
    stretches the compute so): at every hop of a collective too, so its
    time stretches alike (Hardware.comm_turns: beyond what the
    calibration's world already measured)."""
    turns = hw.comm_turns(choice.layout.world)
    compute, grid = _recompute_s(plan, hw) if choice.checkpointing else (0.0, 0.0)
    comm = (plan.comm_s + grid) * turns
    return plan.compute_s + compute + comm + _overhead_s(plan, choice, shape, hw), comm


# Groups whose collectives run inside a block's forward (a recomputed forward runs them again).
STEP_GROUPS = ("dp", "pp", "pp_ends", "grad_norm", "batch")


def _recompute_s(plan: SplitPlan, hw: Hardware) -> tuple[float, float]:
    """What checkpointing adds: the blocks' forward again -- a third of the
    compute -- and the tensor-parallel collectives that forward issues
    again (by kind, the mode's share of the grid's: CostHooks.
    recompute_comm_share), each at its kind's measured time: the
    recomputed forward waits for every one (Hardware.kind_factor)."""
    from tpctl.parallel.tensor.cost_hooks import kv_replicas_size

    from .planner import sent_s

    grid = 0.0
    for (kind, group), c in plan.comm.items():
        if group in STEP_GROUPS or kv_replicas_size(group):  # (shared key/value heads: summed after the backward)
            continue
        sent = sent_s(plan.layout, kind, group, c.group_size, c.calls, c.wire_bytes, hw)
        grid += plan.recompute_shares.get(kind, 0.0) * hw.kind_factor(kind) * sent
    return RECOMPUTE_SHARE * plan.compute_s, grid


def _overhead_s(plan: SplitPlan, choice: Choice, shape: ModelShape, hw: Hardware) -> float:
    """The fixed cost of the blocks' operators on the busiest rank
    (hw.block_overhead_s per block and micro-batch; a pipeline's stretched
    by its bubble, ranks beyond the CPU's cores taking turns)."""
    if not hw.block_overhead_s:
        return 0.0
    lay = choice.layout
    blocks = -(-shape.attention_layers // lay.pp)  # the largest stage, balanced
    cost = hw.block_overhead_s * blocks * choice.microbatches * (1 + RECOMPUTE_SHARE * choice.checkpointing)
    if lay.pp > 1:
        cost /= 1 - plan.bubble
    return cost * (lay.world / hw.cores if hw.cores and lay.world > hw.cores else 1)


def refusal(found: Search, world: int, hw: Hardware) -> Optional[ConfigError]:
    """The one line for a world no choice can use, or a memory none fits
    (None: there is a pick)."""
    if found.ranked:
        return None
    if not found.unfit:
        why = found.invalid[0][1] if found.invalid else "no mode has a size that divides it"
        return ConfigError("world", world, f"no layout of {world} ranks is valid for this model and batch "
                           f"(first refusal: {found.invalid[0][0] if found.invalid else world}: {why}); "
                           "try another world or train.batch_size")
    best = found.unfit[0]
    knobs = _knobs(best)
    return ConfigError("memory", f"{hw.memory_bytes / 2**30:.2f}GiB",
                       f"no layout of {world} ranks fits: the smallest peak is {best.peak_bytes / 2**30:.2f} GiB per rank "
                       f"({best.choice.name}); to fit, {knobs}")


def _knobs(best: Candidate) -> str:
    """Which knob would shrink the smallest footprint most."""
    p = best.parts
    state = p["params"] + p["grads"] + p["optimizer"]
    if p["process"] > state + p["activations"]:
        return "give each rank more memory (the process itself is most of it)"
    if state >= p["activations"]:
        return "use more ranks (a larger world shards the weights, zero=3 or pp)"
    return "use more ranks or a smaller train.batch_size (activation checkpointing is already searched)"


def resolve(cfg: Any, world: int, hw: Hardware) -> Candidate:
    """The pick for `tpctl train layout=auto`: ConfigError as `refusal`."""
    found = search(cfg, world, hw)
    error = refusal(found, world, hw)
    if error is not None:
        raise error
    return found.pick
