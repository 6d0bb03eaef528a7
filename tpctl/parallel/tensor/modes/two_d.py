"""mode=2d: SUMMA / Optimus on a q x q grid, P = q*q.

Rank (i, j) of a q x q grid holds activation rows block i, hidden block j,
and block (i, j) of every weight in nn.Linear's own (out, in) layout, so an
embedding and the LM head tied to it share one layout. A linear is three
SUMMA products over the grid:

    forward   Y  = X W^T   C[i,t] = sum_j X[i,j] W[t,j]^T   (bcast W down columns, reduce along rows)
    backward  dX = dY W    C[i,j] = sum_t dY[i,t] W[t,j]    (bcast dY along rows, W down columns)
              dW = dY^T X  C[t,j] = sum_i dY[i,t]^T X[i,j]  (reuses the dY broadcasts, reduce down columns)

The next step's broadcasts are issued (async) before the current matmul, so
communication overlaps compute (benchmarks/summa_overlap.py: 3-8% faster than
lock-step on 2 CPU cores with gloo, run to run). 2.5d (two_p5_d.py) runs d of these grids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from tpctl.errors import ConfigError
from tpctl.parallel import comm
from tpctl.parallel.dropout import ParallelDropout
from tpctl.parallel.geometry import Geometry, exact_root
from tpctl.parallel.registry import register
from tpctl.parallel.roles.probes import embedding_semantics, norm_width
from tpctl.parallel.shard import ShardSpec, block
from tpctl.parallel.tensor.layers import SplitNorm, to_compute
from tpctl.parallel.tensor.mode import ParallelMode


@dataclass
class Grid:
    """One q x q SUMMA grid: this rank's (i, j) and its row/column groups."""

    q: int
    i: int
    j: int
    row_group: object  # ranks (i, 0..q-1): same activation rows
    col_group: object  # ranks (0..q-1, j): same hidden block
    row_ranks: list  # global rank of (i, t), by t
    col_ranks: list  # global rank of (t, j), by t
    # Issue step t+1's broadcasts before step t's matmul (see _pipelined);
    # False runs the plain lock-step SUMMA, for measuring what overlap buys.
    overlap: bool = True

    # The owner sends `local.data` (same storage, its own autograd version):
    # gloo copies a CUDA tensor's host buffer back into it, the source
    # included, which would move the version of a weight that a micro-batch
    # still in flight saved for its backward (a 1F1B pipeline).
    def bcast_row(self, local: torch.Tensor, t: int):
        """Start broadcasting block (i, t) along this rank's row."""
        buf = local.data.contiguous() if t == self.j else torch.empty_like(local)
        return buf, comm.broadcast(buf, self.row_ranks[t], self.row_group, async_op=True)

    def bcast_col(self, local: torch.Tensor, t: int):
        """Start broadcasting block (t, j) down this rank's column."""
        buf = local.data.contiguous() if t == self.i else torch.empty_like(local)
        return buf, comm.broadcast(buf, self.col_ranks[t], self.col_group, async_op=True)


def _wait(handle) -> None:
    if handle is not None:
        handle.wait()


def _pipelined(q: int, start, overlap: bool = True):
    """Yield the results of start(t) for t = 0..q-1, with step t+1's
    broadcasts already in flight while the caller computes step t (without
    overlap: started only once the caller is done with step t)."""
    pending = start(0)
    for t in range(q):
        current = pending
        if t + 1 < q and overlap:
            pending = start(t + 1)
        for _, handle in current:
            _wait(handle)
        yield [buf for buf, _ in current]
        if t + 1 < q and not overlap:
            pending = start(t + 1)


class _SummaLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, grid: Grid):
        ctx.save_for_backward(x, weight)
        ctx.grid = grid
        partials, reduces = [], []
        for t, (w_t,) in enumerate(_pipelined(grid.q, lambda t: [grid.bcast_col(weight, t)], grid.overlap)):
            p = x @ w_t.t()  # rows i x out-block t, summed over this rank's in-block
            partials.append(p)
            reduces.append(comm.reduce(p, grid.row_ranks[t], grid.row_group, async_op=grid.overlap))
        for handle in reduces:
            _wait(handle)
        return partials[grid.j]

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grid = ctx.grid
        grad_out = grad_out.contiguous()
        # x, weight and grad_out share one dtype (Linear2D casts x and the
        # weight to the compute dtype); the q-term sum of dX accumulates in
        # fp32, as a single matmul would.
        grad_x = torch.zeros_like(x, dtype=torch.promote_types(x.dtype, torch.float32))
        partials, reduces = [], []
        start = lambda t: [grid.bcast_row(grad_out, t), grid.bcast_col(weight, t)]  # noqa: E731
        for t, (dy_t, w_t) in enumerate(_pipelined(grid.q, start, grid.overlap)):
            grad_x += dy_t @ w_t
            p = dy_t.t() @ x  # out-block t x in-block j, summed over rows i
            partials.append(p)
            reduces.append(comm.reduce(p, grid.col_ranks[t], grid.col_group, async_op=grid.overlap))
        for handle in reduces:
            _wait(handle)
        return grad_x.to(x.dtype), partials[grid.i], None


