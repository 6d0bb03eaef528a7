"""mode=1d: Megatron-LM tensor parallelism over P ranks.

Column-parallel linears split the output features (each rank holds whole
heads of q, k and v; whole slices of the MLP's hidden layer), row-parallel
linears split the input features and all-reduce their output. Activations
between blocks are replicated, or, with sequence parallelism, split along the
sequence: then all-reduce becomes reduce-scatter and the column-linear's
input is all-gathered, so norms and dropout run on a sequence shard.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tpctl.parallel import comm
from tpctl.parallel.dropout import ParallelDropout
from tpctl.parallel.geometry import Geometry
from tpctl.parallel.registry import register
from tpctl.parallel.roles.experts import experts_layout, routing_weights_arg
from tpctl.parallel.roles.plan import COLUMN_ROLES
from tpctl.parallel.roles.probes import embedding_semantics
from tpctl.parallel.shard import ShardSpec, block
from tpctl.parallel.tensor.layers import linear_grads, to_compute, vocab_block_lookup
from tpctl.parallel.tensor.mode import ParallelMode, RewriteContext
from tpctl.parallel.tensor.whole import split_mixer

SEQ_DIM = 1  # activations are [batch, seq, hidden]


class _ColumnLinearFn(torch.autograd.Function):
    """Y = X W^T (+ b) on the replicated (or gathered) input, whose backward
    issues the input gradient's all-reduce (reduce-scatter onto sequence
    shards) before the weight gradient's product and waits for it after, as
    Megatron-LM does: the collective runs beside the matmul. The products
    are written out (linear_grads), not asked of autograd one gradient at a
    time: each such request is a backward of its own, and under activation
    checkpointing each would recompute the whole block again. overlap=False
    (wait at once) gives the same bits. X, W and b arrive in one dtype
    (ColumnLinear casts them: to_compute)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, gather: bool, overlap: bool):
        if gather:
            x = comm.all_gather(x, group, SEQ_DIM)  # a fresh tensor: the one kept for the backward
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.gather, ctx.overlap = group, gather, overlap
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]  # (False for a bias that is None)
        grad_x = work = None
        if need_x:
            grad_x = grad.matmul(weight)  # a fresh buffer: summed in place
            if ctx.gather:
                grad_x, work = comm.reduce_scatter(grad_x, ctx.group, SEQ_DIM, async_op=True)
            else:
                grad_x, work = comm.all_reduce(grad_x, ctx.group, async_op=True)
            if not ctx.overlap:
                work.wait()
                work = None
        grad_w, grad_b = linear_grads(grad, x, need_w, need_b)
        if work is not None:
            work.wait()
        return grad_x, grad_w, grad_b, None, None, None


class ColumnLinear(nn.Module):
    """Y[:, p] = X W[p]^T (+ b[p]): output split along features. The input
    is replicated (`entry="replicated"`), sequence shards that it gathers
    (`"seq_shards"`), or already gathered by the attention or MLP module it
    sits in (`"gathered"`: that module's entry hook does the communication).
    overlap: the input gradient's collective runs beside the weight
    gradient's product (False: waited for at once; the same bits)."""

    def __init__(self, weight, bias, group, entry: str = "replicated", overlap: bool = True):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.group, self.entry, self.overlap = group, entry, overlap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = to_compute(x)  # under autocast: the gather and the backward all-reduce in the compute dtype
        if self.entry == "gathered" or comm.group_size(self.group) == 1:
            return F.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else to_compute(self.bias)
        return _column_linear(x, to_compute(self.weight), bias, self.group, self.entry == "seq_shards", self.overlap)


def _column_linear(x, weight, bias, group, gather: bool, overlap: bool) -> torch.Tensor:
    return _ColumnLinearFn.apply(x, weight, bias, group, gather, overlap)


comm.also_eager(globals(), "_column_linear")  # its backward issues a collective mid-way: kept eager


