"""A rewrite that proves itself (`train.verify_rewrite`, on by default).

Before the first step, the rewritten model is run next to the original, one
piece at a time, on the same random input, forward and backward, at two levels:

  * every distinct replaced module (a Linear, an embedding, a norm, ... as
    the mode rewrote it) against its original;
  * every distinct block of the model's repeated stack (a decoder layer)
    against its original. Module checks alone cannot see the worst cases: a
    fused projection sliced [q|k|v] when its rows are interleaved per head
    computes its own rows exactly right; only the attention's output is wrong;
  * the two stages of the model's own forward around the stack, forward
    only: the embedding stage (ids to the first block's input) and the head
    (the last block's output to the logits), which see arithmetic no module
    holds (a scale, or a width read from a rewritten module).

"Distinct" means same class, same printed configuration (shapes, eps, ...)
and the same extra call arguments (a layer given another attention mask is
checked on its own). For each, ONE instance is materialised whole (with the
values training starts from: the model's parameter source makes the whole
tensor, the rank's shard is the slice of it), so the cost is one block's
memory and a few milliseconds of compute, never the whole model.

Inputs. A module's or block's real call arguments are captured with a
forward pre-hook twice: in the original model's forward (parameters stood in
for as in the roles tracer, so nothing is materialised) and in the rewritten
model's forward on this rank's share of the same token ids. The replay keeps
every argument but the first tensor (hidden states, token ids), so attention
masks, position ids and rotary tables reach the layer as training gives them.

  * Blocks take the residual stream: the full random input X, and on this
    rank `mode.shard_hidden` of its rows, the layout training uses.
  * Modules compute row by row (a Linear, a norm, a lookup), so every row of
    their random input is the same vector: the rows a rank holds then do not
    matter, only the features, which its parameters' ShardSpecs name.
    Token-id inputs use one id per run, over a few ids that touch every
    vocabulary block (and the padding id, whose row must get no gradient).

Compared on each rank: the output, the input gradient and every parameter's
gradient (after summing partial gradients over their replicas), each against
this rank's slice of the original's; the worst difference relative to the
reference tensor's largest magnitude, agreed over all ranks with one
all-reduce. Above TOLERANCE the run is refused before step 1.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from tpctl.errors import EXIT_USAGE, TpctlError
from tpctl.parallel import comm
from tpctl.parallel.roles.inference import resolve_plan
from tpctl.parallel.roles.plan import RolePlan
from tpctl.parallel.roles.probes import linearize
from tpctl.parallel.tensor.rewrite import Rewrite
from tpctl.parallel.verify.capture import (
    ELSEWHERE,
    TOLERANCE,
    CannotVerify,
    Check,
    Originals,
    capture_calls,
    capture_originals,
    eval_forward,
    local_rows,
)
from tpctl.parallel.verify.compare import check_block, check_module, check_stage, is_rewritten, materialise


class RewriteRefused(TpctlError):
    """The rewritten model differs from the original: refuse to train.
    str() is the one-line verdict; `report` holds every check."""

    exit_code = EXIT_USAGE

    def __init__(self, line: str, report: Optional["Report"] = None):
        super().__init__(line)
        self.report = report


@dataclass
class Report:
    checks: list[Check]
    seconds: float
    # The most held whole at once: a unit's parameters and gradients, or the
    # parameters outside the stack (for the stages).
    peak_extra_bytes: int = 0

    @property
    def failure(self) -> Optional[Check]:
        """The check a refusal names: the most specific that failed (a broken
        module also breaks its block and the stage it sits in)."""
        failed = [c for c in self.checks if c.failed]
        return min(failed, key=lambda c: ("module", "block", "stage").index(c.kind)) if failed else None

    def line(self, mode) -> str:
        """The one-line verdict (a refusal, or the start-up summary)."""
        where = f"mode={mode.name} size={mode.geo.size}"
        bad = self.failure
        if bad is not None and math.isinf(bad.diff) and bad.note:  # it could not run: say why
            return (f"the rewrite for {where} could not be verified: {bad.kind} {bad.name} ({bad.cls}): {bad.note}; "
                    f"refusing to train (train.verify_rewrite=false skips this check)")
        if bad is not None:
            what = f" in {bad.what}" if bad.what else ""
            return (f"the rewrite for {where} is not the original model: {bad.kind} {bad.name} ({bad.cls}) differs "
                    f"by {bad.diff:.2e} of its scale{what} (fp32 round-off is below {TOLERANCE:g}); "
                    f"refusing to train (train.verify_rewrite=false skips this check)")
        count = {kind: sum(c.kind == kind and not c.note for c in self.checks) for kind in ("module", "block", "stage")}
        worst = max((c.diff for c in self.checks if not c.note), default=0.0)
        return (f"verified the rewrite for {where}: {count['module']} distinct modules, {count['block']} distinct "
                f"blocks and {count['stage']} stages (embedding, head) match the original (worst {worst:.1e} of "
                f"scale) in {self.seconds:.2f}s; largest piece made whole {self.peak_extra_bytes / 2**20:.1f} MiB")


def rewrite_verified(model: nn.Module, par, plan=None, verify: bool = True,
                     training: bool = True) -> tuple[Rewrite, Optional[Report]]:
    """`par.rewrite(model, plan)` (par: the run's Parallelism), moved to the
    mesh's device, and (if `verify`) proven against the original model:
    returns the Rewrite and the report; RewriteRefused (on every rank
    alike) when they differ."""
    mode = par.mode
    if not verify or not mode.rewrites:  # mode none replaces nothing
        done = par.rewrite(model, plan, training=training)
        done.model = done.model.to(mode.mesh.device)
        return done, None
    linearize(model)
    if not isinstance(plan, RolePlan):
        plan = resolve_plan(model, plan)
    start = time.perf_counter()
    # With pp > 1 each rank checks what its stage holds (an instance of
    # each distinct unit there, and the embedding or the head on the end
    # stages), and the verdicts are agreed over every rank.
    pipeline = par.pipeline
    if pipeline is not None:
        pipeline.assign(model)
    originals = capture_originals(model, plan, mode, pipeline.holds if pipeline is not None else None)
    setup = time.perf_counter() - start
    done = par.rewrite(model, plan, training=training)
    done.model = done.model.to(mode.mesh.device)
    report = verify_rewrite(done.model, mode, originals, pipeline)
    report.seconds += setup
    if report.failure is not None:
        raise RewriteRefused(report.line(mode), report)
    return done, report


def verify_rewrite(model: nn.Module, mode, originals: Originals, pipeline=None) -> Report:
    """Check every unit of `originals` against the rewritten `model` (with
    pp > 1 `pipeline`'s stage) on this rank; every rank of the world must
    call it (collectives)."""
    start = time.perf_counter()
    units = [u for u in originals.units if u.check.note != ELSEWHERE]
    local_ids = local_rows(mode, originals.ids).to(mode.mesh.device)
    stream = None
    if pipeline is not None:  # the stream a stage receives in the check's forward (its values do not matter)
        rows, seq = originals.ids.shape[0] // mode.read_block()[1], originals.ids.shape[1]
        stream = torch.zeros(pipeline.stream_shape(rows, seq, mode), device=mode.mesh.device)
    try:
        calls = capture_calls({u.check.name: model.get_submodule(u.check.name) for u in units},
                               lambda: eval_forward(model, local_ids, pipeline, stream))
    except (RuntimeError, ValueError, TypeError, IndexError) as e:  # alike on every rank: a shape error
        where = f"mode={mode.name} size={mode.geo.size}"
        raise RewriteRefused(f"the rewrite for {where} cannot run the model: its forward fails{_raised_in(model, e)} "
                             f"with {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    peak = 0
    was_training = model.training
    model.eval()
    try:
        for unit in units:
            c = unit.check
            rewritten = model.get_submodule(c.name)
            if c.kind == "module" and not is_rewritten(rewritten, unit.original):
                c.note = "kept as it is"
                continue
            if c.name not in calls:
                c.diff, c.note = math.inf, "the rewritten model never calls it"
                continue
            c.missing = _missing(unit.original, rewritten)
            try:
                reference, nbytes = materialise(unit, originals.source, mode.mesh.device)
                peak = max(peak, nbytes)
                check = check_block if c.kind == "block" else check_module
                c.diff, c.what = check(reference, rewritten, unit.full_call, calls[c.name], mode, c)
            except CannotVerify as e:
                c.diff, c.note = math.inf, f"cannot verify: {e}"
            except (RuntimeError, ValueError, TypeError, IndexError) as e:
                c.diff, c.note = math.inf, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            finally:
                for p in rewritten.parameters():
                    p.grad = None
                reference = None  # one whole unit at a time: let it go before the next is made
        for stage in originals.stages:
            if stage.check.note == ELSEWHERE:
                continue
            try:
                stage.check.diff, stage.check.what = check_stage(model, mode, stage, calls, local_ids, pipeline, stream)
            except CannotVerify as e:
                stage.check.diff, stage.check.note = math.inf, f"cannot verify: {e}"
    finally:
        model.train(was_training)
    _agree(originals.units + originals.stages, mode)
    checks = [s.check for s in originals.stages[:1]] + [u.check for u in units] + \
        [s.check for s in originals.stages[1:]] + originals.skipped
    return Report(checks, time.perf_counter() - start, max(peak, originals.stage_bytes))


def _raised_in(model: nn.Module, error: BaseException) -> str:
    """" in NAME (Class)": the innermost module of `model` whose forward
    was running when `error` was raised (its frames' `self`), or "": the
    module whose arithmetic no longer fits what the rewrite made of it
    (a DSA indexer reshaping a split projection to its whole heads)."""
    names = {id(m): n for n, m in model.named_modules() if n}
    found, tb = None, error.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if id(owner) in names:
            found = owner
        tb = tb.tb_next
    return "" if found is None else f" in {names[id(found)]} ({type(found).__name__})"


def _missing(original: nn.Module, rewritten: nn.Module) -> tuple[str, ...]:
    """The original's parameters the rewritten unit holds nothing of on this
    rank, by name (a rewrite keeps its originals' names: HeldHeads keeps a
    rank's per-head modules under their whole-model indices)."""
    held = {name for name, _ in rewritten.named_parameters()}
    return tuple(name for name, _ in original.named_parameters() if name not in held)


def _dropped(missing_by_rank: list[tuple[str, ...]]) -> list[str]:
    """The parameters no rank checking a unit holds: the rewrite dropped
    them, and nothing would train them. A check of outputs cannot see this
    while a dropped parameter's initial value is neutral (a scale of ones:
    Dory's logit_scale before it was carried)."""
    if not missing_by_rank:
        return []
    return sorted(set.intersection(*(set(m) for m in missing_by_rank)))


def _agree(units: list, mode) -> None:
    """Every rank takes, for each unit, the worst difference over all ranks
    and the name of the tensor it was in on the first rank that saw it, so
    all ranks refuse or train alike and print one and the same line."""
    if not units or not dist.is_initialized():
        for unit in units:
            _refuse_dropped(unit.check, _dropped([unit.check.missing]))
        return
    diffs = torch.tensor([u.check.diff for u in units], dtype=torch.float64, device=mode.mesh.device)
    diffs = torch.nan_to_num(diffs, nan=math.inf, posinf=math.inf)
    by_rank = comm.all_gather(diffs.unsqueeze(0), dist.group.WORLD).cpu()  # (world, units)
    # Start-up only: the names are short strings, one object gather.
    names = comm.all_gather_object([(u.check.what, u.check.note, u.check.missing) for u in units], dist.group.WORLD)
    worst, owner = by_rank.max(dim=0)  # max picks the first rank among equals
    for i, unit in enumerate(units):
        dropped = _dropped([names[r][i][2] for r in range(len(names)) if names[r][i][1] != ELSEWHERE])
        if unit.check.note == ELSEWHERE:  # another stage checked it: take that rank's verdict
            checked = [r for r in range(len(names)) if names[r][i][1] != ELSEWHERE] or [int(owner[i])]
            first = int(owner[i]) if int(owner[i]) in checked else checked[0]
            unit.check.what, unit.check.note = names[first][i][:2]
        elif not unit.check.note:
            unit.check.what = names[int(owner[i])][i][0]
        unit.check.diff = float(worst[i])
        _refuse_dropped(unit.check, dropped)


def _refuse_dropped(check: Check, dropped: list[str]) -> None:
    if dropped:
        check.diff = math.inf
        check.note = (f"the rewrite holds {', '.join(dropped)} on no rank, so nothing would train "
                      f"{'it' if len(dropped) == 1 else 'them'}")
