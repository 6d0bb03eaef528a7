"""The rewrite of a model by a mode: every module with a role replaced by
the mode's parallel layer (`rewrite_layers`, also as a dry run: shapes and
records only; what it made comes back as a `Rewrite`), what a split refuses before anything is rewritten
(`check_plan`), and what a rewrite sets beside the layers (this rank's head
counts, per-head arguments and norms, dropout streams keyed by block).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn as nn

from tpctl.parallel.dropout import ParallelDropout
from tpctl.parallel.mesh import Mesh
from tpctl.parallel.registry import mode_class
from tpctl.parallel.roles.fused import held_units
from tpctl.parallel.roles.inference import resolve_plan
from tpctl.parallel.roles.plan import GROUP_ATTRS, KV_ATTRS, RolePlan, repeated_blocks
from tpctl.parallel.roles.mixers import kept_rows
from tpctl.parallel.roles.probes import embedding_semantics, norm_offset, norm_width, traced_width
from tpctl.parallel.shard import spec_of
from tpctl.parallel.tensor.layers import hold_stream_tensors
from tpctl.parallel.tensor.linear import LINEAR_ROLES
from tpctl.parallel.tensor.mode import ParallelMode, RewriteContext
from tpctl.parallel.tensor.output_params import bias_spec, carry_output_params, extra_params, output_params
from tpctl.parallel.tensor.replicas import share_slices


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


@dataclass
class Rewrite:
    """What rewriting a model's layers made, for whoever reads it after
    (the training step, generation, `tpctl inspect`, the planner): the
    rewritten model, the roles it was rewritten by, the real vocabulary
    (the LM head's width before a mode pads it; None without a head), and
    in a dry run every module's record and what the mode cannot shard;
    with pipeline stages, the stage the model now is."""

    model: nn.Module
    plan: RolePlan
    vocab_size: Optional[int] = None
    modules: list[Rewritten] = field(default_factory=list)
    problems: dict[str, str] = field(default_factory=dict)
    # pp > 1: the pipeline whose stage `model` is (Parallelism.rewrite).
    stage: Optional[Any] = None


def is_rewritten(model: nn.Module) -> bool:
    """Whether a rewrite already placed `model`'s parameters (each then
    carries its ShardSpec)."""
    return any(spec_of(p) is not None for p in model.parameters())


def _hold_heads(model: nn.Module, plan: RolePlan, mode: ParallelMode, ctx: RewriteContext) -> None:
    """Each attention module of the plan keeps this rank's heads: its stored
    head counts, its per-head parameters (learned sinks) and, where its
    arguments carry one entry per head, a pre-hook slicing them."""
    split = mode.geo.head_split
    for owner, heads in plan.heads.items():
        module = model.get_submodule(owner)
        for attr, full in heads.attrs.items():  # (its own, or a module's below it: "self.all_head_size")
            path, _, leaf = attr.rpartition(".")
            setattr(module.get_submodule(path), leaf, heads.local(attr, full, split))
        per_rank_counts(module, heads, split)
        ctx.name = owner
        for attr in heads.params if mode.rewrites else ():  # (learned sinks) this rank's heads' entries
            held = held_units(getattr(module, attr).shape[0], split, mode.head_block())  # (query or kv heads)
            full = getattr(module, attr)
            setattr(module, attr, ctx.shard(full, mode.split_spec(full, 0, ((held.start, held.stop),))))
        if heads.per_head_args and split > 1:
            module.register_forward_pre_hook(PerHeadSlice(heads, mode), with_kwargs=True)


def rewrite_layers(model: nn.Module, mode: ParallelMode, plan=None, dry_run: bool = False,
                   training: bool = True) -> Rewrite:
    """Replace the model's layers, by role, with `mode`'s parallel layers.

    `plan`: a parallel.roles.RolePlan, or module-name patterns (fnmatch) -> roles;
    by default the model's own `tp_plan`, else roles traced from its forward.
    The model's code is untouched: only submodules are swapped, each new layer
    holds just this rank's shard of the weights, and attention modules that
    store a head count get this rank's.

    dry_run: shapes only (every shard on the meta device, nothing read or
    made), on any mesh (a process-group-free one: parallelism(..., groups=False));
    a module the mode cannot shard is recorded with its problem instead of
    refused, and the Rewrite lists every module's `Rewritten` record and
    what the mode cannot shard (check_plan). `tpctl inspect` shows them; the
    planner reads every parameter's local shape and replicas from the
    ShardSpecs it leaves.

    The run's Parallelism places its other components around this rewrite
    (Parallelism.rewrite: with pp > 1 the model is first cut to this rank's
    pipeline stage, and only that is rewritten).
    """
    from tpctl.parallel.roles.probes import linearize
    from tpctl.parallel.shard import record_replicas

    if is_rewritten(model):
        raise ValueError(f"{type(model).__name__} is already rewritten: its parameters are placed")
    linearize(model)  # GPT-2's Conv1D: a Linear with a transposed weight
    if not isinstance(plan, RolePlan):
        plan = resolve_plan(model, plan)
    for name, width in plan.norm_widths.items():  # (a model the plan was not traced on)
        traced_width(model.get_submodule(name), width)
    problems = check_plan(plan, model, mode.geo, training)
    if problems and not dry_run:
        name, reason = next(iter(problems.items()))
        raise ValueError(f"cannot parallelize {name} in mode {mode.name} (size {mode.geo.size}): {reason}")
    vocab_size = plan.vocab_size(model)  # before a mode pads it
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
        if role in LINEAR_ROLES and mode.rewrites and extra_params(module):  # (Dory's logit_scale)
            new = carry_output_params(new, module, extra_params(module), bias_spec(mode, role, module, name),
                                      lambda p, partial: mode.split_spec(p, replicas="tp", partial=partial), ctx)
        rewritten.append(Rewritten(name, role, module, new))
        if new is not module:
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    for block, attrs in getattr(plan, "widths", {}).items():  # the stream's width as this rank holds it
        for attr, full in attrs.items():
            setattr(model.get_submodule(block), attr, full // mode.geo.q)
    repoint_aliases(model, ctx)
    split = mode.geo.head_split
    _hold_heads(model, plan, mode, ctx)
    hold_stream_tensors(model, plan, mode, ctx)  # (after the roles: an elementwise module's are replicated there)
    if init is not None:
        init.materialize(model)  # what no layer sharded: norms, replicated tables, ...
    _hold_unplaced(model, plan, mode, dry_run)
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
    shared += held_by_heads_or_slices(plan) + per_head_params(plan) if mode.rewrites else []
    params = dict(model.named_parameters())  # (a one-group mixer's B and C rows, whole on the ranks splitting it)
    shared += [name for name in kept_rows(plan, mode) if name in params]
    # (which rank shares what is learnt by communicating; with pipeline stages on every rank, as a stage
    # without any, a hybrid's attention stage, still makes the groups the others' need: share_slices)
    if (shared or mode.rewrites and mode.mesh.layout.pp > 1) and not dry_run:
        share_slices(model, shared, mode.mesh)
    record_replicas(model, mode.mesh.group_ranks["dp_cp"], mode.mesh.groups["dp_cp"])
    if not dry_run:
        key_dropout_streams(model, mode.mesh)
        # (a real rewrite keeps no reference to the originals: their memory goes)
        return Rewrite(model, plan, vocab_size)
    return Rewrite(model, plan, vocab_size, rewritten, problems)



def _hold_unplaced(model: nn.Module, plan, mode: ParallelMode, dry_run: bool) -> None:
    """Parameters no layer placed, held whole on every rank where that is
    exact: those the forward never reads, or frozen ones (nothing trains
    them), and any where the mode feeds every rank replicated activations
    (each computes the same gradient); else refused."""
    unread = set(getattr(plan, "unread", ())) | set(getattr(plan, "frozen", ()))
    for name, param in model.named_parameters():
        if spec_of(param) is None:
            if name in unread or mode.replicated_activations:
                mode.replicated(param, "tp", partial=False)
            elif not dry_run:
                raise ValueError(f"parameter {name!r} has no role in the plan; mode {mode.name} cannot leave it whole")


def repoint_aliases(model: nn.Module, ctx: RewriteContext) -> None:
    """Every registration of a parameter a layer's rewrite sharded, made to
    hold the shard: a module with no role holding, as its own, a parameter
    of a child with one (BERT's LM head registers `bias`, the very tensor its
    decoder Linear adds: transformers' tied-weights keys) would otherwise
    keep the whole original, untrained, under the name named_parameters and
    so checkpoints, export and the start-up check read first."""
    for module in model.modules():
        for attr, p in list(module._parameters.items()):
            made = None if p is None else ctx.made_for(p)
            if made is not None and made is not p:
                module._parameters[attr] = made


def held_by_heads_or_slices(plan) -> list[str]:
    """Modules whose parameters ranks with other rows hold alike, by
    heads (a latent attention's up-projections) or by slices of experts
    (experts run by their own forward): rewrite learns their replicas."""
    from tpctl.parallel.roles.experts import OwnSplit

    return [name for name, role in plan.roles.items()
            if role == "latent_up" or role == "experts" and isinstance(plan.layouts.get(name), OwnSplit)]


def per_head_params(plan) -> list[str]:
    """Attention modules' own per-head parameters (`Heads.params`), by
    name: ranks with other rows hold their heads' entries alike."""
    return [f"{owner}.{attr}" for owner, heads in plan.heads.items() for attr in heads.params]


def key_dropout_streams(model: nn.Module, mesh: Mesh) -> None:
    """Seed the dropout generators afresh as the model's forward starts and
    as each block of its stack starts (Mesh.reseed_dropout), when it has
    dropout at all: what a block draws then depends on the block, the step
    and the micro-batch, not on what ran before it on this rank."""
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
        elif groups := next(((a, v) for a, v in heads.attrs.items() if a.rpartition(".")[2] in GROUP_ATTRS and v % ways), None):
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
        if role in LINEAR_ROLES and extra_params(module) and (reason := _refused(output_params, module)):
            # (carried where its forward applies them to its output entry by entry: output_params.py)
            problems.setdefault(name, reason)
        elif role in ("qkv", "attn_in", "mlp_in", "attn_out", "mlp_out"):
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
        elif role == "head_reduce" and (reason := _reduce_problem(plan, name, module, ways)):
            problems.setdefault(name, f"{reason} (mode {geo.mode}, size {geo.size})")
        elif role == "lm_head" and not mode.replicated_activations and module.in_features % split:
            problems.setdefault(name, f"{module.in_features} in features do not split {split} ways (mode {geo.mode}, size {geo.size})")
        elif role == "norm" and not mode.replicated_activations:
            if norm_width(module) % geo.q:
                problems.setdefault(name, f"{norm_width(module)} features do not split {geo.q} ways")
            elif reason := _refused(norm_offset, module):
                problems.setdefault(name, reason)
    return problems


def _reduce_problem(plan, name: str, module: nn.Module, ways: int) -> Optional[str]:
    """Why a per-head reduction (`head_reduce`) cannot split `ways` ways, or None."""
    from tpctl.parallel.tensor.head_reduce import reduce_problem

    owner = next((o for o in plan.heads if name.startswith(f"{o}.")), None)
    if owner is None:
        return "a per-head reduction outside any attention tpctl found"
    return reduce_problem(plan.heads[owner], module.out_features, ways)


def _refused(measure, module: nn.Module) -> Optional[str]:
    """The reason `measure` (a probe of what a module's forward computes)
    refuses `module`, or None."""
    try:
        measure(module)
    except ValueError as e:
        return str(e)
    return None
