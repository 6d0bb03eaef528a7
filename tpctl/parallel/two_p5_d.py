"""mode=2.5d: Tesseract, P = d*q*q, rank (h, i, j).

d depth layers of the 2d grid (two_d.py), each running SUMMA on its own block
of rows: rank (h, i, j) holds rows block (h, i) of d*q, hidden block j, and
weight block (i, j), the same block as every other layer. So per rank the
activations are 1/(d*q*q) and the weights 1/(q*q) of the whole. Each layer's
SUMMA sums a weight's gradient over that layer's rows only: the d replicas
must add their gradients over the depth group, exactly once, after backward
(sync_grads, driven by the weight's ShardSpec), or they drift apart.
"""

from __future__ import annotations

import dataclasses

import torch

from tpctl.errors import ConfigError

from .geometry import Geometry, exact_root
from .registry import register
from .shard import ShardSpec
from .two_d import TwoD


@register
class TwoPointFiveD(TwoD):
    name = "2.5d"
    axes = ("h", "i", "j")
    # depth: the replicas of one weight block; hidden_replica: every rank
    # holding the same hidden block (a grid column through all layers).
    grid_groups = {"row": ("j",), "col": ("i",), "depth": ("h",), "hidden_replica": ("h", "i")}
    uses_depth = True

    @classmethod
    def geometry(cls, size: int, depth: int = 1) -> Geometry:
        if depth < 1:
            raise ConfigError("depth", depth, "expected depth >= 1")
        q = exact_root(size // depth, 2) if size % depth == 0 else None
        if q is None:
            valid = ", ".join(str(depth * r * r) for r in range(1, 5))
            raise ConfigError("size", size, f"mode=2.5d needs size = depth*q*q; with depth={depth}: {valid}, ...")
        return Geometry(cls.name, size, depth, q, depth * q, q, q, q)

    @classmethod
    def grid_shape(cls, geo: Geometry) -> tuple[int, ...]:
        return (geo.depth, geo.q, geo.q)

    @classmethod
    def variants(cls, size: int) -> list[dict]:
        # depth 1 is 2d; depth = size (q = 1) is data parallelism with extra steps
        return [{"depth": depth} for depth in range(2, size) if size % depth == 0]
    # Ranks holding the same hidden block: a grid column through all layers.
    hidden_replica = "hidden_replica"

    def __init__(self, mesh):
        super().__init__(mesh)
        self.depth, self.h = mesh.geo.depth, mesh.coords["h"]

    def cost_rows(self, tokens: int) -> int:
        return tokens // (self.depth * self.grid.q)

    def read_block(self):
        return self.h * self.grid.q + self.grid.i, self.depth * self.grid.q

    def _weight_spec(self, full: torch.Tensor, out_ranges, in_dim: int) -> ShardSpec:
        spec = super()._weight_spec(full, out_ranges, in_dim)
        return dataclasses.replace(spec, replica_ranks=tuple(self.mesh.group_ranks["depth"]), partial_grad=True,
                                   replica_group=self.mesh.groups["depth"])
