"""Whole runs through `tpctl train`: every mode's loss curve must equal
mode=none's at every step (same init, same global batches, fp32 round-off).

Runs are cached per session and shared by the tests; a run pays its
start-up per rank on 2 cores, so there are few of them and they are tiny
(gpt-tiny, 20 steps): tensor and data parallel together (1d dp=2, 4
workers). Every other layout (2d with dp=2, 1d with sequence parallelism
among them) runs through the same command in `tpctl check-recipes` (CI's
second step: gpt-tiny in every mode equal to none within 1e-7), and in
every layout of the test pools (test_models, test_mesh_and_training).
"""

from __future__ import annotations

import os

import pytest

from cli_support import scaled
from tpctl.commands.run_dir import layout_overrides, read_metrics, train_subprocess

pytestmark = pytest.mark.slow

COMMON = ["model=gpt-tiny", "optim.eps=1e-5", "train.steps=20", "train.log_every=1", "train.eval_every=0", "seed=0"]
RUNS = {name: layout_overrides(name) for name in ("none", "1d-2-dp2")}
# Its workers start as fresh interpreters (CUDA's way), none's fork from a
# warm server (CPU's default): the two start methods train alike.
RUNS["1d-2-dp2"].append("launcher.start_method=spawn")
REL_TOL = 1e-4


@pytest.fixture(scope="session")
def run_curve(tmp_path_factory):
    cache: dict[str, list[dict]] = {}

    def run(name: str) -> list[dict]:
        if name not in cache:
            run_dir = tmp_path_factory.mktemp("e2e") / name
            env = dict(os.environ, OMP_NUM_THREADS="1")
            proc = train_subprocess([*RUNS[name], *COMMON], run_dir, timeout=scaled(400), env=env)
            assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            cache[name] = read_metrics(run_dir)
        return cache[name]

    return run


@pytest.mark.parametrize("name", [n for n in RUNS if n != "none"])
def test_loss_curve_matches_single_process(run_curve, name):
    reference, curve = run_curve("none"), run_curve(name)
    assert [r["step"] for r in curve] == list(range(1, 21))
    for ref, got in zip(reference, curve):
        rel = abs(got["loss"] - ref["loss"]) / abs(ref["loss"])
        assert rel <= REL_TOL, f"step {ref['step']}: {name} loss {got['loss']} vs none {ref['loss']} (rel {rel:.2e})"
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-3)
        assert got["lr"] == ref["lr"]
    # The model learns: a run that diverged identically everywhere would
    # still "agree".
    assert curve[-1]["loss"] < curve[0]["loss"] - 0.5


def test_metrics_contract(run_curve):
    record = run_curve("none")[0]
    for key in ("step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_time_s"):
        assert key in record
    assert record["tokens"] == 16 * 64


@pytest.mark.timeout(600)
def test_layout_auto_trains_its_pick_exactly(run_curve, tmp_path):
    """`tpctl train layout=auto world=4`: the pick made before any worker,
    said at start-up, trained equal to mode=none, and its prediction beside
    the measurement in summary.json."""
    import json

    run_dir = tmp_path / "auto"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = train_subprocess(["layout=auto", "world=4", *COMMON], run_dir, timeout=scaled(400), env=env)
    assert proc.returncode == 0, f"layout=auto failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    picked = json.loads((run_dir / "summary.json").read_text())["auto"]
    assert f"layout=auto picked {picked['layout']}" in proc.stdout
    assert picked["predicted_ms"] > 0 and picked["measured_ms"] > 0
    assert 0 < picked["predicted_peak_bytes"] and 0 < picked["measured_peak_bytes"]
    for ref, got in zip(run_curve("none"), read_metrics(run_dir), strict=True):
        assert abs(got["loss"] - ref["loss"]) <= REL_TOL * abs(ref["loss"]), (picked["layout"], ref["step"])
