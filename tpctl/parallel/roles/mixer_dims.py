"""The layouts of mixers split by heads or channels (roles/mixers.py):
per kind, each parameter's and buffer's split dimension and segments, read
from the mixer's declared attributes (ProbeError for a tensor held per no
head, group or channel). mixers.py measures them.
"""

from __future__ import annotations

from typing import Optional

import torch.nn as nn

from tpctl.parallel.roles.experts import WHOLE
from tpctl.parallel.roles.fused import ProbeError

# (WHOLE: a parameter every shard holds whole, read as 1/shards of itself: out_proj's bias, as an experts module's bias)
# REPLICA: held whole and read as itself by every shard (a norm weight
# shared by every head): its gradient each rank's heads' part, summed.
REPLICA = -2


class Kept(int):
    """A segment of a split dimension held WHOLE by every rank splitting the
    mixer, beside segments each rank holds a block of (ranges: the whole
    segment on every shard): a Mamba-2 mixer's B and C rows of in_proj and
    channels of the conv when it has one group of heads, which every head
    reads. Each rank's gradient of it is its own heads' part: the rewrite
    sums it over the ranks holding it (replicas.share_slices' row replicas,
    as shared key/value heads' rows). An int: the segment's size."""

    def __repr__(self) -> str:
        return f"Kept({int(self)})"


def kept(sizes) -> int:
    """The part of a dimension of `sizes` (segments) held whole on every shard."""
    return sum(s for s in sizes if isinstance(s, Kept))


def shard_value(entry: tuple, kept_of: dict, shards: int) -> int:
    """A shard's value of an integer attribute (owner, attribute, full):
    full / shards, or where full is the length of a dimension with segments
    held whole (`kept_of`: {length: its part held whole}, a one-group
    mixer's conv_dim and in_proj's outputs), that part plus the rest / shards."""
    full = entry[2]
    whole = kept_of.get(full, 0)
    return whole + (full - whole) // shards


def mamba2_dims(module: nn.Module, order: tuple[str, ...]):
    """A Mamba-2 mixer's dims (in_proj's segments in `order`, default z, x,
    B, C, dt as every family's torch_forward splits it), heads, groups and
    inner width. With ONE group of heads every head reads the same B and C:
    their segments (in_proj's rows, the conv's channels) are Kept, whole on
    every shard, and the rest split by heads (the gated norm, then over the
    whole inner width, has its moments summed: mixers.declared_split)."""
    heads, groups, state = module.num_heads, module.n_groups, module.ssm_state_size
    inner, conv = module.intermediate_size, module.conv_dim
    if inner != heads * module.head_dim or conv != inner + 2 * groups * state or heads % groups:
        raise ProbeError(f"{type(module).__name__} declares {heads} heads of {module.head_dim}, {groups} groups, "
                         f"intermediate {inner}, conv_dim {conv}: not a Mamba-2 layout")
    bc = Kept(state) if groups == 1 else groups * state
    seg = {"z": inner, "x": inner, "B": bc, "C": bc, "dt": heads}
    proj = tuple(seg[k] for k in (order or ("z", "x", "B", "C", "dt")))
    if sum(proj) != module.in_proj.out_features:  # (Mamba2Mixer's d_mlp extra segments: not handled)
        raise ProbeError(f"in_proj's {module.in_proj.out_features} outputs are not [z | x | B | C | dt] ({sum(proj)})")
    known = {conv: (inner, bc, bc), heads: (heads,), inner: (inner,)}
    dims, tensors = [], [*module.named_parameters(), *module.named_buffers()]
    for name, t in tensors:
        owner, _, leaf = name.rpartition(".")
        if owner == "out_proj":
            dims.append((name, 1, (inner,)) if leaf == "weight" else (name, WHOLE, ()))
        elif owner == "in_proj":
            dims.append((name, 0, proj))
        elif t.dim() and t.shape[0] in known:
            dims.append((name, 0, known[t.shape[0]]))
        elif t.dim() and t.shape[-1] == module.in_proj.out_features:  # (FalconH1's mup_vector (1, 1, outputs))
            dims.append((name, t.dim() - 1, proj))
        else:
            raise ProbeError(f"{type(module).__name__}.{name} {tuple(t.shape)} is held per no head, group or channel")
    return dims, heads, groups, inner


