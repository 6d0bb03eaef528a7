"""Checkpoints: boxes of a ShardSpec, save in one layout and load in another
(model and AdamW state intact, on one pool of gloo ranks), and whole runs
through `tpctl train`: exact resume, resume in another mode, restart after a
SIGKILL, corrupted checkpoints, export."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tpctl.checkpoint import shard_boxes
from tpctl.parallel.shard import ShardSpec
from tpctl.testing import DistPool

WORLD = 8
# (mode, size, depth, dp) on the 8-rank pool.
LAYOUTS = {"2d": ("2d", 4, 1, 2), "3d": ("3d", 8, 1, 1), "2.5d": ("2.5d", 8, 2, 1), "1d": ("1d", 2, 1, 4),
           "none": ("none", 1, 1, 8)}


def test_boxes_clip_padding_and_split_fused_ranges():
    spec = ShardSpec((10, 6), (((0, 2), (4, 6), (8, 12)), ((3, 6),)))
    boxes = shard_boxes(spec, spec.local_shape())
    # (8, 12) holds rows 8, 9 and two rows of padding: only 8..9 are saved.
    assert [(b.offsets, b.sizes, b.local) for b in boxes] == [
        ((0, 3), (2, 3), (0, 0)), ((4, 3), (2, 3), (2, 0)), ((8, 3), (2, 3), (4, 0))]
    assert shard_boxes(ShardSpec((4,), (((4, 6),),)), (2,)) == []  # all padding


def _full(name: str, what: str, shape) -> torch.Tensor:
    from tpctl.seeding import derive_seed

    g = torch.Generator().manual_seed(derive_seed(0, name, what))
    return torch.randn(shape, generator=g).abs()  # abs: exp_avg_sq stays non-negative


def _model(layout, n_layer=1):
    from omegaconf import OmegaConf

    import tpctl
    from tpctl.models import build_model
    from tpctl.schema import ModelConfig
    from tpctl.train import build_optimizer
    from tpctl.schema import OptimConfig

    mode, size, depth, dp = layout
    tp = tpctl.init_parallel(mode, size, depth, dp)
    # 37: a vocabulary that pads in every mode.
    cfg = OmegaConf.structured(ModelConfig(n_layer=n_layer, n_embd=16, n_head=4, block_size=8, vocab_size=37))
    model = tpctl.parallelize(build_model(cfg, seed=1, lazy=True), tp)
    return tp, model, build_optimizer(model, OptimConfig()), cfg


def _save_then_load(tmp: str, src, dst) -> dict:
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from tpctl import checkpoint
    from tpctl.parallel.shard import spec_of
    from tpctl.schema import TrainConfig

    tp, model, opt, mcfg = _model(src)
    for name, p in model.named_parameters():  # every value known from its global index
        spec = spec_of(p)
        state = checkpoint._adam_state(opt, p)
        for what, t in (("param", p.data), ("exp_avg", state["exp_avg"]), ("exp_avg_sq", state["exp_avg_sq"])):
            t.copy_(spec.slice(_full(name, what, spec.full_shape)))
        state["step"].fill_(7)
    cfg = OmegaConf.structured(TrainConfig)
    cfg.model = mcfg
    path = checkpoint.save(Path(tmp), 7, model, opt, tp.mesh, cfg, first_loss=5.5)
    manifest = checkpoint.verify(path)

    tp2, model2, opt2, _ = _model(dst)
    step, first = checkpoint.load(path, model2, opt2, tp2.mesh, manifest, seed=0)
    assert (step, first) == (7, 5.5)
    checked = 0
    for name, p in model2.named_parameters():
        spec = spec_of(p)
        state = opt2.state[p]
        assert state["step"].item() == 7
        for what, t in (("param", p.data), ("exp_avg", state["exp_avg"]), ("exp_avg_sq", state["exp_avg_sq"])):
            expect = spec.slice(_full(name, what, spec.full_shape))  # padding zero
            assert torch.equal(t, expect), f"{name} {what}"
            checked += 1
    dist.barrier()
    return {"checked": checked, "bytes": sum(f["bytes"] for n, f in manifest["files"].items() if n.endswith(".distcp"))}


@pytest.fixture(scope="module")
def pool():
    p = DistPool(WORLD, timeout_s=180)
    yield p
    p.close()


@pytest.mark.timeout(400)
@pytest.mark.parametrize("src,dst", [("2d", "3d"), ("3d", "1d"), ("2.5d", "none"), ("1d", "2.5d")])
def test_save_in_one_layout_load_in_another(pool, tmp_path, src, dst):
    results = pool.run(_save_then_load, str(tmp_path / "ckpt"), LAYOUTS[src], LAYOUTS[dst])
    assert all(r["checked"] > 0 for r in results)
    # No replica written twice: the tensor bytes on disk are the model's
    # parameters and both moments once (plus a small per-chunk overhead).
    from tpctl.models import build_model
    from omegaconf import OmegaConf
    from tpctl.schema import ModelConfig

    whole = build_model(OmegaConf.structured(ModelConfig(n_layer=1, n_embd=16, n_head=4, block_size=8, vocab_size=37)), 1)
    numbers = sum(p.numel() for p in whole.parameters()) * 3 * 4
    assert numbers <= results[0]["bytes"]
