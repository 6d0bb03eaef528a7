"""Where a run's numbers go (rank 0): metrics.jsonl (docs/DESIGN.md,
section 3; always, whatever `logger` adds), TensorBoard events
(logger=tensorboard), MLflow and W&B runs (logger=mlflow, logger=wandb:
trackers.py), the worker's log and the terminal (a rich progress bar, or a
plain line per logged step). `logger` is one name or a list of them."""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path
from typing import Any, Optional

log = logging.getLogger("tpctl.train")


def json_safe(record: dict) -> dict:
    """The record with NaN and infinities as null: JSON has no such numbers
    (json.dumps would write NaN/Infinity, which JSON parsers refuse)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}


def truncate_metrics(path: Path, step: int) -> None:
    """Keep the records of steps <= `step` (a resumed run logs the rest again)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line)
        except ValueError:  # a line cut by a crash
            continue
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)


class MetricsLog:
    """The logged steps of one run on one rank: written on the logging rank
    (`enabled`), and on every rank into its log."""

    def __init__(self, run_dir: Optional[Path], enabled: bool, total_steps: int, start_step: int = 0,
                 logger: Any = "jsonl", progress: bool = True):
        from .trackers import loggers_of

        self.file = None
        self.tensorboard = None
        self.trackers = None
        loggers = loggers_of(logger)
        if enabled and run_dir:
            path = run_dir / "metrics.jsonl"
            if start_step > 0:  # each step once: drop what the resumed steps will log again
                truncate_metrics(path, start_step)
            self.file = open(path, "a" if start_step > 0 else "w")
            # config.validate has checked that each logger's package is installed.
            if "tensorboard" in loggers:
                from torch.utils.tensorboard import SummaryWriter

                self.tensorboard = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
            if {"mlflow", "wandb"} & set(loggers):
                from . import trackers

                # Kept open past this log: the summary is logged to them after
                # the loop (trackers.finish, from launch/worker.py).
                self.trackers = trackers.start(run_dir, loggers, resumed=start_step > 0)
        self.progress = _Progress(total_steps, enabled=enabled and progress)

    def __enter__(self) -> "MetricsLog":
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)
        if self.file:
            self.file.close()
        if self.tensorboard:
            self.tensorboard.close()

    def record(self, record: dict) -> None:
        line = json.dumps(json_safe(record), allow_nan=False)
        log.info(line)
        if self.file:
            self.file.write(line + "\n")
            self.file.flush()
        if self.tensorboard:
            for key, value in record.items():
                if key != "step" and not isinstance(value, str):
                    self.tensorboard.add_scalar(key, value, record["step"])
        if self.trackers:
            self.trackers.log(record)
        if not self.progress.live:
            self.progress.plain(record)


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
