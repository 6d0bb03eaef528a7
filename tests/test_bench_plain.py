"""`tpctl bench`'s plain row (the same model trained by a plain PyTorch
loop) and its MFU arithmetic; the CUDA run itself is in tests/test_cuda.py."""

from __future__ import annotations

import pytest

from cli_support import scaled


def test_plain_trains_the_same_model_as_none():
    from tpctl.config import compose_jobs
    from tpctl.cost.measure import bench

    cfg = compose_jobs(["model=gpt-tiny", "model.n_layer=1", "train.batch_size=4", "train.seq_len=16"])[0]
    results = bench(cfg, ["none", "plain"], size=2, steps=2, rounds=1, warmup=1, timeout_s=scaled(240))
    none, plain = results["none"], results["plain"]
    assert abs(none["first_loss"] - plain["first_loss"]) < 1e-6
    assert none["param_bytes"] == plain["param_bytes"] and none["optim_bytes"] == plain["optim_bytes"]
    assert plain["comm_bytes"] == 0 and len(plain["times"]) == 2


def test_flops_per_token_and_mfu():
    from types import SimpleNamespace

    from tpctl.config import compose_jobs
    from tpctl.cost.measure import flops_per_token, mfu

    cfg = compose_jobs(["model=gpt-small", "train.seq_len=1024"])[0]
    # gpt-small: 124.4M parameters, 0.79M of them the position table; 12 layers x 768 x 1024.
    expected = 6 * (124_439_808 - 1024 * 768) + 12 * 12 * 768 * 1024
    assert flops_per_token(cfg) == pytest.approx(expected)
    hw = SimpleNamespace(name="made-up", peak_flops=1e15, peak_flops_bf16=4e15, peak_flops_tf32=2e15)
    tokens = cfg.train.batch_size * cfg.train.seq_len
    assert mfu(cfg, hw, 1.0, 2) == pytest.approx(expected * tokens / 2e15)
    cfg.device, cfg.train.tf32 = "cuda", True  # fp32 matmuls in TF32: its peak
    assert mfu(cfg, hw, 1.0, 1) == pytest.approx(expected * tokens / 2e15)
    cfg.precision = "bf16"
    assert mfu(cfg, hw, 1.0, 1) == pytest.approx(expected * tokens / 4e15)


@pytest.mark.slow
def test_bench_cli_shows_the_plain_ratio(tmp_path):
    import subprocess
    import sys

    from cli_support import REPO

    result = subprocess.run([sys.executable, "-m", "tpctl.cli", "bench", "size=2", "modes=[none,plain]", "steps=1",
                             "rounds=1", "warmup=0", "model.n_layer=1", "train.batch_size=4", "train.seq_len=16"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=scaled(240), env={**__import__("os").environ,
                                                                                             "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr
    assert "x plain" in result.stdout and "plain" in result.stdout
