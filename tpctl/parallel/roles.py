"""Which role each module of a model plays, found by tracing its forward.

A model that carries no `tp_plan` (a Hugging Face model, a user's own) is run
once on a tiny batch of token ids while a `TorchFunctionMode` records which
layer each tensor came from. Roles then follow from the data flow, never from
module names:

  * an Embedding fed the model's input ids is the token `embedding`; one fed
    anything else (positions) is a `pos_embedding`;
  * matrix products between two activations are attention: the Linears
    feeding them are `qkv` (one fused Linear) or `attn_in` (separate q, k, v),
    the Linear reading their result is `attn_out`;
  * the Linear whose output is the model's output is the `lm_head`;
  * of the other Linears, one reading another's output is `mlp_out`, the ones
    it reads (a gated pair too) are `mlp_in`;
  * LayerNorm / RMSNorm modules on the residual stream are `norm`; Dropout
    modules are `dropout` on the stream and `attn_dropout` on split activations.

Anything that fits no role is reported with the reason, so a mode that would
have to split it refuses the model before training instead of training it
wrongly. Parameters are never read: meta parameters are stood in for by
zero-stride tensors of their shape, so a model too large to build whole can
still be traced.
"""

from __future__ import annotations

import contextlib
import fnmatch
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .experts import experts_layout, is_experts
from .fused import FusedLayout, ProbeError, attention_layout, mlp_layout
from .layers import CacheOff, is_norm, norm_width, on_cpu

# The vocabulary every mode maps to its layers.
ROLES = (
    "embedding", "pos_embedding", "qkv", "attn_in", "attn_out", "mlp_in", "mlp_out",
    "norm", "lm_head", "dropout", "attn_dropout", "head_norm", "proj_norm", "experts", "router", "pos_table",
)
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
TRACE_SEQ = 4
TRACE_BATCH = 2


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

    def kv_local(self, split: int) -> int:
        """Key/value heads a rank holds: its share, or one shared head."""
        return max(self.kv_heads // split, 1)

    def local(self, attr: str, full: int, split: int) -> int:
        """This rank's value of a head count, width or ratio `attr`."""
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
    # (parallel/fused.py); every other Linear splits its features in blocks.
    layouts: dict[str, Any] = field(default_factory=dict)
    # Norms over all heads of q or k (`proj_norm`) -> the Linear whose output they normalise.
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


@on_cpu
def resolve_plan(model: nn.Module, plan: Optional[dict[str, str]] = None) -> RolePlan:
    """The roles of `model`'s modules: from `plan` (module-name patterns ->
    roles) if given, else from the model's `tp_plan`, else traced."""
    given = plan if plan is not None else getattr(model, "tp_plan", None)
    if plan is None and isinstance(given, dict) and not set(given.values()) <= set(ROLES):
        given = None  # another library's plan (transformers' colwise/rowwise styles): trace instead
    if not given:
        return infer_plan(model)
    for role in given.values():
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r} in the plan; roles are {', '.join(ROLES)}")
    roles = {}
    for name, _ in model.named_modules():
        role = next((r for pattern, r in given.items() if fnmatch.fnmatchcase(name, pattern)), None)
        if role is not None and name:
            roles[name] = role
    # The draws are found by tracing on token ids: a model fed something else
    # (a given plan is its only way in) is left to the start-up check.
    fed_ids = any(isinstance(m, nn.Embedding) for m in model.modules())
    draws = random_draws(model, _vocab(model)) if fed_ids else []
    return RolePlan(roles, "plan" if plan is not None else "tp_plan", draws=draws)


def _vocab(model: nn.Module) -> int:
    """Token ids the model accepts: below its smallest embedding table."""
    return min((m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)), default=2)


# ---- tracing -------------------------------------------------------------

_MATMULS = {torch.matmul, torch.bmm, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.bmm,
            torch.einsum, F.scaled_dot_product_attention, torch.baddbmm, torch.Tensor.baddbmm}


