"""Every script under benchmarks/ starts and finishes on tiny shapes, so
none goes stale unnoticed when the code it drives changes (one did: it
called TrainStep with a signature gone for months). Each runs as its user
runs it, `python benchmarks/<script>.py <arguments>`, in its own process
(a fork of the suite's CLI server, which has imported torch: runpy runs
the script as __main__; cli_support.run_script).
The ones that train through `tpctl train` (a launcher and its workers per
run, several runs each) are marked slow; the rest take seconds."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from cli_support import run_script, scaled

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"

# A tiny run through `tpctl train` (the scripts that start real workers).
TINY_TRAIN = ["--", "model.n_embd=16", "model.n_head=2", "model.n_layer=1", "model.block_size=16", "data=synthetic",
              "data.synthetic_tokens=20000", "train.batch_size=4", "train.seq_len=16"]

# script (a second case of one: "<script> <what>") -> (its arguments on tiny
# shapes, a line its output must hold, slow)
SCRIPTS = {
    "activation_memory.py": (["--model", "gpt-tiny", "--batch", "2", "--seq", "16", "--modes", "none"],
                             "activation memory per rank", False),
    "bf16_band.py": (["--steps", "2", "--modes", "none", "--fp32-modes", "none", *TINY_TRAIN], "max_rel_vs_fp32_none",
                     True),
    "check_accuracy.py": (["--steps", "1", "gpt-tiny-none"], "max_mem_err=", False),
    "checkpoint_cost.py": (["--mode", "none", "--size", "1", "--steps", "2", *TINY_TRAIN], "load time", True),
    # Without colossalai (CI): the install line, exit 0; with it, a 1d row on tiny shapes.
    "colossalai_compare.py": (["--modes", "1d", "--hidden", "16", "--batch", "4", "--seq", "4", "--layers", "1",
                               "--steps", "1", "--rounds", "1"], "colossalai", False),
    "compare_modes.py": (["--steps", "2", "--modes", "none", *TINY_TRAIN], "none", True),
    "cp_memory.py": (["--seq", "64", "--cps", "1", "2", "--impls", "ring"], "saved for backward", False),
    "generate_speed.py": (["--size", "2", "--new", "4", "--layers", "1", "--embd", "128", "--rounds", "1"],
                          "greedy decoding", False),
    "data_order.py": (["--windows", "1000", "--layouts", "none", "--steps", "2"], "1 of 1 layouts read the same tokens", True),
    "gpu_step.py": (["--cpu"], "tpctl / plain", False),  # the CPU's smoke run: tiny shapes, dynamo only
    "hf_all_families.py": (["gpt2"], "OK gpt2", False),
    # Its training pass: one family in mode=none, 1d-2 and 2d-4, on pools of its own.
    "hf_all_families.py --train": (["--train", "gpt2"], "1 of 1 build: 1 exact", True),
    "loss_memory.py": (["64", "256"], "", False),
    "overlap.py": (["--model", "gpt-tiny", "--size", "2", "--modes", "1d", "--steps", "1", "--rounds", "1", "--",
                    "train.batch_size=2", "train.seq_len=8"], "overlapped vs blocking", False),
    "papers_vs_plan.py": ([], "|", False),
    "param_memory.py": (["--vocab-size", "64", "--n-layer", "1", "--n-head", "4", "--n-embd", "16", "--block-size", "16"],
                        "parameter memory per rank", False),
    "plan_accuracy.py": (["--tiny"], "MAPE_step=", False),
    "pipeline.py": (["--tiny", "--stages", "2", "--micro", "2", "--schedules", "1f1b", "interleaved", "--steps", "1",
                     "--seq", "8", "--batch", "4"], "| 2 |", False),
    "prepare_data.py": (["--mb", "0.05", "--vocab", "300"], "tokens each", False),
    "pretrained_memory.py": (["--tiny", "--mode", "1d", "--size", "2"], "peak RSS ratio", False),
    "summa_overlap.py": (["--tokens", "16", "--hidden", "16", "--repeats", "1"], "lock-step", False),
    "reference_curves.py": (["--layouts", "none", "--out", "curves.json"], "none ", True),
    "teardown_stress.py": (["--trainings", "1", "--generations", "1", "--parallel", "1"], "ok", True),
    "zero_fsdp2_prototype.py": (["--model", "gpt-tiny", "--steps", "2"], "tpctl zero=3: loss vs none", False),
    "zero_memory.py": (["--model", "gpt-tiny", "--modes", "none", "--dp", "2", "--zero", "3", "--seq", "16", "--steps", "1"],
                       "ZeRO per rank", False),
}


def test_every_script_has_its_tiny_arguments():
    """A new script is added to the table (and so started here)."""
    assert sorted(p.name for p in BENCHMARKS.glob("*.py")) == sorted({name.split()[0] for name in SCRIPTS})


@pytest.mark.timeout(900)  # on a loaded machine; seconds on an idle one
@pytest.mark.parametrize("script", [pytest.param(name, marks=[pytest.mark.slow] if slow else [])
                                    for name, (_, _, slow) in SCRIPTS.items()])
def test_script_runs_on_tiny_shapes(script, tmp_path):
    args, expected, _ = SCRIPTS[script]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    # Its own session (forked from the suite's CLI server where it can:
    # cli_support.run_script): a script that runs over is ended with the
    # ranks it spawned, none left behind.
    try:
        done = run_script(BENCHMARKS / script.split()[0], args, tmp_path, env, scaled(840))
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{script} ran over 840 s:\n{((e.stdout or '') + (e.stderr or ''))[-3000:]}")
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{script} exited {done.returncode}:\n{output[-3000:]}"
    assert expected in output, f"{script}: no {expected!r} in its output:\n{output[-3000:]}"
