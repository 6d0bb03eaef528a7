"""Adding a tensor-parallel mode is one class and one registration line.

`RowSplit`, below, is a whole mode written here, outside the package: a
grid of `size` ranks that splits the batch rows and keeps every weight
whole (data parallelism expressed as a mode, the simplest mode there is).
It declares its grid and geometry, registers itself with one line, and
from then on `Layout`, the mesh, the planner's layouts and the trainer
know it by name, and it trains equal to mode=none."""

from __future__ import annotations

import contextlib

import pytest

from conftest import build_trainer, tiny_config
from tpctl.parallel.base import ParallelMode
from tpctl.parallel.geometry import Geometry
from tpctl.parallel.layers import ParallelDropout
from tpctl.parallel.layout import Layout
from tpctl.parallel.registry import register, unregister


class RowSplit(ParallelMode):
    """Rank p of the grid reads row block p of its replica's micro-batch and
    holds every parameter whole; the copies' gradients are partial sums
    over their rows, summed over the grid (their ShardSpec says so)."""

    name = "rows"
    axes = ("p",)

    @classmethod
    def geometry(cls, size: int, depth: int = 1) -> Geometry:
        return Geometry(cls.name, size, 1, 1, batch_split=size, hidden_split=1, head_split=1, vocab_multiple=1)

    def read_block(self):
        return self.mesh.tp_rank, self.mesh.tp_size

    def _whole(self, module, ctx):
        for param in module.parameters(recurse=False):
            self.replicated(param, "tp", partial=True)
        return module

    convert_embedding = convert_pos_embedding = convert_qkv = convert_attn_in = convert_attn_out = _whole
    convert_mlp_in = convert_mlp_out = convert_norm = convert_lm_head = convert_head_norm = _whole

    def convert_dropout(self, module, ctx):
        return ParallelDropout(module.p, self.mesh.rng_local)  # every rank holds other rows

    convert_attn_dropout = convert_dropout


@contextlib.contextmanager
def registered():
    """RowSplit registered while the block runs (in this process): other
    tests see only the package's modes."""
    register(RowSplit)  # the one line
    try:
        yield
    finally:
        unregister(RowSplit.name)


def _curve(layout: Layout) -> list[tuple[float, float]]:
    with registered():
        cfg = layout.write_to(tiny_config(6, **{"model.dropout": 0.0}))
        layout.validate(cfg)
        return [(r["loss"], r["grad_norm"]) for r in build_trainer(cfg, layout).fit()]


@registered()
def test_a_mode_registered_outside_the_package_is_a_layout():
    from tpctl.errors import ConfigError
    from tpctl.parallel.layout import layouts_of

    assert Layout.parse("rows-4-dp2").geo.batch_split == 4
    assert "rows-8" in {layout.name for layout in layouts_of(8)}
    with pytest.raises(ConfigError, match="mode='nope'.*rows"):
        Layout("nope", 2).validate()


def test_a_mode_registered_here_trains_like_mode_none(pool):
    want = pool.run(_curve, Layout.parse("none-dp8"))[0]
    got = pool.run(_curve, Layout.parse("rows-4-dp2"))[0]
    assert want[-1][0] < want[0][0], "the reference did not learn"
    for (loss, norm), (want_loss, want_norm) in zip(got, want):
        assert loss == pytest.approx(want_loss, rel=1e-5) and norm == pytest.approx(want_norm, rel=1e-5)
