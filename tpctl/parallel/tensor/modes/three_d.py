"""mode=3d (P = q^3), rank (i, j, l) of a q x q x q cube.

An activation layout names the cube axis that splits the hidden dimension
(`hidden`) and the one that, with i, splits the rows (`rows`). Blocks start in
layout A = (hidden l, rows (i, j)). A linear fed layout (hidden h, rows (i, r))
holds W[(r, i), h] -- output features in q*q blocks, input features by h -- and

    all-gathers X over r        -> rows block i, input block h
    all-gathers W over i        -> output block r, input block h
    multiplies locally          -> rows block i, output block r, partial over h
    reduce-scatters over h      -> rows (i, h), output block r

so its output is in the flipped layout (hidden r, rows (i, h)). Backward, the
gathers become reduce-scatters and vice versa (autograd of comm's ops). Two
linears in a row (qkv -> proj, fc -> proj) return to layout A, so a residual
add sees matching layouts; the roles fix which layout each layer is fed.
"""

from __future__ import annotations

import functools
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
from tpctl.parallel.tensor.layers import SplitNorm, linear_grads, to_compute, vocab_block_lookup
from tpctl.parallel.tensor.mode import ParallelMode


@dataclass(frozen=True)
class Layout3D:
    hidden: str  # cube axis splitting the hidden dim: "l" or "j"
    rows: str  # cube axis splitting rows within block i: the other one

    def flip(self) -> "Layout3D":
        return Layout3D(self.rows, self.hidden)

    @property
    def replica_plane(self) -> str:
        """Group of ranks holding the same hidden block in this layout."""
        return "i" + self.rows


LAYOUT_A = Layout3D(hidden="l", rows="j")  # embeddings, norms, residual stream
LAYOUT_B = LAYOUT_A.flip()  # inside attention and the MLP, and the logits

# The layout each role is fed.
ROLE_LAYOUT = {"qkv": LAYOUT_A, "attn_in": LAYOUT_A, "mlp_in": LAYOUT_A, "lm_head": LAYOUT_A,
               "attn_out": LAYOUT_B, "mlp_out": LAYOUT_B}


def _waited(work) -> None:
    if work is not None:
        work.wait()


class _CubeLinearFn(torch.autograd.Function):
    """Y = reduce-scatter_h(gather_r(X) gather_i(W)^T). The weight's gather
    is issued first (it depends on no activation), the input's beside it;
    backward, the input gradient's reduce-scatter is issued before the
    weight gradient's product and the weight gradient's own after it, both
    waited for last. The products are written out (as in 1d's column
    linear: a torch.autograd.grad per gradient would each be a backward of
    its own, recomputing a checkpointed block again), so overlap=False (each
    collective waited for at once) gives the same bits."""

    @staticmethod
    def forward(ctx, x, weight, layout: Layout3D, groups: dict, overlap: bool, ahead=None):
        pending = []

        def start(t, group):
            out, work = comm.all_gather(t, group, 0, async_op=True)
            pending.append(work) if overlap else _waited(work)
            return out

        # `ahead`: the weight's gather, issued during the previous linear (_Prefetch)
        weight_full = ahead() if ahead is not None else start(weight, groups["i"])
        x_full = start(x, groups[layout.rows])
        for work in pending:
            _waited(work)
        ctx.save_for_backward(x_full, weight_full)
        ctx.layout, ctx.groups, ctx.overlap = layout, groups, overlap
        return comm.reduce_scatter(F.linear(x_full, weight_full), groups[layout.hidden], 0)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = comm.all_gather(grad.contiguous(), ctx.groups[ctx.layout.hidden], 0)
        need_x, need_w = ctx.needs_input_grad[:2]
        out, pending = [None, None], []

        def scatter(k, full, group):
            out[k], work = comm.reduce_scatter(full, group, 0, async_op=True)
            pending.append(work) if ctx.overlap else _waited(work)

        if need_x:
            scatter(0, grad.matmul(weight), ctx.groups[ctx.layout.rows])
        if need_w:
            scatter(1, linear_grads(grad, x, True, False)[0], ctx.groups["i"])
        for work in pending:
            _waited(work)
        return out[0], out[1], None, None, None, None


