"""Checkpoints: boxes of a ShardSpec, save in one layout and load in another
(model and AdamW state intact, on one pool of gloo ranks), and whole runs
through `tpctl train`: exact resume, resume in another mode, restart after a
SIGKILL, corrupted checkpoints, export."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from cli_support import tpctl  # noqa: F401  (fixture)

from tpctl.checkpoint import shard_boxes
from tpctl.parallel.shard import ShardSpec
from conftest import LAYOUTS as SHARED_LAYOUTS, build_trainer

# mode -> its layout on the 8-rank pool.
LAYOUTS = {mode: SHARED_LAYOUTS[key] for mode, key in
           (("2d", "2d-4-dp2"), ("3d", "3d-8"), ("2.5d", "2.5d-8-d2"), ("1d", "1d-2-dp4"), ("none", "none-dp8"))}


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


def _model(layout, n_layer=1, mechanism=None):
    from omegaconf import OmegaConf

    import tpctl
    from tpctl.models import build_model
    from tpctl.schema import ModelConfig, OptimConfig
    from tpctl.training.step import build_optimizer

    # Deliberately the custom-loop API (init_parallel, parallelize), not build_run: checkpoints of a user's own loop.
    tp = tpctl.init_parallel(layout)
    # 37: a vocabulary that pads in every mode.
    cfg = OmegaConf.structured(ModelConfig(n_layer=n_layer, n_embd=16, n_head=4, block_size=8, vocab_size=37))
    if mechanism is None:
        model = build_model(cfg, seed=1, lazy=True)
    else:  # a traced model of tests/verify_models.py (multi-query: a key/value head several ranks share)
        from tests.verify_models import mechanism as build

        model = build(mechanism, 37, 16, 4, n_layer)
    model = tpctl.parallelize(model, tp)
    return tp, model, build_optimizer(model.parameters(), OptimConfig()), cfg


def _save_then_load(tmp: str, src, dst, mechanism=None) -> dict:
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from tpctl import checkpoint
    from tpctl.checkpoint.manifest import _SafeUnpickler
    from tpctl.checkpoint.state import _adam_state
    from tpctl.parallel.shard import spec_of
    from tpctl.config import default_config

    tp, model, opt, mcfg = _model(src, mechanism=mechanism)
    for name, p in model.named_parameters():  # every value known from its global index
        spec = spec_of(p)
        state = _adam_state(opt, p)
        for what, t in (("param", p.data), ("exp_avg", state["exp_avg"]), ("exp_avg_sq", state["exp_avg_sq"])):
            t.copy_(spec.slice(_full(name, what, spec.full_shape)))
        state["step"].fill_(7)
    cfg = default_config()
    cfg.model = mcfg
    path = checkpoint.save(Path(tmp), 7, model, opt, tp, cfg, first_loss=5.5)
    manifest = checkpoint.verify(path)

    tp2, model2, opt2, _ = _model(dst, mechanism=mechanism)
    step, first = checkpoint.load(path, model2, opt2, tp2, manifest, seed=0)
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
    with open(path / ".metadata", "rb") as f:  # every element of every tensor saved once: chunks never overlap
        saved = _SafeUnpickler(f).load().state_dict_metadata
    elements = {key: (sum(math.prod(c.sizes) for c in md.chunks), math.prod(md.size)) for key, md in saved.items()
                if key.startswith(("model.", "optim.")) and not key.endswith(".step")}
    return {"checked": checked, "elements": elements,
            "bytes": sum(f["bytes"] for n, f in manifest["files"].items() if n.endswith(".distcp"))}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("src,dst", [("3d", "2.5d")])
def test_save_in_one_layout_load_in_another(pool, tmp_path, src, dst):
    results = pool.run(_save_then_load, str(tmp_path / "ckpt"), LAYOUTS[src], LAYOUTS[dst])
    assert all(r["checked"] > 0 for r in results)
    # No replica written twice: the tensor bytes on disk are the model's
    # parameters and both moments once (plus a small per-chunk overhead).
    from omegaconf import OmegaConf

    from tpctl.models import build_model
    from tpctl.schema import ModelConfig

    whole = build_model(OmegaConf.structured(ModelConfig(n_layer=1, n_embd=16, n_head=4, block_size=8, vocab_size=37)), 1)
    numbers = sum(p.numel() for p in whole.parameters()) * 3 * 4
    assert numbers <= results[0]["bytes"]
    # Export: whole tensors under the plain model's names (tied once).
    from tpctl.commands.export import full_weights

    _, weights = full_weights(tmp_path / "ckpt" / "step_7")
    assert list(weights) == [name for name, _ in whole.named_parameters()]
    for name, tensor in weights.items():
        assert torch.equal(tensor, _full(name, "param", tensor.shape)), name


@pytest.mark.timeout(400)
@pytest.mark.parametrize("src,dst,mechanism", [("2d", "3d", "mqa"), ("1d", "none", "mqa"), ("2d", "1d", "fused_mqa"),
                                                ("3d", "2.5d", "fused_mqa"), ("2d", "1d", "head_norm_list")])
def test_a_shared_key_value_head_is_written_once_and_loads_in_any_layout(pool, tmp_path, src, dst, mechanism):
    """One key/value head held by every rank whose query heads read it (and,
    in a fused projection, rows of its own next to rows of the shared head);
    per-head norms of which a rank holds its heads' only: the same slice
    written once, read back in another layout."""
    results = pool.run(_save_then_load, str(tmp_path / "ckpt"), LAYOUTS[src], LAYOUTS[dst], mechanism)
    assert all(r["checked"] > 0 for r in results)
    elements = results[0]["elements"]
    assert {"model.blocks.0.attn.k.weight", "model.blocks.0.attn.qkv.bias", "model.blocks.0.attn.q_norms.3.weight"} \
        & set(elements)
    assert all(saved == whole for saved, whole in elements.values()), elements  # no replica written twice


# ---- training resumes: in the pool, through Trainer (no process start-up) --

def _train_cfg(layout, steps: int, every: int, dropout: float = 0.0):
    from omegaconf import OmegaConf

    from tpctl.config import default_config

    cfg = layout.write_to(default_config())
    settings = {"model.n_layer": 1, "model.n_embd": 16, "model.n_head": 4, "model.block_size": 16,
                "model.vocab_size": 37, "data.name": "synthetic", "data.vocab_size": 37, "data.synthetic_tokens": 20_000,
                "train.batch_size": 8, "train.seq_len": 16, "train.eval_every": 0, "train.log_every": 1,
                "train.progress": False, "train.steps": steps, "optim.lr": 1e-2, "optim.eps": 1e-5, "optim.warmup_steps": 3,
                "checkpoint.every": every, "checkpoint.keep": 0, "model.dropout": dropout}
    for key, value in settings.items():
        OmegaConf.update(cfg, key, value)
    return cfg


def _fit(layout, run_dir: str, steps: int = 8, every: int = 4, resume: str | None = None,
         dropout: float = 0.0) -> list[tuple[int, float]]:
    import tpctl
    from tpctl import checkpoint

    cfg = _train_cfg(layout, steps, every, dropout)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    trainer = build_trainer(cfg, layout, pooled=False, run_dir=run_dir)
    if resume is not None:
        trainer.resume(Path(resume), checkpoint.verify(Path(resume)))
    return [(r["step"], r["loss"]) for r in trainer.fit()]


@pytest.mark.timeout(600)
def test_resume_continues_the_uninterrupted_curve_in_every_mode_and_across_modes(pool, tmp_path):
    # Same mode: 8 uninterrupted steps against 4 + resume + 4, bit for bit
    # up to 1e-6 (weights, AdamW moments and step, schedule, data position).
    curves = {}
    for name, layout in LAYOUTS.items():
        run = tmp_path / name
        curves[name] = pool.run(_fit, layout, str(run))[0]
        resumed = pool.run(_fit, layout, str(tmp_path / f"{name}-resumed"), resume=str(run / "checkpoints" / "step_4"))[0]
        assert [s for s, _ in resumed] == [5, 6, 7, 8]
        for (step, want), (_, got) in zip(curves[name][4:], resumed):
            assert got == pytest.approx(want, rel=1e-6), f"{name} step {step}"
        # The resumed run's metrics.jsonl holds each step once (it started empty here).
        assert [json.loads(l)["step"] for l in (tmp_path / f"{name}-resumed" / "metrics.jsonl").read_text().splitlines()] == [5, 6, 7, 8]
    # Across modes: the 2d checkpoint continues in every other layout along
    # the 2d run's curve (modes agree within fp32 round-off).
    for name, layout in LAYOUTS.items():
        if name == "2d":
            continue
        resumed = pool.run(_fit, layout, str(tmp_path / f"2d-to-{name}"), resume=str(tmp_path / "2d" / "checkpoints" / "step_4"))[0]
        for (step, want), (_, got) in zip(curves["2d"][4:], resumed):
            assert got == pytest.approx(want, rel=1e-4), f"2d -> {name} step {step}"
    assert len({loss for _, loss in curves["2d"]}) > 1  # the weights move
    # Dropout: the shared and local generators come back with the weights.
    calm = pool.run(_fit, LAYOUTS["2d"], str(tmp_path / "drop"), dropout=0.2)[0]
    resumed = pool.run(_fit, LAYOUTS["2d"], str(tmp_path / "drop-resumed"), dropout=0.2,
                       resume=str(tmp_path / "drop" / "checkpoints" / "step_4"))[0]
    assert [loss for _, loss in resumed] == pytest.approx([loss for _, loss in calm[4:]], rel=1e-6)
    assert [loss for _, loss in calm] != pytest.approx([loss for _, loss in curves["2d"]], rel=1e-6)  # dropout acts


# ---- whole runs through `tpctl train` ---------------------------------------

TINY = ["model=gpt-tiny", "optim.eps=1e-5", "model.n_layer=1", "data=synthetic", "data.synthetic_tokens=20000", "train.batch_size=8",
        "train.seq_len=16", "train.log_every=1", "train.eval_every=0", "train.progress=false", "seed=0"]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _one_line_error(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("tpctl: error: "), lines[0]
    return lines[0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_invalid_checkpoints_are_skipped_by_auto_and_refused_by_path(tpctl):
    run = tpctl.cwd / "run"
    args = ["train", *TINY, "mode=none", "checkpoint.every=2", "checkpoint.keep=0", f"hydra.run.dir={run}"]
    first = tpctl.run([*args, "train.steps=6"], timeout=120)
    assert first.returncode == 0, first.stderr
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_2", "step_4", "step_6"]
    reference = _metrics(run)
    # step_6: a file cut in half; step_4: bytes flipped in the middle of one.
    data6 = next(ckpts.glob("step_6/*.distcp"))
    data6.write_bytes(data6.read_bytes()[: data6.stat().st_size // 2])
    data4 = next(ckpts.glob("step_4/*.distcp"))
    raw = bytearray(data4.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data4.write_bytes(bytes(raw))

    for bad, why in (("step_6", "truncated"), ("step_4", "corrupted")):
        line = _one_line_error(tpctl.run([*args, "train.steps=6", f"train.resume={ckpts / bad}"]))
        assert f"train.resume='{ckpts / bad}'" in line and why in line, line

    # A crash mid-write leaves only a temp dir: never read, removed by the next save.
    (ckpts / ".tmp_step_8").mkdir()
    (ckpts / ".tmp_step_8" / "__0_0.distcp").write_bytes(b"half a checkpoint")
    resumed = tpctl.run([*args, "train.steps=6", "train.resume=auto"], timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    warnings = [line for line in resumed.stderr.splitlines() if "skipping invalid checkpoint" in line]
    assert len(warnings) == 2 and "step_6" in warnings[0] and "step_4" in warnings[1], resumed.stderr
    assert f"resumed from {ckpts / 'step_2'}" in resumed.stdout
    assert not (ckpts / ".tmp_step_8").exists()
    again = _metrics(run)
    assert [r["step"] for r in again] == [1, 2, 3, 4, 5, 6]  # each step once
    for ref, got in zip(reference, again):
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6)

    # Another model: refused before anything starts, naming what differs.
    line = _one_line_error(tpctl.run([*args, "model.n_embd=32", "train.resume=auto"]))
    assert "another model" in line and "model.n_embd=64 in the checkpoint, 32 here" in line, line

    # Export: the whole weights under the model's parameter names.
    from safetensors.torch import load_file

    out = tpctl.cwd / "model.safetensors"
    umask = os.umask(0o027)  # the export inherits it, and gives OUT what open() would: 0640
    try:
        exported = tpctl.run(["export", str(ckpts / "step_6"), str(out)])
    finally:
        os.umask(umask)
    assert exported.returncode == 0, exported.stderr
    assert out.stat().st_mode & 0o777 == 0o640
    weights = load_file(str(out))
    assert "wte.weight" in weights and "lm_head.weight" not in weights  # tied: once
    assert weights["wte.weight"].shape == (256, 64)
    data2 = next(ckpts.glob("step_2/*.distcp"))  # the resumed run rewrote step_4 and step_6
    data2.write_bytes(data2.read_bytes()[:-1])
    assert "truncated" in _one_line_error(tpctl.run(["export", str(ckpts / "step_2"), str(out)]))
    assert tpctl.leftover_pids() == []
