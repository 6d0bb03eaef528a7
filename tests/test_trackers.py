"""logger=mlflow and logger=wandb (tpctl/training/trackers.py): one real
`tpctl train` logging to both at once, read back with each tracker's own
formats; the refusals of a bad name and of a missing package, one line,
exit 2, before any worker starts."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

from cli_support import tpctl  # noqa: F401  (fixture)

STEPS = 3
TINY = ["mode=1d", "size=2", "model.n_layer=1", f"train.steps={STEPS}", "train.log_every=1", "train.eval_every=0",
        "data=synthetic", "train.progress=false", "checkpoint.at_end=false", "checkpoint.every=0"]


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    """The defaults under test: no tracking server, W&B offline, nothing inherited."""
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_MODE", "WANDB_PROJECT", "WANDB_DIR"):
        monkeypatch.delenv(var, raising=False)


def wandb_records(path: Path):
    """The records of a W&B run file (`run-<id>.wandb`): W&B writes them in
    LevelDB's log format (a 7-byte header, then 32 KiB blocks of records cut
    into fragments, each with a 7-byte header: crc32c, length, type), each
    record a protobuf `Record` of wandb's own. wandb 0.2x+ ships no Python
    reader (its service is Go), so this reads the format as documented."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, pending = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B", "not a W&B run file"
    block = 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's trailer too small for a header: padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        fragment, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:  # zero padding
            continue
        pending = fragment if kind in (1, 2) else pending + fragment  # FULL, FIRST | MIDDLE, LAST
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            yield record


def _items(items) -> dict:
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}