def cube_linear(x: torch.Tensor, weight: torch.Tensor, layout: Layout3D, groups: dict,
                overlap: bool = True, ahead=None) -> torch.Tensor:
    """X W^T of this rank's blocks, X fed in `layout` (rows on dim 0);
    `ahead()`: the weight's gather, already issued."""
    # Under autocast, X and W are gathered (and Y reduce-scattered) in the compute dtype.
    return _CubeLinearFn.apply(to_compute(x), to_compute(weight), layout, groups, overlap, ahead)


class _Prefetch:
    """The next Linear3D's weight all-gather (over i) issued as a Linear3D's
    forward starts, so it runs during this linear's products
    (train.overlap). The next is the one after it in the first forward
    since `reset` (the training step's attach: after the start-up proof's
    own forwards). A gather is used only by its own linear, with the weight
    unchanged since (its version: the optimizer steps in place) and the
    same compute dtype; anything else (a recomputed block) is waited for
    and dropped. Every rank of a group runs the same forwards, so the
    gathers pair up in one order; the last linear has no next, so nothing
    is in flight between steps."""

    def __init__(self, group):
        self.group = group
        self.reset()

    def reset(self) -> None:
        self.after: dict[int, "nn.Module | None"] = {}  # id(linear) -> the next one
        self.last: "nn.Module | None" = None
        self.ahead = None  # (linear, version, dtype, gathered, work)
        self.used = 0  # gathers a linear took from here (counted for tests and benchmarks)

    def take(self, module: nn.Module):
        """As `module`'s forward starts: its gather if one was issued (a
        thunk that waits for it; None: gather now), and the next linear's
        gather issued."""
        if id(module) not in self.after:
            if self.last is not None:
                self.after[id(self.last)] = module
            self.after[id(module)], self.last = None, module
        mine, self.ahead = self.ahead, None
        following = self.after[id(module)]
        if following is not None:
            w = to_compute(following.weight).detach()
            out, work = comm.all_gather(w, self.group, 0, async_op=True)
            self.ahead = (following, following.weight._version, w.dtype, out, work)
        if mine is None:
            return None
        owner, version, dtype, out, work = mine
        if owner is not module or version != module.weight._version or dtype != to_compute(module.weight).dtype:
            _waited(work)
            return None
        self.used += 1
        return lambda: (_waited(work), out)[1]


def _take(prefetch: _Prefetch, module: nn.Module):
    return prefetch.take(module)


comm.also_eager(globals(), "_take")  # issues a collective and reads versions: never traced
comm.also_eager(globals(), "cube_linear")  # its collectives are issued and waited for out of order: kept eager


class Linear3D(nn.Module):
    def __init__(self, weight, bias, layout: Layout3D, groups: dict, overlap: bool = True,
                 prefetch: "_Prefetch | None" = None):
        super().__init__()
        self.weight, self.bias, self.layout = weight, bias, layout
        self.groups, self.overlap = groups, overlap
        object.__setattr__(self, "prefetch", prefetch)  # shared by the mode's linears: not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ahead = _take(self.prefetch, self) if self.prefetch is not None else None
        y = cube_linear(x, self.weight, self.layout, self.groups, self.overlap, ahead)
        return y if self.bias is None else y + self.bias.to(y.dtype)


class Embedding3D(nn.Module):
    """A lookup as a 3d linear of one-hot rows: gather this rank's vocabulary
    block over i, look up the ids of rows block i that fall in it, then sum
    over the vocabulary blocks while scattering the rows."""

    def __init__(self, weight, layout: Layout3D, vocab_block: int, groups: dict, scale: float = 1.0,
                 padding_idx=None):
        super().__init__()
        self.weight, self.layout, self.vocab_block = weight, layout, vocab_block
        self.weight_group, self.rows_group = groups["i"], groups[layout.rows]
        self.scale, self.padding_idx = scale, padding_idx  # the original embedding's (layers.embedding_semantics)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        table = comm.gather_along(self.weight, self.weight_group, 0)
        out = vocab_block_lookup(ids, table, self.vocab_block * table.shape[0], self.padding_idx)
        if self.scale != 1.0:
            out = out * torch.tensor(self.scale, dtype=out.dtype)
        return comm.reduce_scatter_along(out, self.rows_group, 0)


