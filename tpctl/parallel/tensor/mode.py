"""The interface every tensor-parallel mode implements (`ParallelMode`), and
the context a mode's converters shard parameters through.

A mode answers three questions:
  * data: which rows of a micro-batch does this rank read, and which of
    those does it feed as input and score as targets;
  * layers: what replaces a module of a given role (embedding, qkv, ...);
  * loss: the vocab-parallel cross entropy over the ranks sharing rows.

The machinery that applies a mode to a model is parallel/tensor/rewrite.py.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from tpctl.parallel import comm
from tpctl.parallel.geometry import Geometry, padded_vocab
from tpctl.parallel.mesh import Mesh
from tpctl.parallel.roles.experts import DenseExperts, OwnSplit, eager_where_misaligned, experts_layout
from tpctl.parallel.roles.fused import FusedLayout, held_units
from tpctl.parallel.roles.probes import norm_width
from tpctl.parallel.shard import ShardSpec, make_param
from tpctl.parallel.tensor.cost_hooks import CostHooks
from tpctl.parallel.tensor.layers import SplitNorm
from tpctl.parallel.tensor.linear import LINEAR_ROLES, default_converter
from tpctl.parallel.tensor.loss import vocab_parallel_cross_entropy
from tpctl.parallel.tensor.replicas import sync_replicas
from tpctl.parallel.tensor.whole import gather_hidden, run_untrained, run_whole, split_mixer, split_own_experts


class RewriteContext:
    """State of one rewrite: keeps tied parameters tied, and asks a lazy
    (meta-device) parameter's source for this rank's slice alone."""

    def __init__(self, mesh: Mesh, init=None, shapes_only: bool = False):
        self.mesh = mesh
        self.init = init  # a models.init.ParamSource, for models built lazily
        # Make meta shards of the right shapes only (for tools that inspect layouts).
        self.shapes_only = shapes_only
        self.name = ""  # the module being converted
        self._new: dict[int, nn.Parameter] = {}
        # id -> a weak reference to the original sharded (the id alone may be
        # a freed original's, reused: `made_for` checks it is the same object)
        self._originals: dict[int, weakref.ref] = {}

    def shard(self, original: torch.Tensor, spec: ShardSpec) -> nn.Parameter:
        """The sharded parameter for `original`, created once: a parameter
        used by two modules (embedding = LM head) stays one parameter."""
        made = self._new.get(id(original))
        if made is None:
            if self.shapes_only:
                local = torch.empty(spec.local_shape(), dtype=original.dtype, device="meta")
            elif original.is_meta and self.init:  # read or made one shard at a time
                local = self.init.shard(original, spec)
            else:
                local = spec.slice(original.detach())
            made = self._new[id(original)] = make_param(local, spec)
            # (a frozen tensor stays frozen: Marian's sinusoidal position table, requires_grad off,
            # trained by no mode=none step; a shard made trainable would train it, silently)
            made.requires_grad_(original.requires_grad)
            self._originals[id(original)] = weakref.ref(original)
        elif (made.tpctl_spec.full_shape, made.tpctl_spec.index) != (spec.full_shape, spec.index):
            raise ValueError(f"a tied parameter {tuple(original.shape)} is used by layers that shard it differently")
        return made


    def made_for(self, original: torch.Tensor) -> Optional[nn.Parameter]:
        """The shard made for `original` (this very object), or None."""
        ref = self._originals.get(id(original))
        return self._new[id(original)] if ref is not None and ref() is original else None


class ParallelMode(CostHooks):
    """Base class of the modes; subclasses fill in the role converters and
    declare their grid. A mode registers itself (`registry.register`)."""

    name = ""
    # The tensor grid: its axes, slowest first (rank inside the grid =
    # mixed radix over them, last fastest), and its named groups: name ->
    # the axes in which the group's members differ.
    axes: tuple[str, ...] = ("p",)
    grid_groups: dict[str, tuple[str, ...]] = {}
    # Whether `depth` shapes the grid (2.5d) and whether sequence
    # parallelism applies (1d).
    uses_depth = False
    sequence_parallel = False
    # Activations between layers are whole on every rank of the grid (none,
    # 1d), so a parameter no role places can stay whole: its gradient is the
    # same on every rank.
    replicated_activations = False
    # Whether the rewrite replaces any layer (mode=none's does not: there is
    # nothing to verify).
    rewrites = True

    def __init_subclass__(cls, **kwargs):
        """A linear role the subclass has no `convert_<role>` for gets the
        default conversion (`convert_linear`: its weight_spec, output_spec,
        linear_fn)."""
        super().__init_subclass__(**kwargs)
        for role in LINEAR_ROLES:
            if getattr(cls, f"convert_{role}", None) is None:
                setattr(cls, f"convert_{role}", default_converter(role))

    @classmethod
    def geometry(cls, size: int, depth: int = 1) -> Geometry:
        """The grid of `size` ranks (ConfigError naming the key that does not fit)."""
        raise NotImplementedError

    @classmethod
    def grid_shape(cls, geo: Geometry) -> tuple[int, ...]:
        """The extent of each of `axes`."""
        return (geo.size,)

    @classmethod
    def variants(cls, size: int) -> list[dict]:
        """The layouts of a grid of `size` ranks this mode offers the
        planner, as Layout keyword arguments ([] for none)."""
        return [{}] if size > 1 else []

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.geo = mesh.geo
        # Fused Linear name -> its FusedLayout (parallel/roles/fused.py), from the plan.
        self.layouts: dict = {}
        # proj_norm -> the Linear it normalises, and that Linear -> its role (from the plan).
        self.sources: dict = {}
        self.source_roles: dict = {}
        self.head_rows: dict = {}  # per-head norms with one weight row per head (from the plan)

    # ---- data ---------------------------------------------------------
    def read_block(self) -> tuple[int, int]:
        """(index, count): this rank reads row block `index` of `count`
        equal blocks of its data-parallel share of a micro-batch."""
        return 0, 1

    def split_input(self, rows: torch.Tensor) -> torch.Tensor:
        return rows

    def split_target(self, rows: torch.Tensor) -> torch.Tensor:
        return rows

    def shard_hidden(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a [rows, seq, hidden] activation between
        blocks (the residual stream), given the rows it reads."""
        return rows

    def read_rows(self, share: range) -> range:
        """This rank's rows of `share`, its replica's rows of a micro-batch
        (data_parallel.DataParallel.share): row block `read_block()`."""
        index, count = self.read_block()
        per_rank = len(share) // count
        start = share.start + index * per_rank
        return range(start, start + per_rank)

    # ---- loss ---------------------------------------------------------
    # How many tensor-parallel ranks hold (a replica of) each row's loss.
    @property
    def loss_replicas(self) -> int:
        return 1

    def loss_group(self) -> Optional[dist.ProcessGroup]:
        """The ranks that share rows of the logits (and split the vocab)."""
        return None

    def vocab_block(self) -> int:
        """Index of this rank's block of the (padded) vocabulary in logits."""
        return 0

    def cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                      label_smoothing: float = 0.0) -> torch.Tensor:
        """Per-token loss of this rank's rows; full logits are never gathered."""
        width = logits.shape[-1]
        return vocab_parallel_cross_entropy(
            logits.reshape(-1, width), targets.reshape(-1), self.vocab_block() * width,
            vocab_size, self.loss_group(), label_smoothing,
        )

    # ---- gradients ------------------------------------------------------
    def sync_grads(self, params) -> None:
        """Sum the gradients of the grid's own replicas (per ShardSpec) of
        `params`: a model, or the parameters the optimizer steps."""
        sync_replicas(params)

    def attach_grads(self, model_parts: list[nn.Module], micro_batches: int) -> None:
        """Before a training step's first backward (gradients final after
        `micro_batches` accumulations): a mode that sums some gradients
        during the backward installs its hooks (2.5d's depth sums)."""

    def sums_during_backward(self, spec) -> bool:
        """Whether a parameter's replica sum runs during the backward (the planner counts it hidden)."""
        return False

    # ---- cost: the planner's model of one micro-batch on this rank
    # (cost_hooks.CostHooks: cost_rows, cost_linear, ..., mode=none's)

    # ---- layers -------------------------------------------------------
    def convert(self, role: str, module: nn.Module, ctx: RewriteContext) -> nn.Module:
        if role == "experts" and isinstance(self.layouts.get(ctx.name), OwnSplit):
            return eager_where_misaligned(self.convert_own_experts(module, ctx)) if self.rewrites else module
        converter: Optional[Callable] = getattr(self, f"convert_{role}", None)
        if converter is None:
            raise ValueError(f"mode {self.name} has no layer for role {role!r}")
        new = converter(module, ctx)
        # (1d runs the experts' own forward on its shards: grouped_mm may refuse their widths)
        return eager_where_misaligned(new) if role == "experts" else new

    def head_block(self) -> int:
        """Index of this rank's block of attention heads (of geo.head_split)."""
        return 0

    def attention_row_block(self) -> int:
        """Which chunk of the rows the model's input holds the attention of
        this rank sees (3d splits rows again inside attention)."""
        return 0

    def fused_layout(self, role: str, module: nn.Module, ctx: RewriteContext):
        """The layout of the output features of the Linear being converted:
        the measured one of a fused projection; for a `qkv` Linear of a
        given plan (tp_plan: the role declares it), three equal parts
        [q | k | v]; else None (split in plain blocks)."""
        layout = self.layouts.get(ctx.name)
        if layout is None and role == "qkv":
            layout = FusedLayout.equal(module.out_features, ("q", "k", "v"))
        return layout

    def convert_proj_norm(self, module: nn.Module, ctx: RewriteContext) -> nn.Module:
        """A norm over all heads of q or k (OLMo-2): its features are the
        output features of the projection it normalises, held as that
        projection's are (where its bias would land), the moments summed
        over the ranks splitting them; a shared key/value head, held by
        several of them, is counted once."""
        source = self.sources[ctx.name]
        role, layout = self.source_roles[source], self.layouts.get(source)
        spec = lambda p: self.output_spec(p, role, layout)  # noqa: E731
        features = spec(torch.empty(norm_width(module), device="meta")).index[0]
        copies = 1
        if layout is not None and layout.shares(self.geo.head_split):
            counts = layout.holders(self.geo.head_split)
            if not bool((counts == counts[0]).all()):
                raise ValueError(f"{ctx.name}: one norm over features held by different numbers of ranks")
            copies = int(counts[0])
        return SplitNorm.like(module, features, lambda p, f: ctx.shard(p, spec(p)), self.output_group(role), copies)

    def output_spec(self, tensor: torch.Tensor, role: str, layout=None, n: Optional[int] = None) -> ShardSpec:
        """Where a Linear of `role` puts its output features (its bias's
        ShardSpec): they follow its weight's `layout` if it has one."""
        return self.split_spec(tensor)

    def output_group(self, role: str):
        """The ranks splitting the output features of a Linear of `role`
        (the same rows): what a norm over them sums over."""
        return None

    def splits_stream(self, ctx: RewriteContext) -> bool:
        """Whether the residual stream where the module being converted
        sits is split between ranks (rows, hidden or sequence)."""
        return False

    def convert_pos_table(self, module: nn.Module, ctx: RewriteContext) -> nn.Module:
        """A table of constants as wide as the stream (sinusoidal
        positions): its output, computed whole, cut to this rank's piece."""
        if self.splits_stream(ctx):
            module.register_forward_hook(lambda mod, args, out: self.shard_hidden(out))
        return module

    def stream_group(self):
        """The ranks holding the other hidden features of this rank's rows
        of the residual stream (None: a rank holds whole rows)."""
        return None

    def stream_spec(self, full: torch.Tensor) -> Optional[ShardSpec]:
        """Where a tensor whose last dimension is the stream's features lives
        (a bias added to the stream outside any Linear, a sinusoidal table):
        this rank's features of it, as its piece of the stream holds them,
        the ranks with other rows holding replicas; None where every rank
        holds the stream's features whole (tensor/layers.hold_stream_tensors)."""
        return None

    def convert_router(self, module: nn.Module, ctx: RewriteContext) -> nn.Module:
        """A mixture-of-experts router (or a per-row gate beside it) scores
        a row from its whole hidden vector, and every rank holding the row
        must route it alike: it runs as written on the row gathered over
        the ranks holding its other features, its weight whole on every
        rank. Its output feeds split activations, so each rank's gradient is
        a partial sum over the group (and the gather's backward sums the
        input's)."""
        group = self.stream_group()
        if self.replicated_activations:  # whole rows, replicated: every rank computes the same gradient
            return module
        for param in module.parameters():
            self.replicated(param, "tp", partial=True)
        module.register_forward_pre_hook(functools.partial(gather_hidden, group=group), with_kwargs=True)
        return module

    def convert_experts(self, module: nn.Module, ctx: RewriteContext) -> nn.Module:
        """Every expert's MLP sharded like any MLP, run by the mode's own
        Linear layers on every row this rank holds (parallel/roles/experts.py)."""
        gate_up, down, layout = experts_layout(module)
        weights = {}
        for name, role, fused in ((gate_up, "mlp_in", layout), (down, "mlp_out", None)):
            full = getattr(module, name)
            plane = self.weight_spec(full[0], role, fused)  # one expert's (out, in) matrix, as a Linear's
            weights[name] = ctx.shard(full, dataclasses.replace(plane, full_shape=tuple(full.shape),
                                                                index=(None,) + plane.index))
        return DenseExperts(module, gate_up, down, weights, self.linear_fn("mlp_in"), self.linear_fn("mlp_out"),
                            functools.partial(self.rows_like_output, role="mlp_in"))

    def rows_like_output(self, t: torch.Tensor, role: str) -> torch.Tensor:
        """A per-row tensor (rows on dim 0, the rest whole) held in the rows
        a `role` Linear is fed, in the rows its output holds: the experts'
        routing weights, applied between their two products. A SUMMA
        product's output holds its input's rows: itself."""
        return t

    # ---- latent attention (roles.LATENT_ROLES) and elementwise modules ----
    def attention_rows(self, x: torch.Tensor, gathered: bool = False) -> torch.Tensor:
        """Whole hidden vectors of the rows this rank's attention holds (its
        queries' rows), from its piece of the stream; the backward sums the
        gradients of every rank computing on them (each with its heads).
        `gathered`: an entry hook already gathered the sequence (1d + SP)."""
        group = self.stream_group()
        if group is not None:  # rows held with other ranks' hidden features
            return comm.gather_along(x, group, -1)
        if gathered:
            return x
        if self.geo.size > 1 and self.sequence_parallel and getattr(self, "seq_parallel", False):
            return comm.gather_along(x, self.mesh.tp_group, 1)
        return comm.copy_to_group(x, self.mesh.tp_group)

    def convert_latent(self, module: nn.Module, ctx: RewriteContext) -> nn.Module:
        """A latent attention's down-projection, whole on every rank, run on
        whole rows of the rows its attention holds: each rank's gradient
        holds its heads' (and rows') part, summed over the group."""
        if not self.rewrites:
            return module
        for param in module.parameters():
            self.replicated(param, "tp", partial=True)
        gathered = ctx.name in getattr(self, "gathered", ())
        module.register_forward_pre_hook(
            lambda mod, args: (self.attention_rows(args[0], gathered), *args[1:]))
        return module

    def convert_latent_norm(self, module: nn.Module, ctx: RewriteContext) -> nn.Module:
        """A norm of a latent (whole, like its down-projection)."""
        for param in module.parameters() if self.rewrites else ():
            self.replicated(param, "tp", partial=True)
        return module

    def convert_latent_up(self, module: nn.Module, ctx: RewriteContext) -> nn.Module:
        """A latent attention's up-projection: this rank's heads (whole:
        rotary and other features together), on the whole latent of its
        attention's rows; ranks with the same heads and other rows hold
        replicas (rewrite.py shares them)."""
        if not self.rewrites:
            return module
        from tpctl.parallel.tensor.linear import ShardedLinear

        layout = self.layouts[ctx.name]
        split = self.geo.head_split
        ranges = layout.ranges(split, split, self.head_block())
        weight = ctx.shard(module.weight, self.split_spec(module.weight, 0, ranges))
        bias = None if module.bias is None else ctx.shard(module.bias, self.split_spec(module.bias, 0, ranges))
        return ShardedLinear(weight, bias, torch.nn.functional.linear)

    def convert_head_reduce(self, module: nn.Module, ctx: RewriteContext) -> nn.Module:
        """One value per head from all heads of a projection (Doge's dt_proj): tensor/head_reduce.py."""
        from tpctl.parallel.tensor.head_reduce import convert_head_reduce

        return convert_head_reduce(self, module, ctx) if self.rewrites else module

    def convert_elementwise(self, module: nn.Module, ctx: RewriteContext) -> nn.Module:
        """An elementwise module on the stream: its scalars replicated,
        their gradients partial where the stream is split."""
        for param in module.parameters() if self.rewrites else ():
            self.replicated(param, "tp", partial=self.splits_stream(ctx))
        return module

    def convert_split_elementwise(self, module: nn.Module, ctx: RewriteContext) -> nn.Module:
        """An elementwise module on a split activation (a learned activation
        inside the MLP): each rank's gradient of its scalars is partial."""
        for param in module.parameters() if self.rewrites else ():
            self.replicated(param, "tp", partial=True)
        return module

    def convert_whole(self, module: nn.Module, ctx: RewriteContext) -> nn.Module:
        """A module no split fits, run whole on every rank (tensor/whole.py)."""
        return run_whole(self, module, ctx)

    def convert_untrained(self, module: nn.Module, ctx: RewriteContext) -> nn.Module:
        """A module returning indices only (role `untrained`: DeepSeek's
        sparse-attention indexer), held whole, fed whole rows of its
        attention's rows (tensor/whole.py, run_untrained)."""
        return run_untrained(self, module, ctx) if self.rewrites else module

    def whole_split(self, ctx: RewriteContext):
        """(group, dim): the ranks holding the rest of this rank's piece of
        the stream where the module being converted sits, and the dimension
        they split; None where every rank holds the stream whole."""
        return (self.stream_group(), -1) if self.splits_stream(ctx) else None

    def convert_own_experts(self, module: nn.Module, ctx: RewriteContext) -> nn.Module:
        """Experts in a model's own module (experts.OwnSplit), run by its own
        forward on whole rows (tensor/whole.py, split_own_experts)."""
        return split_own_experts(self, module, ctx)

    def convert_mixer(self, module: nn.Module, ctx: RewriteContext) -> nn.Module:
        """A mixer split by heads over the q ranks holding a block of rows
        (roles/mixers.py; tensor/whole.py, split_mixer): whole rows
        gathered, the partial output reduce-scattered onto this rank's
        hidden block; ranks with other rows hold its heads alike."""
        group = self.stream_group()
        # (this rank's block of heads also in a dry run, whose mesh has no groups: the planner cuts the sets
        # of ranks holding a one-group mixer's B and C rows from every rank's dry run, layer_comm.kv_replica_sums)
        s = comm.group_rank(group) if group is not None else \
            sorted(self.mesh.group_ranks[self.stream_group_name]).index(self.mesh.rank)
        return split_mixer(self, module, ctx, group, self.own_forward_ways(), s, -1,
                           self.cost_sliced_replicas("experts"))

    def weight_spec(self, weight: torch.Tensor, role: str, layout=None, n: Optional[int] = None) -> ShardSpec:
        """The ShardSpec of a Linear's (out, in) weight for `role`."""
        raise ValueError(f"mode {self.name} has no weight layout for role {role!r}")

    def linear_fn(self, role: str) -> Callable:
        """(x, this rank's weight shard) -> y: the mode's Linear for `role`."""
        raise ValueError(f"mode {self.name} has no Linear for role {role!r}")

    def convert_linear(self, module: nn.Module, ctx: RewriteContext, role: str) -> nn.Module:
        """The default conversion of a Linear of a linear role (linear.py):
        its weight sharded by `weight_spec`, its bias by `output_spec`, both
        following a fused projection's layout, the lm_head's rows padded to
        the mode's vocabulary multiple, run by `linear_fn(role)`. A mode
        defining those three needs no `convert_<role>` of its own."""
        n = self.padded_vocab(module.out_features) if role == "lm_head" else module.out_features
        layout = self.fused_layout(role, module, ctx)
        weight = ctx.shard(module.weight, self.weight_spec(module.weight, role, layout, n))
        bias = None if module.bias is None else ctx.shard(module.bias, self.output_spec(module.bias, role, layout, n))
        return self.linear_module(weight, bias, role)

    def linear_module(self, weight: torch.Tensor, bias: Optional[torch.Tensor], role: str) -> nn.Module:
        """The module that runs a Linear of `role` on this rank's shards of
        its weight and bias (default: `linear_fn(role)` around them; a mode
        with a Linear class of its own returns that)."""
        from tpctl.parallel.tensor.linear import ShardedLinear

        return ShardedLinear(weight, bias, self.linear_fn(role))

    def convert_head_norm(self, module: nn.Module, ctx: RewriteContext) -> nn.Module:
        """A norm over each head of q or k runs as written on this rank's
        whole heads; its weight sees only those heads (and rows), so its
        gradient is a partial sum over the tensor-parallel group. A weight
        holding one row per head (Cohere) keeps this rank's heads' rows."""
        if ctx.name in self.head_rows and self.geo.head_split > 1:
            for attr, param in list(module.named_parameters(recurse=False)):
                held = held_units(param.shape[0], self.geo.head_split, self.head_block())
                setattr(module, attr, ctx.shard(param, self.split_spec(param, 0, ((held.start, held.stop),))))
            return module
        for param in module.parameters():
            self.replicated(param, "tp", partial=self.rewrites)
        return module

    def padded_vocab(self, vocab_size: int) -> int:
        return padded_vocab(vocab_size, self.geo.vocab_multiple)

    def split_spec(self, full: torch.Tensor, dim: Optional[int] = None, ranges=None,
                   replicas: Optional[str] = None, partial: bool = True) -> ShardSpec:
        """`full` split along `dim` only (dim None: held whole), with copies on
        every rank of the mesh group `replicas`, whose gradients are partial
        sums unless `partial` is False."""
        index = tuple(ranges if d == dim else None for d in range(full.dim()))
        if replicas is None:
            return ShardSpec(tuple(full.shape), index)
        return ShardSpec(tuple(full.shape), index, tuple(self.mesh.group_ranks[replicas]), partial,
                         self.mesh.groups[replicas])

    def prepare(self, model: nn.Module, plan) -> None:
        """Called by the rewrite (rewrite_layers) before any layer is converted."""

    def replicated(self, param: torch.Tensor, group: str, partial: bool) -> None:
        """Tag a parameter every rank of `group` holds whole."""
        param.tpctl_spec = self.split_spec(param, replicas=group, partial=partial)
