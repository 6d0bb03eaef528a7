"""The role vocabulary every mode maps to its layers, and what a model's
roles are recorded in (`RolePlan`), with the two facts about a model's shape
every component reads: its repeated stack of blocks and its logits.

Roles are found by parallel/roles/inference.py from a trace (parallel/roles/tracing.py)
of the model's forward, or given by a plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn as nn

# The vocabulary every mode maps to its layers.
ROLES = (
    "embedding", "pos_embedding", "qkv", "attn_in", "attn_out", "mlp_in", "mlp_out",
    "norm", "lm_head", "dropout", "attn_dropout", "head_norm", "proj_norm", "experts", "router", "pos_table",
    "latent", "latent_norm", "latent_up", "elementwise", "split_elementwise", "whole", "head_reduce",
    "untrained",
)
# `untrained`: a module holding parameters whose outputs are indices only
# (DeepSeek's sparse-attention indexer: top-k positions, its forward under
# no_grad), so no gradient reaches them, in mode=none either: held whole on
# every rank, run as written on whole rows of its attention's rows
# (roles/inference.untrained_modules, ParallelMode.convert_untrained).
# `head_reduce`: a Linear inside attention reading all heads of one
# projection's output and making one value per head (Doge's dt_proj: a
# dynamic-mask rate per value head), split by heads (tensor/head_reduce.py).
# Latent attention (DeepSeek's MLA): `latent` Linears project the stream down
# (q_a_proj, kv_a_proj_with_mqa: a latent and a rotary part shared by all
# heads), `latent_norm`s normalise a latent, `latent_up` Linears project a
# latent up to per-head q, k, v. The first two run whole on every rank, on
# whole rows of the rows its attention holds; the last holds its heads.
LATENT_ROLES = ("latent", "latent_norm", "latent_up")
# Elementwise modules with parameters (a learned activation's scalars): on
# the stream (`elementwise`) or on a split activation inside attention or an
# MLP (`split_elementwise`); their parameters are replicated.
ELEMENTWISE_ROLES = ("elementwise", "split_elementwise")
# `whole`: a module on the stream no split fits (a state-space or
# linear-attention mixer, a recurrence): run as written on every rank, on
# whole rows of the rows it holds (roles/whole.py).
# Roles whose Linear is fed the residual stream and produces a split
# activation (Megatron's column-parallel ones); the other Linears are fed a
# split activation and produce the stream.
COLUMN_ROLES = ("qkv", "attn_in", "mlp_in", "lm_head")
# Attributes of an attention module (or of the config it reads) that hold a
# head count or a width, which the rewrite sets to this rank's (so
# `view(b, t, self.num_heads, d)` works on a rank's heads): query counts and
# widths divided by the split, key/value counts too unless fewer than the
# split (a shared head: one per rank); the ratio of the two
# (num_key_value_groups) changes only when key/value heads are shared.
KV_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_head", "n_kv_heads", "multi_query_group_num")
RATIO_ATTRS = ("num_key_value_groups", "num_kv_groups")
# Counts of groups of heads a fused projection is reshaped into (CodeGen's
# mp_num = 4: qkv viewed as 4 groups of [q | v | k]): a rank holds whole
# groups, so the count is divided by the split, which must divide it.
GROUP_ATTRS = ("mp_num",)
HEAD_ATTRS = ("num_heads", "n_head", "n_heads", "num_attention_heads", *KV_ATTRS[:4],
              "embed_dim", "split_size", "hidden_size", "all_head_size", "inner_dim")


def head_attrs(modules: dict, owner: str, members: list[str], h: int, kv: int, q_width: int,
               kv_width: int) -> dict[str, int]:
    """The head counts, widths and ratios an attention module `owner`
    stores (attribute -> full value); where it stores none, those of the
    modules between it and its Linears `members`, by their path below it
    ("self.all_head_size": MegatronBERT's and RoFormer's self-attention,
    beside its output projection, views its context as all_head_size
    wide)."""
    def stored(module) -> dict[str, int]:
        return {a: v for a, v in vars(module).items() if isinstance(v, int) and not isinstance(v, bool)
                and (a in HEAD_ATTRS and v in (h, kv, q_width, kv_width) or a in RATIO_ATTRS and kv and v == h // kv
                     or a in GROUP_ATTRS)}

    attrs = stored(modules[owner])
    if attrs:
        return attrs
    prefix = f"{owner}." if owner else ""
    between = {m[:i] for m in members for i in range(len(m)) if m[i] == "." and m[:i].startswith(prefix)}
    for name in sorted(between - {owner}):
        attrs.update({f"{name[len(prefix):]}.{a}": v for a, v in stored(modules[name]).items()})
    return attrs


@dataclass
class Heads:
    """The attention module of one layer, and what its heads look like."""

    heads: int
    kv_heads: int
    head_dim: int
    # attribute -> its full value; the rewrite divides each by the split.
    attrs: dict[str, int] = field(default_factory=dict)
    # Arguments of the attention module holding one slice per (row, head),
    # rows outermost (BLOOM's alibi: [batch * heads, 1, seq]), or one per
    # head (MPT's: [heads, 1, seq]): positions (ints) or keyword names; the
    # rewrite passes each rank its heads' slices.
    per_head_args: list = field(default_factory=list)
    # Parameters of the attention module itself holding one entry per query
    # head (learned attention sinks) or per key/value head (Doge's dynamic
    # mask's A) along their first dimension: a rank keeps its heads' entries.
    params: tuple = ()

    def kv_local(self, split: int) -> int:
        """Key/value heads a rank holds: its share, or one shared head."""
        return max(self.kv_heads // split, 1)

    def local(self, attr: str, full: int, split: int) -> int:
        """This rank's value of a head count, width or ratio `attr` (of the
        attention module, or of a module below it: its path first)."""
        attr = attr.rpartition(".")[2]
        kv = self.kv_local(split)
        if attr in RATIO_ATTRS:
            return (self.heads // split) // kv
        if attr in GROUP_ATTRS:
            return full // split
        if attr in KV_ATTRS or full in (self.kv_heads, self.kv_heads * self.head_dim) \
                and full not in (self.heads, self.heads * self.head_dim):
            return kv if full == self.kv_heads else kv * self.head_dim
        return full // split


@dataclass
class RolePlan:
    """Roles of a model's modules, and where they came from."""

    roles: dict[str, str]  # module name -> role
    source: str  # "tp_plan", "plan" (given) or "inferred" (traced)
    heads: dict[str, Heads] = field(default_factory=dict)  # attention module name -> heads
    problems: dict[str, str] = field(default_factory=dict)  # module name -> why it has no role
    # The module list of the transformer blocks (where sequence parallelism
    # starts when positions are computed from the embedding's output shape).
    blocks: Optional[str] = None
    # Attention and MLP modules -> the Linears inside them.
    units: dict[str, list[str]] = field(default_factory=dict)
    # Fused Linears -> the measured layout of their output features
    # (parallel/roles/fused.py); every other Linear splits its features in blocks.
    layouts: dict[str, Any] = field(default_factory=dict)
    # Norms over all heads of q or k (`proj_norm`) -> the Linear whose output they normalise;
    # per-head reductions (`head_reduce`) -> the projection whose heads they read.
    sources: dict[str, str] = field(default_factory=dict)
    # ModuleLists holding one per-head norm per head (StableLM's q/k
    # LayerNorms) -> their attention module; a rank keeps its heads' norms.
    head_lists: dict[str, str] = field(default_factory=dict)
    # Per-head norms whose weight holds one row per head (Cohere) -> their
    # attention module; a rank keeps its heads' rows.
    head_rows: dict[str, str] = field(default_factory=dict)
    # Random functions the training forward calls on torch's global
    # generator (outside Dropout modules): no split mode reproduces them.
    draws: list[str] = field(default_factory=list)
    # Mixture-of-experts blocks -> their attributes holding the hidden width
    # (GraniteMoE views its output as input_size): set to the rank's.
    widths: dict[str, dict[str, int]] = field(default_factory=dict)
    # Mixture-of-experts blocks' experts modules -> routing weights per row
    # (the top-k) in the traced call: the planner's count of 1d's sum of
    # their gradient.
    routed: dict[str, int] = field(default_factory=dict)
    # Modules run whole on every rank (roles/whole.py: no split fits them)
    # -> the problem inside them that no split solves.
    whole: dict[str, str] = field(default_factory=dict)
    # Norms storing no width of their own (NanoChat's RMSNorm: no weight,
    # no normalized_shape) -> the width the trace saw: set on the module
    # by the rewrite, which may meet another instance than the traced one
    # (the planner's dry run).
    norm_widths: dict[str, int] = field(default_factory=dict)
    # Modules -> their own tensors as wide as the stream, added to (or
    # multiplied into) it outside any Linear: a parameter of one entry per
    # feature (GPT-NeoX-Japanese's dense_bias, a per-feature scale), a
    # buffer of constants whose last dimension is the features (CTRL's
    # sinusoidal table). Each rank holds its features of them, as it holds
    # the stream's (mode.hold_stream_tensors).
    stream_tensors: dict[str, tuple] = field(default_factory=dict)
    # Modules the traced forward calls more than once -> how many times
    # (Dory's blocks, run in its input and its output sections; its final
    # norm, four times): each call sends what one does (the planner's
    # count). A given plan traces nothing: each module once.
    calls: dict[str, int] = field(default_factory=dict)
    # Experts modules fed more rows than the stream holds -> rows per stream
    # row (Llama 4's: every row to every expert, the expert count): what
    # their collectives carry (the planner's count). Absent: 1.
    expert_rows: dict[str, int] = field(default_factory=dict)
    # Parameters the traced forward never reads, of a module holding only
    # such (BERT's LM head's `bias` where transformers leaves it untied from
    # its decoder's): mode=none never trains them; every rank holds them
    # whole (rewrite.py), their gradient none.
    unread: tuple = ()
    # Parameters of frozen tables (requires_grad off) not as wide as the
    # stream (RoFormer's sinusoidal rotary table, one head wide): no role,
    # whole on every rank (rewrite.py), as nothing trains them.
    frozen: tuple = ()

    @property
    def lm_head(self) -> Optional[str]:
        return next((name for name, role in self.roles.items() if role == "lm_head"), None)

    def vocab_size(self, model: nn.Module) -> Optional[int]:
        """The real vocabulary: the LM head's output features as the model
        was built (read before a mode pads them); None without an LM head."""
        head = self.lm_head
        return None if head is None else model.get_submodule(head).out_features