def delta_dims(module: nn.Module, order: tuple[str, ...]):
    """A gated delta-rule attention's dims (order ("grouped",): in_proj_qkvz
    and in_proj_ba grouped per key head, as Qwen3-Next's
    fix_query_key_value_ordering reads them; ("concat",): [q|k|v|z] and
    [b|a] each concatenated), value heads, key heads and value width."""
    kh, vh, key, value = module.num_k_heads, module.num_v_heads, module.key_dim, module.value_dim
    if key != kh * module.head_k_dim or value != vh * module.head_v_dim or module.conv_dim != 2 * key + value \
            or vh % kh:
        raise ProbeError(f"{type(module).__name__} declares {kh} key heads of {module.head_k_dim}, {vh} value heads "
                         f"of {module.head_v_dim}, conv_dim {module.conv_dim}: not a gated delta-rule layout")
    grouped = order == ("grouped",)
    conv = (key, key, value)
    if hasattr(module, "in_proj_qkvz"):  # (Qwen3-Next's fused [q|k|v|z] and [b|a])
        rules = {"in_proj_qkvz": (0, (2 * key + 2 * value,) if grouped else (key, key, value, value)),
                 "in_proj_ba": (0, (2 * vh,) if grouped else (vh, vh))}
    elif hasattr(module, "in_proj_qkv"):  # (Qwen3.5's [q|k|v], z, b, a)
        rules = {"in_proj_qkv": (0, (2 * key + value,) if grouped else (key, key, value)),
                 "in_proj_z": (0, (value,)), "in_proj_b": (0, (vh,)), "in_proj_a": (0, (vh,))}
    else:  # (OLMo Hybrid's q, k, v, a, b, g: only the conv's channels are fused, [q | k | v] as the forward
        # concatenates them; "grouped": read per key head, the wrong order the measurement must reject)
        rules = {"q_proj": (0, (key,)), "k_proj": (0, (key,)), "v_proj": (0, (value,)), "a_proj": (0, (vh,)),
                 "b_proj": (0, (vh,)), "g_proj": (0, (value,))}
        conv = (2 * key + value,) if grouped else conv
    out, norm = ("out_proj", "norm") if hasattr(module, "out_proj") else ("o_proj", "o_norm")
    rules.update({"conv1d": (0, conv), f"{out}.weight": (1, (value,)), f"{out}.bias": (WHOLE, ()),
                  norm: (REPLICA, ())})
    # (A_log, dt_bias: per value head; a key head's value heads are consecutive -- repeat_interleave -- so a
    # block of key heads owns a block of value heads)
    return rule_dims(module, rules, vh), vh, kh, value


