"""What the GPU paths decide, checked on a CPU (no GPU in CI): bench's
hardware profile follows the device and never prints an MFU above 1;
train.tf32 is a boolean, left alone on a CPU. (The loss's CUDA policy:
tests/test_loss.py and test_layers.py; the pipeline's host staging:
test_pipeline.py; on a GPU: test_cuda.py.)"""

from __future__ import annotations

import pytest
import torch

from tpctl.errors import ConfigError


def test_bench_prices_on_the_devices_profile(monkeypatch):
    from tpctl.cost.measure import hardware_for

    assert hardware_for("auto", "cpu") == "cpu" and hardware_for("a100", "cuda") == "a100"
    for name, profile in (("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA A100-SXM4-80GB", "a100")):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0, name=name: name)
        assert hardware_for("auto", "cuda") == profile
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA L4")
    with pytest.raises(ConfigError, match="hardware=.*h100"):
        hardware_for("auto", "cuda")


def test_an_mfu_above_1_is_refused():
    """The issue's case: an H200's step priced on the CPU profile (8815.6)."""
    from omegaconf import OmegaConf

    from tpctl.config import default_config
    from tpctl.cost.measure import ImpossibleMFU, flops_per_token, mfu
    from tpctl.cost.planner import load_hardware

    cfg = default_config()
    OmegaConf.update(cfg, "precision", "bf16")
    tokens = cfg.train.batch_size * cfg.train.seq_len
    h200 = load_hardware("h200")
    assert h200.peak_flops_bf16 == 989e12 and h200.memory_bytes == 141e9
    half = flops_per_token(cfg) * tokens / (0.5 * h200.peak_flops_bf16)  # seconds at MFU 0.5
    assert mfu(cfg, h200, half, 1) == pytest.approx(0.5)
    with pytest.raises(ImpossibleMFU, match="hardware=cpu"):
        mfu(cfg, load_hardware("cpu"), half, 1)


def test_tf32_is_a_boolean_and_a_cpu_is_left_alone():
    from omegaconf import OmegaConf

    from tpctl.config import default_config
    from tpctl.config.validate import validate
    from tpctl.training.step import set_tf32

    cfg = default_config()
    assert cfg.train.tf32 is False
    OmegaConf.update(cfg, "train.tf32", "yes")
    with pytest.raises(ConfigError, match="train.tf32"):
        validate(cfg)
    assert set_tf32(True, torch.device("cpu")) is None
    assert torch.get_float32_matmul_precision() == "highest"


def test_fused_adamw_is_chosen_on_a_gpu_only_and_updates_as_foreach_does():
    """optim.fused=auto picks torch's fused AdamW where the weights are on a
    GPU; the fused update (here forced on the CPU, which torch also fuses)
    equals the unfused one within fp32 round-off over several steps."""
    from omegaconf import OmegaConf

    from tpctl.schema import OptimConfig
    from tpctl.training.step import build_optimizer, fused_update

    cpu = [torch.nn.Parameter(torch.ones(2))]
    assert not fused_update("auto", cpu) and fused_update("true", cpu) and not fused_update(False, cpu)
    meta_cuda = [torch.empty(2, device="meta")]
    assert not fused_update("auto", meta_cuda)  # only CUDA weights make auto fuse

    def run(fused: str) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(16, 8, generator=g)), torch.nn.Parameter(torch.randn(8, generator=g))]
        cfg = OmegaConf.structured(OptimConfig)
        cfg.fused = fused
        opt = build_optimizer(params, cfg)
        assert bool(opt.defaults.get("fused")) == (fused == "true")
        for _ in range(5):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        return [p.detach().clone() for p in params]

    for fused, plain in zip(run("true"), run("false")):
        assert not torch.equal(fused, torch.zeros_like(fused))
        torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-7)


def test_optim_fused_is_refused_unless_auto_true_or_false():
    from omegaconf import OmegaConf

    from tpctl.config import default_config, validate

    cfg = default_config()
    OmegaConf.update(cfg, "optim.fused", "sometimes")
    with pytest.raises(ConfigError, match="optim.fused.*auto, true, false"):
        validate(cfg)