@dataclass
class _Node:
    kind: str  # input, linear, embedding, norm, dropout, attention, layer (other parameter holder)
    name: str  # module name ("" for ops)
    inputs: frozenset  # ids of the nodes this one reads (through any ops in between)
    operands: list = field(default_factory=list)  # attention: provenance of each operand
    shape: tuple = ()  # attention: shape of the first operand (the queries)


class _Trace(TorchFunctionMode):
    """Records, for every tensor, the nearest layers (nodes) it came from."""

    def __init__(self, params: set[int], stand_ins: set[int]):
        super().__init__()
        self.nodes: list[_Node] = []
        self.params = params
        self.stand_ins = stand_ins
        self._prov: dict[int, frozenset] = {}
        self._alive: list[torch.Tensor] = []  # keeps ids unique during the trace

    def prov(self, value) -> frozenset:
        out: set = set()
        for t in _tensors(value):
            if id(t) not in self.params:
                out |= self._prov.get(id(t), frozenset())
        return frozenset(out)

    def tag(self, value, prov: frozenset) -> None:
        for t in _tensors(value):
            self._prov[id(t)] = prov
            self._alive.append(t)

    def add(self, node: _Node) -> int:
        self.nodes.append(node)
        return len(self.nodes) - 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = _skip_stand_in(func, args, kwargs, self.stand_ins)
        if out is None:
            out = func(*args, **kwargs)
        operands = [a for a in _tensors((args, kwargs)) if id(a) not in self.params]
        prov = self.prov((args, kwargs))
        if func in _MATMULS:
            sources = [self.prov(a) for a in operands if a.is_floating_point()]
            if len([s for s in sources if s]) >= 2:  # two activations: attention
                shape = tuple(operands[0].shape)
                prov = frozenset({self.add(_Node("attention", "", prov, sources, shape))})
        self.tag(out, prov)
        return out


def _skip_stand_in(func, args, kwargs, stand_ins: set[int]):
    """The output of a Linear or Embedding whose weight is a stand-in, made
    without computing it (zeros of the right shape: values never matter to
    the trace), so that no stand-in is ever expanded into a whole matrix."""
    if func is F.linear:
        x, weight = args[0], args[1] if len(args) > 1 else kwargs.get("weight")
        if id(weight) in stand_ins:
            return x.new_zeros(*x.shape[:-1], weight.shape[0])
    elif func is F.embedding:
        ids, weight = args[0], args[1] if len(args) > 1 else kwargs.get("weight")
        if id(weight) in stand_ins:
            return weight.new_zeros(*ids.shape, weight.shape[1])
    return None


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _kind(module: nn.Module) -> Optional[str]:
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Embedding):
        return "embedding"
    if is_norm(module):
        return "norm"
    if isinstance(module, nn.Dropout):
        return "dropout"
    if is_experts(module):
        return "experts"
    if any(True for _ in module.parameters(recurse=False)):
        return "layer"
    if any(b.is_floating_point() for b in module.buffers(recurse=False)):
        return "table"  # constants without parameters: rotary frequencies, a sinusoidal position table
    return None


# Functions drawing random numbers (from torch's global generator unless
# given one), and the dropouts among them (random only with p > 0).
_RANDOM = {torch.rand, torch.rand_like, torch.randn, torch.randn_like, torch.randint, torch.randint_like,
           torch.randperm, torch.bernoulli, torch.multinomial, torch.normal, torch.poisson, torch.Tensor.uniform_,
           torch.Tensor.normal_, torch.Tensor.bernoulli_, torch.Tensor.exponential_, torch.Tensor.random_,
           torch.Tensor.geometric_, torch.Tensor.log_normal_, torch.Tensor.cauchy_}
_DROPOUTS = {F.dropout: 1, F.dropout1d: 1, F.dropout2d: 1, F.dropout3d: 1, F.alpha_dropout: 1,
             F.feature_alpha_dropout: 1, torch.dropout: 1, F.scaled_dot_product_attention: 4}