@pytest.mark.slow
def test_one_run_logs_to_jsonl_mlflow_and_wandb(tpctl, tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    run_dir = tmp_path / "run"
    proc = tpctl.run(["train", "logger=[jsonl,mlflow,wandb]", *TINY, f"hydra.run.dir={run_dir}"], timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert tpctl.leftover_pids() == []  # W&B's service process ends with the run
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]  # metrics.jsonl is written whatever else is
    summary = json.loads((run_dir / "summary.json").read_text())
    ids = json.loads((run_dir / "trackers.json").read_text())

    # MLflow: the file store in the run dir, read through MLflow's client.
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    run = client.get_run(ids["mlflow"])
    assert run.info.status == "FINISHED" and run.info.run_name == "1d-2"
    assert run.data.params["mode"] == "1d" and run.data.params["train.steps"] == str(STEPS)
    assert run.data.params["model.n_layer"] == "1"
    history = client.get_metric_history(ids["mlflow"], "loss")
    assert [h.step for h in history] == [1, 2, 3]
    assert [h.value for h in history] == pytest.approx([m["loss"] for m in metrics])
    assert len(client.get_metric_history(ids["mlflow"], "grad_norm")) == STEPS
    assert run.data.metrics["summary/final_loss"] == pytest.approx(summary["final_loss"])
    assert run.data.metrics["summary/peak_rss_bytes_max_rank"] == summary["peak_rss_bytes_max_rank"]
    assert run.data.tags["summary/mode"] == "1d"
    assert {a.path for a in client.list_artifacts(ids["mlflow"])} >= {"config.yaml", "summary.json"}

    # W&B: the offline run in the run dir, its records read back.
    [run_file] = (run_dir / "wandb").glob(f"offline-run-*-{ids['wandb']}/run-{ids['wandb']}.wandb")
    records = list(wandb_records(run_file))
    kinds = [r.WhichOneof("record_type") for r in records]
    started = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert started.display_name == "1d-2" and started.project == "tpctl"
    config = _items(started.config.update)
    assert config["mode"] == "1d" and config["train"]["steps"] == STEPS
    history = [_items(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]
    assert [h["_step"] for h in history] == [1, 2, 3]
    assert [h["loss"] for h in history] == pytest.approx([m["loss"] for m in metrics])
    summaries = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summaries.update(_items(r.summary.update))
    assert summaries["summary/final_loss"] == pytest.approx(summary["final_loss"])
    assert kinds[-1] == "exit" and records[-1].exit.exit_code == 0


@pytest.mark.parametrize("setting,message", [
    ("logger=mlflw", "invalid config: logger='mlflw': expected one of jsonl, tensorboard, mlflow, wandb (did you mean 'mlflow'?)"),
    ("logger=[jsonl,wandbb]", "invalid config: logger='wandbb': expected one of jsonl, tensorboard, mlflow, wandb"),
    ("logger=[mlflow,mlflow]", "invalid config: logger='mlflow': named twice"),
    ("logger=[]", "invalid config: logger=[]: expected one of"),
])
def test_bad_logger_exits_2_with_one_line(tpctl, setting, message):
    proc = tpctl.run(["train", setting, "data=synthetic", "hydra.run.dir=run"])
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"tpctl: error: {message}"), proc.stderr
    assert not (tpctl.cwd / "run").exists()  # refused before the run dir, so before any worker


HIDE = """\
import sys
for name in {names!r}:
    sys.modules[name] = None  # `import name` fails; importlib.util.find_spec finds nothing
"""


@pytest.mark.parametrize("logger,package,extra", [("mlflow", "mlflow-skinny", "tracking"), ("wandb", "wandb", "tracking")])
def test_missing_tracker_package_exits_2_naming_the_pip_command(tpctl, tmp_path, logger, package, extra):
    """The package hidden from the launcher by a sitecustomize on PYTHONPATH."""
    shim = tmp_path / "hide"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(HIDE.format(names=[logger]))
    tpctl.extra_env["PYTHONPATH"] = str(shim)
    proc = tpctl.run(["train", f"logger=[jsonl,{logger}]", "data=synthetic", "hydra.run.dir=run"])
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == [f"tpctl: error: invalid config: logger='{logger}': needs the {package} package (import {logger}): "
                     f"pip install 'tpctl[{extra}]' (or pip install {package}), or leave {logger} out of logger"]
    assert not (tpctl.cwd / "run").exists()


def test_logger_as_a_string_or_a_list_validates(monkeypatch):
    """In-process: `logger=jsonl` (the string form) and lists pass; the check
    is the package's presence, faked absent here."""
    from tpctl.config import compose_jobs, validate
    from tpctl.errors import ConfigError

    for setting in ("logger=jsonl", "logger=[jsonl]", "logger=[jsonl,tensorboard]"):
        if "tensorboard" in setting:
            pytest.importorskip("tensorboard")
        validate(compose_jobs([setting, "data=synthetic"])[0], model_check=False)
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(ConfigError, match=r"logger='mlflow': needs the mlflow-skinny package"):
        validate(compose_jobs(["logger=mlflow", "data=synthetic"])[0], model_check=False)


def test_importing_tpctl_imports_no_tracker():
    """Tracker packages are imported on rank 0 of a run that asks for them, never by `import tpctl`."""
    import subprocess

    code = "import sys, tpctl, tpctl.cli, tpctl.training.metrics, tpctl.config; print(sorted({'mlflow', 'wandb'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_resumed_run_continues_its_mlflow_run_and_a_failed_one_is_marked(tmp_path, monkeypatch):
    """In-process (Trackers as rank 0 uses them): a resumed run logs into
    the same MLflow run; a fresh run in the same dir starts a new one; a
    run that ends without its summary is FAILED."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient
    from omegaconf import OmegaConf

    from tpctl.config import compose_jobs
    from tpctl.training.trackers import Trackers

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # (what trackers.py sets for its own store)
    OmegaConf.save(compose_jobs(["mode=1d", "size=2", "dp=2", "data=synthetic"])[0], tmp_path / "config.yaml")
    record = {"lr": 1e-3, "grad_norm": 0.5, "sample": "text is left out", "data_hash": "ab12"}
    first = Trackers(tmp_path, ["jsonl", "mlflow"])
    for step in (1, 2):
        first.log({"step": step, "loss": 3.0 - step, **record})
    first.finish(None)  # as at exit after a crash: no summary
    run_id = first_id = json.loads((tmp_path / "trackers.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    assert client.get_run(run_id).info.status == "FAILED" and client.get_run(run_id).info.run_name == "1d-2-dp2"
    resumed = Trackers(tmp_path, ["mlflow"], resumed=True)
    resumed.log({"step": 3, "loss": 0.5, **record})
    resumed.finish({"final_loss": 0.5, "mode": "1d", "auto": {"predicted_ms": 2.0}, "val_loss": None})
    assert json.loads((tmp_path / "trackers.json").read_text())["mlflow"] == first_id
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [1, 2, 3]
    assert "sample" not in run.data.metrics and "data_hash" not in run.data.metrics
    assert run.data.metrics["summary/auto.predicted_ms"] == 2.0 and run.data.tags["summary/mode"] == "1d"
    fresh = Trackers(tmp_path, ["mlflow"])
    fresh.finish({"final_loss": 0.1})
    assert json.loads((tmp_path / "trackers.json").read_text())["mlflow"] != first_id
