"""Experiment trackers beside metrics.jsonl (`logger=mlflow`, `logger=wandb`,
several at once: `logger=[jsonl,mlflow,wandb]`), written by rank 0 only.

What each tracker gets: the resolved config (the run dir's config.yaml,
flattened to dotted keys), every logged step's numbers, and the run's
summary.json under `summary/`. The run is named by its layout
(`Layout.name`: `1d-2-dp2`). Both work offline by default, their files in
the run dir: MLflow a file store in `<run dir>/mlruns` (or
MLFLOW_TRACKING_URI where set), W&B mode offline in `<run dir>/wandb` (or
WANDB_MODE where set). Their ids are kept in `<run dir>/trackers.json`, so
a resumed run (train.resume, a restart) continues the same tracker runs.

The packages are imported only here, and only on rank 0 of a run that asks
for them: `import tpctl` never pays for them. The launcher checks they are
installed (`missing_package`, called by config.validate) before any worker
starts.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

LOGGERS = ("jsonl", "tensorboard", "mlflow", "wandb")
# logger -> (module imported, package installed, the extra of tpctl that installs it)
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard", "tensorboard"),
            "mlflow": ("mlflow", "mlflow-skinny", "tracking"),
            "wandb": ("wandb", "wandb", "tracking")}
IDS_FILE = "trackers.json"
PROJECT = "tpctl"  # MLflow's experiment and W&B's project, unless their environment names one
# MLflow's file store (its offline default) refuses to open since MLflow 3.x
# unless asked for explicitly: tpctl asks, for the store it places itself.
ALLOW_FILE_STORE = "MLFLOW_ALLOW_FILE_STORE"
PARAMS_PER_BATCH = 100  # MLflow's log_batch takes at most 100 params per call


def loggers_of(setting: Any) -> list[str]:
    """The `logger` key as a list of names: `jsonl`, `mlflow`, `[jsonl,mlflow]`."""
    if isinstance(setting, str):
        return [setting]
    try:
        return [str(item) for item in setting]
    except TypeError:
        return [str(setting)]


def missing_package(logger: str) -> Optional[str]:
    """What to install for `logger` when its package is not importable (None: nothing)."""
    if logger not in PACKAGES:
        return None
    module, package, extra = PACKAGES[logger]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules, a broken parent
        found = False
    if found:
        return None
    also = f" (or pip install {package})"
    if logger == "tensorboard":  # the wording tests/test_report.py holds
        return f"needs the tensorboard package: pip install 'tpctl[{extra}]'{also}, or use logger=jsonl"
    return (f"needs the {package} package (import {module}): pip install 'tpctl[{extra}]'{also}, "
            f"or leave {logger} out of logger")


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted.key: leaf} of a nested dict (lists are leaves)."""
    out: dict[str, Any] = {}
    if isinstance(tree, dict):
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def numbers(record: dict) -> dict[str, float]:
    """The numeric entries of a record (strings -- a sample, a mode -- and nulls left out)."""
    return {k: float(v) for k, v in record.items() if isinstance(v, (int, float))}  # (a bool: 0 or 1)


class _Mlflow:
    """One MLflow run through the tracking client (no global active run)."""

    def __init__(self, run_dir: Path, config: dict, name: str, run_id: Optional[str]):
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or (run_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):
            os.environ.setdefault(ALLOW_FILE_STORE, "true")
        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        if run_id is not None:  # a resumed run: the same MLflow run, running again
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")
            return
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        run = self.client.create_run(experiment_id, run_name=name, tags={"tpctl.run_dir": str(run_dir)})
        self.run_id = run.info.run_id
        from mlflow.entities import Param

        # MLflow keeps a param's value as text of at most 6000 characters.
        params = [Param(k, str(v)[:6000]) for k, v in flatten(config).items()]
        for i in range(0, len(params), PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + PARAMS_PER_BATCH])
        config_file = run_dir / "config.yaml"
        if config_file.exists():
            self.client.log_artifact(self.run_id, str(config_file))

    @property
    def id(self) -> str:
        return self.run_id

    def log(self, record: dict) -> None:
        from mlflow.entities import Metric

        stamp, step = int(time.time() * 1000), int(record["step"])
        metrics = [Metric(k, v, stamp, step) for k, v in numbers(record).items() if k != "step"]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def summary(self, summary: dict, run_dir: Path) -> None:
        from mlflow.entities import Metric

        flat = flatten(summary)
        stamp = int(time.time() * 1000)
        metrics = [Metric(f"summary/{k}", v, stamp, 0) for k, v in numbers(flat).items()]
        self.client.log_batch(self.run_id, metrics=metrics)
        for key, value in flat.items():
            if isinstance(value, str):
                self.client.set_tag(self.run_id, f"summary/{key}", value[:5000])
        if (run_dir / "summary.json").exists():
            self.client.log_artifact(self.run_id, str(run_dir / "summary.json"))

    def finish(self, ok: bool) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if ok else "FAILED")