class _Draws(TorchFunctionMode):
    """Records the random functions a training forward calls on torch's
    global generator, outside Dropout modules (tpctl replaces those with
    ones drawing from the mesh's generators)."""

    def __init__(self):
        super().__init__()
        self.found: list[str] = []
        self.in_dropout = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.in_dropout:
            if func in _RANDOM and kwargs.get("generator") is None:
                self.found.append(getattr(func, "__name__", str(func)))
            elif func in _DROPOUTS:
                p = args[_DROPOUTS[func]] if len(args) > _DROPOUTS[func] else kwargs.get("dropout_p", kwargs.get("p", 0.0))
                on = kwargs.get("training", args[2] if func is not F.scaled_dot_product_attention and len(args) > 2 else True)
                if isinstance(p, (int, float)) and p > 0 and on:
                    self.found.append(f"{getattr(func, '__name__', func)}(p={p})")
        return func(*args, **kwargs)


@on_cpu
def random_draws(model: nn.Module, vocab_size: int = 2) -> list[str]:
    """The random functions `model`'s forward calls in training on torch's
    global generator (a router sampling its experts, jitter noise,
    functional attention dropout), Dropout modules aside."""
    draws = _Draws()
    trace(model, vocab_size, draws=draws)
    return sorted(set(draws.found))


def trace(model: nn.Module, vocab_size: int = 2, seq: int = TRACE_SEQ, inputs: Optional[dict] = None,
          ids: Optional[torch.Tensor] = None, draws: Optional[_Draws] = None):
    """Run `model` on `ids` (default: a batch of TRACE_BATCH x `seq` random
    token ids); return (nodes, the node ids the output came from, module
    name -> node ids of its calls). `inputs`, if given, is filled with module
    name -> (args, kwargs) of its first call (what a probe of the module's
    own forward runs it on). With `draws`, the forward runs in training mode
    and `draws` records its random numbers."""
    originals, stand_ins = {}, {}
    for module in model.modules():  # meta parameters: zero-stride stand-ins
        for attr, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                if id(p) not in stand_ins:
                    stand_ins[id(p)] = nn.Parameter(torch.full((), 0.02, dtype=p.dtype).expand(p.shape), requires_grad=False)
                originals[(module, attr)] = p
                module._parameters[attr] = stand_ins[id(p)]
    params = {id(p) for p in model.parameters()}
    tracer = _Trace(params, {id(p) for p in stand_ins.values()})
    calls: dict[str, list[int]] = {}
    handles = []

    def hooks(name, module, kind):
        def before(mod, args, kwargs):
            mod._tpctl_in = tracer.prov((args, kwargs))

        def after(mod, args, kwargs, out):
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else ()
            node = tracer.add(_Node(kind, name, mod._tpctl_in, shape=shape))
            calls.setdefault(name, []).append(node)
            # Dropout and tables of constants pass their input's provenance
            # on: they change no layout.
            tracer.tag(out, mod._tpctl_in if kind in ("dropout", "table") else frozenset({node}))
        handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(module.register_forward_hook(after, with_kwargs=True))

    def keep(name):
        def before(mod, args, kwargs):
            inputs.setdefault(name, (args, kwargs))
        handles.append(model.get_submodule(name).register_forward_pre_hook(before, with_kwargs=True))

    for name, module in model.named_modules():
        kind = _kind(module)
        if kind is not None and name:
            hooks(name, module, kind)
        if inputs is not None:
            keep(name)
    if draws is not None:
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                handles.append(module.register_forward_pre_hook(lambda *a: setattr(draws, "in_dropout", draws.in_dropout + 1)))
                handles.append(module.register_forward_hook(lambda *a: setattr(draws, "in_dropout", draws.in_dropout - 1)))
    was_training = model.training
    model.train(draws is not None)
    try:
        if ids is None:
            ids = torch.randint(0, vocab_size, (TRACE_BATCH, seq), generator=torch.Generator().manual_seed(0))
        input_node = tracer.add(_Node("input", "", frozenset()))
        tracer.tag(ids, frozenset({input_node}))
        with torch.no_grad(), CacheOff(model), tracer, draws if draws is not None else contextlib.nullcontext():
            logits = logits_of(model(ids))
        out = tracer.prov(logits)
    finally:
        for h in handles:
            h.remove()
        for (module, attr), p in originals.items():
            module._parameters[attr] = p
        for module in model.modules():
            module.__dict__.pop("_tpctl_in", None)
        model.train(was_training)
    return tracer.nodes, out, calls


