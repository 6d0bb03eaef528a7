"""Memory before launch (tpctl/cost/memory_check.py): `tpctl train
--check` prints each rank's predicted peak beside its memory and starts
nothing; `tpctl train` refuses a run that will not fit, in one line, exit 2,
before any run dir or worker exists."""

from __future__ import annotations

import pytest

from cli_support import tpctl  # noqa: F401  (fixture)

TINY = ["model.n_layer=2", "train.steps=2", "data=synthetic"]


def _composed(*overrides):
    from tpctl.config import compose_jobs, validate

    cfg = compose_jobs(list(overrides))[0]
    validate(cfg)
    return cfg


def test_check_prints_the_table_and_starts_nothing(tpctl):
    proc = tpctl.run(["train", "--check", "mode=1d", "size=2", *TINY, "hydra.run.dir=run"])
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    assert out[0].startswith("tpctl: memory check: 1d size=2 (2 ranks)")
    header = next(line for line in out if line.startswith("ranks"))
    for column in ("params", "grads", "optimizer", "activations", "temporary", "other", "peak", "has"):
        assert column in header
    row = out[out.index(header) + 1].split()
    assert row[0] == "0-1" and row[-1] == "fits"
    assert out[-1].startswith("memory per rank: ") and "this machine's RAM" in out[-1]
    assert proc.stderr == ""
    assert not (tpctl.cwd / "run").exists()  # no run dir: nothing was started
    assert tpctl.leftover_pids(wait_s=0) == []


def test_check_has_one_row_per_pipeline_stage(tpctl):
    proc = tpctl.run(["train", "--check", "pp=2", "dp=2", "model.n_layer=2", "train.batch_size=8", "data=synthetic",
                      "train.memory_limit_gib=64", "hydra.run.dir=run"])
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if "(stage" in line]
    # dp outermost, then pp: stage 0 holds ranks 0 and 2
    assert [(r[0], r[2]) for r in rows] == [("0,2", "0)"), ("1,3", "1)")]
    assert proc.stdout.splitlines()[-1] == "memory per rank: 65,536.0 MiB, train.memory_limit_gib=64.0"


@pytest.mark.parametrize("command", [["train", "--check"], ["train"]])
def test_a_run_that_will_not_fit_is_refused_in_one_line(tpctl, command):
    proc = tpctl.run([*command, "mode=1d", "size=2", *TINY, "train.memory_limit_gib=0.01", "hydra.run.dir=run"])
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    assert line.startswith("tpctl: error: invalid config: memory='") and "1d size=2: rank 0 is predicted to peak at" in line
    assert "more than the 0.01 GiB per rank of train.memory_limit_gib=0.01; to fit, " in line
    assert "process" in line.split("to fit, ")[1]  # a tiny model: the process itself is the peak
    assert not (tpctl.cwd / "run").exists()  # refused before the run dir, so before any worker
    assert tpctl.leftover_pids(wait_s=0) == []
    if "--check" in command:
        assert "OVER" in proc.stdout  # the table is printed beside the refusal


@pytest.mark.parametrize("value", ["-1", "0"])
def test_bad_memory_limit_exits_2(tpctl, value):
    proc = tpctl.run(["train", "--check", *TINY, f"train.memory_limit_gib={value}"])
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("tpctl: error: invalid config: train.memory_limit_gib=")
    assert "expected a positive number of GiB per rank" in proc.stderr


def test_prediction_is_layout_autos_for_the_same_choice():
    """The check and layout=auto predict one peak for one choice."""
    from tpctl.cost.memory_check import predict
    from tpctl.cost.auto import search
    from tpctl.cost.hardware import load_hardware

    cfg = _composed("mode=1d", "size=2", "train.grad_accum=2", "model.n_layer=2", "data=synthetic")
    found = predict(cfg)
    [stage] = found.stages
    assert stage.ranks == [0, 1] and stage.peak == sum(stage.parts.values())
    auto = search(cfg, 2, load_hardware("cpu"))
    same = next(c for c in auto.ranked + auto.unfit if c.choice.name == "1d-2 accum=2")
    assert stage.parts == same.parts and stage.peak == same.peak_bytes


def test_the_knob_named_is_the_part_that_dominates():
    from tpctl.cost.memory_check import knobs
    from tpctl.parallel.layout import Layout

    cfg = _composed("mode=1d", "size=2", "dp=2", "data=synthetic", "model.n_layer=2")
    layout = Layout.from_config(cfg)
    parts = dict(params=4, grads=4, optimizer=8, activations=1, temporary=0, comm_buffer=0, zero_gathered=0, process=0)
    assert knobs(layout, parts, cfg).startswith("raise size (now 2), pp (now 1) or use zero=1 (dp=2 replicas share the state)")
    parts.update(activations=100)
    assert knobs(layout, parts, cfg).startswith("lower train.batch_size (now 16) or raise train.grad_accum (now 1), "
                                                "or set train.activation_checkpointing=true")
    parts.update(process=1000)
    assert knobs(layout, parts, cfg).startswith("run fewer ranks on this machine")


def test_memory_per_rank_sources(monkeypatch):
    from tpctl.cost import memory_check
    from tpctl.parallel.layout import Layout

    cfg = _composed("mode=1d", "size=2", "data=synthetic", "model.n_layer=2")
    layout = Layout.from_config(cfg)
    monkeypatch.setattr(memory_check, "_mem_total", lambda: 8 * 2**30)
    assert memory_check.memory_per_rank(cfg, layout) == (4 * 2**30, "this machine's RAM (8.0 GiB) / 2 rank(s)")
    cfg.hardware = "h100"
    assert memory_check.memory_per_rank(cfg, layout) == (80e9, "hardware=h100")
    cfg.train.memory_limit_gib = 2.5
    assert memory_check.memory_per_rank(cfg, layout) == (2.5 * 2**30, "train.memory_limit_gib=2.5")
    cfg.train.memory_limit_gib, cfg.hardware, cfg.launcher.name = None, None, "slurm"
    limit, why = memory_check.memory_per_rank(cfg, layout)
    assert limit is None and why.startswith("launcher=slurm")


def test_the_prediction_is_within_5_percent_of_a_real_runs_peak(tpctl):
    """--check's predicted peak beside the largest rank's peak resident set
    (summary.json, VmHWM) of a real run of the same config, its workers
    forked as any run's: within 5% (benchmarks/check_accuracy.py does this
    for every recipe). The process's floor is the cpu profile's
    train_base_bytes, measured on this machine by `tpctl plan --calibrate`."""
    import json

    overrides = ["mode=1d", "size=2", "model.n_layer=2", "train.steps=2", "train.batch_size=16", "train.seq_len=128", "model.block_size=128",
                 "train.eval_every=0", "checkpoint.every=0", "checkpoint.at_end=false", "train.progress=false",
                 "train.sample_every=0", "hydra.run.dir=run"]
    check = tpctl.run(["train", "--check", *overrides])
    assert check.returncode == 0, check.stderr
    row = next(line.split() for line in check.stdout.splitlines() if line.startswith("0-1"))
    predicted = float(row[-3].replace(",", "")) * 2**20
    proc = tpctl.run(["train", *overrides], timeout=180)
    assert proc.returncode == 0, proc.stderr
    measured = json.loads((tpctl.cwd / "run" / "summary.json").read_text())["peak_rss_bytes_max_rank"]
    assert abs(predicted / measured - 1) < 0.05, (predicted / 2**20, measured / 2**20)