def summa_linear(x: torch.Tensor, weight: torch.Tensor, grid: Grid) -> torch.Tensor:
    """X W^T of this rank's blocks (rows of any leading shape)."""
    # Under autocast: broadcasts and reduces in the compute dtype.
    y = _SummaLinear.apply(to_compute(x.reshape(-1, x.shape[-1])), to_compute(weight), grid)
    return y.reshape(*x.shape[:-1], y.shape[-1])


class Linear2D(nn.Module):
    def __init__(self, weight, bias, grid: Grid):
        super().__init__()
        self.weight, self.bias, self.grid = weight, bias, grid

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = summa_linear(x, self.weight, self.grid)
        return y if self.bias is None else y + self.bias.to(y.dtype)


class Embedding2D(nn.Module):
    """Gather the column's vocabulary blocks of this hidden block (backward:
    reduce-scatter), then a plain lookup of this rank's rows.

    This moves the table's hidden block (vocab x hidden/q) per step. The
    alternative -- masked partial lookups of the column's rows, then a
    reduce-scatter of (tokens x hidden/q) activations -- is cheaper when a
    step has fewer tokens than the vocabulary has entries; the cost model
    can choose between them."""

    def __init__(self, weight, col_group, scale: float = 1.0, padding_idx=None):
        super().__init__()
        self.weight, self.col_group = weight, col_group
        self.scale, self.padding_idx = scale, padding_idx  # the original embedding's (layers.embedding_semantics)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = F.embedding(ids, comm.gather_along(self.weight, self.col_group, 0), padding_idx=self.padding_idx)
        return out * torch.tensor(self.scale, dtype=out.dtype) if self.scale != 1.0 else out