class _Wandb:
    """One W&B run; offline unless WANDB_MODE says otherwise."""

    def __init__(self, run_dir: Path, config: dict, name: str, run_id: Optional[str]):
        import wandb

        settings = wandb.Settings(console="off", silent=True, disable_git=True, x_disable_stats=True)
        self.run = wandb.init(dir=str(run_dir), mode=os.environ.get("WANDB_MODE") or "offline",
                              project=os.environ.get("WANDB_PROJECT") or PROJECT, name=name, config=config,
                              id=run_id, resume="allow" if run_id else None, settings=settings, reinit="create_new")

    @property
    def id(self) -> str:
        return self.run.id

    def log(self, record: dict) -> None:
        values = {k: v for k, v in numbers(record).items() if k != "step"}
        self.run.log(values, step=int(record["step"]))

    def summary(self, summary: dict, run_dir: Path) -> None:
        self.run.summary.update({f"summary/{k}": v for k, v in flatten(summary).items() if v is not None})

    def finish(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)


TRACKERS = {"mlflow": _Mlflow, "wandb": _Wandb}


class Trackers:
    """The trackers of one run on rank 0, from the first logged step to the
    summary (`finish`); a run that ends otherwise marks them failed at exit."""

    def __init__(self, run_dir: Path, names: list[str], resumed: bool = False):
        self.run_dir = run_dir
        self.open: dict[str, Any] = {}
        names = [n for n in names if n in TRACKERS]
        if not names:
            return
        config = _read_config(run_dir)
        name = _run_name(config)
        # A resumed run (train.resume, a restart) continues its tracker runs;
        # a fresh run in a used run dir starts new ones, as metrics.jsonl does.
        ids = _read_ids(run_dir) if resumed else {}
        for tracker in names:
            self.open[tracker] = TRACKERS[tracker](run_dir, config, name, ids.get(tracker))
        _write_ids(run_dir, {**ids, **{k: t.id for k, t in self.open.items()}})
        atexit.register(self.finish, None)  # not reached by a SIGKILL: the tracker shows the run as running

    def log(self, record: dict) -> None:
        for tracker in self.open.values():
            tracker.log(record)

    def finish(self, summary: Optional[dict]) -> None:
        """The summary logged and each run ended (summary None: ended as failed); once."""
        opened, self.open = self.open, {}
        for name, tracker in opened.items():
            try:
                if summary is not None:
                    tracker.summary(summary, self.run_dir)
                tracker.finish(summary is not None)
            except Exception as e:  # a tracker must never fail a run that trained
                print(f"tpctl: warning: logger={name}: could not finish its run: {e}", file=sys.stderr, flush=True)


# The trackers of this process's run (rank 0), held from the metrics log to
# the summary: the loop ends its metrics log before the summary is made.
_ACTIVE: list[Trackers] = []


def start(run_dir: Path, names: list[str], resumed: bool = False) -> Trackers:
    trackers = Trackers(run_dir, names, resumed)
    _ACTIVE.append(trackers)
    return trackers


def finish(summary: dict) -> None:
    """After summary.json (launch/worker.py, rank 0): log it and end the runs."""
    while _ACTIVE:
        _ACTIVE.pop().finish({k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                              for k, v in summary.items()})


def _read_config(run_dir: Path) -> dict:
    from omegaconf import OmegaConf

    path = run_dir / "config.yaml"
    return OmegaConf.to_container(OmegaConf.load(path), resolve=True) if path.exists() else {}


def _run_name(config: dict) -> str:
    from omegaconf import OmegaConf

    from tpctl.parallel.layout import Layout

    try:
        return Layout.from_config(OmegaConf.create(config)).name
    except Exception:  # a config without layout keys (tests' hand-made runs)
        return "tpctl"


def _read_ids(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / IDS_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _write_ids(run_dir: Path, ids: dict) -> None:
    from tpctl.atomic import write_file

    write_file(run_dir / IDS_FILE, [(json.dumps(ids, indent=1) + "\n").encode()])