def kda_dims(module: nn.Module, order: tuple[str, ...]):
    """Kimi Linear's KimiDeltaAttention's dims (order ("concat",): the
    conv's channels [q | k | v] as its forward concatenates them;
    ("grouped",): per head, a wrong order), heads (its own groups) and
    q/k/v width. Every head has its q, k, v rows and conv channels, its
    beta (b_proj's row), its decay (f_b_proj's rows, dt_bias's channels,
    A_log's entry), its output gate (g_b_proj's rows) and o_proj's columns.

    The forget gate and the output gate are low-rank: f_a_proj and g_a_proj
    map the stream to ONE latent of head_dim features that every head
    reads (head h's gate is B_h (A x), B_h its rows of f_b_proj / g_b_proj).
    The rank dimension is not per head, so A is held whole on every rank
    (REPLICA: read as itself; its gradient on a rank, sum over its heads of
    B_h^T dL/d(B_h A x) x^T, summed over the group is the whole gradient),
    and only B's rows are split. Splitting the rank instead would give each
    rank a partial sum of B_h A x, which the softplus / sigmoid that follow
    do not add up (an all-reduce inside the mixer, not built); holding A
    costs 2 x hidden x head_dim weights per rank, small beside q, k, v."""
    heads, width = module.num_heads, module.qkv_dim
    if width != heads * module.head_dim or module.conv_dim != 3 * width:
        raise ProbeError(f"{type(module).__name__} declares {heads} heads of {module.head_dim}, qkv_dim {width}, "
                         f"conv_dim {module.conv_dim}: not Kimi's delta attention layout")
    per_head = (0, (width,))
    rules = {"q_proj": per_head, "k_proj": per_head, "v_proj": per_head, "b_proj": (0, (heads,)),
             "g_b_proj": per_head, "forget_gate.f_b_proj": per_head, "forget_gate.dt_bias": per_head,
             "forget_gate.A_log": (2, (heads,)),  # (1, 1, heads, 1)
             "conv1d": (0, (3 * width,) if order == ("grouped",) else (width,) * 3),
             "o_proj.weight": (1, (width,)), "o_proj.bias": (WHOLE, ()),
             "g_a_proj": (REPLICA, ()), "forget_gate.f_a_proj": (REPLICA, ()), "o_norm": (REPLICA, ())}
    return rule_dims(module, rules), heads, heads, width


def mamba1_dims(module: nn.Module, order: tuple[str, ...]):
    """A Mamba-1 mixer's dims (order ("x", "z"): in_proj's rows as the two
    segments its forward chunks them into; ("xz",): one block of both, a
    wrong order), inner channels (heads and groups alike: one channel is
    the unit) and inner width. Per channel: in_proj's rows of x and of z,
    the depthwise conv's, dt_proj's rows and bias, A_log's and D's rows,
    x_proj's and out_proj's columns. x_proj's product over a rank's
    channels is a partial sum of [dt | B | C], summed over the ranks inside
    the mixer (REDUCED); Jamba's RMSNorms over dt, B and C then act on the
    sum, held whole on every rank (REPLICA; FalconMamba's, weightless, are
    buffers)."""
    inner = module.intermediate_size
    if module.in_proj.out_features != 2 * inner or module.x_proj.out_features != module.time_step_rank + \
            2 * module.ssm_state_size:
        raise ProbeError(f"{type(module).__name__} declares intermediate {inner}, in_proj to "
                         f"{module.in_proj.out_features}, x_proj to {module.x_proj.out_features}: not a Mamba-1 layout")
    rules = {"in_proj": (0, (2 * inner,) if order == ("xz",) else (inner, inner)), "conv1d": (0, (inner,)),
             "x_proj.weight": (1, (inner,)), "x_proj.bias": (WHOLE, ()), "dt_proj": (0, (inner,)),
             "out_proj.weight": (1, (inner,)), "out_proj.bias": (WHOLE, ()),
             **{norm: (REPLICA, ()) for norm in ("dt_layernorm", "b_layernorm", "c_layernorm")}}
    return rule_dims(module, rules, inner), inner, inner, inner


