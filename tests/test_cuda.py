"""CUDA: run with `pytest -m cuda` on a machine with a GPU (skipped without
one; CI has none). Every rank of a test shares the machine's GPU(s) over
gloo (launcher.backend=gloo), so one GPU runs every mode:

  * every mode on CUDA reproduces mode=none on CUDA (fp32), and bf16 stays
    in the suite's bf16 band;
  * torch.compile (inductor) equals eager on CUDA;
  * a checkpoint saved and resumed through `tpctl train device=cuda`
    continues the uninterrupted curve (the CUDA generators included);
  * `tpctl bench device=cuda` runs, with its plain row and MFU column;
  * NCCL with more ranks than GPUs keeps its one-line exit 2.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from cli_support import tpctl  # noqa: F401 (fixture)
from conftest import build_trainer, layouts, tiny_config

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pytest -m cuda on a GPU machine)")]

MESHES = layouts("none-dp8", "1d-2-dp4", "1d-4-sp-dp2", "2d-4-dp2", "2.5d-8-d2", "3d-8")
STEPS = 4
TOL = 1e-5  # fp32 modes against none (the suite's band)
BF16_MODE_TOL = 1e-3  # bf16 modes against bf16 none (tests/test_train_features.py)


def _cfg(**overrides):
    return tiny_config(STEPS, **{"model.n_embd": 32, "device": "cuda", **overrides})


def _train_cuda(key: str, **overrides) -> list[float]:
    import torch.distributed as dist


    gpu = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
    torch.cuda.set_device(gpu)
    torch._dynamo.reset()
    trainer = build_trainer(_cfg(**MESHES[key].to_dict(), **overrides), pooled=False, device=gpu)
    model = trainer.model
    assert all(p.is_cuda for p in model.parameters())
    return [r["loss"] for r in trainer.fit()]


def _rel(a, b) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def reference(pool):
    return {p: pool.run(_train_cuda, "none-dp8", precision=p)[0] for p in ("fp32", "bf16")}


@pytest.mark.parametrize("key", [k for k in MESHES if k != "none-dp8"])
def test_every_mode_on_cuda_matches_none(pool, reference, key):
    for losses in pool.run(_train_cuda, key):
        assert _rel(losses, reference["fp32"]) <= TOL, (losses, reference["fp32"])


@pytest.mark.parametrize("key", ["1d-4-sp-dp2", "3d-8"])
def test_bf16_on_cuda(pool, reference, key):
    for losses in pool.run(_train_cuda, key, precision="bf16"):
        assert _rel(losses, reference["bf16"]) <= BF16_MODE_TOL, (losses, reference["bf16"])


@pytest.mark.parametrize("key", ["none-dp8", "2d-4-dp2"])
def test_compile_on_cuda_equals_eager(pool, reference, key):
    eager = reference["fp32"] if key == "none-dp8" else pool.run(_train_cuda, key)[0]
    for losses in pool.run(_train_cuda, key, **{"train.compile": "true"}):
        assert _rel(losses, eager) <= TOL, (losses, eager)


TINY = ["model=gpt-tiny", "model.n_layer=1", "data=synthetic", "data.synthetic_tokens=20000", "train.batch_size=8",
        "train.seq_len=16", "train.log_every=1", "train.eval_every=0", "train.progress=false", "seed=0",
        "model.dropout=0.1", "device=cuda", "launcher.backend=gloo",
        "optim.warmup_steps=0", "optim.min_lr=0.001"]  # a constant LR: the schedule does not depend on train.steps


def _losses(run_dir) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(600)
def test_checkpoint_saved_and_resumed_on_cuda(tpctl):
    """Dropout on: the resumed curve needs the CUDA generators restored."""
    whole, first = tpctl.cwd / "whole", tpctl.cwd / "first"
    base = ["train", *TINY, "mode=1d", "size=2", "checkpoint.keep=0"]
    full = tpctl.run([*base, "train.steps=6", "checkpoint.every=0", f"hydra.run.dir={whole}"], timeout=300)
    assert full.returncode == 0, full.stderr
    assert "not for speed" in full.stderr  # the one line saying ranks share the GPU
    part = tpctl.run([*base, "train.steps=3", "checkpoint.every=3", f"hydra.run.dir={first}"], timeout=300)
    assert part.returncode == 0, part.stderr
    resumed = tpctl.run([*base, "train.steps=6", "checkpoint.every=0", f"hydra.run.dir={first}", "train.resume=auto"],
                        timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert _losses(first) == pytest.approx(_losses(whole), rel=1e-6)


@pytest.mark.timeout(600)
def test_bench_on_cuda(tpctl):
    result = tpctl.run(["bench", "device=cuda", "hardware=h100", "size=2", "modes=[none,plain,1d]", "steps=2",
                        "rounds=1", "warmup=1", "model.n_layer=1"], timeout=500)
    assert result.returncode == 0, result.stderr
    assert "MFU (h100)" in result.stdout and "x plain" in result.stdout


def test_nccl_with_more_ranks_than_gpus_exits_2(tpctl):
    ranks = torch.cuda.device_count() + 1
    result = tpctl.run(["train", "device=cuda", "launcher.backend=nccl", "mode=1d", f"size={ranks}",
                        f"hydra.run.dir={tpctl.cwd / 'run'}"], timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "CUDA devices with NCCL" in lines[0] and "launcher.backend=gloo" in lines[0]
