"""One optimizer step, cut where a pipeline schedule takes over.

    forward_backward(micro_batches) -> loss_sum     what a schedule replaces
    finish(loss_sum, step)          -> numbers      gradient sync, clip, the
                                                    non-finite policy, lr, optimizer

The trainer, `tpctl bench` (cost/measure.py) and the planner's test call
this one step. It holds `model_parts` (one part: the whole model, or with
pp > 1 this rank's pipeline stage, whose chunks are views of it) and works
against `Parallelism`, so it is the same for every layout; what runs the
micro-batches is a component with one interface: with pp > 1 the
pipeline's schedule (parallel/pipeline/schedule.py), else `Accumulate`. It
builds the optimizer itself, over what the data-parallel component hands
it: the parameters, or under ZeRO this replica's chunks of them
(parallel/data_parallel/zero.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch

from tpctl.errors import TpctlError, warning
from tpctl.parallel.parallelism import Parallelism
from tpctl.parallel.roles.plan import logits_of
from tpctl.parallel.roles.probes import CacheOff
from tpctl.parallel.shard import spec_of


@dataclass
class Schedule:
    """The learning rate of each step: linear warm-up, then cosine decay to min_lr."""

    lr: float
    min_lr: float
    warmup_steps: int
    total_steps: int

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (self.lr - self.min_lr)


def fused_update(setting, params: list[torch.nn.Parameter]) -> bool:
    """optim.fused: whether AdamW updates in torch's one fused kernel per
    device rather than its multi-tensor (foreach) passes. auto: on a GPU,
    where the update of a 1B model is several full passes over 16 GB of
    weights and state otherwise. The result differs from the foreach update
    by fp32 round-off only, and every layout on a device makes the same choice."""
    setting = str(setting).lower()
    if setting == "auto":
        return bool(params) and all(p.device.type == "cuda" for p in params)
    return setting == "true"


def build_optimizer(params: Iterable[torch.nn.Parameter], optim) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (embeddings, linears), as in
    GPT-2. Decided from the *full* shape, so a shard decays like its whole."""
    params = list(params)
    decay, no_decay = [], []
    for p in params:
        spec = spec_of(p)
        ndim = len(spec.full_shape) if spec is not None else p.dim()
        (decay if ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": optim.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    fused = fused_update(getattr(optim, "fused", "auto"), params)
    return torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps,
                             **({"fused": True} if fused else {}))


def autocast(device: torch.device, precision: str):
    """The autocast context of `precision` ("fp32": disabled)."""
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def set_tf32(enabled: bool, device: torch.device, precision: str = "fp32") -> Optional[str]:
    """train.tf32 for this process's fp32 matmuls on a GPU (a CPU is left
    alone: there "high" precision may mean bf16 passes); returns the start-up
    line that names the key, where fp32 runs on a GPU that has TF32 (None: nothing to say)."""
    if device.type != "cuda":
        return None
    mode = "tf32" if enabled else "ieee"
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):  # torch >= 2.9: mixing old and new flags raises
        torch.backends.cuda.matmul.fp32_precision = mode
        torch.backends.cudnn.conv.fp32_precision = mode
    else:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    if torch.cuda.get_device_capability(device) < (8, 0):  # TF32 tensor cores came with Ampere
        return None
    import warnings

    # Inductor's own advice names a torch call; ours (below) names the key.
    warnings.filterwarnings("ignore", message="TensorFloat32 tensor cores")
    name = torch.cuda.get_device_name(device)
    if enabled:
        return f"tpctl: train.tf32=true: fp32 matmuls on {name} run in TensorFloat32 (faster, not exact)"
    if precision != "fp32":
        return None
    return (f"tpctl: precision=fp32 on {name}: matmuls in exact fp32; train.tf32=true runs them in "
            "TensorFloat32 (faster, not exact), precision=bf16 faster still")


class NonFiniteLoss(TpctlError, RuntimeError):
    """The loss or the gradient norm of a step is NaN or infinite
    (train.on_nonfinite=stop); the message names the step."""


