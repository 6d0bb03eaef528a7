"""The training loop: batches in, one `TrainStep` per step, evaluation,
samples, logging (training/metrics.py) and checkpoints. Written against
`Parallelism`, so it is the same for every layout."""

from __future__ import annotations

import logging
import os
import resource
import signal
import time
from pathlib import Path
from typing import Optional

import torch

from tpctl import checkpoint
from tpctl.data.batches import TokenData
from tpctl.parallel import comm

from .build import Run, build_step
from .metrics import MetricsLog
from .step import NonFiniteLoss, autocast

log = logging.getLogger("tpctl.train")
__all__ = ["Trainer", "NonFiniteLoss", "peak_rss_bytes"]


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
    def __init__(self, run: Run, data: TokenData, run_dir: Optional[Path] = None):
        """The loop over a run build_run assembled, with its step (made here
        alike when build_run was asked for none)."""
        cfg, model, par = run.cfg, run.model, run.par
        self.cfg, self.model, self.par, self.data = cfg, model, par, data
        self.mesh = par.mesh
        self.run_dir = run_dir
        self.step = run.step if run.step is not None else build_step(cfg, par, model, vocab_size=run.vocab_size)
        # The model's parts: one (the whole model) without a pipeline.
        self.model_parts = self.step.model_parts
        self.optimizer = self.step.optimizer
        from .compile import compile_model, compile_setting

        self.compiled = compile_model(model, compile_setting(cfg), self.mesh.device.type,
                                      say=lambda line: print(line, flush=True) if self.mesh.rank == 0 else None,
                                      per_block=par.pipeline is not None,
                                      log_path=run_dir / "logs" / f"compile_rank{self.mesh.rank}.log" if run_dir else None)
        self.tokens_per_step = self.step.tokens_per_step
        # The real vocabulary (the LM head's width before any padding): the
        # bound every id read must be inside.
        self.vocab_size = run.vocab_size
        self.is_logger = self.mesh.rank == 0
        # Where training starts (a resumed run: the checkpoint's step).
        self.start_step = 0
        self.first_loss = float("nan")
        c = cfg.checkpoint
        self.checkpointer = (checkpoint.Checkpointer(run_dir / checkpoint.CHECKPOINTS, c.every, c.keep, c.at_end)
                             if run_dir is not None else None)

    @property
    def skipped_steps(self) -> int:
        """Steps whose update was skipped for a non-finite loss (train.on_nonfinite=skip)."""
        return self.step.nonfinite.skipped_steps

    # ---- checkpoints -------------------------------------------------------
    def resume(self, path: Path, manifest: dict) -> None:
        """Continue from checkpoint `path`: weights, AdamW state, generators;
        the LR schedule and the data follow from the step."""
        self.start_step, self.first_loss = checkpoint.load(path, self.model, self.optimizer, self.par,
                                                           manifest, self.cfg.seed)

    def save_checkpoint(self, step: int) -> Path:
        return checkpoint.save(self.checkpointer.root, step, self.model, self.optimizer, self.par, self.cfg,
                               self.first_loss, self.checkpointer.keep)

    # ---- one global batch ------------------------------------------------
    def _micro_batches(self, split: str, step: int):
        t = self.cfg.train
        micros = self.step.micro_count
        for micro in range(micros):
            x, y = self.data.batch(split, step, self.par.rows(t.batch_size, micros, micro), self.vocab_size)
            yield (self.par.mode.split_input(self.par.cp.split(x)).to(self.mesh.device),
                   self.par.mode.split_target(self.par.cp.split(y)).to(self.mesh.device))

    def train_step(self, step: int) -> dict:
        """One optimizer step (training/step.py); the loss and the gradient
        norm come back as 0-dim device tensors: the loop fetches them, with
        any other number it logs, in one transfer."""
        return self.step(self._micro_batches("train", step), step)

    @torch.no_grad()
    def evaluate(self) -> torch.Tensor:
        """The validation loss, a 0-dim device tensor (see train_step)."""
        self.model.eval()
        local_sum = torch.zeros((), device=self.mesh.device)
        for k in range(self.cfg.train.eval_batches):
            local_sum += self.step.eval_loss_sum(self._micro_batches("val", k))
        return self.par.global_mean_tensor(local_sum, self.tokens_per_step * self.cfg.train.eval_batches)

    def _fetch(self, out: dict) -> dict:
        """`out` with its device tensors (and a step-1 loss not yet fetched)
        made Python floats: one host sync for all of them."""
        keys = [k for k, v in out.items() if isinstance(v, torch.Tensor)]
        tensors = [out[k].double().reshape(1) for k in keys]
        if isinstance(self.first_loss, torch.Tensor):
            tensors.append(self.first_loss.double().reshape(1))
        first_bad = self.step.nonfinite.first_bad
        if first_bad is not None:
            tensors.append(first_bad)
        values = torch.cat(tensors).tolist() if tensors else []
        if first_bad is not None:
            self.step.nonfinite.check(values[-3:])
            del values[-3:]
        if isinstance(self.first_loss, torch.Tensor):
            self.first_loss = values.pop()
        return {**out, **dict(zip(keys, values))}

    def sample(self) -> str:
        """train.sample_every: a short greedy continuation of
        train.sample_prompt; every rank takes part in the forwards."""
        from tpctl.data.tokenizer import Tokenizer

        from .generation import sample

        if getattr(self, "_tokenizer", None) is None:
            self._tokenizer = Tokenizer(self.cfg.data.tokenizer)
        t = self.cfg.train
        with autocast(self.mesh.device, self.cfg.precision):
            return sample(self.model, self.par.mode, self._tokenizer, t.sample_prompt, t.sample_tokens,
                          self.vocab_size)

    # ---- the loop ----------------------------------------------------------
    def fit(self) -> list[dict]:
        t = self.cfg.train
        records: list[dict] = []
        metrics = MetricsLog(self.run_dir, self.is_logger, t.steps, self.start_step, self.cfg.logger, t.progress)
        # Bytes this rank hands to collectives during training steps (eval
        # excluded), and what a ring algorithm would send for them, for
        # comparing modes against their cost model.
        self.comm_train_bytes = self.comm_train_wire_bytes = 0
        start = last_time = time.perf_counter()
        last_step = self.start_step
        shown_loss = float("nan")  # the progress bar's loss: the last one fetched
        with metrics:
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
                metrics.progress.update(done, shown_loss, self.tokens_per_step * done / (time.perf_counter() - start))
                if logged or evaluated or sampled:
                    now = time.perf_counter()
                    steps = done - last_step
                    records.append({"step": done, **out, "tokens": done * self.tokens_per_step,
                                    "tokens_per_s": steps * self.tokens_per_step / (now - last_time),
                                    "step_time_s": (now - last_time) / steps})
                    if self.is_logger:  # this step's whole global batch, read again here: metrics.jsonl is rank 0's
                        records[-1]["data_hash"] = self.data.batch_hash("train", step)
                    last_time, last_step = now, done
                    metrics.record(records[-1])
                if self.checkpointer and self.checkpointer.due(done, t.steps):
                    self._fetch({})  # a checkpoint records the first loss, and is never written after a bad step
                    self.save_checkpoint(done)
                _test_kill_hook(self.mesh.rank, done)
        self.elapsed_s = time.perf_counter() - start
        return records

    def summary(self, records: list[dict]) -> dict:
        last = records[-1]
        steps_run = last["step"] - self.start_step
        rss = peak_rss_bytes()
        out = {
            "mode": self.mesh.mode, "size": self.mesh.tp_size, "dp": self.mesh.dp_size, "pp": 1,
            "zero": self.mesh.layout.zero, "cp": self.mesh.layout.cp,
            "steps": last["step"], "first_loss": self.first_loss, "final_loss": last["loss"],
            "val_loss": next((r["val_loss"] for r in reversed(records) if "val_loss" in r), None),
            "tokens_per_s": steps_run * self.tokens_per_step / self.elapsed_s,
            "time_s": self.elapsed_s,
            # Counted from the tensors this rank holds after the last step
            # (gradients: those kept for the optimizer).
            **self.step.memory(),
            "comm_bytes_per_step": self.comm_train_bytes / steps_run,
            "comm_wire_bytes_per_step": self.comm_train_wire_bytes / steps_run,
            "peak_rss_bytes": rss,
            "skipped_steps": self.skipped_steps or None,  # (None: not shown)
            **self.data.progress(last["step"]),  # data, data_epoch, data_epoch_fraction: how far into the corpus
        }
        if self.mesh.device.type == "cuda":
            out["peak_cuda_bytes"] = torch.cuda.max_memory_allocated()
        pipeline = self.par.pipeline
        if pipeline is not None:
            # Measured: each stage's idle share of its steps' wall time
            # (parallel/pipeline/schedule.py), averaged over the ranks; beside it the
            # plan's (p-1)/(v*m+p-1).
            out.update(pp=pipeline.size, pipeline_schedule=pipeline.spec.schedule,
                       pipeline_microbatches=pipeline.spec.microbatches,
                       pipeline_bubble=_mean_over_ranks(pipeline.bubble() or 0.0, self.mesh.device),
                       pipeline_bubble_planned=pipeline.spec.bubble())
        out.update(_max_over_ranks(out, ("param_bytes", "grad_bytes", "optimizer_bytes", "peak_rss_bytes",
                                         "peak_cuda_bytes")))
        if self.cfg.get("auto"):
            out["auto"] = _auto_record(self.cfg.auto, records, out)
        return out


