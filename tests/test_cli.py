"""`tpctl train` as a user runs it: a real subprocess per test.

A bad config must exit 2 with one line on stderr naming the key, the value
and what would be valid, before any run dir exists or any worker starts
(docs/DESIGN.md, section 3).
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from cli_support import tpctl  # noqa: F401  (fixture)

from tpctl.cli import COMMANDS
from tpctl.parallel.registry import mode_classes

# The package's modes, as the registry lists them (a refusal names them all).
MODES = ", ".join(cls.name for cls in mode_classes())

# (overrides, key, value as printed, a fragment of what would be valid)
BAD_CONFIGS = [
    (["mode=4d"], "mode", "'4d'", MODES),
    (["size=0"], "size", "0", "positive"),
    (["mode=2d", "size=3"], "size", "3", "square number"),
    (["mode=2.5d", "depth=2", "size=6"], "size", "6", "depth*q*q; with depth=2: 2, 8, 18"),
    (["model.n_head=3", "mode=1d", "size=2"], "model.n_head", "3", "multiple of 2"),
    # 1d splits heads and hidden alike: the heads are named first.
    (["mode=1d", "size=3"], "model.n_head", "4", "multiple of 3"),
    # 3d splits heads q ways but the hidden dim q*q ways.
    (["mode=3d", "size=8", "model.n_head=2", "model.n_embd=66"], "model.n_embd", "66", "hidden dim 4 ways"),
    # 2d size 4 splits the batch 2 ways, 3d size 8 4 ways.
    (["train.batch_size=5", "mode=2d", "size=4"], "train.batch_size", "5", "multiple of 2"),
    (["train.batch_size=6", "mode=3d", "size=8"], "train.batch_size", "6", "multiple of 4"),
    (["data.path=/nonexistent"], "data.path", "'/nonexistent'", "no such file"),
    (["train.seq_len=65"], "train.seq_len", "65", "model.block_size=64"),
    (["optim.min_lr=0.01"], "optim.min_lr", "0.01", "min_lr <= optim.lr=0.001"),
    (["model.arch=gtp"], "model.arch", "'gtp'", "did you mean 'gpt'"),
    (["trian.steps=5"], "trian.steps", "5", "did you mean 'train'"),
    (["train.stpes=5"], "train.stpes", "5", "valid keys under 'train': steps,"),
    (["+train.foo=1"], "train.foo", "1", "unknown key"),
    (["train.steps=abc"], "train.steps", "'abc'", "expected an integer"),
    (["seq_parallel=maybe"], "seq_parallel", "'maybe'", "expected true or false"),
    (["dp=2", "zero=4"], "zero", "4", "expected 0, 1, 2 or 3"),
    (["pp=0"], "pp", "0", "expected a positive number of pipeline stages"),  # once read as `pp or 1`
    # A pipeline stage keeps its gradients whole across the schedule.
    (["dp=2", "pp=2", "zero=2"], "zero", "2", "expected zero=0 or zero=1"),
    (["model=gpt-huge"], "model", "'gpt-huge'", "available: custom, gpt-small, gpt-tiny, hf, llama-100m, mlp"),
    (["size=2,4"], "size", "'2,4'", "--multirun"),
    (["train.steps"], "override", "'train.steps'", "key=value"),
    # Launcher and run-dir settings, checked before anything starts.
    (["launcher.master_port=99999"], "launcher.master_port", "99999", "expected a TCP port 1..65535"),
    (["launcher.max_restarts=-1"], "launcher.max_restarts", "-1", ">= 0"),
    (["launcher.start_method=fork"], "launcher.start_method", "'fork'", "expected one of auto, forkserver, spawn"),
    (["launcher.monitor_interval_s=0"], "launcher.monitor_interval_s", "0.0", "positive"),
    (["data.path=."], "data.path", "'.'", "a directory without index.json: expected a UTF-8 text file"),
    (["data.cache_dir=/proc/tpctl-cache"], "data.cache_dir", "'/proc/tpctl-cache'", "cannot create a directory in /proc"),
    (["checkpoint.every=-1"], "checkpoint.every", "-1", ">= 0"),
    (["train.resume=/nonexistent"], "train.resume", "'/nonexistent'", "not a valid checkpoint: no such directory"),
    # A sweep with no valid job at all: the first job's reason.
    (["-m", "mode=2d", "size=3,5"], "size", "3", "square number"),
    # A job that does not compose (a misspelt key) stops a sweep.
    (["-m", "mode=1d,2d", "trian.steps=5"], "trian.steps", "5", "did you mean 'train'"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("overrides,key,value,valid", BAD_CONFIGS, ids=[" ".join(c[0]) for c in BAD_CONFIGS])
def test_bad_config_exits_2_with_one_line_before_any_worker(tpctl, overrides, key, value, valid):
    # Were the config accepted, the fake worker would write files to the run dir.
    tpctl.extra_env["TPCTL_WORKER_MODULE"] = "tests.fake_worker"
    run_dir, sweep_dir = tpctl.cwd / "run", tpctl.cwd / "sweep"
    result = tpctl.run(["train", *overrides, f"hydra.run.dir={run_dir}", f"hydra.sweep.dir={sweep_dir}"])

    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert line.startswith("tpctl: error: invalid config: "), line
    assert f" {key}={value}: " in line, line
    assert valid in line, line
    assert not run_dir.exists() and not sweep_dir.exists(), "a run dir was created"
    assert not list(tpctl.cwd.rglob("config.yaml")) and not list(tpctl.cwd.rglob("*.log"))
    assert tpctl.leftover_pids(wait_s=0) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("override,key", [
    ("hydra.run.dir=/proc/tpctl-run", "hydra.run.dir"),
    ("hydra.sweep.dir=/proc/tpctl-sweep", "hydra.sweep.dir"),
])
def test_an_unwritable_run_dir_exits_2_with_one_line(tpctl, override, key):
    tpctl.extra_env["TPCTL_WORKER_MODULE"] = "tests.fake_worker"
    args = ["train"] + (["-m", "dp=1,2"] if "sweep" in key else []) + [override]
    result = tpctl.run(args)
    assert result.returncode == 2, result.stderr
    value = override.split("=", 1)[1]
    assert result.stderr.strip().splitlines() == [
        f"tpctl: error: invalid config: {key}={value!r}: cannot create a directory in /proc (No such file or directory)"]
    assert tpctl.leftover_pids(wait_s=0) == []


@pytest.mark.timeout(60)
def test_cfg_job_prints_composed_config_and_starts_nothing(tpctl):
    result = tpctl.run(["train", "--cfg", "job", "mode=1d", "size=2", "model=mlp", "train.steps=7"])
    assert result.returncode == 0, result.stderr
    assert "mode: 1d" in result.stdout and "steps: 7" in result.stdout and "arch: mlp" in result.stdout
    assert not (tpctl.cwd / "outputs").exists()


@pytest.mark.timeout(60)
def test_help(tpctl):
    top = tpctl.run(["--help"])
    assert top.returncode == 0 and "train" in top.stdout
    hydra_help = tpctl.run(["train", "--help"])
    assert hydra_help.returncode == 0, hydra_help.stderr
    assert "model: custom, gpt-small, gpt-tiny, hf, llama-100m, mlp" in hydra_help.stdout
    assert hydra_help.stdout.startswith("tpctl train: train a model with tensor parallelism")
    unknown = tpctl.run(["trian"])
    assert unknown.returncode == 2 and unknown.stderr.strip().splitlines() == [
        "tpctl: error: unknown command 'trian'; expected one of: " + ", ".join(COMMANDS) + " (see tpctl --help)"
    ]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args,message", [
    (["train", "--foo"], "tpctl: error: tpctl train: unrecognized arguments: --foo (see tpctl train --help)"),
    (["train", "-cp", "elsewhere"], "tpctl: error: --config-path/-cp is not supported; add a config directory with --config-dir/-cd"),
    ([], None),
])
def test_usage_errors_exit_2_with_one_line(tpctl, args, message):
    result = tpctl.run(args)
    assert result.returncode == 2, result.stderr
    if message is not None:
        assert result.stderr.strip().splitlines() == [message]


@pytest.mark.timeout(60)
def test_a_group_file_with_a_bad_key_is_named(tpctl):
    (tpctl.cwd / "extra" / "model").mkdir(parents=True)
    (tpctl.cwd / "extra" / "model" / "mine.yaml").write_text("arch: gpt\nn_embed: 64\n")
    result = tpctl.run(["train", "-cd", str(tpctl.cwd / "extra"), "model=mine"])
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("tpctl: error: invalid config: model.n_embed=64: unknown key; valid keys under 'model': arch, "), lines
    assert "(did you mean 'n_embd'" in lines[0]


@pytest.mark.timeout(120)
def test_multirun_gives_each_job_its_own_run_dir(tpctl):
    tpctl.extra_env["TPCTL_WORKER_MODULE"] = "tests.fake_worker"
    sweep = tpctl.cwd / "sweep"
    result = tpctl.run(["train", "-m", "mode=1d", "size=1,2", "data=synthetic", f"hydra.sweep.dir={sweep}"], timeout=100)
    assert result.returncode == 0, result.stderr
    for job, size in (("0", 1), ("1", 2)):
        config = (sweep / job / "config.yaml").read_text()
        assert f"size: {size}" in config
        assert sorted(p.name for p in (sweep / job).glob("fake_worker_rank*.pid")) == [f"fake_worker_rank{r}.pid" for r in range(size)]
    assert tpctl.leftover_pids() == []


@pytest.mark.timeout(120)
def test_sweep_skips_invalid_combinations_and_writes_a_comparison(tpctl):
    tpctl.extra_env["TPCTL_WORKER_MODULE"] = "tests.fake_worker"
    sweep = tpctl.cwd / "sweep"
    result = tpctl.run(["train", "-m", "mode=1d,2d", "size=2,4", "data=synthetic", f"hydra.sweep.dir={sweep}"], timeout=100)
    assert result.returncode == 0, result.stderr
    skipped = [line for line in result.stderr.splitlines() if line.startswith("tpctl: skipping")]
    assert skipped == ["tpctl: skipping job 2 (mode=2d size=2): invalid config: size=2: mode=2d needs a square number of ranks (1, 4, 9, 16, ...)"]
    assert not (sweep / "2" / "config.yaml").exists()  # no worker started for it
    jobs = json.loads((sweep / "comparison.json").read_text())["jobs"]
    assert [(j["job"], j["status"]) for j in jobs] == [(0, "ok"), (1, "ok"), (2, "skipped"), (3, "ok")]
    # The numbers come from each run's summary.json (the fake worker's: world-dependent).
    assert [j["tokens_per_s"] for j in jobs] == [2000.0, 4000.0, None, 4000.0]
    assert jobs[3]["param_bytes_per_rank"] == 2**20 / 4
    table = (sweep / "comparison.md").read_text()
    assert "Every job: `data=synthetic`" in table
    assert "| 3 | `mode=2d size=4` | fake ×4 | ok | 4.0000 | 0.0e+00 | 4,000 | 4.00 | 0.250 |  |  | 256 |" in table
    assert "- job 2 (`mode=2d size=2`) skipped: invalid config: size=2" in table
    assert tpctl.leftover_pids() == []


@pytest.mark.timeout(120)
@pytest.mark.skipif(importlib.util.find_spec("tpctl.launch.worker") is None or importlib.util.find_spec("tpctl.data.corpora") is None,
                    reason="tpctl.launch.worker / tpctl.data.corpora not written yet")
def test_train_end_to_end_writes_the_run_dir_contract(tpctl):
    run_dir = tpctl.cwd / "run"
    result = tpctl.run(["train", "mode=1d", "size=2", "data=synthetic", "train.steps=4", "train.log_every=2",
                        "train.eval_every=0", "train.progress=false", f"hydra.run.dir={run_dir}"], timeout=100)
    assert result.returncode == 0, result.stderr
    assert "size: 2" in (run_dir / "config.yaml").read_text()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r][-1] == 4
    for key in ("step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_time_s"):
        assert key in records[-1], key
    assert tpctl.leftover_pids() == []
