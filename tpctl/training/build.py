"""One way to assemble a run on a rank: layout -> parallelism (mesh, mode,
data parallelism, pipeline) -> model (built, rewritten, maybe verified) ->
step. The worker, `tpctl bench`, `tpctl inspect`, the test pool's jobs and
the benchmarks all call `build_run`, so a run built anywhere is the run
`tpctl train` trains: the same init, the same parameter order, the same step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from tpctl.parallel.pipeline.stages import pipeline_of
from tpctl.parallel.layout import Layout
from tpctl.parallel.parallelism import Parallelism, parallelism
from tpctl.parallel.tensor.rewrite import Rewrite

from .step import Schedule, TrainStep


@dataclass
class Run:
    """What `build_run` assembled: the config, this rank's parallel machinery,
    the rewrite (tensor.rewrite.Rewrite: the rewritten model, this rank's
    stage with pp > 1, its roles and real vocabulary), its training step
    (None when not asked for), the start-up verification's report (None
    when it did not run) and, with cp > 1, the start-up proof's worst
    difference (`prove_context`; None when it did not run)."""

    cfg: Any
    par: Parallelism
    rewrite: Rewrite
    step: Optional[TrainStep] = None
    verified: Any = None
    cp_error: Optional[float] = None

    @property
    def model(self) -> torch.nn.Module:
        return self.rewrite.model

    @property
    def vocab_size(self) -> int:
        """The real vocabulary (the LM head's width before a mode pads it;
        the config's for a model without a head): the bound of every id
        read and of the loss."""
        return self.rewrite.vocab_size or self.cfg.model.vocab_size

    @property
    def layout(self) -> Layout:
        return self.par.layout


def build_parallelism(cfg, layout: Optional[Layout] = None, device: str | torch.device = "cpu",
                      groups: bool = True, rank: Optional[int] = None) -> Parallelism:
    """This rank's parallel machinery of `layout` (default: the config's),
    seeded by cfg.seed, with the config's pipeline schedule when pp > 1.
    groups=False: the process-group-free version (dry runs)."""
    layout = layout or Layout.from_config(cfg)
    return parallelism(layout, cfg.seed, device, groups=groups, rank=rank, pipeline=pipeline_of(layout, cfg))


def build_step(cfg, par: Parallelism, model: torch.nn.Module, schedule: bool = True,
               vocab_size: Optional[int] = None) -> TrainStep:
    """The training step over `model`, as the trainer runs it: activation
    checkpointing first (train.activation_checkpointing; it wraps blocks the
    step's hooks then see), then the step with the config's learning-rate
    schedule (schedule=False: a constant optim.lr, as `tpctl bench` measures)."""
    if cfg.train.get("activation_checkpointing", False):
        from .recompute import apply_activation_checkpointing

        apply_activation_checkpointing(model)
    o = cfg.optim
    lr = Schedule(o.lr, o.min_lr, o.warmup_steps, cfg.train.steps) if schedule else None
    return TrainStep(par, [model], cfg, lr, vocab_size)


def build_run(cfg, par: Optional[Parallelism] = None, *, layout: Optional[Layout] = None,
              device: str | torch.device = "cpu", groups: bool = True, lazy: bool = True,
              verify: bool = False, step: bool = True, schedule: bool = True, training: bool = True) -> Run:
    """Assemble a run of `cfg` on this rank.

    par: parallel machinery made elsewhere (the test pool reuses a process's
    groups: launch.pool.parallelism_of); else built here from `layout`
    (default: the config's) on `device`. lazy: each parameter made whole one
    at a time, to slice this rank's shard (False: the whole model first; the
    same values). verify: the start-up proof of the rewrite
    (parallel/verify/proof.py; RewriteRefused when it differs). step: also build
    the TrainStep (`build_step`). training=False: a model that is only
    decoded (generation), which a split refuses less of (check_plan)."""
    from tpctl.models import build_model
    from tpctl.parallel.verify.proof import rewrite_verified

    if par is None:
        par = build_parallelism(cfg, layout, device, groups)
    par.mode.overlap = par.dp.overlap = bool(cfg.train.get("overlap", True))  # read as layers and buckets are built
    rewrite, verified = rewrite_verified(build_model(cfg.model, cfg.seed, lazy=lazy), par, cfg.model.get("plan"),
                                         verify, training)
    model = rewrite.model
    # After the proof of the tensor rewrite, which replays units on whole sequences.
    par.cp.impl = cfg.get("context", {}).get("impl", "ring")
    par.cp.install(model, rewrite.plan.roles)
    _install_documents(cfg, par, model)
    cp_error = prove_context(cfg, par, model, verify)
    run = Run(cfg, par, rewrite, None, verified, cp_error)
    run.step = build_step(cfg, par, model, schedule, run.vocab_size) if step else None
    return run


def _install_documents(cfg, par: Parallelism, model: torch.nn.Module) -> None:
    """data.documents=true: the model keeps the corpus's documents apart on
    this rank's layout (parallel/context/documents.py)."""
    from tpctl.data.documents import separator
    from tpctl.parallel.context import documents

    documents.install(model, par.mode, par.cp, separator(cfg) if cfg.get("data") is not None else None)


# What the start-up proof of context parallelism accepts: fp32 round-off of
# attention merged in another order (measured: below 1e-6).
CP_TOLERANCE = 1e-4


def prove_context(cfg, par: Parallelism, model: torch.nn.Module, verify: bool = True) -> Optional[float]:
    """With cp > 1 (and no pipeline stages, whose forward is the schedule's:
    config/layout_checks.py refuses a window there): ContextParallel.prove
    on every rank, which also surveys the family's windows (without
    `verify`, the survey alone), the worst difference agreed over all
    ranks; RewriteRefused (exit 2 from the workers) above CP_TOLERANCE.
    Returns it (None: nothing proven)."""
    from tpctl.parallel import comm
    from tpctl.parallel.verify.proof import RewriteRefused

    if par.cp.size == 1 or par.pipeline is not None:
        return None
    t = cfg.train
    worst = torch.tensor([par.cp.prove(model, par.mode, par.rows(t.batch_size, t.grad_accum), t.batch_size,
                                       cfg.model.vocab_size, t.seq_len, check=verify)])
    if not verify:
        return None
    comm.all_reduce(worst, torch.distributed.group.WORLD, op=torch.distributed.ReduceOp.MAX)
    if not worst.item() <= CP_TOLERANCE:
        raise RewriteRefused(f"cp={par.cp.size} context.impl={par.cp.impl}: the logits on each rank's positions differ "
                             f"from the whole sequence's by {worst.item():.1e} (> {CP_TOLERANCE:g}): this model's "
                             "attention or positions do not split exactly; expected cp=1")
    return worst.item()
