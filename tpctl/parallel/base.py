"""The interface every tensor-parallel mode implements, and the machinery
shared by all of them: the role-driven rewrite of a model, gradient
synchronisation and the global gradient norm.

A mode answers three questions:
  * data: which rows of a micro-batch does this rank read, and which of
    those does it feed as input and score as targets;
  * layers: what replaces a module of a given role (embedding, qkv, ...);
  * loss: the vocab-parallel cross entropy over the ranks sharing rows.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from . import comm
from .data_parallel import all_reduce_coalesced
from .mesh import Mesh
from .geometry import Geometry, padded_vocab
from .experts import DenseExperts, experts_layout
from .fused import held_units
from .layers import SplitNorm, embedding_semantics, norm_offset, norm_width
from .loss import vocab_parallel_cross_entropy
from .roles import GROUP_ATTRS, KV_ATTRS, RolePlan, resolve_plan
from .shard import RowReplicas, ShardSpec, make_param, spec_of



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
        elif (made.tpctl_spec.full_shape, made.tpctl_spec.index) != (spec.full_shape, spec.index):
            raise ValueError(f"a tied parameter {tuple(original.shape)} is used by layers that shard it differently")
        return made


class ParallelMode:
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
        # Fused Linear name -> its FusedLayout (parallel/fused.py), from the plan.
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

    # ---- cost: the planner's model of one micro-batch on this rank -----
    # cost/planner.py calls these with `add(kind, group, numel, times=1)`,
    # which counts a collective over the named mesh group; they return the
    # activation elements kept for the backward (an estimate). Comm counts
    # are exact: tests/test_plan.py checks them against comm.STATS. The
    # defaults are mode=none's: nothing is split, nothing is sent.
    # The group of the vocab-parallel cross entropy (loss_group), by name.
    loss_group_name: Optional[str] = None

    def cost_rows(self, tokens: int) -> int:
        """Token rows of a micro-batch this rank computes on (of `tokens`,
        its replica's)."""
        return tokens

    def cost_hidden(self, hidden: int) -> int:
        """This rank's features of a hidden (or vocabulary) dimension where
        activations hold it."""
        return hidden

    def cost_vocab(self, vocab: int) -> int:
        """This rank's columns of the (padded) logits."""
        return self.cost_hidden(vocab)

    def cost_embedding(self, add, tokens: int, vocab: int, dim: int) -> None:
        """The lookup of `tokens` ids in a (padded) `vocab` x `dim` table."""

    def cost_norm(self, add, tokens: int, hidden: int) -> int:
        return 2 * self.cost_rows(tokens) * self.cost_hidden(hidden)

    def cost_linear(self, add, role: str, tokens: int, n: int, k: int) -> int:
        """A Linear of role `role`, k -> n features, on `tokens` rows."""
        return tokens * k

    def cost_loss(self, add, tokens: int) -> None:
        """The vocab-parallel cross entropy: the row max, then (sum-exp,
        target logit, sum) over the ranks that share the rows."""
        if self.loss_group_name:
            rows = self.cost_rows(tokens)
            add("all_reduce", self.loss_group_name, rows)
            add("all_reduce", self.loss_group_name, 3 * rows)

    # ---- layers -------------------------------------------------------
    def convert(self, role: str, module: nn.Module, ctx: RewriteContext) -> nn.Module:
        converter: Optional[Callable] = getattr(self, f"convert_{role}", None)
        if converter is None:
            raise ValueError(f"mode {self.name} has no layer for role {role!r}")
        return converter(module, ctx)

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
            from .fused import FusedLayout

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

    def convert_router(self, module: nn.Module, ctx: RewriteContext) -> nn.Module:
        """A mixture-of-experts router (or a per-row gate beside it) scores
        a row from its whole hidden vector, and every rank holding the row
        must route it alike: it runs as written on the row gathered over
        the ranks holding its other features, its weight whole on every
        rank. Its output feeds split activations, so each rank's gradient is
        a partial sum over the group (and the gather's backward sums the
        input's)."""
        group = self.stream_group()
        if group is None:  # whole rows, replicated: every rank computes the same gradient
            return module
        for param in module.parameters():
            self.replicated(param, "tp", partial=True)
        module.register_forward_pre_hook(functools.partial(_gather_hidden, group=group), with_kwargs=True)
        return module

    def convert_experts(self, module: nn.Module, ctx: RewriteContext) -> nn.Module:
        """Every expert's MLP sharded like any MLP, run by the mode's own
        Linear layers on every row this rank holds (parallel/experts.py)."""
        gate_up, down, layout = experts_layout(module)
        weights = {}
        for name, role, fused in ((gate_up, "mlp_in", layout), (down, "mlp_out", None)):
            full = getattr(module, name)
            plane = self.weight_spec(full[0], role, fused)  # one expert's (out, in) matrix, as a Linear's
            weights[name] = ctx.shard(full, dataclasses.replace(plane, full_shape=tuple(full.shape),
                                                                index=(None,) + plane.index))
        return DenseExperts(module, gate_up, down, weights, self.linear_fn("mlp_in"), self.linear_fn("mlp_out"))

    def weight_spec(self, weight: torch.Tensor, role: str, layout=None, n: Optional[int] = None) -> ShardSpec:
        """The ShardSpec of a Linear's (out, in) weight for `role`."""
        raise ValueError(f"mode {self.name} has no weight layout for role {role!r}")

    def linear_fn(self, role: str) -> Callable:
        """(x, this rank's weight shard) -> y: the mode's Linear for `role`."""
        raise ValueError(f"mode {self.name} has no Linear for role {role!r}")

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
        """Called by `parallelize` before any layer is converted."""

    def replicated(self, param: torch.Tensor, group: str, partial: bool) -> None:
        """Tag a parameter every rank of `group` holds whole."""
        param.tpctl_spec = self.split_spec(param, replicas=group, partial=partial)


# ---- the rewrite --------------------------------------------------------

def as_mode(tp) -> ParallelMode:
    """The tensor-parallel mode of `tp`: a ParallelMode, or a
    parallelism.Parallelism holding one."""
    return tp if isinstance(tp, ParallelMode) else tp.mode


@dataclass
class Rewritten:
    """What the rewrite did to one module that has a role: the original,
    what replaced it (the same object where the mode keeps it and only
    shards its parameters), and -- in a dry run -- why the mode cannot
    shard it (it is then left as it was)."""

    name: str
    role: str
    original: nn.Module
    new: nn.Module
    problem: str = ""


def parallelize(model: nn.Module, mode: ParallelMode, plan=None, dry_run: bool = False,
                training: bool = True) -> nn.Module:
    """Replace the model's layers, by role, with `mode`'s parallel layers
    (`mode`: a ParallelMode or a Parallelism).

    `plan`: a parallel.roles.RolePlan, or module-name patterns (fnmatch) -> roles;
    by default the model's own `tp_plan`, else roles traced from its forward.
    The model's code is untouched: only submodules are swapped, each new layer
    holds just this rank's shard of the weights, and attention modules that
    store a head count get this rank's.

    dry_run: shapes only (every shard on the meta device, nothing read or
    made), on any mesh (a process-group-free one: parallelism(..., groups=False));
    a module the mode cannot shard is recorded with its problem instead of
    refused, `model.tpctl_rewritten` lists every module's `Rewritten` record
    and `model.tpctl_problems` what the mode cannot shard (check_plan). `tpctl inspect` shows them; the planner reads every parameter's
    local shape and replicas from the ShardSpecs it leaves.

    A Parallelism places its components around the rewrite
    (Parallelism.parallelize: with pp > 1 the model is first cut to this
    rank's pipeline stage, and only that is rewritten).
    """
    from .layers import linearize
    from .shard import record_replicas

    if not isinstance(mode, ParallelMode):
        return mode.parallelize(model, plan, dry_run, training)
    if getattr(model, "tpctl_mode", None) is not None:
        raise ValueError(f"{type(model).__name__} is already parallelized ({model.tpctl_mode.name})")
    linearize(model)  # GPT-2's Conv1D: a Linear with a transposed weight
    if not isinstance(plan, RolePlan):
        plan = resolve_plan(model, plan)
    problems = check_plan(plan, model, mode.geo, training)
    if problems and not dry_run:
        name, reason = next(iter(problems.items()))
        raise ValueError(f"cannot parallelize {name} in mode {mode.name} (size {mode.geo.size}): {reason}")
    head = next((name for name, role in plan.roles.items() if role == "lm_head"), None)
    if head is not None:  # the real vocabulary, before a mode pads it
        model.tpctl_vocab_size = model.get_submodule(head).out_features
    init = None if dry_run else getattr(model, "tpctl_init", None)
    ctx = RewriteContext(mode.mesh, init, shapes_only=dry_run)
    mode.layouts = dict(getattr(plan, "layouts", {}))
    mode.sources = dict(getattr(plan, "sources", {}))
    mode.source_roles = {linear: plan.roles[linear] for linear in mode.sources.values()}
    mode.head_rows = dict(getattr(plan, "head_rows", {}))
    mode.prepare(model, plan)
    rewritten = []
    for name, role in plan.roles.items():
        module = model.get_submodule(name)
        if name in problems:
            rewritten.append(Rewritten(name, role, module, module, problems[name]))
            continue
        ctx.name = name
        new = mode.convert(role, module, ctx)
        rewritten.append(Rewritten(name, role, module, new))
        if new is not module:
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    for block, attrs in getattr(plan, "widths", {}).items():  # the stream's width as this rank holds it
        for attr, full in attrs.items():
            setattr(model.get_submodule(block), attr, full // mode.geo.q)
    split = mode.geo.head_split
    for owner, heads in plan.heads.items():
        module = model.get_submodule(owner)
        for attr, full in heads.attrs.items():
            setattr(module, attr, heads.local(attr, full, split))
        per_rank_counts(module, heads, split)
        if heads.per_head_args and mode.geo.head_split > 1:
            module.register_forward_pre_hook(PerHeadSlice(heads, mode), with_kwargs=True)
    if init is not None:
        init.materialize(model)  # what no layer sharded: norms, replicated tables, ...
    for name, param in model.named_parameters():
        if spec_of(param) is None:
            if mode.replicated_activations:
                # Replicated over the group and fed replicated activations:
                # every rank computes the same gradient.
                mode.replicated(param, "tp", partial=False)
            elif not dry_run:
                raise ValueError(f"parameter {name!r} has no role in the plan; mode {mode.name} cannot leave it whole")
    for name in plan.head_lists if split > 1 else ():
        whole = model.get_submodule(name)
        held = held_units(len(whole), split, mode.head_block())
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, HeldHeads({i: whole[i] for i in held}))
    # Parameters several ranks hold alike with partial gradients, beyond the
    # mode's own groups: shared key/value heads, and this rank's per-head norms.
    shared = [name for name, layout in plan.layouts.items() if layout.shares(split)]
    shared += [norm for norm, source in mode.sources.items() if source in shared]
    shared += list(plan.head_lists) + list(plan.head_rows) if split > 1 else []
    if shared and not dry_run:  # (which rank shares what is learnt by communicating)
        share_slices(model, shared, mode.mesh)
    record_replicas(model, mode.mesh.group_ranks["dp"], mode.mesh.groups["dp"])
    model.tpctl_mode = mode  # marks the model as rewritten (and by which mode)
    model.tpctl_plan = plan
    if not dry_run:
        key_dropout_streams(model, mode.mesh)
    if dry_run:  # (a real rewrite keeps no reference to the originals: their memory goes)
        model.tpctl_rewritten, model.tpctl_problems = rewritten, problems
    return model


def key_dropout_streams(model: nn.Module, mesh: Mesh) -> None:
    """Seed the dropout generators afresh as the model's forward starts and
    as each block of its stack starts (Mesh.reseed_dropout), when it has
    dropout at all: what a block draws then depends on the block, the step
    and the micro-batch, not on what ran before it on this rank."""
    from .layers import ParallelDropout
    from .roles import repeated_blocks

    if not any(isinstance(m, ParallelDropout) and m.p > 0 for m in model.modules()):
        return
    model.register_forward_pre_hook(lambda module, args: mesh.reseed_dropout(-1))
    stack = repeated_blocks(model)
    for key, block in (stack._modules.items() if stack is not None else ()):
        block.register_forward_pre_hook(lambda module, args, index=int(key): mesh.reseed_dropout(index))


# Head counts a model's config may hold, which an attention module reads at
# run time (Phi-3: config.num_attention_heads * head_dim).
CONFIG_COUNTS = ("num_attention_heads", "num_heads", "n_head", "n_heads", *KV_ATTRS)


def per_rank_counts(module: nn.Module, heads, split: int) -> None:
    """Give an attention module that reads head counts from its `config`
    its own copy of that config with this rank's counts. The model's config
    (what export and save_pretrained write) is left as it was."""
    config = getattr(module, "config", None)
    if config is None or split == 1:
        return
    counts = {a: getattr(config, a) for a in CONFIG_COUNTS
              if isinstance(getattr(config, a, None), int) and getattr(config, a) in (heads.heads, heads.kv_heads)}
    if counts:
        local = copy.copy(config)
        for attr, full in counts.items():  # (aliases of one count, e.g. n_head, get the same value)
            setattr(local, attr, heads.local(attr, full, split))
        module.config = local


def share_slices(model: nn.Module, names: list[str], mesh: Mesh) -> None:
    """The parameters of modules `names` hold key/value heads shared by
    several ranks (fewer heads than the split): every rank of the
    tensor-parallel group holding the same rows (output features) of the
    same parameter, with the same other dimensions, is one of their
    replicas, each with the gradient of its own query heads (and rows),
    summed over exactly those ranks. A fused projection also holds rows of
    its own (its query heads): its rows then carry their replicas run by run
    (ShardSpec.row_replicas). Who holds what is learnt with one gather over
    the group; the replica groups are made once per mesh."""
    mine = {}
    for owner in names:
        for attr, p in model.get_submodule(owner).named_parameters():
            mine[f"{owner}.{attr}"] = p
    keys = {}
    for name, p in mine.items():
        spec = spec_of(p)
        keys[name] = (spec.index[1:], spec.index[0] or ((0, spec.full_shape[0]),))
    everyone = comm.all_gather_object(keys, mesh.tp_group)

    def pieces(name: str, t: int) -> list[tuple[int, int, tuple[int, ...]]]:
        """(start, stop, holders) of tp rank t's rows of `name`, cut where
        the set of ranks holding them changes."""
        rest, rows = everyone[t][name]
        others = [(u, theirs[name][1]) for u, theirs in enumerate(everyone) if theirs.get(name, (None,))[0] == rest]
        cuts = sorted({x for _, ranges in others for a, b in ranges for x in (a, b)})
        out = []
        for a, b in rows:
            points = [a] + [c for c in cuts if a < c < b] + [b]
            for lo, hi in zip(points, points[1:]):
                holders = tuple(u for u, ranges in others if any(x <= lo and hi <= y for x, y in ranges))
                if out and out[-1][1] == lo and out[-1][2] == holders:
                    out[-1] = (out[-1][0], hi, holders)
                else:
                    out.append((lo, hi, holders))
        return out

    # Every rank makes every set's group, in one order (process groups are collective).
    sets = sorted({h for t, theirs in enumerate(everyone) for name in theirs for _, _, h in pieces(name, t)})
    groups = mesh.tp_subgroups(sets)
    for name, p in mine.items():
        spec, mine_pieces = spec_of(p), pieces(name, mesh.tp_rank)
        if len({h for _, _, h in mine_pieces}) == 1:  # one replica set for the whole shard
            group, ranks = groups[mine_pieces[0][2]]
            p.tpctl_spec = dataclasses.replace(spec, replica_ranks=tuple(ranks), partial_grad=len(ranks) > 1,
                                               replica_group=group)
            continue
        runs, at = [], 0
        for lo, hi, holders in mine_pieces:
            group, ranks = groups[holders]
            runs.append(RowReplicas(at, at + hi - lo, tuple(ranks), group))
            at += hi - lo
        index = (tuple((lo, hi) for lo, hi, _ in mine_pieces),) + spec.index[1:]
        p.tpctl_spec = dataclasses.replace(spec, index=index, replica_ranks=(), partial_grad=False,
                                           replica_group=None, row_replicas=tuple(runs))


def _gather_hidden(module, args, kwargs, group):
    """Pre-hook: the first argument (or hidden_states) gathered along its
    last dimension over `group`: whole hidden vectors of this rank's rows."""
    if args:
        return (comm.gather_along(args[0], group, -1), *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": comm.gather_along(kwargs["hidden_states"], group, -1)}


class HeldHeads(nn.ModuleList):
    """A list of per-head modules (one norm per head) holding this rank's
    heads only, under their original indices (so parameter names, hence
    checkpoints and the start-up check, are the whole model's); iterating
    and indexing go over the held ones, as the module's forward on a rank's
    heads expects (StableLM: zip(self.norms, heads))."""

    def __init__(self, held: dict[int, nn.Module]):
        nn.Module.__init__(self)
        for i, module in held.items():
            self.add_module(str(i), module)

    def __getitem__(self, idx):
        held = list(self._modules.values())
        return nn.ModuleList(held[idx]) if isinstance(idx, slice) else held[idx]


class PerHeadSlice:
    """Pre-hook of an attention module: arguments holding one slice per
    (row, head) keep this rank's heads (and, where the mode splits rows
    again inside attention, its rows)."""

    def __init__(self, heads, mode: "ParallelMode"):
        self.heads, self.names = heads.heads, heads.per_head_args
        self.block, self.blocks = mode.head_block(), mode.geo.head_split
        self.row_block = mode.attention_row_block()

    def _slice(self, t: torch.Tensor, rows: int) -> torch.Tensor:
        if t.shape[0] == self.heads:  # one slice per head, shared by every row (MPT's alibi)
            local = self.heads // self.blocks
            return t[self.block * local:(self.block + 1) * local]
        per = t.reshape(-1, self.heads, *t.shape[1:])
        local = per.shape[1] // self.blocks
        per = per[:, self.block * local:(self.block + 1) * local]
        if per.shape[0] != rows:  # rows split again inside attention (3d): this rank's chunk
            per = per[self.row_block * rows:(self.row_block + 1) * rows]
        return per.reshape(-1, *t.shape[1:])

    def __call__(self, module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        rows = hidden.shape[0]
        args = tuple(self._slice(a, rows) if i in self.names else a for i, a in enumerate(args))
        kwargs = {k: self._slice(a, rows) if k in self.names else a for k, a in kwargs.items()}
        return args, kwargs


def check_plan(plan, model: nn.Module, geo, training: bool = True) -> dict[str, str]:
    """{module name: why mode `geo` cannot shard it}: what the role tracer
    could not place (fatal unless nothing is split), head counts or matrix
    sizes the split does not divide, and (`training`: a model that is only
    decoded draws nothing) random draws a split cannot reproduce."""
    from .registry import mode_class

    mode = mode_class(geo.mode)
    if not mode.rewrites:
        return {}
    problems = dict(plan.problems)
    if training and getattr(plan, "draws", None):
        problems["<forward>"] = (f"the model's forward draws random numbers in training from torch's global generator "
                                 f"({', '.join(plan.draws)}: a router sampling its experts, jitter noise, functional "
                                 "dropout): a mode that splits rows or features cannot reproduce mode=none's draws (use "
                                 "mode=none, or a config of the model without that randomness)")
    ways = geo.head_split
    for owner, heads in plan.heads.items():
        if heads.heads % ways:
            problems.setdefault(owner, f"{heads.heads} query heads do not split {ways} ways (mode {geo.mode}, size {geo.size})")
        elif groups := next(((a, v) for a, v in heads.attrs.items() if a in GROUP_ATTRS and v % ways), None):
            problems.setdefault(owner, f"its forward reshapes the fused projection into {groups[0]}={groups[1]} groups "
                                       f"of heads, which do not split {ways} ways (mode {geo.mode}, size {geo.size})")
        elif heads.kv_heads % ways and (heads.kv_heads > ways or ways % heads.kv_heads):
            # Fewer key/value heads than the split are shared (each by ways / kv_heads ranks).
            problems.setdefault(owner, f"{heads.kv_heads} key/value heads neither split {ways} ways nor are shared "
                                       f"evenly by {ways} blocks of query heads (mode {geo.mode}, size {geo.size})")
    layouts = getattr(plan, "layouts", {})
    for name, layout in layouts.items():
        reason = layout.split_problem(ways, geo.hidden_split)
        if reason:
            problems.setdefault(name, f"{reason} (mode {geo.mode}, size {geo.size})")
    split = geo.hidden_split
    for name, role in plan.roles.items():
        module = model.get_submodule(name)
        if role in ("qkv", "attn_in", "mlp_in", "attn_out", "mlp_out"):
            dims = {"out": module.out_features, "in": module.in_features}
            if mode.replicated_activations:  # only the split dimension
                dims = {"out": module.out_features} if role not in ("attn_out", "mlp_out") else {"in": module.in_features}
            if name in layouts:  # its output features split by their layout (checked above)
                dims.pop("out", None)
            for which, size in dims.items():
                if size % split:
                    problems.setdefault(name, f"{size} {which} features do not split {split} ways (mode {geo.mode}, size {geo.size})")
        elif role in ("embedding", "pos_embedding") and not mode.replicated_activations and module.embedding_dim % geo.q:
            problems.setdefault(name, f"{module.embedding_dim} embedding features do not split {geo.q} ways")
        elif role == "embedding" and (reason := _refused(embedding_semantics, module)):
            problems.setdefault(name, reason)
        elif role == "lm_head" and not mode.replicated_activations and module.in_features % split:
            problems.setdefault(name, f"{module.in_features} in features do not split {split} ways (mode {geo.mode}, size {geo.size})")
        elif role == "norm" and not mode.replicated_activations:
            if norm_width(module) % geo.q:
                problems.setdefault(name, f"{norm_width(module)} features do not split {geo.q} ways")
            elif reason := _refused(norm_offset, module):
                problems.setdefault(name, reason)
    return problems


def _refused(measure, module: nn.Module) -> Optional[str]:
    """The reason `measure` (a probe of what a module's forward computes)
    refuses `module`, or None."""
    try:
        measure(module)
    except ValueError as e:
        return str(e)
    return None


# ---- gradients ----------------------------------------------------------

def sync_replicas(params) -> None:
    """Sum every gradient of `params` (a model, or parameters) that is a
    partial sum, over exactly the ranks of the tensor-parallel grid that
    hold its other parts, once (per the parameter's ShardSpec). Data-parallel
    replicas are not this function's: data_parallel.DataParallel reduces
    across them."""
    buckets: dict[int, tuple[object, list[torch.Tensor]]] = {}
    for p in (params.parameters() if isinstance(params, nn.Module) else params):
        spec = spec_of(p)
        for piece, group in spec.partial_parts(p.grad) if spec is not None and p.grad is not None else ():
            buckets.setdefault(id(group), (group, []))[1].append(piece)
    # One order on every rank (shared key/value heads give ranks different
    # sets of groups, which must never be entered in crossing orders).
    for group, grads in sorted(buckets.values(), key=lambda b: dist.get_process_group_ranks(b[0])):
        all_reduce_coalesced(grads, group)