def logits_of(output: Any) -> torch.Tensor:
    """The logits a model returned: a tensor, `.logits` (Hugging Face) or the
    first element of a tuple."""
    if isinstance(output, torch.Tensor):
        return output
    if getattr(output, "logits", None) is not None:
        return output.logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"the model returned {type(output).__name__}; tpctl needs logits (a tensor or an object with .logits)")


def repeated_blocks(model: nn.Module) -> Optional[nn.ModuleList]:
    """The model's stack of blocks: of the nn.ModuleLists whose children are
    all of one class and that no such list holds (a list of per-head norms
    inside a block is not the stack, however many heads), the one with the
    most children (ties: the first in definition order); a hybrid's list of
    blocks of several classes (Mamba layers beside attention layers) when it
    holds that one or there is none; a pipeline stage's stack
    (pipeline.StageStack), whatever its length. None if the model has no
    such list."""
    for module in model.modules():
        if getattr(module, "tpctl_stage_stack", False):
            return module
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    inside = lambda name, other: other != name and name.startswith(f"{other}." if other else "")  # noqa: E731
    alike = [(name, m) for name, m in lists if len({type(child) for child in m}) == 1]
    best, best_name = None, None
    for name, module in alike:
        if not any(inside(name, other) for other, _ in alike) and (best is None or len(module) > len(best)):
            best, best_name = module, name
    outer = [(name, m) for name, m in lists if not any(inside(name, other) for other, _ in lists) and len(m) > 1]
    mixed = max((item for item in outer if item[1] is not best), key=lambda item: len(item[1]), default=None)
    if mixed is not None and (best is None or inside(best_name, mixed[0])):
        return mixed[1]
    return best


def named_stack(model: nn.Module) -> Optional[tuple[str, nn.ModuleList]]:
    """(its path in the model, the stack) of repeated_blocks(model), or None:
    the path prefixes the names of the blocks' modules ("" when the model
    is the list itself)."""
    stack = repeated_blocks(model)
    if stack is None:
        return None
    return next(name for name, m in model.named_modules() if m is stack), stack


def common_parent(names: list[str]) -> str:
    parts = [n.split(".") for n in names]
    common = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    if len(common) == min(len(p) for p in parts):  # one of them is the parent itself
        common = common[:-1]
    return ".".join(common)


def blocks_of(model: nn.Module, roles: dict[str, str]) -> Optional[str]:
    """The nn.ModuleList holding the transformer blocks: the one whose
    children hold the attention and MLP layers."""
    best, count = None, 0
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module):
            inside = sum(1 for r in roles if r.startswith(f"{name}." if name else ""))
            if inside > count:
                best, count = name, inside
    return best