class RowLinear(nn.Module):
    """Y = sum_p X[:, p] W[:, p]^T (+ b): input split along features, output
    all-reduced (or reduce-scattered onto sequence shards)."""

    def __init__(self, weight, bias, group, seq_parallel: bool):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.group, self.seq_parallel = group, seq_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.seq_parallel:
            y = comm.reduce_scatter_along(y, self.group, SEQ_DIM)
        else:
            y = comm.reduce_to_replicated(y, self.group)
        return y if self.bias is None else y + self.bias.to(y.dtype)


class VocabEmbedding(nn.Module):
    """Each rank holds a block of the vocabulary's rows: look up the ids
    that fall in it, zero the rest, and sum over ranks."""

    def __init__(self, weight, vocab_start: int, group, seq_parallel: bool, scale: float = 1.0, padding_idx=None):
        super().__init__()
        self.weight, self.vocab_start = weight, vocab_start
        self.group, self.seq_parallel = group, seq_parallel
        self.scale, self.padding_idx = scale, padding_idx  # the original embedding's (layers.embedding_semantics)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = vocab_block_lookup(ids, self.weight, self.vocab_start, self.padding_idx)
        if self.scale != 1.0:
            out = out * torch.tensor(self.scale, dtype=out.dtype)
        if self.seq_parallel:
            return comm.reduce_scatter_along(out, self.group, SEQ_DIM)
        return comm.reduce_to_replicated(out, self.group)


class SeqShardPosEmbedding(nn.Module):
    """A replicated position table whose output keeps only this rank's
    sequence shard, to match sequence-parallel activations."""

    def __init__(self, weight, group):
        super().__init__()
        self.weight, self.group = weight, group

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        return comm.split_block(F.embedding(pos, self.weight), self.group, 0)