class NonFinitePolicy:
    """train.on_nonfinite. `skip` must know before the update, so it reads
    the step's two numbers every step (one host sync per step, the price of
    choosing it). `stop` records the first bad step on the device and is
    told when the numbers are next fetched (a logged step, or before a
    checkpoint is written), so no checkpoint after the bad step is ever
    written and the run ends naming that step."""

    def __init__(self, setting: str, say_warning: bool):
        self.skip = setting == "skip"
        self.say_warning = say_warning
        self.skipped_steps = 0
        # stop: (the first bad step, 0 while none was; its loss; its norm), on the device.
        self.first_bad: Optional[torch.Tensor] = None

    def allows_update(self, step: int, loss: torch.Tensor, norm: torch.Tensor) -> bool:
        """Whether the optimizer may step (both numbers are global: every
        rank decides alike)."""
        finite = torch.isfinite(loss) & torch.isfinite(norm)
        if self.skip:
            if bool(finite):
                return True
            self.skipped_steps += 1
            if self.say_warning:
                warning(f"step {step + 1}: the loss is {float(loss)} and the gradient norm {float(norm)}; "
                      "the update is skipped (train.on_nonfinite=skip)")
            return False
        here = torch.stack([torch.full((), step + 1, dtype=torch.float64, device=loss.device), loss.double(), norm.double()])
        if self.first_bad is None:
            self.first_bad = torch.zeros(3, dtype=torch.float64, device=loss.device)
        keep = self.first_bad[0] > 0
        self.first_bad = torch.where(keep | finite, self.first_bad, here)
        return True

    def check(self, fetched: list[float]) -> None:
        """With `first_bad`'s fetched values: raise NonFiniteLoss naming the
        first bad step, if there was one."""
        bad_step, bad_loss, bad_norm = fetched
        if bad_step > 0:
            raise NonFiniteLoss(f"step {int(bad_step)}: the loss is {bad_loss} and the gradient norm {bad_norm} "
                                f"(train.on_nonfinite=stop; the checkpoints written before step {int(bad_step)} are kept)")


class Accumulate:
    """A step's micro-batches one after another through the whole model,
    their gradients accumulated: what runs a step without a pipeline (the
    same calls as parallel.pipeline.Pipeline's)."""

    def __init__(self, model_parts: list[torch.nn.Module], mesh, micro_batches: int):
        (self.model,) = model_parts
        self.mesh, self.micro_batches = mesh, micro_batches

    def stream_shape(self, rows: int, seq: int, mode) -> tuple[int, ...]:
        """Nothing crosses between stages."""
        return ()

    def forward_backward(self, micro_batches: list, criterion: Callable, tokens: int, stream: tuple,
                         autocast: Callable, step: Optional[int] = None) -> torch.Tensor:
        if step is not None:  # the dropout masks are keyed by it (Mesh.reseed_dropout)
            self.mesh.draw_step = step
        total = None
        for micro, (x, y) in enumerate(micro_batches):
            self.mesh.draw_micro = micro
            with autocast():
                loss_sum = criterion(logits_of(self.model(x)), y)
            # (The backward outside autocast, as torch recommends: it follows the forward's dtypes.)
            (loss_sum / tokens).backward()
            total = loss_sum.detach() if total is None else total + loss_sum.detach()
        return total

    def loss_sums(self, micro_batches: list, criterion: Callable, stream: tuple, autocast: Callable) -> torch.Tensor:
        total = torch.zeros((), device=self.mesh.device)
        for x, y in micro_batches:
            with autocast():
                loss_sum = criterion(logits_of(self.model(x)), y)
            total = total + loss_sum
        return total


