"""Mixers split by heads (as Megatron-Core splits Mamba and gated
delta-rule attention in tensor parallelism): a rank holds whole heads, and
whole groups of heads, of everything the mixer holds per head or per group
(Mamba-1's: a block of its inner channels). A mixer is recognised by one
of the attribute sets of LAYOUTS (Mamba-2's, the gated delta rule's in
four families' spellings, Mamba-1's, MiniMax's lightning attention,
RecurrentGemma's recurrent block), each with the segments of its fused
dimensions (mixer_dims.py builds them); all are measured alike.

transformers' Mamba-2-style mixers (Mamba2Mixer, NemotronH's, FalconH1's,
Bamba's, Zamba2's, GraniteMoeHybrid's mamba layer) declare the same
attributes: `num_heads` heads of `head_dim` features (`intermediate_size`
in all), `n_groups` groups of heads sharing a B and a C of `ssm_state_size`
each, `conv_dim` = intermediate + 2 x groups x state channels, an
`in_proj` Linear to [z | x | B | C | dt], a depthwise `conv1d` over
[x | B | C], per-head `A_log`, `D`, `dt_bias`, a gated `norm` over the
inner width (per group of heads: each group's own moments) and an
`out_proj` back to the stream. Each fused dimension is a list of segments
(z, x, B, C, dt), and a rank holds block s of S of every segment: its heads
of z, x and dt, its groups of B and C. The scan then runs on this rank's
heads alone, with its own groups' B and C; out_proj's input columns are
split the same way, so its output is a partial sum (one all-reduce after
the mixer, like 1d's row-parallel Linear), and the input's gradient is
summed over the group (tensor/whole.py's split_mixer).

With ONE group of heads (n_groups=1, Falcon-H1's default) every head reads
the same B and C, and the gated norm is over the whole inner width. A rank
then holds its heads of z, x and dt (rows of in_proj, channels of the
conv, A_log, D, dt_bias, the norm's features, out_proj's columns) and B's
and C's rows of in_proj and channels of the conv (their biases, FalconH1's
mup_vector's entries) WHOLE: segments Kept (mixer_dims.py), on every shard
whole, its integer attributes a Kept part plus the rest / S (conv_dim =
intermediate / S + 2 x state; n_groups stays 1). Each rank's gradient of
B's and C's rows is its own heads' part: they are rows several ranks hold
alike beside rows of their own, as shared key/value heads' in a fused
projection, so the rewrite hands them to replicas.share_slices (row
replicas, summed once after the backward by sync_replicas; `kept_rows`),
and the planner counts those sums from every rank's dry run
(cost/layer_comm.kv_shared). The norm's moments are summed over the ranks
splitting the mixer (MOMENTS, below: a layers.SplitNorm gating before or
after the norm as the family's does). Such a split mixer, and its
measurement, take the torch path (transformers' fused kernel would
normalise by one rank's features). It splits when its heads divide by S.

Gated delta-rule linear attention (Qwen3-Next's Qwen3NextGatedDeltaNet)
declares `num_k_heads` key heads of `head_k_dim`, `num_v_heads` value
heads of `head_v_dim` (each key head serves num_v / num_k consecutive
value heads), `key_dim`, `value_dim`, `conv_dim` = 2 key_dim + value_dim,
`in_proj_qkvz` and `in_proj_ba` grouped per key head (its [q|k|v|z] and
[b|a] rows together: fix_query_key_value_ordering reshapes them to
(num_k_heads, ...), so a block of key heads is a block of rows), a
depthwise `conv1d` over [q | k | v], per-value-head `A_log` and
`dt_bias`, a gated RMSNorm over one head's `head_v_dim` (the same weight
for every head: every rank holds it whole, REPLICA, its gradient each
rank's heads' part) and `out_proj`. A rank holds block s of S of the key
heads and of their value heads; it splits when num_k_heads divides by S.
Qwen3.5's Qwen3_5GatedDeltaNet declares the same with its projections
unfused: in_proj_qkv as [q | k | v] concatenated, in_proj_z, in_proj_b,
in_proj_a (LAYOUTS' "delta_split"). OLMo Hybrid's OlmoHybridGatedDeltaNet
declares the same counts with q_proj, k_proj, v_proj, a_proj, b_proj, the
output gate's g_proj, o_norm and o_proj, each Linear's rows per key or
value head, only the conv's channels fused ("delta_qkv"). Kimi Linear's
KimiDeltaAttention ("kda") has `num_heads` heads of `head_dim` for q, k
and v alike (`qkv_dim` each, no key-head grouping): q_proj, k_proj,
v_proj and a depthwise conv over [q | k | v], beta's b_proj, a decay per
channel (forget_gate: f_a_proj, f_b_proj, dt_bias per channel, A_log per
head), an output gate (g_a_proj, g_b_proj), a gated RMSNorm over one
head's width (o_norm: REPLICA) and o_proj. Its gates are low-rank: the
a-projections' latent is read by every head, so it is held whole on every
rank (REPLICA) and only the b-projections' rows are split (kda_dims says
why).

Mamba-1's mixers (MambaMixer, FalconMambaMixer, Jamba's JambaMambaMixer:
LAYOUTS' "mamba1") have no heads: `intermediate_size` channels, each with
its rows of in_proj's x and z segments (the forward chunks [x | z]), its
depthwise conv channel, its rows of A_log (channel x state), D, dt_proj's
weight and bias, and its columns of x_proj and out_proj. A rank holds block
s of S of the channels of all of them. x_proj (channels -> dt rank + 2
state) reads every channel: a rank's product is a PARTIAL sum of [dt | B |
C], summed over the S ranks inside the mixer before dt_proj and the scan
read it (REDUCED: tensor/whole.py's split_mixer all-reduces it; every
rank then reads the sum for its own channels, so its gradient is summed
too: an all-reduce both ways). Jamba's RMSNorms over dt, B and C act on the
sum: held whole on every rank (REPLICA); FalconMamba's weightless ones are
buffers. It splits when the channels divide by S. The split mixer is made
to take its torch path (transformers' fused CUDA kernel reads x_proj's
weight itself and would never sum it: tensor/whole.py's _torch_path).

MiniMax's lightning attention (MiniMaxLightningAttention: LAYOUTS'
"lightning") has `num_attention_heads` heads of `head_dim`: per head its
rows of the fused qkv_proj ([q | k | v] of each head together: the forward
reshapes them to (heads, 3 head_dim)), of output_gate, its decay buffers
(slope_rate, query_decay, key_decay by their first dimension,
diagonal_decay by its second) and out_proj's columns. A rank holds block s
of S of the heads of all of them. Its RMSNorm `norm` acts on the WHOLE
inner width, every head's features: a rank holds its heads' features of
it (its weight's block s), and the rows' moments are summed over the S
ranks inside the mixer (MOMENTS: tensor/whole.py's split_mixer makes the
norm a layers.SplitNorm over the mixer's group, divided by the whole
width), the general mechanism for a norm inside a split mixer over its
whole inner width. It splits when the heads divide by S.
RecurrentGemma's recurrent block (RecurrentGemmaRecurrentBlock, Griffin's:
LAYOUTS' "rglru") declares `lru_width`, linear_x and linear_y (stream ->
lru_width), a depthwise `conv_1d` over the lru_width channels, `rg_lru`
(the RG-LRU: `num_attention_heads` heads of `block_width` channels,
block-diagonal input and recurrent gates [heads, block_width,
block_width] with per-head biases, a per-channel `recurrent_param`) and
linear_out back to the stream. The RG-LRU reshapes its channels to
(heads, block_width), so head h owns channels [h bw, (h+1) bw); its
gates mix channels only within a head, and the recurrence and its state
are per channel. A rank holds block s of S of the heads of all of them:
linear_x's and linear_y's rows, the conv's channels, the gates' heads,
recurrent_param's entries, linear_out's columns (its bias WHOLE, as
out_proj's); the shard's lru_width (the block's, its cache's width),
rg_lru's num_attention_heads and the conv's channels set to 1/S,
block_width kept. It is called with position ids (the recurrence resets
at position 0), an attention mask and use_cache: the measurement runs it
on its traced call, its shards copied before the whole call (with
use_cache on, the block keeps its conv and recurrence state from its
last call). It splits when its heads divide by S.

The layout is derived from the declared attributes and then MEASURED, as
experts.own_split measures an experts module's: the S shards' outputs of
the module's own forward (its integer attributes set to a shard's: heads,
groups, widths; the norm's group size kept), on random weights and input,
must sum to the whole module's; with an inner sum (Mamba-1's x_proj) the
shards run side by side, each given the others' partial products as the
rewrite's all-reduce gives them; with a norm of MOMENTS,
each shard's norm run on the whole width from the others' features (what
the summed moments compute; mixer_measure.py). A layout the forward
does not follow (a norm over the whole inner width not in MOMENTS, a
different order of in_proj's segments, x_proj's products left unsummed)
fails that and the mixer keeps running whole, which stays exact; so does a
split that does not divide (`n_groups` > 1, or `num_k_heads`, not a
multiple of the tensor-parallel size: one group's B and C, or one key
head's q and k, would be needed on some ranks but not all, and a norm over
a group on two ranks would need its moments summed across them, neither
built; one group's heads: a head's channels; Kimi's heads: a head's
channels; the RG-LRU's heads: a head's gate block).

In 1d a mixer splits over the whole group (its stream is whole rows, or
sequence shards gathered for the mixer). In 2d, 2.5d and 3d the q ranks
holding one block of rows (the stream's group: each a block of its
hidden features) gather whole rows and split the mixer's heads q ways
among them, as experts run by their own forward are split
(tensor/mode.py, convert_mixer): the scan runs on this rank's rows and
heads, and the partial outputs are reduce-scattered back onto the
stream's hidden blocks; ranks with other rows hold the same heads
(replicas, their gradients summed). Mamba-1's x_proj sum and MiniMax's
norm moments run over those q ranks too.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from tpctl.parallel.roles.experts import WHOLE
from tpctl.parallel.roles.fused import ProbeError
from tpctl.parallel.roles.mixer_dims import (REPLICA, Kept, delta_dims, kda_dims, kept, lightning_dims, mamba1_dims,
                                              mamba2_dims, rglru_dims, shard_value)
from tpctl.parallel.roles.mixer_measure import measure
from tpctl.parallel.roles.probes import is_rms_norm, norm_width

# What a Mamba-2 mixer declares (transformers' families all do).
DECLARED = ("num_heads", "head_dim", "n_groups", "ssm_state_size", "intermediate_size", "conv_dim",
            "in_proj", "conv1d", "out_proj")
# What a gated delta-rule linear attention declares (Qwen3-Next's).
DELTA_DECLARED = ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "key_dim", "value_dim", "conv_dim",
                  "in_proj_qkvz", "in_proj_ba", "conv1d", "out_proj", "norm")
# Integer attributes a shard's forward reads, set to the shard's value
# (any module inside the mixer: FalconH1's gated norm keeps its own
# n_groups); a group's size (a norm's `group_size`) and a head's width stay.
SHARD_ATTRS = ("num_heads", "n_groups", "intermediate_size", "conv_dim")
# Qwen3.5's: the same with [q|k|v], z, b and a each its own Linear.
DELTA_SPLIT_DECLARED = DELTA_DECLARED[:7] + ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "out_proj",
                                             "norm")
DELTA_SHARD_ATTRS = ("num_k_heads", "num_v_heads", "key_dim", "value_dim", "conv_dim")
# OLMo Hybrid's: q, k, v, a, b and the output gate g each its own Linear, o_norm and o_proj.
DELTA_QKV_DECLARED = DELTA_DECLARED[:7] + ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj", "conv1d",
                                          "o_norm", "o_proj")
# Kimi Linear's KimiDeltaAttention: one head count for q, k and v.
KDA_DECLARED = ("num_heads", "head_dim", "qkv_dim", "conv_dim", "q_proj", "k_proj", "v_proj", "conv1d",
                "forget_gate", "b_proj", "g_a_proj", "g_b_proj", "o_norm", "o_proj")
KDA_SHARD_ATTRS = ("num_heads", "qkv_dim", "conv_dim")
# Mamba-1's (MambaMixer, FalconMambaMixer, JambaMambaMixer): split by inner channels.
MAMBA1_DECLARED = ("intermediate_size", "ssm_state_size", "time_step_rank", "in_proj", "conv1d", "x_proj", "dt_proj",
                   "A_log", "D", "out_proj")
# Linears whose input features are split and whose partial outputs are summed over the splitting ranks
# INSIDE the mixer, before anything reads them (Mamba-1's x_proj: [dt | B | C] from every channel).
REDUCED = {"mamba1": ("x_proj",)}
# MiniMax's lightning attention (MiniMaxLightningAttention): per head its rows of the fused qkv_proj and
# output_gate, its decay buffers, out_proj's columns, and its features of an RMSNorm over ALL heads.
LIGHTNING_DECLARED = ("num_attention_heads", "head_dim", "block_size", "qkv_proj", "output_gate", "norm", "out_proj",
                      "slope_rate", "query_decay", "key_decay", "diagonal_decay")
# Norms inside a mixer over its WHOLE inner width, every head's features: a rank holds its heads' features
# (and weight), and the rows' moments are summed over the ranks splitting the mixer (tensor/whole.py's
# split_mixer: layers.SplitNorm, divided by the whole width).
MOMENTS = {"lightning": ("norm",)}
# RecurrentGemma's recurrent block (Griffin's): linear_x / linear_y, a depthwise conv_1d, the RG-LRU
# (its heads and gates a child's: dotted), linear_out.
RGLRU_DECLARED = ("lru_width", "linear_x", "linear_y", "conv_1d", "rg_lru.num_attention_heads", "rg_lru.block_width",
                  "rg_lru.input_gate_weight", "rg_lru.recurrent_gate_weight", "rg_lru.recurrent_param", "linear_out")
CONV_ATTRS = ("in_channels", "out_channels", "groups")


@dataclass(frozen=True)
class MixerSplit:
    """A mixer's split by heads: per parameter or buffer (name inside the
    mixer), the dimension split and its segments' sizes (a rank holds
    block s of S of each; WHOLE: held whole, read as 1/S; REPLICA: held
    whole, read as itself), and the integer
    attributes (module path, attribute, full value) set to full / S."""

    heads: int
    groups: int
    dims: tuple[tuple[str, int, tuple[int, ...]], ...]
    attrs: tuple[tuple[str, str, int], ...]
    kind: str = "mamba2"  # (a key of LAYOUTS)
    # (Linear inside the mixer, its outputs): its partial products summed over the ranks inside the mixer
    reduced: tuple[tuple[str, int], ...] = ()
    # (norm inside the mixer, its moments: 1 an RMSNorm's, 2 a LayerNorm's, its whole width): MOMENTS
    moments: tuple[tuple[str, int, int], ...] = ()

    def whole(self) -> tuple[str, ...]:
        return tuple(name for name, dim, _ in self.dims if dim == WHOLE)

    def ranges(self, name: str, shards: int, s: int):
        """(dim, ((start, stop), ...)): block s of `shards` of every segment."""
        _, dim, sizes = next(d for d in self.dims if d[0] == name)
        out, offset = [], 0
        for size in sizes:  # (a Kept segment: whole on every shard)
            step = size // shards
            whole = isinstance(size, Kept)
            out.append((offset, offset + size) if whole else (offset + s * step, offset + (s + 1) * step))
            offset += size
        return dim, tuple(out)

    def kept_params(self) -> tuple[str, ...]:
        """The tensors with segments held whole on every shard (Kept: one
        group's B and C), whose rows' gradients the rewrite sums over the
        ranks holding them (replicas.share_slices; a buffer among them,
        FalconH1's mup_vector, has none)."""
        return tuple(name for name, dim, sizes in self.dims if dim >= 0 and kept(sizes))

    def torch_path(self) -> bool:
        """Whether the split mixer must take its torch path: transformers'
        fused CUDA kernels (taken while its `training` is set) read its
        weights themselves and would never make its sums across ranks
        (Mamba-1's x_proj products; a Mamba-2 gated norm's moments, over
        this rank's features alone). tensor/whole.py's _torch_path; the
        measurement runs the same path."""
        return bool(self.reduced) or self.kind == "mamba2" and bool(self.moments)

    def shard_attrs(self, shards: int) -> list[tuple[str, str, int]]:
        """(module path, attribute, a shard's value) of each integer attribute
        the shard's forward reads: full / shards, a Kept part kept whole."""
        kept_of = {sum(sizes): kept(sizes) for _, dim, sizes in self.dims if dim >= 0 and kept(sizes)}
        return [(entry[0], entry[1], shard_value(entry, kept_of, shards)) for entry in self.attrs]

    def heads_problem(self, shards: int) -> Optional[str]:
        """Why the mixer cannot be split `shards` ways (it then runs whole)."""
        if self.groups % shards == 0 or self.kept_params() and self.heads % shards == 0:
            return None
        if self.kept_params():  # (one group, its B and C on every rank: a head is the unit)
            return f"{self.heads} heads of one group do not split {shards} ways (a head's channels would span ranks)"
        if self.kind == "mamba1":
            return f"{self.groups} inner channels do not split {shards} ways"
        if self.kind in ("kda", "lightning"):
            return (f"{self.groups} head(s) do not split {shards} ways (a head's query, key, value, gate and decay "
                    "channels would span ranks)")
        if self.kind == "rglru":
            return f"{self.groups} head(s) do not split {shards} ways (a head's block-diagonal gates would span ranks)"
        if self.kind.startswith("delta"):
            return (f"{self.groups} key head(s) do not split {shards} ways (a key head's query, key and value "
                    "heads would span ranks)")
        return (f"{self.groups} group(s) of heads do not split {shards} ways (a group's B, C and gated-norm "
                "moments would span ranks)")

    # (the plan's layout interface: rewrite.check_plan, share_slices) A
    # mixer that does not split runs whole: never a reason to refuse.
    def split_problem(self, ways: int, blocks: Optional[int] = None) -> Optional[str]:
        return None

    def shares(self, ways: int) -> bool:
        return False

    def describe(self) -> str:
        segments = lambda sizes: ", ".join(f"{int(s)} whole" if isinstance(s, Kept) else str(s) for s in sizes)  # noqa: E731
        parts = ", ".join(f"{n} whole (1/shards each)" if d == WHOLE else f"{n} whole on every rank" if d == REPLICA
                          else f"{n} dim {d} [{segments(sizes)}]" for n, d, sizes in self.dims)
        if self.kind == "mamba1":
            sums = ", ".join(f"{n}'s {w} outputs" for n, w in self.reduced)
            return (f"mixer (heads split): {self.heads} inner channels, a rank's block of {parts}; {sums} summed "
                    "over the ranks inside the mixer")
        if self.kind in ("kda", "rglru"):
            return f"mixer (heads split): {self.heads} heads, a rank's whole heads of {parts}"
        one = (" in one group (its B and C segments whole on every rank, their gradients summed over the ranks "
               "inside the mixer)" if self.kept_params() else "")
        if self.moments:
            sums = ", ".join(f"{n}'s moments (over its {w} features)" for n, _, w in self.moments)
            return (f"mixer (heads split): {self.heads} heads{one}, a rank's whole heads of {parts}; {sums} summed "
                    "over the ranks inside the mixer")
        if self.kind.startswith("delta"):
            return (f"mixer (heads split): {self.heads} value heads of {self.groups} key heads, a rank's whole key "
                    f"heads and their value heads of {parts}")
        if one:
            return f"mixer (heads split): {self.heads} heads{one}, a rank's whole heads of {parts}"
        return f"mixer (heads split): {self.heads} heads in {self.groups} groups, a rank's whole heads and groups of {parts}"


def mixer_kind(module: nn.Module) -> Optional[str]:
    """The key of LAYOUTS whose attributes `module` declares, or None."""
    return next((kind for kind, (declared, linears, *_) in LAYOUTS.items()
                 if all(_has(module, a) for a in declared)
                 and all(isinstance(_submodule(module, a), nn.Linear) for a in linears + REDUCED.get(kind, ()))),
                None)


def _has(module: nn.Module, path: str) -> bool:
    """Whether `module` has the attribute at dotted `path` (RecurrentGemma's rg_lru.num_attention_heads)."""
    try:
        operator.attrgetter(path)(module)
    except AttributeError:
        return False
    return True


def _submodule(module: nn.Module, path: str) -> Optional[nn.Module]:
    try:  # (a Linear of a child: Kimi's forget_gate.f_b_proj)
        return module.get_submodule(path)
    except AttributeError:
        return None


def is_mixer(module: nn.Module) -> bool:
    return mixer_kind(module) is not None


def is_mamba2_mixer(module: nn.Module) -> bool:
    return mixer_kind(module) == "mamba2"


def declared_split(module: nn.Module, order: Optional[tuple[str, ...]] = None) -> MixerSplit:
    """The split read from a mixer's declared attributes (its kind's
    builder in LAYOUTS); `order`: its fused projections' segments (default
    the kind's first). ProbeError for a parameter of no known width."""
    kind = mixer_kind(module)
    if kind is None:
        raise ProbeError(f"{type(module).__name__} declares no mixer layout")
    declared, linears, shard_attrs, build, orders = LAYOUTS[kind]
    dims, heads, groups, width = build(module, order or _flat(orders[0]))
    one_group = any(kept(sizes) for _, d, sizes in dims if d >= 0)  # (its B and C whole: n_groups stays 1)
    attrs = [(path, a, v) for path, m in module.named_modules() for a, v in vars(m).items()
             if isinstance(v, int) and not isinstance(v, bool) and v > 0
             and (a in shard_attrs or isinstance(m, nn.Conv1d) and a in CONV_ATTRS)
             and not (one_group and a == "n_groups")]
    # (linears: the Linears split by heads, the output projection last; a low-rank projection read
    # whole by every head, Kimi's f_a_proj / g_a_proj, is none of them and keeps its width)
    attrs += [(lin, "out_features", module.get_submodule(lin).out_features) for lin in linears[:-1]]
    attrs += [(linears[-1], "in_features", width)]
    reduced = tuple((lin, module.get_submodule(lin).out_features) for lin in REDUCED.get(kind, ()))
    attrs += [(lin, "in_features", module.get_submodule(lin).in_features) for lin, _ in reduced]
    moments = tuple((n, 1 if is_rms_norm(norm) else 2, norm_width(norm))
                    for n in MOMENTS.get(kind, ()) for norm in [module.get_submodule(n)])
    if one_group and getattr(getattr(module, "norm", None), "weight", None) is not None:
        # One group's gated RMSNorm is over the WHOLE inner width (group_size = intermediate): its moments
        # summed over the ranks splitting the mixer, as MiniMax's norm's (a norm's class named *Gated: one moment)
        moments = (("norm", 1, norm_width(module.norm)),)
    return MixerSplit(heads, groups, tuple(dims), tuple(attrs), kind, reduced, moments)


ORDERS = tuple(itertools.permutations(("z", "xBC", "dt")))
DELTA_ORDERS = (("grouped",), ("concat",))

# Per kind of mixer: what it declares, its Linear attributes (out_proj
# last), the integer attributes a shard's forward reads, the builder of
# its dims and the orders of its fused segments tried by the measurement.
LAYOUTS = {
    "mamba2": (DECLARED, ("in_proj", "out_proj"), SHARD_ATTRS, mamba2_dims, ORDERS),
    "delta": (DELTA_DECLARED, ("in_proj_qkvz", "in_proj_ba", "out_proj"), DELTA_SHARD_ATTRS, delta_dims,
              DELTA_ORDERS),
    "delta_split": (DELTA_SPLIT_DECLARED, ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"),
                    DELTA_SHARD_ATTRS, delta_dims, DELTA_ORDERS[::-1]),  # ([q|k|v] concatenated first)
    "delta_qkv": (DELTA_QKV_DECLARED, ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj", "o_proj"),
                  DELTA_SHARD_ATTRS, delta_dims, DELTA_ORDERS[::-1]),
    # (f_a_proj and g_a_proj, the low-rank gates' shared latent, are not split: kda_dims)
    "kda": (KDA_DECLARED, ("q_proj", "k_proj", "v_proj", "b_proj", "forget_gate.f_b_proj", "g_b_proj", "o_proj"),
            KDA_SHARD_ATTRS, kda_dims, DELTA_ORDERS[::-1]),
    # (x_proj, REDUCED: its input columns split, its partial outputs summed inside the mixer)
    "mamba1": (MAMBA1_DECLARED, ("in_proj", "dt_proj", "out_proj"), ("intermediate_size",), mamba1_dims,
               (("x", "z"), ("xz",))),
    # (norm, MOMENTS: over every head's features, its moments summed across the ranks inside the mixer)
    "lightning": (LIGHTNING_DECLARED, ("qkv_proj", "output_gate", "out_proj"), ("num_attention_heads",),
                  lightning_dims, DELTA_ORDERS),
    # (lru_width: the block's, its cache's width; num_attention_heads: rg_lru's, its reshape's; block_width kept)
    "rglru": (RGLRU_DECLARED, ("linear_x", "linear_y", "linear_out"), ("lru_width", "num_attention_heads"), rglru_dims,
              (("heads",),)),
}
# (checked first: no order of the segments helps) a split's smallest unit is one group, or one key head
ONE_GROUP = {
    # (one group of heads splits by heads: its B and C Kept whole on every rank, the gated norm's moments summed)
    "mamba2": ("num_heads", "one head (num_heads=1): nothing to split"),
    "delta": ("num_k_heads", "one key head (num_k_heads=1): its query and key serve every value head"),
    "delta_split": ("num_k_heads", "one key head (num_k_heads=1): its query and key serve every value head"),
    "delta_qkv": ("num_k_heads", "one key head (num_k_heads=1): its query and key serve every value head"),
    "kda": ("num_heads", "one head (num_heads=1): nothing to split"),
    "mamba1": ("intermediate_size", "one inner channel: nothing to split"),
    "lightning": ("num_attention_heads", "one head (num_attention_heads=1): nothing to split"),
    "rglru": ("rg_lru.num_attention_heads", "one head (num_attention_heads=1): its gates read every channel"),
}


def _flat(order: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(p for part in order for p in (("x", "B", "C") if part == "xBC" else (part,)))


def mixer_split(module: nn.Module, args, kwargs, orders=None) -> MixerSplit:
    """The measured head split of a mixer of LAYOUTS (module.forward on
    `args`, `kwargs`: its traced call): the declared layout, its fused
    segments in the first order of `orders` (default its kind's) whose
    shards reproduce the whole output. ProbeError with the reason if none does."""
    kind = mixer_kind(module)
    if kind is None:
        raise ProbeError(f"{type(module).__name__} declares no mixer layout ({', '.join(DECLARED)}; or "
                         f"{', '.join(DELTA_DECLARED)})")
    if not isinstance(args[0] if args else kwargs.get("hidden_states"), torch.Tensor):
        raise ProbeError("its traced call has no hidden states")
    attr, why = ONE_GROUP[kind]
    if operator.attrgetter(attr)(module) == 1:
        raise ProbeError(why)
    for order in orders or LAYOUTS[kind][4]:
        split = declared_split(module, _flat(order))
        why = measure(module, split, args, kwargs)
        if why is None:
            return split
    raise ProbeError(f"no layout of its heads reproduces its output: {why}")


def heads_split(mode, split) -> bool:
    """Whether `mode` (a tensor.mode.ParallelMode) splits a mixer of plan
    layout `split` by heads: a MixerSplit, over the ranks that hold one
    row's hidden features (`own_forward_ways`: 1d's whole group, a 2d grid's row
    of q), whose number its groups divide by. The rewrite
    (tensor/whole.py) and the planner (cost/layer_comm.py) ask the same."""
    return isinstance(split, MixerSplit) and mode.rewrites and split.heads_problem(mode.own_forward_ways()) is None


def kept_rows(plan, mode) -> list[str]:
    """The parameters (by name) of the mixers `mode` splits by heads with
    segments held whole on every rank of the split (one group's B and C):
    each rank's gradient of those rows is its heads' part, summed over the
    ranks holding them. The rewrite hands them to replicas.share_slices
    (row replicas beside the rows of its own heads), the planner counts
    those sums (cost/layer_comm.kv_shared)."""
    return [f"{name}.{p}" for name, layout in getattr(plan, "layouts", {}).items()
            if name in plan.roles and heads_split(mode, layout) for p in layout.kept_params()]