def _auto_record(predicted, records: list[dict], out: dict) -> dict:
    """layout=auto's prediction beside what this run measured: the median
    step time of the logged windows after the first (which holds the
    warm-up), and the largest peak of any rank (CUDA: allocated; CPU: RSS)."""
    times = sorted(r["step_time_s"] for r in (records[1:] or records))
    peak = out.get("peak_cuda_bytes_max_rank") or out["peak_rss_bytes_max_rank"]
    return {"layout": predicted.layout, "predicted_ms": predicted.predicted_ms,
            "measured_ms": times[len(times) // 2] * 1e3, "predicted_peak_bytes": predicted.predicted_peak_bytes,
            "measured_peak_bytes": peak}


# Test hook: TPCTL_TEST_KILL_AT="<rank>:<step>" makes that rank SIGKILL itself
# after that step, in the first attempt only (a restart must run on).
KILL_ENV = "TPCTL_TEST_KILL_AT"


def _test_kill_hook(rank: int, done: int) -> None:
    spec = os.environ.get(KILL_ENV)
    if spec and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        kill_rank, kill_step = map(int, spec.split(":"))
        if (rank, done) == (kill_rank, kill_step):
            os.kill(os.getpid(), signal.SIGKILL)


def _mean_over_ranks(value: float, device: torch.device) -> float:
    """The mean of `value` over every rank (every rank must call this)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return value
    total = torch.tensor([value], dtype=torch.float64, device=device)
    comm.all_reduce(total, dist.group.WORLD)
    return total.item() / dist.get_world_size()


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
    comm.all_reduce(local, dist.group.WORLD, op=dist.ReduceOp.MAX)
    return {f"{k}_max_rank": int(v) for k, v in zip(keys, local.tolist())}