# ---- roles from the data flow --------------------------------------------

def infer_plan(model: nn.Module, vocab_size: Optional[int] = None) -> RolePlan:
    """Trace `model` and assign a role to every module that has one."""
    if vocab_size is None:
        vocab_size = _vocab(model)
    first_inputs: dict[str, tuple] = {}  # module -> the inputs of its first call, for probes
    nodes, out, calls = trace(model, vocab_size, inputs=first_inputs)
    roles: dict[str, str] = {}
    layouts: dict[str, Any] = {}
    probed: dict[tuple, Any] = {}  # one probe per kind of module
    problems: dict[str, str] = {}
    modules = dict(model.named_modules())

    def assign(name: str, role: str) -> None:
        if roles.get(name, role) != role:
            problems[name] = f"used as both {roles[name]} and {role}"
        roles[name] = role

    node_name = {i: n.name for i, n in enumerate(nodes)}
    kind_of = {i: n.kind for i, n in enumerate(nodes)}

    def linears(ids) -> list[int]:
        """The Linear nodes among `ids`, looking through norms (a per-head
        q/k norm between a projection and the attention)."""
        out = []
        for j in ids:
            if kind_of[j] == "linear":
                out.append(j)
            elif kind_of[j] == "norm":
                out.extend(k for k in nodes[j].inputs if kind_of[k] == "linear")
        return out

    def probe(key: tuple, run):
        """A layout measured once per kind of module (the layers of a model
        are alike); a ProbeError is the refusal's reason."""
        if key not in probed:
            try:
                probed[key] = run()
            except ProbeError as e:
                probed[key] = e
            except Exception as e:  # the module's forward did not run on the probe
                probed[key] = ProbeError(f"measuring its layout failed: {type(e).__name__}: {e}")
        return probed[key]
    attention = [i for i, n in enumerate(nodes) if n.kind == "attention"]

    # Attention units: attention ops chained through each other (q k^T, then
    # the probabilities times v), with the Linears around them.
    unit_of: dict[int, int] = {}
    for i in attention:  # in call order: an op reads only earlier ones
        linked = {unit_of[j] for j in nodes[i].inputs if j in unit_of}
        unit_of[i] = min(linked, default=i)
        for k, u in unit_of.items():
            if u in linked:
                unit_of[k] = unit_of[i]
    ops_of_unit: dict[int, list[int]] = {}
    for i, u in unit_of.items():
        ops_of_unit.setdefault(u, []).append(i)

    heads: dict[str, Heads] = {}
    units: dict[str, list[str]] = {}  # attention / MLP module -> its Linears
    for ops in ops_of_unit.values():
        ops.sort()
        members = set(ops)
        feeders: list[str] = []
        for i in ops:
            for j in linears(nodes[i].inputs):
                if node_name[j] not in feeders:
                    feeders.append(node_name[j])
        readers = [n.name for n in nodes if n.kind == "linear" and n.inputs & members]
        if not feeders or len(set(readers)) != 1:
            for name in feeders + readers:
                problems[name] = "an attention whose projections tpctl cannot recognise"
            continue
        out_proj = readers[0]
        if set().union(*(nodes[j].inputs for j in calls[out_proj])) - members:
            problems[out_proj] = "reads the attention's output mixed with other activations"
        first = nodes[ops[0]]
        head_dim = first.shape[-1] if len(first.shape) == 4 else None
        q_name = next((node_name[j] for j in linears(first.operands[0])), feeders[0])
        k_name = next((node_name[j] for j in linears(first.operands[1])), None) \
            if len(first.operands) > 1 else None
        owner = _common_parent(feeders + [out_proj])
        if len(feeders) == 1:
            assign(feeders[0], "qkv")
            fused = feeders[0]
            rel = fused[len(owner) + 1:] if owner else fused
            layout = probe((type(modules[owner]), rel, modules[fused].weight.shape),
                           lambda: attention_layout(modules[owner], rel, *first_inputs[owner]))
            if isinstance(layout, ProbeError):
                problems[fused] = f"a fused projection whose layout tpctl cannot measure: {layout}"
                continue
            layouts[fused] = layout
            q_width, kv_width = layout.width(0), layout.width(1)
            head_dim = q_width // layout.units[0]
        else:
            for name in feeders:
                assign(name, "attn_in")
            q_width = modules[q_name].out_features
            kv_width = modules[k_name].out_features if k_name in modules else q_width
        assign(out_proj, "attn_out")
        if head_dim is None:  # no 4-D query: look for a stored head count
            n = next((v for a, v in vars(modules[owner]).items() if a in HEAD_ATTRS[:4] and isinstance(v, int)), None)
            head_dim = q_width // n if n else None
        if not head_dim or q_width % head_dim or kv_width % head_dim:
            problems[owner] = "cannot tell the attention's head size from its forward"
            continue
        h, kv = q_width // head_dim, kv_width // head_dim
        attrs = {a: v for a, v in vars(modules[owner]).items() if isinstance(v, int) and not isinstance(v, bool)
                 and (a in HEAD_ATTRS and v in (h, kv, q_width, kv_width) or a in RATIO_ATTRS and kv and v == h // kv
                      or a in GROUP_ATTRS)}
        if kv < h:  # separate key/value projections: heads of their own, which may be shared
            for name in feeders:
                if name != q_name and name not in layouts and modules[name].out_features == kv_width:
                    layouts[name] = FusedLayout.heads(kv_width, kv, "k" if name == k_name else "v")
        heads[owner] = Heads(h, kv, head_dim, attrs, _per_head_args(first_inputs.get(owner), h))
        units[owner] = feeders + [out_proj]

    # The LM head: the Linear the logits come from.
    heads_out = [node_name[i] for i in out if kind_of[i] == "linear"]
    if len(heads_out) == 1 and not (out - {calls[heads_out[0]][-1]}):
        assign(heads_out[0], "lm_head")
    else:
        problems["<output>"] = "the model's output does not come from one Linear (the LM head)"

    # The MLPs: of the other Linears, a reader of another's output.
    rest = {n.name for n in nodes if n.kind == "linear" and n.name not in roles}
    for name in sorted(rest):
        inputs = set().union(*(nodes[i].inputs for i in calls[name]))
        fed_by = {node_name[i] for i in inputs if kind_of[i] == "linear" and node_name[i] in rest}
        if fed_by:
            if inputs - {i for i in inputs if node_name[i] in fed_by}:
                problems[name] = "reads an MLP's hidden activation mixed with other activations"
            assign(name, "mlp_out")
            for source in fed_by:
                assign(source, "mlp_in")
            owner = _common_parent(sorted(fed_by) + [name])
            units[owner] = sorted(fed_by) + [name]
            for source in fed_by:
                if modules[source].out_features == modules[name].in_features:
                    continue  # one hidden feature per output feature: split in blocks
                rel, out_rel = (n[len(owner) + 1:] if owner else n for n in (source, name))
                layout = probe((type(modules[owner]), rel, modules[source].weight.shape),
                               lambda: mlp_layout(modules[owner], rel, out_rel, *first_inputs[owner]))
                if isinstance(layout, ProbeError):
                    problems[source] = f"a fused projection whose layout tpctl cannot measure: {layout}"
                else:
                    layouts[source] = layout
    # Embeddings: token ids or positions.
    inner = {i for i, n in enumerate(nodes) if n.kind == "attention"
             or (n.kind == "linear" and roles.get(n.name) in ("qkv", "attn_in", "mlp_in"))}
    input_ids = {i for i, n in enumerate(nodes) if n.kind == "input"}
    token = [n.name for n in nodes if n.kind == "embedding" and n.inputs & input_ids]
    if len(set(token)) > 1:  # positions derived from the ids: prefer the vocabulary-sized table
        head = next((modules[n] for n, r in roles.items() if r == "lm_head"), None)
        vocab = [t for t in token if head is not None and modules[t].num_embeddings == head.out_features]
        token = vocab[:1] or token[:1]
    for n in nodes:
        if n.kind == "embedding":
            assign(n.name, "embedding" if n.name in token else "pos_embedding")
    hidden = modules[token[0]].embedding_dim if token else None

    # Mixture-of-experts blocks: the experts module, and beside it (in the
    # module holding it) the routers: modules reading the whole residual
    # stream with an (outputs x hidden) weight whose output feeds no Linear
    # (the router proper, a shared expert's gate).
    moe_blocks, widths = [], {}
    for n in nodes:
        if n.kind == "experts" and n.name not in roles:
            layout = probe((type(modules[n.name]), n.name), lambda: experts_layout(modules[n.name])[2])
            if isinstance(layout, ProbeError):
                problems[n.name] = f"a mixture of experts tpctl cannot shard: {layout}"
                continue
            assign(n.name, "experts")
            layouts[n.name] = layout
            moe_blocks.append(n.name.rpartition(".")[0])
            block = modules[moe_blocks[-1]]
            widths[moe_blocks[-1]] = {a: v for a, v in vars(block).items()
                                      if isinstance(v, int) and not isinstance(v, bool) and v == hidden}
    for n in nodes:
        weight = getattr(modules.get(n.name), "weight", None)
        if n.kind in ("linear", "layer") and n.name not in roles and hidden is not None \
                and any(n.name.startswith(f"{b}." if b else "") for b in moe_blocks) \
                and isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[1] == hidden:
            assign(n.name, "router")
    feeding = {j for i, n in enumerate(nodes) if n.kind == "linear" and roles.get(n.name) in ("qkv", "attn_in")
               for j in n.inputs | {k for m in n.inputs if kind_of[m] == "norm" for k in nodes[m].inputs}}
    for name in rest:
        if name in roles:
            continue
        if feeding & set(calls[name]):
            problems[name] = ("a Linear feeding the attention's projections (a low-rank or latent projection, as "
                              "DeepSeek's multi-head latent attention): tpctl splits attention by heads, and its "
                              "output has none")
        else:
            problems[name] = "a Linear outside the attention / MLP / LM head pattern"

    head_dims = {h.head_dim for h in heads.values()}
    projections = {i for i, n in enumerate(nodes) if n.kind == "linear" and roles.get(n.name) in ("qkv", "attn_in")}
    sources: dict[str, str] = {}
    head_rows: dict[str, str] = {}
    for n in nodes:
        if n.kind == "norm":
            size = norm_width(modules[n.name])
            source = node_name[next(iter(n.inputs))] if len(n.inputs) == 1 and n.inputs <= projections else None
            weight = getattr(modules[n.name], "weight", None)
            if weight is not None and weight.dim() == 2:  # one row per head
                owner = next((o for o in heads if n.name.startswith(o + ".")), None)
                if owner is not None and n.inputs and n.inputs <= projections and size == heads[owner].head_dim \
                        and weight.shape[0] in (heads[owner].heads, heads[owner].kv_heads):
                    assign(n.name, "head_norm")
                    head_rows[n.name] = owner
                else:
                    problems[n.name] = f"a norm with a {tuple(weight.shape)} weight that is not one row per head"
            elif n.inputs and n.inputs <= projections and size in head_dims:
                # A norm over each head of q or k (Qwen3 style): whole heads
                # live on one rank, so it runs as written.
                assign(n.name, "head_norm")
            elif source is not None and size == modules[source].out_features:
                # A norm over all heads of one projection's output (OLMo-2's
                # q/k norms): split as that output is.
                assign(n.name, "proj_norm")
                if sources.setdefault(n.name, source) != source:
                    problems[n.name] = f"one norm over the outputs of both {sources[n.name]} and {source}"
            elif n.inputs & inner or (hidden is not None and size not in (None, hidden)):
                problems[n.name] = (f"a norm over {size} features inside attention or the MLP: neither per head "
                                    f"({', '.join(map(str, sorted(head_dims))) or 'no heads'}) nor over one projection's output")
            else:
                assign(n.name, "norm")
        elif n.kind == "dropout":
            assign(n.name, "attn_dropout" if n.inputs & inner else "dropout")
        elif n.kind == "table" and n.inputs <= input_ids and hidden is not None and n.shape[-1:] == (hidden,):
            # A table of constants indexed by positions and as wide as the
            # stream, added to it (XGLM's sinusoidal positions): each rank
            # keeps its piece of the stream's layout.
            assign(n.name, "pos_table")
        elif n.kind in ("layer", "experts") and n.name not in roles:
            problems.setdefault(n.name, f"an unsupported layer type ({type(modules[n.name]).__name__}) with parameters")

    # Dropout modules the traced forward never called (used only in
    # training, or only for their `p`): split activations inside attention.
    owners = tuple(f"{owner}." for owner in heads)
    for name, module in model.named_modules():
        if isinstance(module, nn.Dropout) and name not in roles:
            assign(name, "attn_dropout" if owners and name.startswith(owners) else "dropout")

    called = {id(p) for name in calls for p in modules[name].parameters(recurse=False)}
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if name and name not in calls and own and not all(id(p) in called for p in own):
            problems.setdefault(name, "never called in the forward")
    head_lists = {}  # one per-head norm per head, in a list: a rank keeps its heads'
    for name, module in modules.items():
        if isinstance(module, nn.ModuleList) and len(module) > 1 \
                and all(roles.get(f"{name}.{i}") == "head_norm" for i in range(len(module))):
            owner = next((o for o in heads if name.startswith(o + ".")), None)
            if owner is not None and len(module) in (heads[owner].heads, heads[owner].kv_heads):
                head_lists[name] = owner
            else:
                problems[name] = f"a list of {len(module)} per-head norms that matches no attention's head count"
    ordered = {name: roles[name] for name in modules if name in roles}
    # A layer tpctl has no rule for says more than the Linears around it
    # that fit no pattern because of it (a linear-attention mixer): first,
    # the outermost first.
    unsupported = lambda item: item[1].startswith("an unsupported layer type")  # noqa: E731
    problems = dict(sorted(problems.items(), key=lambda item: (0, item[0].count(".")) if unsupported(item) else (1, 0)))
    return RolePlan(ordered, "inferred", heads, problems, _blocks(model, ordered), units, layouts, sources, head_lists,
                    head_rows, random_draws(model, vocab_size), widths)


