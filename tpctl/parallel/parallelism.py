"""A run's parallel machinery on one rank, composed: the mesh, the tensor-
parallel mode acting on its grid, the pipeline along the stages (pp > 1)
and the data-parallel component across replicas. What a training step
(training/step.py) or a custom loop (`tpctl.init_parallel`) works with;
each part knows only its own axis.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch
import torch.nn as nn

from tpctl.parallel import comm
from tpctl.parallel.context.split import ContextParallel
from tpctl.parallel.data_parallel.ddp import DataParallel
from tpctl.parallel.geometry import Geometry
from tpctl.parallel.layout import Layout
from tpctl.parallel.mesh import Mesh, build_mesh
from tpctl.parallel.pipeline.cut import compute_weight
from tpctl.parallel.pipeline.schedule import Pipeline
from tpctl.parallel.pipeline.stages import PipelineSpec
from tpctl.parallel.shard import spec_of
from tpctl.parallel.roles.inference import resolve_plan
from tpctl.parallel.roles.plan import RolePlan
from tpctl.parallel.roles.probes import linearize
from tpctl.parallel.tensor.mode import ParallelMode
from tpctl.parallel.tensor.rewrite import Rewrite, rewrite_layers


@dataclass
class Parallelism:
    mode: ParallelMode
    dp: DataParallel = field(default=None)  # type: ignore[assignment]
    # pp > 1: this rank's stage of the pipeline; None without one.
    pipeline: Optional[Pipeline] = None
    # The ranks splitting each sequence (cp = 1: one, which splits nothing).
    cp: ContextParallel = field(default=None)  # type: ignore[assignment]

    def __post_init__(self):
        if self.dp is None:
            self.dp = DataParallel(self.mode.mesh)
        if self.cp is None:
            self.cp = ContextParallel(self.mode.mesh)

    @property
    def mesh(self) -> Mesh:
        return self.mode.mesh

    @property
    def layout(self) -> Layout:
        return self.mesh.layout

    @property
    def geo(self) -> Geometry:
        return self.mesh.geo

    # ---- the model ------------------------------------------------------------
    def rewrite(self, model: nn.Module, plan=None, dry_run: bool = False, training: bool = True,
                stage: Optional[bool] = None) -> Rewrite:
        """The one place a model becomes this rank's: with a pipeline, cut
        to this rank's stage, its layers rewritten by the mode
        (tensor.rewrite.rewrite_layers), the stage wired; without, its
        layers rewritten. `stage`: cut (default: unless a dry run, which
        rewrites the whole model for `tpctl inspect`; the planner's dry run
        asks for the stage)."""
        if self.pipeline is None or not (not dry_run if stage is None else stage):
            return rewrite_layers(model, self.mode, plan, dry_run, training)
        linearize(model)  # GPT-2's Conv1D: a Linear with a transposed weight, before the plan reads it
        if not isinstance(plan, RolePlan):
            plan = resolve_plan(model, plan)
        done = rewrite_layers(model, self.mode, self.pipeline.cut(model, plan), dry_run, training)
        self.pipeline.install(done.model)
        done.stage = self.pipeline
        return done

    # ---- data ----------------------------------------------------------------
    def rows(self, batch_size: int, grad_accum: int = 1, micro: int = 0) -> range:
        """Rows of the global batch this rank reads for micro-batch `micro`:
        its replica's share, then its row block inside the grid."""
        return self.mode.read_rows(self.dp.share(batch_size, grad_accum, micro))

    def shard_batch(self, batch: torch.Tensor, micro: int = 0, grad_accum: int = 1) -> torch.Tensor:
        """This rank's model input from a whole global batch of token ids."""
        rows = self.rows(batch.shape[0], grad_accum, micro)
        return self.mode.split_input(self.cp.split(batch[rows.start:rows.stop]))

    def shard_targets(self, batch: torch.Tensor, micro: int = 0, grad_accum: int = 1) -> torch.Tensor:
        """This rank's targets (the rows its logits hold) from a global batch."""
        rows = self.rows(batch.shape[0], grad_accum, micro)
        return self.mode.split_target(self.cp.split(batch[rows.start:rows.stop]))

    def cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                      label_smoothing: float = 0.0) -> torch.Tensor:
        return self.mode.cross_entropy(logits, targets, vocab_size, label_smoothing)

    # ---- the mean over the global batch ----------------------------------------
    def global_mean_tensor(self, local_sum: torch.Tensor, count: int) -> torch.Tensor:
        """The mean over the whole global batch of a per-row quantity, from
        each rank's sum over its rows, as a 0-dim float64 tensor on the
        device (no host sync): summed over the `batch` group, where each row
        lives on `loss_replicas` ranks of its grid."""
        total = local_sum.detach().double().reshape(1).clone()
        comm.all_reduce(total, self.mesh.groups["batch"])
        return total[0] / (self.mode.loss_replicas * count)

    def global_mean(self, local_sum: torch.Tensor, count: int) -> float:
        return self.global_mean_tensor(local_sum, count).item()

    # ---- gradients ---------------------------------------------------------------
    def attach(self, model_parts: list[nn.Module], micro_batches: int) -> list[nn.Parameter]:
        """A training step's gradient reductions installed: the data-parallel
        buckets (DataParallel.attach) and the mode's sums during the
        backward; returns the optimizer's parameters."""
        params = self.dp.attach(model_parts, micro_batches)
        self.mode.attach_grads(model_parts, micro_batches)
        return params

    def finish_grads(self, model_parts: list[nn.Module]) -> list[nn.Parameter]:
        """The one gradient finalisation, after a step's backwards (the
        training step's and a custom loop's alike), as Megatron's
        `finalize_model_grads`: the data-parallel reduction (the buckets'
        wait, or one all-reduce without them), then the sum of a tied
        weight's stage copies, then the grid's replica sums (the mode).
        Each parameter's record (ShardSpec) says over which group each
        piece is summed. Returns the optimizer's parameters (under ZeRO
        this replica's chunks)."""
        params = self.dp.finish_grads(model_parts)
        # After the replicas' reductions have finished (both are sums, so
        # their order is free; overlapping them is not). The model's own
        # parameters: under ZeRO 1 a chunk's gradient is a view of them.
        sum_stage_copies(model_parts)
        self.mode.sync_grads(params)
        return params

    def sync_grads(self, model: nn.Module) -> None:
        """Every gradient of `model` summed once over the ranks that hold
        its other parts (a custom loop's call after its backward):
        `finish_grads`."""
        self.finish_grads([model])

    def grad_norm(self, params: nn.Module | Iterable[nn.Parameter]) -> torch.Tensor:
        """The L2 norm of the whole model's gradient, as one process would
        compute it, from `params` (a model, or the optimizer's parameters:
        under ZeRO each replica's chunks): each element counted once however
        many ranks hold it (ShardSpec.norm_parts: whole tensors, or the rows
        this rank owns of a tensor with row replicas; the first stage's copy
        of a tied weight), summed over the `grad_norm` group (the grid and
        the stages, and the replicas under ZeRO). Per-tensor norms in one
        foreach call (no copy of any gradient), each accumulated in float64
        (_norms), their squares summed in float64."""
        grads, rank = [], self.mesh.rank
        for p in _params(params):
            if p.grad is not None:
                spec = spec_of(p)
                grads.extend([p.grad] if spec is None else spec.norm_parts(p.grad, rank))
        if grads:
            total = torch.stack(_norms(grads)).pow(2).sum()
        else:
            total = torch.zeros((), dtype=torch.float64, device=self.mesh.device)
        comm.all_reduce(total, self.mesh.groups["grad_norm"])
        return total.sqrt()

    def clip_grads(self, params: nn.Module | Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
        """`clip_grad_norm_` without a host sync: returns the global norm as
        a 0-dim tensor on the device, and scales the gradients by
        min(1, max_norm / (norm + 1e-6)) on the device (a factor of exactly
        1 leaves them bit for bit, as torch.nn.utils.clip_grad_norm_ does)."""
        params = _params(params)
        grads = [p.grad for p in params if p.grad is not None]
        norm = self.grad_norm(params)
        if max_norm > 0 and grads:
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            _scale_(grads, coef)
        return norm

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> float:
        """Clip to `max_norm` on the true global norm; returns that norm."""
        return self.clip_grads(model, max_norm).item()


def sum_stage_copies(model_parts: list[nn.Module]) -> None:
    """Sum the gradients of the weights several pipeline stages hold (an
    embedding tied to the LM head), each over its stage copies' group."""
    by_group: dict[int, tuple] = {}
    for part in model_parts:
        for p in part.parameters():
            spec = spec_of(p)
            for grad, group in spec.stage_parts(p.grad) if spec is not None and p.grad is not None else ():
                by_group.setdefault(id(group), (group, []))[1].append(grad)
    for group, grads in by_group.values():
        comm.all_reduce_coalesced(grads, group)


def _params(params: nn.Module | Iterable[nn.Parameter]) -> list[nn.Parameter]:
    return list(params.parameters() if isinstance(params, nn.Module) else params)


def _scale_(grads: list[torch.Tensor], coef: torch.Tensor) -> None:
    """grads *= coef (a 0-dim device tensor), grouped by dtype as foreach needs."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for dtype, group in by_dtype.items():
        torch._foreach_mul_(group, coef.to(dtype))


def _norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's L2 norm, accumulated in float64. Why not in the
    tensors' fp32: torch's CPU norm sums a tensor's squares with an error
    that grows with its size (measured on torch 2.13: 2.8e-3 relative for
    25M elements, 1e-5 for 0.5M), so a layout that splits a tensor into
    other pieces would see another norm, and clip by another factor, than
    one process holding it whole (an MoE's experts: 2.5e-5 off mode=none's
    gradient norm at step 1). In float64 each piece's norm is exact to
    ~1e-12, and the sum of their squares is the whole's however split."""
    try:
        return list(torch._foreach_norm(grads, 2, dtype=torch.float64))
    except (AttributeError, TypeError, RuntimeError):  # a torch without foreach norms or their dtype
        return [torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]


def parallelism(layout: Layout, seed: int = 0, device: str | torch.device = "cpu", groups: bool = True,
                rank: int | None = None, pipeline: Optional[PipelineSpec] = None,
                weigh: Callable[[nn.Module], float] = compute_weight, mesh: Optional[Mesh] = None,
                bucket_bytes: Optional[int] = None) -> Parallelism:
    """The parallel machinery of `layout` on this rank, the one factory of
    a Parallelism (groups=False: the process-group-free version, for tools
    that only look at layouts). `pipeline`: the schedule of a layout with
    pp > 1 (default: 1F1B over pp micro-batches); `weigh`: each repeated
    block's (and what runs before and after them) weight when the stages
    are balanced (default: training FLOPs, parameters breaking ties:
    cut.compute_weight). `mesh`: one built before for this layout, whose
    process groups are reused (the test pool's ranks); the mode, pipeline
    and data-parallel objects, which a rewrite and a step fill in, are new.
    `bucket_bytes`: the data-parallel gradient buckets' size (default:
    DataParallel's)."""
    mesh = mesh or build_mesh(layout, rank, device, seed, groups)
    stages = None
    if layout.pp > 1:
        stages = Pipeline(mesh, pipeline or PipelineSpec.plain(layout.pp), weigh)
    dp = DataParallel(mesh, bucket_bytes) if bucket_bytes else None
    return Parallelism(layout.mode_class(mesh), dp, pipeline=stages)
