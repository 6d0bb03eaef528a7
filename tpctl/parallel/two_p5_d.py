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

from .shard import ShardSpec
from .two_d import TwoD


class TwoPointFiveD(TwoD):
    name = "2.5d"
    # Ranks holding the same hidden block: a grid column through all layers.
    hidden_replica = "hidden_replica"

    def __init__(self, mesh):
        super().__init__(mesh)
        self.depth, self.h = mesh.geo.depth, mesh.coords["h"]

    def read_block(self):
        return self.h * self.grid.q + self.grid.i, self.depth * self.grid.q

    def _weight_spec(self, full: torch.Tensor, out_ranges, in_dim: int) -> ShardSpec:
        spec = super()._weight_spec(full, out_ranges, in_dim)
        return dataclasses.replace(spec, replica_ranks=tuple(self.mesh.group_ranks["depth"]), partial_grad=True,
                                   replica_group=self.mesh.groups["depth"])
