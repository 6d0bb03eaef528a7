"""Same config, same numbers: a run is bit-identical to itself, idle or with
every core kept busy by other processes (docs/DESIGN.md, "Same config, same
numbers"). Nothing a rank sums may depend on which message arrives first;
this test makes the load itself and runs one layout of every family twice."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest

from conftest import build_trainer, tiny_config
from tpctl.parallel.layout import Layout

# One layout of each family: replicas with each ZeRO stage, sequence
# parallelism, the 2d grid, 2.5d's depth, 3d's cube, pipeline stages, both
# context-parallel attentions.
FAMILIES = ("none-dp4-z3", "1d-2-sp-dp2-z1", "1d-2-dp2-z2", "2d-4", "2.5d-8-d2", "3d-8", "1d-2-pp2", "none-cp2-dp2")


def _curve(key: str, impl: str) -> list[tuple]:
    """Every step's loss, grad norm and val loss of a short run with dropout,
    as rank 0 logs them."""
    cfg = tiny_config(4, **{"model.dropout": 0.1, "train.eval_every": 2, "train.eval_batches": 1,
                            "context.impl": impl})
    records = build_trainer(cfg, Layout.parse(key)).fit()
    return [(r.get("loss"), r.get("grad_norm"), r.get("val_loss")) for r in records]


@contextlib.contextmanager
def _every_core_busy():
    """One spinning process per core for the duration of the block."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        yield
    finally:
        for b in burners:
            b.kill()
            b.wait()


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_every_layout_family_is_bit_identical_to_itself_idle_and_under_load(pool):
    runs = [(key, impl) for key in FAMILIES for impl in (("ring", "ulysses") if "cp" in key else ("ring",))]
    quiet = {run: pool.run(_curve, *run, ranks=Layout.parse(run[0]).world)[0] for run in runs}
    with _every_core_busy():
        loaded = {run: pool.run(_curve, *run, ranks=Layout.parse(run[0]).world)[0] for run in runs}
    differ = [f"{key} ({impl}): {quiet[(key, impl)]} vs {loaded[(key, impl)]}" for key, impl in runs
              if quiet[(key, impl)] != loaded[(key, impl)]]
    assert not differ, "\n".join(differ)
    assert all(len(curve) == 4 and all(loss is not None for loss, _, _ in curve) for curve in quiet.values())