class TrainStep:
    def __init__(self, par: Parallelism, model_parts: list[torch.nn.Module], cfg, schedule: Optional[Schedule] = None,
                 vocab_size: Optional[int] = None):
        self.par, self.model_parts, self.cfg = par, model_parts, cfg
        # The real vocabulary (the LM head's width before any padding; the
        # rewrite's Rewrite.vocab_size): the loss masks the padding above it.
        self.vocab_size = vocab_size or cfg.model.vocab_size
        # What runs a step's micro-batches: the pipeline's schedule through
        # the stages, or one after another through the whole model.
        self.runner = par.pipeline or Accumulate(model_parts, par.mesh, cfg.train.grad_accum)
        # Micro-batches a step's batch is cut into: the pipeline's, or train.grad_accum.
        self.micro_count = self.runner.micro_batches
        # From here on the replicas' gradients are reduced in buckets during
        # each backward; the optimizer steps what this replica owns.
        self.optimizer = build_optimizer(par.attach(model_parts, self.micro_count), cfg.optim)
        self.schedule = schedule or (lambda step: cfg.optim.lr)
        self.device = par.mesh.device
        self.tokens_per_step = cfg.train.batch_size * cfg.train.seq_len
        self.nonfinite = NonFinitePolicy(cfg.train.get("on_nonfinite", "stop"), say_warning=par.mesh.rank == 0)
        rows = len(par.rows(cfg.train.batch_size, self.micro_count))
        self.stream = self.runner.stream_shape(rows, cfg.train.seq_len // par.layout.cp, par.mode)
        # Training forwards never build a key/value cache, whatever the config says.
        self.cache_off = CacheOff(torch.nn.ModuleList(model_parts))

    @property
    def model(self) -> torch.nn.Module:
        """The whole model (one part: no pipeline)."""
        (model,) = self.model_parts
        return model

    def autocast(self):
        """The autocast context of the run's precision."""
        return autocast(self.device, self.cfg.precision)

    def loss_sum(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The summed loss of this rank's rows of one micro-batch.

        precision=bf16: the forward runs under autocast (matmuls in bf16)
        while parameters, their gradients and the optimizer state stay fp32;
        norms and the cross entropy compute in fp32. The backward runs
        outside autocast, as torch recommends: it follows the forward's dtypes."""
        with autocast(self.device, self.cfg.precision), self.cache_off:
            return self.criterion(logits_of(self.model(x)), y)

    def criterion(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The summed cross entropy of this rank's rows of one micro-batch."""
        return self.par.cross_entropy(logits, y, self.vocab_size, self.cfg.train.label_smoothing).sum()

    def eval_loss_sum(self, micro_batches) -> torch.Tensor:
        """Forward only: the summed loss of this rank's rows of a batch."""
        with self.cache_off:
            return self.runner.loss_sums(list(micro_batches), self.criterion, self.stream, self.autocast)

    def forward_backward(self, micro_batches, step: Optional[int] = None) -> torch.Tensor:
        """Forward and backward of every micro-batch; the summed loss of this
        rank's rows (detached, on the device). Each micro-batch's *sum* is
        divided by the global batch's token count, so the accumulated
        gradients are those of the global mean, whatever the split. With
        pp > 1 the pipeline's schedule runs them (the same division), and
        every stage returns the last stage's sum. `step` keys the dropout
        masks (None: as the mesh last drew)."""
        with self.cache_off:
            return self.runner.forward_backward(list(micro_batches), self.criterion, self.tokens_per_step,
                                                self.stream, self.autocast, step)

    def finish(self, loss_sum: torch.Tensor, step: int) -> dict:
        """Sync, clip, the non-finite policy, the learning rate and the
        optimizer: the loss and the gradient norm come back as 0-dim device
        tensors (nothing here waits for the device, unless `skip` must)."""
        params = self.par.finish_grads(self.model_parts)
        norm = self.par.clip_grads(params, self.cfg.optim.grad_clip)
        lr = self.schedule(step)
        loss = self.par.global_mean_tensor(loss_sum, self.tokens_per_step)
        if not self.nonfinite.allows_update(step, loss, norm):
            return {"loss": float(loss), "lr": lr, "grad_norm": float(norm), "skipped": True}
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.par.dp.after_step()
        return {"loss": loss, "lr": lr, "grad_norm": norm}

    def __call__(self, micro_batches, step: int) -> dict:
        for part in self.model_parts:
            part.train()
        self.par.dp.zero_grad(self.optimizer)
        return self.finish(self.forward_backward(micro_batches, step), step)

    def memory(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank holds."""
        return self.par.dp.memory(self.model_parts, self.optimizer)
