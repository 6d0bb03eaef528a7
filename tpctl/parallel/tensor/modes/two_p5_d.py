"""mode=2.5d: Tesseract, P = d*q*q, rank (h, i, j).

d depth layers of the 2d grid (two_d.py), each running SUMMA on its own block
of rows: rank (h, i, j) holds rows block (h, i) of d*q, hidden block j, and
weight block (i, j), the same block as every other layer. So per rank the
activations are 1/(d*q*q) and the weights 1/(q*q) of the whole. Each layer's
SUMMA sums a weight's gradient over that layer's rows only: the d replicas
must add their gradients over the depth group, exactly once per step (driven
by the weight's ShardSpec), or they drift apart. In a training step each
weight's depth sum is issued as soon as its gradient is final (its last
micro-batch's accumulation), asynchronously, and waited for at the step's end
(`_DepthSums`; train.overlap=false: waited for at once, the same calls);
what is left (norms, biases, shared heads, tied weights, anything with
data-parallel replicas) is summed at the end (sync_grads).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from tpctl.errors import ConfigError
from tpctl.parallel import comm
from tpctl.parallel.geometry import Geometry, exact_root
from tpctl.parallel.registry import register
from tpctl.parallel.shard import ShardSpec, spec_of
from tpctl.parallel.tensor.modes.two_d import TwoD
from tpctl.parallel.tensor.replicas import sync_replicas


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
        self.depth_sums: "_DepthSums | None" = None

    def sums_during_backward(self, spec: ShardSpec | None) -> bool:
        """A weight whose whole gradient is summed over the depth group
        alone, on a rank without data-parallel replicas (their buckets hold
        the gradient during the backward and are reduced first) and not
        tied across stages (summed between the stages first)."""
        return (spec is not None and spec.partial_grad and not spec.row_replicas and not len(spec.stage_ranks) > 1
                and spec.replica_ranks == tuple(self.mesh.group_ranks["depth"]) and self.mesh.layout.dp * self.mesh.layout.cp == 1)

    def attach_grads(self, model_parts: list[nn.Module], micro_batches: int) -> None:
        if self.depth_sums is not None:  # a step built anew on the same model: its hooks replace the old
            self.depth_sums.remove()
            self.depth_sums = None
        params = [p for part in model_parts for p in part.parameters() if self.sums_during_backward(spec_of(p))]
        if params and comm.group_size(self.mesh.groups.get("depth")) > 1:
            self.depth_sums = _DepthSums(params, self.mesh.groups["depth"], micro_batches, self.overlap)

    def sync_grads(self, params) -> None:
        done = self.depth_sums.finish() if self.depth_sums is not None else set()
        if isinstance(params, nn.Module):
            params = params.parameters()
        sync_replicas([p for p in params if id(p) not in done])

    def cost_rows(self, tokens: int) -> int:
        return tokens // (self.depth * self.grid.q)

    def read_block(self):
        return self.h * self.grid.q + self.grid.i, self.depth * self.grid.q

    def _weight_spec(self, full: torch.Tensor, out_ranges, in_dim: int) -> ShardSpec:
        spec = super()._weight_spec(full, out_ranges, in_dim)
        return dataclasses.replace(spec, replica_ranks=tuple(self.mesh.group_ranks["depth"]), partial_grad=True,
                                   replica_group=self.mesh.groups["depth"])


class _DepthSums:
    """The depth sums of `params`' gradients over `group`, each issued once
    its gradient has been accumulated `micro_batches` times in a step (a
    post-accumulate-grad hook), so the sums run while the backward goes on;
    `finish` waits for them. Every depth replica runs the same backward, so
    the calls pair up in one order; overlap=False waits for each at once."""

    def __init__(self, params: list[nn.Parameter], group, micro_batches: int, overlap: bool):
        self.group, self.micro_batches, self.overlap = group, micro_batches, overlap
        self.count = {id(p): 0 for p in params}
        self.pending: list = []
        self.issued: set[int] = set()
        self.hooks = [p.register_post_accumulate_grad_hook(self._ready) for p in params]

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()

    def _ready(self, p: torch.Tensor) -> None:
        self.count[id(p)] += 1
        if self.count[id(p)] == self.micro_batches:
            _, work = comm.all_reduce(p.grad, self.group, async_op=True)
            self.pending.append(work) if self.overlap else work.wait()
            self.issued.add(id(p))

    def finish(self) -> set[int]:
        """Wait for the step's sums; the ids of the parameters they summed
        (a gradient that never became final is left to the caller)."""
        for work in self.pending:
            work.wait()
        issued = self.issued
        self.pending, self.issued = [], set()
        self.count = dict.fromkeys(self.count, 0)
        return issued
