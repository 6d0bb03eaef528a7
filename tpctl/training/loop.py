"""The training loop: forward, parallel loss, backward, gradient sync, clip,
step, log. Written against `ParallelMode`, so it is the same for every mode."""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from . import checkpoint
from tpctl.parallel import comm
from .data import TokenData
from tpctl.parallel.roles import logits_of
from tpctl.parallel.base import ParallelMode
from tpctl.parallel.shard import spec_of

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


def peak_rss_bytes() -> int:
    """This process's peak resident set. VmHWM on Linux: ru_maxrss is
    inherited from the parent that started the process (the launcher), so a
    light worker would report its parent's peak."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


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
        from .compile import compile_model, compile_setting

        self.compiled = compile_model(model, compile_setting(cfg), mode.mesh.device.type,
                                      say=lambda line: print(line, flush=True) if mode.mesh.rank == 0 else None)
        o = cfg.optim
        self.schedule = Schedule(o.lr, o.min_lr, o.warmup_steps, cfg.train.steps)
        self.tokens_per_step = cfg.train.batch_size * cfg.train.seq_len
        # The real vocabulary (the LM head's width before any padding): the
        # loss's, and the bound every id read must be inside.
        self.vocab_size = getattr(model, "tpctl_vocab_size", None) or cfg.model.vocab_size
        self.is_logger = self.mesh.rank == 0
        # Where training starts (a resumed run: the checkpoint's step).
        self.start_step = 0
        self.first_loss = float("nan")
        # Steps whose update was skipped for a non-finite loss (train.on_nonfinite=skip).
        self.skipped_steps = 0
        # train.on_nonfinite=stop: (the first step whose loss or gradient
        # norm was not finite, 0 while none was; its loss; its norm), kept on
        # the device and read with the logged numbers.
        self._first_nonfinite: Optional[torch.Tensor] = None
        c = cfg.checkpoint
        self.checkpointer = (checkpoint.Checkpointer(run_dir / checkpoint.CHECKPOINTS, c.every, c.keep, c.at_end)
                             if run_dir is not None else None)

    # ---- checkpoints -------------------------------------------------------
    def resume(self, path: Path, manifest: dict) -> None:
        """Continue from checkpoint `path`: weights, AdamW state, generators;
        the LR schedule and the data follow from the step."""
        self.start_step, self.first_loss = checkpoint.load(path, self.model, self.optimizer, self.mesh,
                                                           manifest, self.cfg.seed)

    def save_checkpoint(self, step: int) -> Path:
        return checkpoint.save(self.checkpointer.root, step, self.model, self.optimizer, self.mesh, self.cfg,
                               self.first_loss, self.checkpointer.keep)

    # ---- one global batch ------------------------------------------------
    def _micro_batches(self, split: str, step: int):
        t = self.cfg.train
        for micro in range(t.grad_accum):
            x, y = self.data.batch(split, step, self.mode.read_rows(t.batch_size, t.grad_accum, micro), self.vocab_size)
            yield (self.mode.split_input(x).to(self.mesh.device),
                   self.mode.split_target(y).to(self.mesh.device))

    def _loss_sum(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # precision=bf16: the forward runs under autocast (matmuls in bf16)
        # while parameters, their gradients and the optimizer state stay
        # fp32; norms and the cross entropy compute in fp32. The backward
        # runs outside autocast, as torch recommends: it follows the
        # forward's dtypes.
        with autocast(self.mesh.device, self.cfg.precision):
            logits = logits_of(self.model(x))
            return self.mode.cross_entropy(logits, y, self.vocab_size, self.cfg.train.label_smoothing).sum()


    def train_step(self, step: int) -> dict:
        """One optimizer step. The loss and the gradient norm come back as
        0-dim device tensors: nothing here waits for the device (the loop
        fetches them, with any other number it logs, in one transfer).

        A non-finite loss or gradient norm (train.on_nonfinite): `skip` must
        know before the update, so it fetches the two numbers every step (one
        host sync per step, the price of choosing it). `stop` records the
        first bad step on the device and is told at the next fetch (a logged
        step, or before a checkpoint is written), so no checkpoint after the
        bad step is ever written and the run ends naming that step."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        local_sum = None
        for x, y in self._micro_batches("train", step):
            loss_sum = self._loss_sum(x, y)
            # Dividing by the global token count makes the summed gradients
            # the gradient of the global mean, whatever the split.
            (loss_sum / self.tokens_per_step).backward()
            local_sum = loss_sum.detach() if local_sum is None else local_sum + loss_sum.detach()
        self.mode.sync_grads(self.model)
        norm = self.mode.clip_grads(self.model, self.cfg.optim.grad_clip)
        lr = self.schedule(step)
        loss = self.mode.global_mean_tensor(local_sum, self.tokens_per_step)
        # Both are global (all-reduced): every rank sees the same values.
        finite = torch.isfinite(loss) & torch.isfinite(norm)
        if self.cfg.train.on_nonfinite == "skip":
            if not bool(finite):
                self.skipped_steps += 1
                loss_value, norm_value = float(loss), float(norm)
                if self.is_logger:
                    print(f"tpctl: warning: step {step + 1}: the loss is {loss_value} and the gradient norm {norm_value}; "
                          "the update is skipped (train.on_nonfinite=skip)", file=sys.stderr, flush=True)
                return {"loss": loss_value, "lr": lr, "grad_norm": norm_value, "skipped": True}
        else:
            here = torch.stack([torch.full((), step + 1, dtype=torch.float64, device=loss.device), loss.double(), norm.double()])
            if self._first_nonfinite is None:
                self._first_nonfinite = torch.zeros(3, dtype=torch.float64, device=loss.device)
            keep = self._first_nonfinite[0] > 0
            self._first_nonfinite = torch.where(keep | finite, self._first_nonfinite, here)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        return {"loss": loss, "lr": lr, "grad_norm": norm}

    @torch.no_grad()
    def evaluate(self) -> torch.Tensor:
        """The validation loss, a 0-dim device tensor (see train_step)."""
        self.model.eval()
        local_sum = torch.zeros((), device=self.mesh.device)
        for k in range(self.cfg.train.eval_batches):
            for x, y in self._micro_batches("val", k):
                local_sum += self._loss_sum(x, y)
        return self.mode.global_mean_tensor(local_sum, self.tokens_per_step * self.cfg.train.eval_batches)

    def _fetch(self, out: dict) -> dict:
        """`out` with its device tensors (and a step-1 loss not yet fetched)
        made Python floats: one host sync for all of them."""
        keys = [k for k, v in out.items() if isinstance(v, torch.Tensor)]
        tensors = [out[k].double().reshape(1) for k in keys]
        if isinstance(self.first_loss, torch.Tensor):
            tensors.append(self.first_loss.double().reshape(1))
        if self._first_nonfinite is not None:
            tensors.append(self._first_nonfinite)
        values = torch.cat(tensors).tolist() if tensors else []
        if self._first_nonfinite is not None:
            bad_step, bad_loss, bad_norm = values[-3:]
            del values[-3:]
            if bad_step > 0:
                raise NonFiniteLoss(f"step {int(bad_step)}: the loss is {bad_loss} and the gradient norm {bad_norm} "
                                    f"(train.on_nonfinite=stop; the checkpoints written before step {int(bad_step)} are kept)")
        if isinstance(self.first_loss, torch.Tensor):
            self.first_loss = values.pop()
        return {**out, **dict(zip(keys, values))}

    def sample(self) -> str:
        """train.sample_every: a short greedy continuation of
        train.sample_prompt; every rank takes part in the forwards."""
        from .generation import Tokenizer, sample

        if getattr(self, "_tokenizer", None) is None:
            self._tokenizer = Tokenizer(self.cfg.data.tokenizer)
        t = self.cfg.train
        with autocast(self.mesh.device, self.cfg.precision):
            return sample(self.model, self.mode, self._tokenizer, t.sample_prompt, t.sample_tokens)

    # ---- the loop ----------------------------------------------------------
    def fit(self) -> list[dict]:
        t = self.cfg.train
        records: list[dict] = []
        metrics_file = None
        if self.is_logger and self.run_dir:
            path = self.run_dir / "metrics.jsonl"
            if self.start_step > 0:  # each step once: drop what the resumed steps will log again
                checkpoint.truncate_metrics(path, self.start_step)
            metrics_file = open(path, "a" if self.start_step > 0 else "w")
        tensorboard = _tensorboard_writer(self.run_dir) if (self.is_logger and self.run_dir and self.cfg.logger == "tensorboard") else None
        progress = _Progress(t.steps, enabled=self.is_logger and t.progress)
        # Bytes this rank hands to collectives during training steps (eval
        # excluded), and what a ring algorithm would send for them, for
        # comparing modes against their cost model.
        self.comm_train_bytes = self.comm_train_wire_bytes = 0
        start = last_time = time.perf_counter()
        last_step = self.start_step
        shown_loss = float("nan")  # the progress bar's loss: the last one fetched
        try:
            with progress:
                for step in range(self.start_step, t.steps):
                    before = comm.STATS.total_bytes(), comm.STATS.total_wire_bytes()
                    out = self.train_step(step)
                    self.comm_train_bytes += comm.STATS.total_bytes() - before[0]
                    self.comm_train_wire_bytes += comm.STATS.total_wire_bytes() - before[1]
                    if step == 0:
                        self.first_loss = out["loss"]  # a tensor until the first logged step fetches it
                    done = step + 1
                    logged = done % t.log_every == 0 or done == t.steps
                    evaluated = t.eval_every > 0 and (done % t.eval_every == 0 or done == t.steps)
                    if evaluated:
                        out["val_loss"] = self.evaluate()
                    sampled = t.sample_every > 0 and done % t.sample_every == 0
                    if sampled:
                        out["sample"] = self.sample()
                    if logged or evaluated or sampled:
                        out = self._fetch(out)  # the step's one host sync
                        shown_loss = out["loss"]
                    progress.update(done, shown_loss, self.tokens_per_step * done / (time.perf_counter() - start))
                    if logged or evaluated or sampled:
                        now = time.perf_counter()
                        steps = done - last_step
                        record = {"step": done, **out, "tokens": done * self.tokens_per_step,
                                  "tokens_per_s": steps * self.tokens_per_step / (now - last_time),
                                  "step_time_s": (now - last_time) / steps}
                        last_time, last_step = now, done
                        records.append(record)
                        line = json.dumps(json_safe(record), allow_nan=False)
                        log.info(line)
                        if metrics_file:
                            metrics_file.write(line + "\n")
                            metrics_file.flush()
                        if tensorboard:
                            for key, value in record.items():
                                if key != "step" and not isinstance(value, str):
                                    tensorboard.add_scalar(key, value, done)
                        if not progress.live:
                            progress.plain(record)
                    if self.checkpointer and self.checkpointer.due(done, t.steps):
                        self._fetch({})  # a checkpoint records the first loss, and is never written after a bad step
                        self.save_checkpoint(done)
                    _test_kill_hook(self.mesh.rank, done)
        finally:
            if metrics_file:
                metrics_file.close()
            if tensorboard:
                tensorboard.close()
        self.elapsed_s = time.perf_counter() - start
        return records

    def summary(self, records: list[dict]) -> dict:
        last = records[-1]
        steps_run = last["step"] - self.start_step
        rss = peak_rss_bytes()
        out = {
            "mode": self.mesh.mode, "size": self.mesh.tp_size, "dp": self.mesh.dp_size,
            "steps": last["step"], "first_loss": self.first_loss, "final_loss": last["loss"],
            "val_loss": next((r["val_loss"] for r in reversed(records) if "val_loss" in r), None),
            "tokens_per_s": steps_run * self.tokens_per_step / self.elapsed_s,
            "time_s": self.elapsed_s, "param_bytes": param_bytes(self.model),
            "comm_bytes_per_step": self.comm_train_bytes / steps_run,
            "comm_wire_bytes_per_step": self.comm_train_wire_bytes / steps_run,
            "peak_rss_bytes": rss,
            "skipped_steps": self.skipped_steps or None,  # (None: not shown)
        }
        if self.mesh.device.type == "cuda":
            out["peak_cuda_bytes"] = torch.cuda.max_memory_allocated()
        out.update(_max_over_ranks(out, ("param_bytes", "peak_rss_bytes", "peak_cuda_bytes")))
        return out