def _own_rows(forward, q: int, j: int, fed: dict, *args, **kwargs) -> torch.Tensor:
    """A position table's output, cut to rows block j of q where it holds
    the rows the model was fed (`fed["rows"]`, rows block i: BERT's token
    types, expanded to the input ids' shape); not one row broadcast to all,
    a bare [seq] of positions (GPT's), nor rows made from the embedding's
    output (OPT's positions from a mask of its rows: already this rank's)."""
    out = forward(*args, **kwargs)
    rows = fed.get("rows", 1)
    return out.chunk(q, 0)[j] if rows > 1 and out.dim() >= 3 and out.shape[0] == rows else out


def _record_rows(fed: dict, module, args, kwargs) -> None:
    """Pre-hook of the model: how many rows of ids it is fed."""
    ids = args[0] if args else kwargs.get("input_ids")
    if isinstance(ids, torch.Tensor) and ids.dim() == 2:
        fed["rows"] = ids.shape[0]


@register
class ThreeD(ParallelMode):
    name = "3d"
    axes = ("i", "j", "l")
    # Lines along each cube axis, and the two planes over which a
    # hidden-split parameter is replicated in each layout.
    grid_groups = {"i": ("i",), "j": ("j",), "l": ("l",), "ij": ("i", "j"), "il": ("i", "l")}
    overlap = True  # train.overlap (training.build sets it): each linear's collectives beside each other and its products

    @classmethod
    def geometry(cls, size: int, depth: int = 1) -> Geometry:
        q = exact_root(size, 3)
        if q is None:
            raise ConfigError("size", size, "mode=3d needs a cube number of ranks (1, 8, 27, ...)")
        # A weight's output dim is stored in q*q blocks, so linears need q*q.
        return Geometry(cls.name, size, 1, q, q * q, q * q, q, q * q)

    @classmethod
    def grid_shape(cls, geo: Geometry) -> tuple[int, ...]:
        return (geo.q, geo.q, geo.q)

    def __init__(self, mesh):
        super().__init__(mesh)
        self.q = mesh.geo.q
        self.c = mesh.coords
        self.fed: dict = {}  # the rows of ids the model was last fed (_record_rows)

    def prepare(self, model, plan) -> None:
        model.register_forward_pre_hook(functools.partial(_record_rows, self.fed), with_kwargs=True)

    # ---- cost (mode.ParallelMode) -------------------------------------------
    loss_group_name, stream_group_name = LAYOUT_B.hidden, LAYOUT_A.hidden

    def cost_rows(self, tokens: int) -> int:
        return tokens // (self.q * self.q)

    def cost_hidden(self, hidden: int) -> int:
        return hidden // self.q

    def cost_embedding(self, add, tokens: int, vocab: int, dim: int) -> None:
        q = self.q
        add("all_gather", "i", vocab // q * (dim // q))
        add("reduce_scatter", "i", vocab // q * (dim // q))
        add("reduce_scatter", LAYOUT_A.rows, tokens // q * (dim // q))
        add("all_gather", LAYOUT_A.rows, tokens // q * (dim // q))

    def cost_norm(self, add, tokens: int, hidden: int, moments: int = 2) -> int:
        add("all_reduce", LAYOUT_A.hidden, moments * self.cost_rows(tokens), times=2)
        return super().cost_norm(add, tokens, hidden)

    def cost_proj_norm(self, add, tokens: int, role: str, moments: int) -> None:
        # the output features land in the flipped layout of the Linear's
        # input (output_spec): split over its hidden axis, rows as many
        add("all_reduce", ROLE_LAYOUT[role].flip().hidden, moments * self.cost_rows(tokens), times=2)

    def cost_head_reduce(self, add, tokens: int, role: str, heads: int) -> None:
        add("reduce_scatter", ROLE_LAYOUT[role].flip().hidden, heads * self.cost_rows(tokens))
        add("all_gather", ROLE_LAYOUT[role].flip().hidden, heads * self.cost_rows(tokens))

    def cost_sliced_replicas(self, role: str) -> str:
        # heads in layout B's hidden block; own experts by layout A's
        return (LAYOUT_B if role == "latent_up" else LAYOUT_A).replica_plane

    def cost_latent(self, add, tokens: int, hidden: int) -> None:
        # rows (i, j) made whole, then gathered to block i (attention_rows)
        super().cost_latent(add, tokens, hidden)
        add("all_gather", LAYOUT_A.rows, tokens // self.q * hidden)
        add("reduce_scatter", LAYOUT_A.rows, tokens // self.q * hidden)

    def cost_linear(self, add, role: str, tokens: int, n: int, k: int) -> int:
        q, layout = self.q, ROLE_LAYOUT[role]
        x, w, y = tokens // q * (k // q), (n // q) * (k // q), tokens // q * (n // q)
        for group, numel in ((layout.rows, x), ("i", w)):  # X and W gathered; backward: reduce-scattered
            add("all_gather", group, numel)
            add("reduce_scatter", group, numel, hidden=group != "i")  # dX's beside dW's product
        add("reduce_scatter", layout.hidden, y)
        add("all_gather", layout.hidden, y)
        return x + w

    def cost_rows_like_output(self, add, role: str, tokens: int, width: int) -> None:
        rows = self.cost_rows(tokens) * self.q * width  # block i, gathered over the fed rows' axis
        add("all_gather", ROLE_LAYOUT[role].rows, rows)
        add("reduce_scatter", ROLE_LAYOUT[role].rows, rows)

    # ---- data: read rows block i; feed it whole (the embedding scatters
    # it to rows (i, j)); score rows (i, l), where the LM head's logits land.
    def read_block(self):
        return self.c["i"], self.q

    def split_target(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.chunk(self.q, 0)[self.c[LAYOUT_B.rows]]

    def shard_hidden(self, rows: torch.Tensor, layout: Layout3D = LAYOUT_A) -> torch.Tensor:
        """This rank's piece of an activation in `layout` (default: the
        residual stream's), given rows block i (or one row, broadcast)."""
        if rows.shape[0] > 1:
            rows = rows.chunk(self.q, 0)[self.c[layout.rows]]
        return rows.chunk(self.q, -1)[self.c[layout.hidden]]

    def splits_stream(self, ctx) -> bool:
        return True

    def stream_spec(self, full: torch.Tensor) -> ShardSpec:
        """The stream's (layout A's) hidden block of the last dimension, as a norm's weight."""
        return self._hidden_spec(full, LAYOUT_A, full.dim() - 1)

    @property
    def loss_replicas(self) -> int:
        return self.q

    def loss_group(self):
        return self.mesh.groups[LAYOUT_B.hidden]

    def vocab_block(self) -> int:
        return self.c[LAYOUT_B.hidden]

    def head_block(self) -> int:
        return self.c[LAYOUT_B.hidden]  # q, k and v are in layout B

    def attention_row_block(self) -> int:
        return self.c[LAYOUT_B.rows]

    # ---- parameter layouts -------------------------------------------------
    def _weight_ranges(self, n: int, layout: Layout3D, fused=None):
        """Block (r, i) of q*q blocks of an output dim fed `layout` (of the
        features in `fused`'s order: a FusedLayout)."""
        index = self.c[layout.rows] * self.q + self.c["i"]
        if fused is not None:
            return fused.ranges(self.q, self.q * self.q, index)
        return block(n, self.q * self.q, index)

    def _hidden_spec(self, full: torch.Tensor, layout: Layout3D, dim: int = 0, ranges=None) -> ShardSpec:
        """Split by `layout`'s hidden block, replicated over its plane."""
        if ranges is None:
            ranges = block(full.shape[dim], self.q, self.c[layout.hidden])
        return self.split_spec(full, dim, ranges, replicas=layout.replica_plane)

    def weight_spec(self, weight, role: str, layout=None, n: int | None = None) -> ShardSpec:
        fed = ROLE_LAYOUT[role]
        n = n if n is not None else weight.shape[0]
        in_ranges = block(weight.shape[1], self.q, self.c[fed.hidden])
        return ShardSpec(tuple(weight.shape), (self._weight_ranges(n, fed, layout), in_ranges))

    def linear_fn(self, role: str):
        overlap = self.overlap
        return lambda x, weight: cube_linear(x, weight, ROLE_LAYOUT[role], self.mesh.groups, overlap)

    def stream_group(self):
        return self.mesh.groups[LAYOUT_A.hidden]

    def attention_rows(self, x: torch.Tensor, gathered: bool = False) -> torch.Tensor:
        """Rows (i, j) of the stream made whole, gathered to block i, cut to
        the attention's rows (i, l) (ParallelMode.attention_rows)."""
        x = comm.gather_along(comm.gather_along(x, self.stream_group(), -1), self.mesh.groups[LAYOUT_A.rows], 0)
        return x.chunk(self.q, 0)[self.c[LAYOUT_B.rows]]

    def rows_like_output(self, t: torch.Tensor, role: str) -> torch.Tensor:
        """Rows (i, r) of `role`'s fed layout (hidden h) gathered to block i
        over r, cut to the rows (i, h) its flipped output holds
        (ParallelMode.rows_like_output). Backward, the gradient of rows
        (i, h) placed in block i and reduce-scattered over r: rank (i, r, h)
        gets the whole gradient of rows (i, r) where r == h, else zero, and
        the sum over h (the stream group, where the experts' router sums
        its routing weights' gradient) is exact."""
        fed = ROLE_LAYOUT[role]
        return comm.gather_along(t, self.mesh.groups[fed.rows], 0).chunk(self.q, 0)[self.c[fed.hidden]]

    def attach_grads(self, model_parts: list[nn.Module], micro_batches: int) -> None:
        """Training starts: the weight prefetch learns the linears' order anew
        (the start-up proof ran them in its own)."""
        if getattr(self, "prefetch", None) is not None:
            self.prefetch.reset()

    def linear_module(self, weight, bias, role: str) -> Linear3D:
        """A linear role's Linear on the cube, in its role's layout (the
        default ParallelMode.convert_linear shards it by weight_spec/output_spec)."""
        layout = self.mesh.layout
        # (ZeRO 3 gathers a block's weights just before its forward: none to read ahead of it.)
        ahead = self.overlap and not (layout.dp * layout.cp > 1 and layout.zero == 3)
        if ahead and getattr(self, "prefetch", None) is None:
            self.prefetch = _Prefetch(self.mesh.groups["i"])
        return Linear3D(weight, bias, ROLE_LAYOUT[role], self.mesh.groups, self.overlap,
                        self.prefetch if ahead else None)

    def output_spec(self, tensor, role: str, layout=None, n: int | None = None) -> ShardSpec:
        """Output features land in the flipped layout of the Linear's input."""
        out_layout, n = ROLE_LAYOUT[role].flip(), n if n is not None else tensor.shape[0]
        b = self.c[out_layout.hidden]
        ranges = layout.ranges(self.q, self.q, b) if layout is not None else block(n, self.q, b)
        return self._hidden_spec(tensor, out_layout, ranges=ranges)

    def output_group(self, role: str):
        return self.mesh.groups[ROLE_LAYOUT[role].flip().hidden]

    # ---- roles ----------------------------------------------------------------
    def convert_embedding(self, module: nn.Embedding, ctx):
        rows = self.padded_vocab(module.num_embeddings)
        in_ranges = block(module.embedding_dim, self.q, self.c[LAYOUT_A.hidden])
        spec = ShardSpec(tuple(module.weight.shape), (self._weight_ranges(rows, LAYOUT_A), in_ranges))
        return Embedding3D(ctx.shard(module.weight, spec), LAYOUT_A, self.c[LAYOUT_A.rows], self.mesh.groups,
                           *embedding_semantics(module))

    def convert_pos_embedding(self, module: nn.Embedding, ctx):
        # The module's own forward on this rank's hidden block of the table.
        module.weight = ctx.shard(module.weight, self._hidden_spec(module.weight, LAYOUT_A, dim=1))
        if ctx.shapes_only:
            return module
        # Ids with the input's rows (BERT's token types, expanded to rows
        # block i) look up rows the token embedding scatters to blocks
        # (i, j): this rank keeps its block of them, as shard_hidden does
        # (positions, one row for every row, stay broadcast).
        # (its forward itself: the start-up check replays forward, not hooks)
        module.forward = functools.partial(_own_rows, module.forward, self.q, self.c[LAYOUT_A.rows], self.fed)
        return module

    def convert_norm(self, module: nn.Module, ctx):
        shard = lambda p, features: ctx.shard(p, self._hidden_spec(p, LAYOUT_A, ranges=features))  # noqa: E731
        features = block(norm_width(module), self.q, self.c[LAYOUT_A.hidden])
        return SplitNorm.like(module, features, shard, self.mesh.groups[LAYOUT_A.hidden])

    def convert_dropout(self, module: nn.Dropout, ctx):
        return ParallelDropout(module.p, self.mesh.rng_local)  # every activation is sharded

    convert_attn_dropout = convert_dropout
