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


@pytest.mark.timeout(900)
def test_each_stage_holds_a_quarter_of_its_figure_at_dp4(pool):
    """summary.json's bytes of the largest rank, counted from the tensors it
    holds: optimizer state from stage 1, gradients from stage 2, parameters
    from stage 3, each at most 0.30 of zero=0's at dp=4 (1/4 and padding)."""
    from tpctl.parallel.layout import Layout

    held = [pool.run(_curve, Layout.parse("1d-2-dp4").replace(zero=zero), timeout_s=600,
                     **{"train.steps": 2})[0]["summary"] for zero in range(4)]
    for zero, figure in ((1, "optimizer_bytes_max_rank"), (2, "grad_bytes_max_rank"), (3, "param_bytes_max_rank")):
        assert held[zero][figure] <= 0.30 * held[0][figure], (zero, figure, held[zero][figure], held[0][figure])
        for later in range(zero, 4):  # and stays sharded in the later stages
            assert held[later][figure] <= held[zero][figure], (later, figure)
    for figure in ("grad_bytes_max_rank", "param_bytes_max_rank"):  # stage 1 shards only the optimizer state
        assert held[1][figure] >= held[0][figure]


def _coverage(path) -> dict[str, tuple[int, int]]:
    """{tensor: (elements the saved chunks hold, elements of the tensor)}
    of a checkpoint's model and moments, from DCP's metadata."""
    import math

    from tpctl.training.checkpoint import _reader

    saved = _reader(Path(path)).read_metadata().state_dict_metadata
    return {fqn: (sum(math.prod(c.sizes) for c in md.chunks), math.prod(md.size))
            for fqn, md in saved.items() if fqn.startswith("model.") or fqn.endswith(("exp_avg", "exp_avg_sq"))}


@pytest.mark.timeout(900)
def test_a_zero2_checkpoint_resumes_in_other_stages_and_modes(pool, tmp_path):
    """1d dp=2 zero=2 saves at step 4 (every replica writes its chunks);
    2d zero=0, none dp=8 zero=3 and 1d dp=4 zero=1 load it and continue the
    uninterrupted curve. Each byte is written once: the saved chunks of
    every tensor add up to the tensor, as zero=0's do."""
    from test_checkpoint import _fit

    from tpctl.parallel.layout import Layout

    source = Layout.parse("1d-4-dp2-z2")
    curve = pool.run(_fit, source, str(tmp_path / "z2"), timeout_s=600)[0]
    assert len({loss for _, loss in curve}) > 1
    step4 = tmp_path / "z2" / "checkpoints" / "step_4"
    for name in ("2d-4-dp2", "none-dp8-z3", "1d-2-dp4-z1", "1d-4-dp2-z2"):
        resumed = pool.run(_fit, Layout.parse(name), str(tmp_path / name), resume=str(step4), timeout_s=600)[0]
        assert [s for s, _ in resumed] == [5, 6, 7, 8], name
        rel = 1e-6 if name == source.name else REL  # the same layout: the same numbers
        for (step, want), (_, got) in zip(curve[4:], resumed):
            assert got == pytest.approx(want, rel=rel), f"{source.name} -> {name} step {step}"
    coverage = _coverage(step4)
    assert len(coverage) > 10 and all(held == whole for held, whole in coverage.values()), coverage