@register
class OneD(ParallelMode):
    name = "1d"
    replicated_activations = True
    sequence_parallel = True

    @classmethod
    def geometry(cls, size: int, depth: int = 1) -> Geometry:
        return Geometry(cls.name, size, 1, 1, 1, size, size, size)

    @classmethod
    def variants(cls, size: int) -> list[dict]:
        return [{}, {"seq_parallel": True}] if size > 1 else []

    def __init__(self, mesh):
        super().__init__(mesh)
        self.seq_parallel = mesh.layout.seq_parallel
        self.group = mesh.tp_group
        self.p, self.world = mesh.tp_rank, mesh.tp_size
        # With sequence parallelism the residual stream is split along the
        # sequence from the embedding on, or -- for a model that computes
        # positions, masks or reshapes from the full sequence length outside
        # its blocks (Hugging Face models) -- inside the blocks only: split on
        # entering the first, gathered on leaving the last. `blocks` names
        # that module list; None: the first way.
        self.blocks: str | None = None
        self.gathered: set[str] = set()  # Linears whose input a module's entry hook gathered
        self.gathered_owners: set[str] = set()  # the modules of those entry hooks (attention, MLP)
        # train.overlap: collectives issued async beside independent compute
        # (False: each waited for at once, the same bits; for measuring it).
        self.overlap = True

    # ---- cost (mode.ParallelMode) -----------------------------------------
    loss_group_name = "tp"

    def recompute_comm_share(self, dropout: bool, kind: str) -> float:
        # A block's forward and backward issue 4 sums of the stream (the
        # outputs' and the column inputs' gradients) -- with sequence
        # parallelism 4 gathers and 4 reduce-scatters instead -- half of
        # them in the forward. The recomputation issues the forward's again
        # but the MLP output's sum (or reduce-scatter) when nothing after it
        # saves a tensor (no dropout). The other kinds are the embedding's
        # and the loss's, outside the blocks.
        if kind not in (("all_gather", "reduce_scatter") if self.seq_parallel else ("all_reduce",)):
            return 0.0
        return 1 / 2 if dropout or kind == "all_gather" else 1 / 4

    def cost_vocab(self, vocab: int) -> int:
        return vocab // self.world

    def cost_norm(self, add, tokens: int, hidden: int, moments: int = 2) -> int:
        return 2 * (tokens // self.world if self.seq_parallel else tokens) * hidden

    def cost_proj_norm(self, add, tokens: int, role: str, moments: int) -> None:
        # An attention's Linears hold whole rows of the whole sequence (with
        # sequence parallelism its entry gathered it), their features split
        # over the group.
        add("all_reduce", "tp", moments * tokens, times=2)

    def cost_head_reduce(self, add, tokens: int, role: str, heads: int) -> None:
        add("reduce_scatter", "tp", heads * tokens)
        add("all_gather", "tp", heads * tokens)

    def cost_latent(self, add, tokens: int, hidden: int) -> None:
        # copy_to_group: the heads' partial input gradients summed. (With
        # sequence parallelism the attention module's entry gathers the
        # sequence for all its Linears: counted by none of these hooks.)
        if not self.seq_parallel:
            add("all_reduce", "tp", tokens * hidden)

    def cost_whole(self, add, tokens: int, hidden: int) -> None:
        # the sequence gathered on entry (backward: reduce-scatter); without
        # sequence parallelism the stream is whole already
        if self.seq_parallel:
            add("all_gather", "tp", tokens * hidden)
            add("reduce_scatter", "tp", tokens * hidden)

    def cost_mixer(self, add, tokens: int, hidden: int) -> None:
        # A mixer split by heads (convert_mixer): the input's gradient summed
        # (backward) and the partial output summed -- with sequence
        # parallelism the sequence gathered (backward: reduce-scatter) and
        # the output reduce-scattered (backward: gather)
        if self.seq_parallel:
            self.cost_whole(add, tokens, hidden)
            self._cost_reduce_out(add, tokens * hidden)
        else:
            add("all_reduce", "tp", tokens * hidden, times=2)

    def cost_mixer_reduce(self, add, tokens: int, width: int) -> None:
        # x_proj's partial sum over the group, forward and backward (whole rows: with sequence
        # parallelism the mixer's entry gathered the sequence)
        add("all_reduce", "tp", tokens * width, times=2)

    def cost_experts(self, add, tokens: int, hidden: int, e) -> int:
        # (own module or not) the partial output summed; backward: the
        # input's and the routing weights' partial gradients
        for numel in (tokens * hidden, tokens * hidden, tokens * e.routed):
            if numel:  # (none for routing weights where the call has none: Llama 4's)
                add("all_reduce", "tp", numel)
        return tokens * hidden

    def cost_embedding(self, add, tokens: int, vocab: int, dim: int) -> None:
        self._cost_reduce_out(add, tokens * dim)

    def cost_linear(self, add, role: str, tokens: int, n: int, k: int) -> int:
        if role in COLUMN_ROLES:
            # the input gradient's sum runs beside the weight gradient's product (_ColumnLinearFn)
            if self.seq_parallel:  # gather the input's sequence shards; backward: reduce-scatter its gradient
                add("all_gather", "tp", tokens * k)
                add("reduce_scatter", "tp", tokens * k, hidden=True)
            else:
                add("all_reduce", "tp", tokens * k, hidden=True)
            return tokens * k
        self._cost_reduce_out(add, tokens * n)
        return tokens * k // self.world

    def _cost_reduce_out(self, add, numel: int) -> None:
        """A partial output summed over the group: all-reduce, or with
        sequence parallelism reduce-scatter (and the backward's all-gather)."""
        if self.seq_parallel:
            add("reduce_scatter", "tp", numel)
            add("all_gather", "tp", numel)
        else:
            add("all_reduce", "tp", numel)

    def prepare(self, model, plan) -> None:
        self.blocks, self.gathered, self.gathered_owners = None, set(), set()
        if self.seq_parallel and "experts" in plan.roles.values():
            raise ValueError("sequence parallelism with a mixture-of-experts block is not supported (its routed "
                             "experts and shared expert would need one sum over the sequence shards after the block "
                             "flattens its rows); use seq_parallel=false")
        if self.seq_parallel and plan.source == "inferred" and plan.blocks:
            self.blocks = plan.blocks
            blocks = model.get_submodule(plan.blocks)
            blocks[0].register_forward_pre_hook(self._split_sequence, with_kwargs=True)
            blocks[-1].register_forward_hook(self._gather_sequence)
            # Attention and MLP modules may read the sequence length from
            # their input (Llama's view(*input_shape, -1, d)): they get the
            # whole sequence, gathered once on entry for all their Linears.
            for owner, members in plan.units.items():
                inner = [o for o in plan.units if o != owner and (not owner or o.startswith(owner + "."))]
                if inner:
                    # OPT's fc1/fc2 sit in the decoder layer itself, which
                    # also holds the attention (and flattens the rows).
                    raise ValueError(f"{', '.join(members)} have no module of their own "
                                     f"({owner or 'the model'} also holds {', '.join(inner)}): "
                                     "sequence parallelism cannot gather their input once; use seq_parallel=false")
                model.get_submodule(owner).register_forward_pre_hook(self._gather_on_entry, with_kwargs=True)
                self.gathered.update(members)
                self.gathered_owners.add(owner)

    def _gather_on_entry(self, module, args, kwargs):
        """Pre-hook of an attention or MLP module: its hidden states (the
        first argument) from sequence shards to the whole sequence; the
        backward sums the Linears' partial input gradients and scatters."""
        if args:
            return (comm.gather_along(args[0], self.group, SEQ_DIM), *args[1:]), kwargs
        kwargs["hidden_states"] = comm.gather_along(kwargs["hidden_states"], self.group, SEQ_DIM)
        return args, kwargs

    def _split_sequence(self, module, args, kwargs):
        """Pre-hook of the first block: keep this rank's sequence shard of
        its (replicated) hidden states, the first argument."""
        if args:
            return (comm.split_along(args[0], self.group, SEQ_DIM), *args[1:]), kwargs
        kwargs["hidden_states"] = comm.split_along(kwargs["hidden_states"], self.group, SEQ_DIM)
        return args, kwargs

    def _gather_sequence(self, module, args, out):
        """Hook of the last block: the whole sequence again, replicated."""
        if isinstance(out, tuple):
            return (comm.gather_to_replicated(out[0], self.group, SEQ_DIM), *out[1:])
        return comm.gather_to_replicated(out, self.group, SEQ_DIM)

    def _shards_sequence(self, ctx) -> bool:
        """Whether the module being converted sees a sequence shard."""
        return self.seq_parallel and (self.blocks is None or ctx.name.startswith(self.blocks + "."))

    def splits_stream(self, ctx) -> bool:
        return self._shards_sequence(ctx)

    def whole_split(self, ctx):
        return (self.group, SEQ_DIM) if self._shards_sequence(ctx) else None

    def shard_hidden(self, rows: torch.Tensor) -> torch.Tensor:
        return comm.split_block(rows, self.group, SEQ_DIM) if self.seq_parallel else rows

    @property
    def loss_replicas(self) -> int:
        return self.world

    def loss_group(self):
        return self.group

    def vocab_block(self) -> int:
        return self.p

    def head_block(self) -> int:
        return self.p

    def _split(self, tensor, dim: int, n: int, layout=None) -> ShardSpec:
        ranges = layout.ranges(self.world, self.world, self.p) if layout else block(n, self.world, self.p)
        return self.split_spec(tensor, dim, ranges)

    def output_spec(self, tensor, role: str, layout=None, n: int | None = None) -> ShardSpec:
        return self._split(tensor, 0, n if n is not None else tensor.shape[0], layout)

    def output_group(self, role: str):
        return self.group

    def _column(self, linear: nn.Linear, ctx: RewriteContext, role: str, rows: int | None = None) -> ColumnLinear:
        n = rows if rows is not None else linear.out_features
        layout = self.fused_layout(role, linear, ctx)
        weight = ctx.shard(linear.weight, self._split(linear.weight, 0, n, layout))
        bias = None if linear.bias is None else ctx.shard(linear.bias, self.output_spec(linear.bias, role, layout, n))
        entry = "gathered" if ctx.name in self.gathered else "seq_shards" if self._shards_sequence(ctx) else "replicated"
        return ColumnLinear(weight, bias, self.group, entry, self.overlap)

    def convert_qkv(self, module: nn.Linear, ctx):
        return self._column(module, ctx, "qkv")

    def convert_mlp_in(self, module: nn.Linear, ctx):
        return self._column(module, ctx, "mlp_in")

    def convert_attn_in(self, module: nn.Linear, ctx):
        return self._column(module, ctx, "attn_in")

    def convert_lm_head(self, module: nn.Linear, ctx):
        return self._column(module, ctx, "lm_head", rows=self.padded_vocab(module.out_features))

    def _row(self, linear: nn.Linear, ctx) -> RowLinear:
        weight = ctx.shard(linear.weight, self._split(linear.weight, 1, linear.in_features))
        bias = linear.bias
        if bias is not None:
            self.replicated(bias, "tp", partial=self._shards_sequence(ctx))
        return RowLinear(weight, bias, self.group, self._shards_sequence(ctx))

    convert_attn_out = convert_mlp_out = _row

    def convert_embedding(self, module: nn.Embedding, ctx):
        rows = self.padded_vocab(module.num_embeddings)
        weight = ctx.shard(module.weight, self._split(module.weight, 0, rows))
        return VocabEmbedding(weight, self.p * (rows // self.world), self.group, self._shards_sequence(ctx),
                              *embedding_semantics(module))

    def convert_pos_embedding(self, module: nn.Embedding, ctx):
        shards = self._shards_sequence(ctx)
        self.replicated(module.weight, "tp", partial=shards)
        return SeqShardPosEmbedding(module.weight, self.group) if shards else module

    def convert_norm(self, module: nn.Module, ctx):
        for param in module.parameters():
            self.replicated(param, "tp", partial=self._shards_sequence(ctx))
        return module

    def convert_experts(self, module: nn.Module, ctx):
        """The experts module's own forward on this rank's slice of every
        expert (its routed rows only): [gate | up] rows and down columns of
        the hidden features it holds, as a column and a row Linear. Its
        partial output is summed once over the group; the input's and the
        routing weights' gradients (each rank's experts see a slice of the
        hidden features) are summed over the group in the backward."""
        gate_up, down, layout = experts_layout(module)
        for name, dim, ranges in ((gate_up, 1, layout.ranges(self.world, self.world, self.p)),
                                  (down, 2, block(getattr(module, down).shape[2], self.world, self.p))):
            full = getattr(module, name)
            setattr(module, name, ctx.shard(full, self.split_spec(full, dim, ranges)))
        module.register_forward_pre_hook(self._experts_entry, with_kwargs=True)
        module.register_forward_hook(lambda mod, args, out: comm.reduce_to_replicated(out, self.group))
        return module

    def _experts_entry(self, module, args, kwargs):
        args, kwargs = list(args), dict(kwargs)
        weights = routing_weights_arg(args, kwargs)
        for where in (0 if args else "hidden_states", weights):
            if where is None:  # (no routing weights among its arguments)
                continue
            box = args if isinstance(where, int) else kwargs
            box[where] = comm.copy_to_group(box[where], self.group)
        return tuple(args), kwargs

    # A mixer (role `whole`: Mamba-2, gated delta rule) with a measured split by heads
    # (roles/mixers.py) runs on this rank's heads (tensor/whole.py).
    def convert_mixer(self, module: nn.Module, ctx):
        seq = SEQ_DIM if self._shards_sequence(ctx) else None
        return split_mixer(self, module, ctx, self.group, self.world, self.p, seq)

    def convert_dropout(self, module: nn.Dropout, ctx):
        # Replicated activations need one mask on every rank; sequence shards
        # are different tokens and need their own.
        shards = self._shards_sequence(ctx)
        return ParallelDropout(module.p, self.mesh.rng_local if shards else self.mesh.rng_shared)

    def convert_attn_dropout(self, module: nn.Dropout, ctx):
        return ParallelDropout(module.p, self.mesh.rng_local)  # heads are split
