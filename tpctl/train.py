"""The training loop: forward, parallel loss, backward, gradient sync, clip,
step, log. Written against `ParallelMode`, so it is the same for every mode."""

from __future__ import annotations

import json
import logging
import math
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from . import comm
from .data import TokenData
from .parallel.base import ParallelMode
from .parallel.shard import spec_of

log = logging.getLogger("tpctl.train")


@dataclass
class Schedule:
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


def build_optimizer(model: torch.nn.Module, optim) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (embeddings, linears), as in
    GPT-2. Decided from the *full* shape, so a shard decays like its whole."""
    decay, no_decay = [], []
    for p in model.parameters():
        spec = spec_of(p)
        ndim = len(spec.full_shape) if spec is not None else p.dim()
        (decay if ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": optim.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps)


def autocast(device: torch.device, precision: str):
    """The autocast context of `precision` ("fp32": disabled)."""
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def param_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters this rank holds (tied parameters once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


class Trainer:
    def __init__(self, cfg, model: torch.nn.Module, mode: ParallelMode, data: TokenData,
                 run_dir: Optional[Path] = None):
        self.cfg, self.model, self.mode, self.data = cfg, model, mode, data
        self.mesh = mode.mesh
        self.run_dir = run_dir
        if cfg.train.activation_checkpointing:
            from .recompute import apply_activation_checkpointing

            apply_activation_checkpointing(model)
        self.optimizer = build_optimizer(model, cfg.optim)
        o = cfg.optim
        self.schedule = Schedule(o.lr, o.min_lr, o.warmup_steps, cfg.train.steps)
        self.tokens_per_step = cfg.train.batch_size * cfg.train.seq_len
        self.is_logger = self.mesh.rank == 0

    # ---- one global batch ------------------------------------------------
    def _micro_batches(self, split: str, step: int):
        t = self.cfg.train
        for micro in range(t.grad_accum):
            x, y = self.data.batch(split, step, self.mode.read_rows(t.batch_size, t.grad_accum, micro))
            yield (self.mode.split_input(x).to(self.mesh.device),
                   self.mode.split_target(y).to(self.mesh.device))

    def _loss_sum(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # precision=bf16: the forward runs under autocast (matmuls in bf16)
        # while parameters, their gradients and the optimizer state stay
        # fp32; norms and the cross entropy compute in fp32. The backward
        # runs outside autocast, as torch recommends: it follows the
        # forward's dtypes.
        with autocast(self.mesh.device, self.cfg.precision):
            logits = self.model(x)
            return self.mode.cross_entropy(logits, y, self.cfg.model.vocab_size, self.cfg.train.label_smoothing).sum()


    def train_step(self, step: int) -> dict:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        local_sum = torch.zeros((), device=self.mesh.device)
        for x, y in self._micro_batches("train", step):
            loss_sum = self._loss_sum(x, y)
            # Dividing by the global token count makes the summed gradients
            # the gradient of the global mean, whatever the split.
            (loss_sum / self.tokens_per_step).backward()
            local_sum += loss_sum.detach()
        self.mode.sync_grads(self.model)
        norm = self.mode.clip_grad_norm_(self.model, self.cfg.optim.grad_clip)
        lr = self.schedule(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        return {"loss": self.mode.global_mean(local_sum, self.tokens_per_step), "lr": lr, "grad_norm": norm}

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        local_sum = torch.zeros((), device=self.mesh.device)
        for k in range(self.cfg.train.eval_batches):
            for x, y in self._micro_batches("val", k):
                local_sum += self._loss_sum(x, y)
        return self.mode.global_mean(local_sum, self.tokens_per_step * self.cfg.train.eval_batches)

    # ---- the loop ----------------------------------------------------------
    def fit(self) -> list[dict]:
        t = self.cfg.train
        records: list[dict] = []
        metrics_file = open(self.run_dir / "metrics.jsonl", "w") if (self.is_logger and self.run_dir) else None
        tensorboard = _tensorboard_writer(self.run_dir) if (self.is_logger and self.run_dir and self.cfg.logger == "tensorboard") else None
        progress = _Progress(t.steps, enabled=self.is_logger and t.progress)
        # Bytes this rank hands to collectives during training steps (eval
        # excluded), and what a ring algorithm would send for them, for
        # comparing modes against their cost model.
        self.comm_train_bytes = self.comm_train_wire_bytes = 0
        start = last_time = time.perf_counter()
        last_step = 0
        try:
            with progress:
                for step in range(t.steps):
                    before = comm.STATS.total_bytes(), comm.STATS.total_wire_bytes()
                    out = self.train_step(step)
                    self.comm_train_bytes += comm.STATS.total_bytes() - before[0]
                    self.comm_train_wire_bytes += comm.STATS.total_wire_bytes() - before[1]
                    if step == 0:
                        self.first_loss = out["loss"]
                    done = step + 1
                    logged = done % t.log_every == 0 or done == t.steps
                    evaluated = t.eval_every > 0 and (done % t.eval_every == 0 or done == t.steps)
                    if evaluated:
                        out["val_loss"] = self.evaluate()
                    progress.update(done, out["loss"], self.tokens_per_step * done / (time.perf_counter() - start))
                    if logged or evaluated:
                        now = time.perf_counter()
                        steps = done - last_step
                        record = {"step": done, **out, "tokens": done * self.tokens_per_step,
                                  "tokens_per_s": steps * self.tokens_per_step / (now - last_time),
                                  "step_time_s": (now - last_time) / steps}
                        last_time, last_step = now, done
                        records.append(record)
                        log.info(json.dumps(record))
                        if metrics_file:
                            metrics_file.write(json.dumps(record) + "\n")
                            metrics_file.flush()
                        if tensorboard:
                            for key, value in record.items():
                                if key != "step":
                                    tensorboard.add_scalar(key, value, done)
                        if not progress.live:
                            progress.plain(record)
        finally:
            if metrics_file:
                metrics_file.close()
            if tensorboard:
                tensorboard.close()
        self.elapsed_s = time.perf_counter() - start
        return records

    def summary(self, records: list[dict]) -> dict:
        last = records[-1]
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        out = {
            "mode": self.mesh.mode, "size": self.mesh.tp_size, "dp": self.mesh.dp_size,
            "steps": last["step"], "first_loss": self.first_loss, "final_loss": last["loss"],
            "val_loss": next((r["val_loss"] for r in reversed(records) if "val_loss" in r), None),
            "tokens_per_s": last["step"] * self.tokens_per_step / self.elapsed_s,
            "time_s": self.elapsed_s, "param_bytes": param_bytes(self.model),
            "comm_bytes_per_step": self.comm_train_bytes / last["step"],
            "comm_wire_bytes_per_step": self.comm_train_wire_bytes / last["step"],
            "peak_rss_bytes": rss,
        }
        if self.mesh.device.type == "cuda":
            out["peak_cuda_bytes"] = torch.cuda.max_memory_allocated()
        return out


def _tensorboard_writer(run_dir: Path):
    """A TensorBoard writer into <run dir>/tensorboard (logger=tensorboard;
    config.validate has checked that the tensorboard package is installed)."""
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(run_dir / "tensorboard"))


class _Progress:
    """A rich progress bar on an interactive terminal; plain lines otherwise."""

    def __init__(self, total: int, enabled: bool):
        self.enabled = enabled
        self.live = enabled and sys.stdout.isatty()
        self._bar = None
        if self.live:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
            self._bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("loss {task.fields[loss]:.4f}"), TextColumn("{task.fields[tps]:,.0f} tok/s"),
                                 TimeRemainingColumn())
            self._task = self._bar.add_task("train", total=total, loss=float("nan"), tps=0.0)

    def __enter__(self):
        if self._bar:
            self._bar.start()
        return self

    def __exit__(self, *exc):
        if self._bar:
            self._bar.stop()

    def update(self, done: int, loss: float, tps: float) -> None:
        if self._bar:
            self._bar.update(self._task, completed=done, loss=loss, tps=tps)

    def plain(self, record: dict) -> None:
        if self.enabled:
            extra = f"  val {record['val_loss']:.4f}" if "val_loss" in record else ""
            print(f"step {record['step']:>6}  loss {record['loss']:.4f}{extra}  lr {record['lr']:.2e}  "
                  f"grad_norm {record['grad_norm']:.3f}  {record['tokens_per_s']:,.0f} tok/s", flush=True)