def _per_head_args(call, heads: int) -> list:
    """The arguments (after the hidden states) of an attention module's
    traced call that hold one slice per (row, head): floating tensors whose
    first dimension is the trace's batch times the query heads."""
    if call is None or heads < 2:
        return []
    args, kwargs = call
    def per_head(a) -> bool:  # [batch * heads, ...] (BLOOM), or [heads, ...] shared by every row (MPT)
        return isinstance(a, torch.Tensor) and a.is_floating_point() and a.dim() >= 2 \
            and a.shape[0] in (TRACE_BATCH * heads, heads)

    found = [i for i, a in enumerate(args) if i and per_head(a)]
    return found + [k for k, a in kwargs.items() if k != "hidden_states" and per_head(a)]


def _common_parent(names: list[str]) -> str:
    parts = [n.split(".") for n in names]
    common = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    if len(common) == min(len(p) for p in parts):  # one of them is the parent itself
        common = common[:-1]
    return ".".join(common)


def repeated_blocks(model: nn.Module) -> Optional[nn.ModuleList]:
    """The model's stack of blocks: of the nn.ModuleLists whose children are
    all of one class and that no such list holds (a list of per-head norms
    inside a block is not the stack, however many heads), the one with the
    most children (ties: the first in definition order). None if the model
    has no such list."""
    lists = [(name, m) for name, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and len(m) > 0 and len({type(child) for child in m}) == 1]
    best = None
    for name, module in lists:
        inside = any(other != name and name.startswith(f"{other}." if other else "") for other, _ in lists)
        if not inside and (best is None or len(module) > len(best)):
            best = module
    return best


def _blocks(model: nn.Module, roles: dict[str, str]) -> Optional[str]:
    """The nn.ModuleList holding the transformer blocks: the one whose
    children hold the attention and MLP layers."""
    best, count = None, 0
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module):
            inside = sum(1 for r in roles if r.startswith(f"{name}." if name else ""))
            if inside > count:
                best, count = name, inside
    return best