def lightning_dims(module: nn.Module, order: tuple[str, ...]):
    """MiniMax's lightning attention's dims (order ("grouped",): qkv_proj's
    rows per head [q | k | v], as its forward reshapes them to (heads, 3
    head_dim) before splitting; ("concat",): [q.. | k.. | v..], a wrong
    order), heads (its own groups) and inner width. Per head: its rows of
    qkv_proj and output_gate, its decay buffers (slope_rate, query_decay,
    key_decay: first dimension; diagonal_decay: the second), its features
    of `norm` and out_proj's columns. The norm (an RMSNorm over the WHOLE
    inner width, every head's features) is split by the same features: its
    moments are summed over the ranks inside the mixer (mixers.MOMENTS)."""
    heads, inner = module.num_attention_heads, module.num_attention_heads * module.head_dim
    width = getattr(getattr(module.norm, "weight", None), "shape", (inner,))[-1]
    if module.qkv_proj.out_features != 3 * inner or module.output_gate.out_features != inner or width != inner:
        raise ProbeError(f"{type(module).__name__} declares {heads} heads of {module.head_dim}, qkv_proj to "
                         f"{module.qkv_proj.out_features}, output_gate to {module.output_gate.out_features}, a norm "
                         f"over {width}: not a lightning attention layout")
    rules = {"qkv_proj": (0, (3 * inner,) if order == ("grouped",) else (inner,) * 3),
             "output_gate": (0, (inner,)), "norm": (0, (inner,)), "diagonal_decay": (1, (heads,)),  # (1, heads, ..)
             "out_proj.weight": (1, (inner,)), "out_proj.bias": (WHOLE, ())}
    return rule_dims(module, rules, heads), heads, heads, inner
def rglru_dims(module: nn.Module, order: tuple[str, ...]):
    """RecurrentGemma's recurrent block's dims (Griffin's: linear_x and
    linear_y to lru_width channels, a depthwise conv over them, the RG-LRU,
    linear_out back), heads (its own groups) and lru_width. The RG-LRU's
    forward reshapes its channels to (num_attention_heads, block_width):
    head h owns channels [h bw, (h + 1) bw), its block-diagonal gates'
    weights and biases are indexed by head, recurrent_param and the
    recurrence's state by channel. So a block of heads is a block of
    linear_x's and linear_y's rows, the conv's channels, recurrent_param's
    entries, the gates' heads and linear_out's columns (order ("heads",);
    ("strided",): the gates' heads dealt round the ranks, a wrong layout
    the measurement must reject)."""
    lru, rg = module.lru_width, module.rg_lru
    heads = getattr(rg, "num_attention_heads", 0)
    if not heads or lru != heads * getattr(rg, "block_width", 0):
        raise ProbeError(f"{type(module).__name__} declares lru_width {lru}, its rg_lru {heads} heads of "
                         f"{getattr(rg, 'block_width', None)}: not a real-gated linear recurrence's layout")
    gates = (0, (heads // 2, heads // 2) if order == ("strided",) else (heads,))
    rules = {"linear_x": (0, (lru,)), "linear_y": (0, (lru,)), "conv_1d": (0, (lru,)),
             "rg_lru.recurrent_param": (0, (lru,)),
             **{f"rg_lru.{g}": gates for g in ("input_gate_weight", "input_gate_bias", "recurrent_gate_weight",
                                                "recurrent_gate_bias")},
             "linear_out.weight": (1, (lru,)), "linear_out.bias": (WHOLE, ())}
    return rule_dims(module, rules), heads, heads, lru


def rule_dims(module: nn.Module, rules: dict, per_head: Optional[int] = None):
    """Each parameter's and buffer's (name, dim, segments) from `rules`
    (keyed by its name or its owner's); a tensor of the module's own whose
    first dimension is `per_head` long: per head. ProbeError for any other,
    or a split dimension of another length than its segments'."""
    dims = []
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        owner = name.rpartition(".")[0]
        rule = rules.get(name) or rules.get(owner) or ((0, (per_head,)) if not owner and t.dim()
                                                         and t.shape[0] == per_head else None)
        if rule is None:
            raise ProbeError(f"{type(module).__name__}.{name} {tuple(t.shape)} is held per no head or channel")
        if rule[0] >= 0 and (t.dim() <= rule[0] or t.shape[rule[0]] != sum(rule[1])):
            raise ProbeError(f"{type(module).__name__}.{name} {tuple(t.shape)} is not {rule[1]} along dim {rule[0]}")
        dims.append((name, *rule))
    return dims
