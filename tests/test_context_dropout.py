"""Dropout with context parallelism: masks drawn by global position
(parallel/context/split.py ContextDropout, context_attention.gathered_attention),
so a cp run drops what the same layout without cp drops.

The reference without cp is the same layout with its cp ranks turned into
pipeline stages of one micro-batch: on 8 ranks that keeps the replicas (dp)
and the tensor grid, hence every generator's seed, and a stage draws the
masks one process draws for its blocks (docs/DESIGN.md, "Dropout")."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config

from tpctl.parallel.layout import Layout

DROPOUT = {"model.n_embd": 32, "model.n_head": 8, "model.dropout": 0.2, "pipeline.schedule": "gpipe",
           "pipeline.microbatches": 1}


def _curve_and_bytes(name: str, steps: int = 3, **overrides) -> tuple[list[float], dict]:
    """The global loss of `steps` optimizer steps in layout `name`, and the
    bytes comm counted by kind in the first step."""
    from conftest import build

    from tpctl.parallel import comm

    cfg = tiny_config(steps, **{**DROPOUT, **overrides})
    run = build(cfg, Layout.parse(name))
    gen = torch.Generator().manual_seed(7)
    out, counted = [], {}
    for step in range(steps):
        ids = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1), generator=gen)
        x, y = ids[:, :-1], ids[:, 1:]
        comm.STATS.reset()
        out.append(float(run.step([(run.par.shard_batch(x), run.par.shard_targets(y))], step)["loss"]))
        counted = counted or dict(comm.STATS.bytes)
    return out, counted


@pytest.mark.parametrize("name,reference,impl,recompute", [
    ("none-cp2-dp4", "none-pp2-dp4", "ring", False), ("none-cp2-dp4", "none-pp2-dp4", "ulysses", False),
    ("none-cp4-dp2", "none-pp4-dp2", "ring", True), ("2d-4-cp2", "2d-4-pp2", "ring", False),
    ("1d-2-cp2-dp2", "1d-2-pp2-dp2", "ulysses", False), ("2.5d-4-cp2", "2.5d-4-pp2", "ring", False),
])
def test_cp_drops_what_the_layout_without_cp_drops(pool, name, reference, impl, recompute):
    """`recompute`: the cp run with activation checkpointing, whose
    recomputed forward must redraw the whole-sequence masks."""
    from tpctl.cost.planner import model_shape, plan_split

    layers = {"model.n_layer": 4} if "pp4" in reference else {}
    ref = pool.run(_curve_and_bytes, reference, timeout_s=600, **layers)[0][0]
    if impl == "ulysses":  # once: the masks matter
        plain = pool.run(_curve_and_bytes, reference, timeout_s=600, **layers, **{"model.dropout": 0.0})[0][0]
        assert ref != pytest.approx(plain, rel=1e-5)
    cfg = tiny_config(1, **{**DROPOUT, **layers})
    plan = plan_split(model_shape(cfg.model), Layout.parse(name), cfg.train.batch_size, cfg.train.seq_len,
                      context="gather")
    extra = {"context.impl": impl, "train.activation_checkpointing": recompute}
    for curve, counted in pool.run(_curve_and_bytes, name, timeout_s=600, **layers, **extra):
        assert curve == pytest.approx(ref, rel=1e-6), (curve, ref)
        if name.startswith("none") and not recompute:  # the gathers are cp's alone there (recomputing: twice)
            for kind in ("all_gather", "reduce_scatter"):
                assert counted[kind] == plan.comm[(kind, "cp")].bytes > 0, kind