@register
class TwoD(ParallelMode):
    name = "2d"
    axes = ("i", "j")
    # row: ranks holding the same activation rows (one grid row); col: the
    # same hidden block (one grid column).
    grid_groups = {"row": ("j",), "col": ("i",)}

    @classmethod
    def geometry(cls, size: int, depth: int = 1) -> Geometry:
        q = exact_root(size, 2)
        if q is None:
            raise ConfigError("size", size, "mode=2d needs a square number of ranks (1, 4, 9, 16, ...)")
        return Geometry(cls.name, size, 1, q, q, q, q, q)

    @classmethod
    def grid_shape(cls, geo: Geometry) -> tuple[int, ...]:
        return (geo.q, geo.q)
    # The group of ranks holding the same hidden block: their copies of a
    # hidden-split parameter (bias, norm, position table) see other rows.
    hidden_replica = "col"

    def __init__(self, mesh):
        super().__init__(mesh)
        c = mesh.coords
        self.grid = Grid(mesh.geo.q, c["i"], c["j"], mesh.groups["row"], mesh.groups["col"],
                         mesh.group_ranks["row"], mesh.group_ranks["col"])

    @property
    def overlap(self) -> bool:
        """train.overlap: the next SUMMA step's broadcasts in flight during this one's matmul."""
        return self.grid.overlap

    @overlap.setter
    def overlap(self, on: bool) -> None:
        self.grid.overlap = on

    # ---- cost (mode.ParallelMode) -------------------------------------------
    loss_group_name = stream_group_name = "row"

    def cost_rows(self, tokens: int) -> int:
        return tokens // self.geo.batch_split

    def cost_hidden(self, hidden: int) -> int:
        return hidden // self.grid.q

    def cost_embedding(self, add, tokens: int, vocab: int, dim: int) -> None:
        # the column's vocabulary blocks of this hidden block gathered; backward: reduce-scattered
        add("all_gather", "col", vocab * (dim // self.grid.q))
        add("reduce_scatter", "col", vocab * (dim // self.grid.q))

    def cost_norm(self, add, tokens: int, hidden: int, moments: int = 2) -> int:
        add("all_reduce", "row", moments * self.cost_rows(tokens), times=2)  # the moments forward, their gradient backward
        return super().cost_norm(add, tokens, hidden)

    def cost_proj_norm(self, add, tokens: int, role: str, moments: int) -> None:
        # a SUMMA product's output holds its input's rows, its features split
        # over the row group (output_group), as the stream's are
        add("all_reduce", "row", moments * self.cost_rows(tokens), times=2)

    def cost_head_reduce(self, add, tokens: int, role: str, heads: int) -> None:
        add("reduce_scatter", "row", heads * self.cost_rows(tokens))
        add("all_gather", "row", heads * self.cost_rows(tokens))

    def cost_linear(self, add, role: str, tokens: int, n: int, k: int) -> int:
        q, rows = self.grid.q, self.cost_rows(tokens)
        w, y = (n // q) * (k // q), rows * (n // q)
        # All but the first of q broadcasts in flight during the previous
        # step's matmul; all but the last reduce during the next one's.
        for hidden in (False, True):
            times = q - 1 if hidden else 1
            add("broadcast", "col", w, times=2 * times, hidden=hidden)  # W, forward and backward
            add("broadcast", "row", y, times=times, hidden=hidden)  # dY, backward
            add("reduce", "row", y, times=times, hidden=hidden)  # Y, forward
            add("reduce", "col", w, times=times, hidden=hidden)  # dW, backward
        return rows * (k // q)

    def cost_linear_temporary(self, role: str, tokens: int, n: int, k: int) -> int:
        # _SummaLinear: the other ranks' blocks in flight (bcast_*: one at
        # q=2, two when pipelined), and the q-1 partial products reduced to
        # other ranks. Forward: W's blocks and Y's partials; backward: dY's
        # and W's blocks and dW's partials (at the LM head: its largest).
        q, rows = self.grid.q, self.cost_rows(tokens)
        w, y = (n // q) * (k // q), rows * (n // q)
        in_flight = min(2, q - 1)
        return max(in_flight * w + (q - 1) * y, in_flight * (y + w) + (q - 1) * w)

    # ---- data: rows block i, hidden block j --------------------------------
    def read_block(self):
        return self.grid.i, self.grid.q

    def shard_hidden(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.chunk(self.grid.q, -1)[self.grid.j]

    def splits_stream(self, ctx) -> bool:
        return True

    def stream_spec(self, full: torch.Tensor) -> ShardSpec:
        """Hidden block j of the last dimension, as a norm's weight (2.5d: the same on every depth layer)."""
        return self._hidden_spec(full, block(full.shape[-1], self.grid.q, self.grid.j), full.dim() - 1)

    @property
    def loss_replicas(self) -> int:
        return self.grid.q

    def loss_group(self):
        return self.grid.row_group

    def vocab_block(self) -> int:
        return self.grid.j

    def head_block(self) -> int:
        return self.grid.j  # the output block j of q, k and v

    # ---- parameter layouts -----------------------------------------------
    def _weight_spec(self, full: torch.Tensor, out_ranges, in_dim: int) -> ShardSpec:
        """Block (i, j) of a weight in (out, in) layout."""
        return ShardSpec(tuple(full.shape), (out_ranges, block(in_dim, self.grid.q, self.grid.j)))

    def _hidden_spec(self, full: torch.Tensor, ranges, dim: int = 0) -> ShardSpec:
        """A tensor split along `dim` by hidden block j, replicated over the
        ranks with other rows (whose gradients are partial)."""
        return self.split_spec(full, dim, ranges, replicas=self.hidden_replica)

    def _out_ranges(self, n: int, layout, b: int):
        """Output block `b` of q of a Linear's n output features (by its layout)."""
        return layout.ranges(self.grid.q, self.grid.q, b) if layout else block(n, self.grid.q, b)

    def output_spec(self, tensor, role: str, layout=None, n: int | None = None) -> ShardSpec:
        n = n if n is not None else tensor.shape[0]
        return self._hidden_spec(tensor, self._out_ranges(n, layout, self.grid.j))

    def output_group(self, role: str):
        return self.grid.row_group

    def weight_spec(self, weight, role: str, layout=None, n: int | None = None) -> ShardSpec:
        n = n if n is not None else weight.shape[0]
        return self._weight_spec(weight, self._out_ranges(n, layout, self.grid.i), weight.shape[1])

    def linear_fn(self, role: str):
        return lambda x, weight: summa_linear(x, weight, self.grid)

    def stream_group(self):
        return self.grid.row_group

    def linear_module(self, weight, bias, role: str) -> Linear2D:
        """Every linear role runs SUMMA on its (q x q) blocks (the default
        ParallelMode.convert_linear shards them by weight_spec/output_spec)."""
        return Linear2D(weight, bias, self.grid)

    # ---- roles -------------------------------------------------------------
    def convert_embedding(self, module: nn.Embedding, ctx):
        rows = self.padded_vocab(module.num_embeddings)
        spec = self._weight_spec(module.weight, block(rows, self.grid.q, self.grid.i), module.embedding_dim)
        return Embedding2D(ctx.shard(module.weight, spec), self.grid.col_group, *embedding_semantics(module))

    def convert_pos_embedding(self, module: nn.Embedding, ctx):
        # The module's own forward (OPT's takes position_ids and adds an
        # offset) on this rank's hidden block of the table.
        spec = self._hidden_spec(module.weight, block(module.embedding_dim, self.grid.q, self.grid.j), dim=1)
        module.weight = ctx.shard(module.weight, spec)
        return module

    def convert_norm(self, module: nn.Module, ctx):
        shard = lambda p, features: ctx.shard(p, self._hidden_spec(p, features))  # noqa: E731
        return SplitNorm.like(module, block(norm_width(module), self.grid.q, self.grid.j), shard, self.grid.row_group)

    def convert_dropout(self, module: nn.Dropout, ctx):
        return ParallelDropout(module.p, self.mesh.rng_local)  # every activation is sharded

    convert_attn_dropout = convert_dropout
