"""`tpctl report` and `logger=tensorboard`; the config checks of the
training-feature keys (precision, logger)."""

from __future__ import annotations

import json
import sys

import pytest
import yaml

from cli_support import tpctl  # noqa: F401  (fixture)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _fake_run(path, config: dict, losses: list[float], summary: bool = True, val_at=None):
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    with open(path / "metrics.jsonl", "w") as f:
        for step, loss in enumerate(losses, 1):
            record = {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 1.0, "tokens": 1024 * step,
                      "tokens_per_s": 1000.0 + step, "step_time_s": 1.0}
            if step == val_at:
                record["val_loss"] = loss + 0.1
            f.write(json.dumps(record) + "\n")
    if summary:
        (path / "summary.json").write_text(json.dumps({"comm_bytes_per_step": 3 * 2**20}))
    return path


def test_report_writes_pngs_labelled_by_mode(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from tpctl.commands import report

    a = _fake_run(tmp_path / "a", {"mode": "2d", "size": 4, "dp": 1, "precision": "bf16"}, [3.0, 2.5, 2.0], val_at=3)
    b = _fake_run(tmp_path / "b", {"mode": "2.5d", "size": 8, "depth": 2, "dp": 2, "zero": 2,
                                   "train": {"activation_checkpointing": True}}, [3.0, 2.7], summary=False)
    out = tmp_path / "plots"
    assert report.main([str(a), str(b), "--out", str(out)]) == 0
    written = capsys.readouterr().out.split()
    assert sorted(written) == sorted(str(out / f"{n}.png") for n in ("loss", "tokens_per_s", "comm_bytes", "report"))
    for path in written:
        assert open(path, "rb").read(8) == PNG_MAGIC
    assert [report.load_run(p).label for p in (a, b)] == ["2d size=4 bf16", "2.5d size=8 depth=2 dp=2 zero=2 ckpt"]


def test_report_same_labels_get_the_run_dir_name(tmp_path):
    from tpctl.commands import report

    runs = [report.load_run(_fake_run(tmp_path / name, {"mode": "1d", "size": 2}, [1.0])) for name in ("x", "y")]
    report._unique_labels(runs)
    assert [r.label for r in runs] == ["1d size=2 (x)", "1d size=2 (y)"]


@pytest.mark.parametrize("make,message", [
    (lambda p: p / "missing", "no such run dir"),
    (lambda p: p, "no metrics.jsonl"),
    (lambda p: ((p / "metrics.jsonl").write_text(""), p)[1], "no logged steps"),
    (lambda p: ((p / "metrics.jsonl").write_text("{oops\n"), p)[1], "metrics.jsonl:1: not JSON"),
])
def test_report_bad_run_dir_exits_2_with_one_line(tmp_path, capsys, make, message):
    from tpctl.commands import report

    assert report.main([str(make(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and err.startswith("tpctl: error: ")


def test_report_without_matplotlib_says_what_to_install(tmp_path, capsys, monkeypatch):
    from tpctl.commands import report

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    assert report.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'tpctl[report]'" in err


def _composed(*overrides):
    from tpctl.config import compose_jobs

    return compose_jobs(list(overrides))[0]


@pytest.mark.parametrize("override,message", [
    ("precision=fp16", "invalid config: precision='fp16': expected one of fp32, bf16"),
    ("logger=visdom", "invalid config: logger='visdom': expected one of jsonl, tensorboard, mlflow, wandb"),
])
def test_bad_precision_or_logger_is_a_config_error(override, message):
    from tpctl.config import validate
    from tpctl.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        validate(_composed(override))
    assert str(e.value).startswith(message)


def test_tensorboard_missing_is_a_config_error(monkeypatch):
    import importlib.util

    from tpctl.config import validate
    from tpctl.errors import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError, match=r"logger='tensorboard': needs the tensorboard package: pip install 'tpctl\[tensorboard\]'"):
        validate(_composed("logger=tensorboard"))


def test_unknown_command_lists_report(tpctl):
    proc = tpctl.run(["reprot"])
    assert proc.returncode == 2 and "expected one of: train, " in proc.stderr and "report" in proc.stderr


@pytest.mark.slow
def test_bf16_checkpointed_run_with_tensorboard_then_report(tpctl, tmp_path):
    """One real run with every feature on: 1d over 2 ranks, bf16,
    activation checkpointing, TensorBoard events; then `tpctl report` on it."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("matplotlib")
    run_dir = tmp_path / "run"
    proc = tpctl.run(["train", "mode=1d", "size=2", "precision=bf16", "train.activation_checkpointing=true",
                      "logger=tensorboard", "model.dropout=0.1", "train.steps=3", "train.log_every=1",
                      "train.eval_every=0", "data=synthetic", f"hydra.run.dir={run_dir}"], timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [e.value for e in events.Scalars("loss")] == pytest.approx([m["loss"] for m in metrics])
    proc = tpctl.run(["report", str(run_dir), "--out", str(tmp_path / "plots")])
    assert proc.returncode == 0, proc.stderr
    assert open(tmp_path / "plots" / "report.png", "rb").read(8) == PNG_MAGIC