class NonFiniteLoss(RuntimeError):
    """The loss or the gradient norm of a step is NaN or infinite
    (train.on_nonfinite=stop); the message names the step."""


def json_safe(record: dict) -> dict:
    """The record with NaN and infinities as null: JSON has no such numbers
    (json.dumps would write NaN/Infinity, which JSON parsers refuse)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}


# Test hook: TPCTL_TEST_KILL_AT="<rank>:<step>" makes that rank SIGKILL itself
# after that step, in the first attempt only (a restart must run on).
KILL_ENV = "TPCTL_TEST_KILL_AT"


def _test_kill_hook(rank: int, done: int) -> None:
    spec = os.environ.get(KILL_ENV)
    if spec and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        kill_rank, kill_step = map(int, spec.split(":"))
        if (rank, done) == (kill_rank, kill_step):
            os.kill(os.getpid(), signal.SIGKILL)


def _max_over_ranks(values: dict, keys: tuple[str, ...]) -> dict:
    """{key_max_rank: the largest value of any rank}: ranks hold different
    shards (a padded vocabulary block, replicated norms), and memory per rank
    is what has to fit. Every rank must call this (one all-reduce)."""
    import torch.distributed as dist

    keys = tuple(k for k in keys if k in values)
    if not dist.is_initialized():
        return {f"{k}_max_rank": values[k] for k in keys}
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    local = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    return {f"{k}_max_rank": int(v) for k, v in zip(keys, local.tolist())}


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
            if "sample" in record:
                print(f"sample: {record['sample']!r}", flush=True)
