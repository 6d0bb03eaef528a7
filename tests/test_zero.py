"""ZeRO over data parallelism (parallel/zero.py): every tensor mode with
zero = 1, 2, 3 trains exactly as mode=none (loss and gradient norm, 10
steps), holds the fraction of the memory the stages promise, and its
checkpoints load into any other layout and stage.

On the 8-rank pool through the trainer; the reference (mode=none, one
process) runs on each rank without any process group. 2.5d and 3d need 16
ranks with dp=2: those run through `tpctl train` (slow)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import tiny_config

REL = 1e-4
STEPS = 10


def _cfg(layout, **overrides):
    # Dropout off unless asked: dropout draws its masks per row block, and
    # the reference must see the same (DESIGN.md, "Dropout").
    return layout.write_to(tiny_config(STEPS, **{"model.n_layer": 2, "train.batch_size": 16, **overrides}))


def _fit(layout, par, **overrides):
    from tpctl.models import build_model
    from tpctl.parallel.base import parallelize
    from tpctl.training.data import TokenData, prepare_data
    from tpctl.training.loop import Trainer

    cfg = _cfg(layout, **overrides)
    model = parallelize(build_model(cfg.model, cfg.seed, lazy=True), par)
    trainer = Trainer(cfg, model, par, TokenData(cfg, prepare_data(cfg)))
    records = trainer.fit()
    return {"loss": [r["loss"] for r in records], "norm": [r["grad_norm"] for r in records],
            "summary": trainer.summary(records)}


def _curve(layout, bucket_bytes: int | None = None, **overrides) -> dict:
    """On a pool rank: train `layout`; its curve and what its summary says
    it held."""
    from tpctl.launch.pool import parallelism_of

    return _fit(layout, parallelism_of(layout, bucket_bytes), **overrides)


_references: dict = {}


def reference(**overrides) -> dict:
    """mode=none's curve, in this process (no process group)."""
    from tpctl.parallel.layout import Layout
    from tpctl.parallel.parallelism import parallelism

    key = tuple(sorted(overrides.items()))
    if key not in _references:
        _references[key] = _fit(Layout(), parallelism(Layout(), groups=False), **overrides)
    return _references[key]


def _assert_equal_to_none(result: dict, ref: dict, what: str, rel: float = REL) -> None:
    for step, (got, want) in enumerate(zip(result["loss"], ref["loss"]), 1):
        assert got == pytest.approx(want, rel=rel), f"{what}: step {step} loss {got} vs none {want}"
    for step, (got, want) in enumerate(zip(result["norm"], ref["norm"]), 1):
        assert got == pytest.approx(want, rel=rel), f"{what}: step {step} grad norm {got} vs none {want}"
    assert len(result["loss"]) == STEPS and result["loss"][-1] < result["loss"][0]  # it trains


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["none-dp8", "1d-4-dp2", "1d-4-sp-dp2", "2d-4-dp2"])
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_every_stage_trains_as_mode_none(pool, name, zero):
    from tpctl.parallel.layout import Layout

    layout = Layout.parse(name).replace(zero=zero)
    # Small buckets: several per step, reduced while the backward goes on.
    result = pool.run(_curve, layout, 4096, timeout_s=600)[0]
    _assert_equal_to_none(result, reference(), layout.label())
