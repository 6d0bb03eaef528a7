"""The tracer: one forward of a model on a tiny batch of token ids while a
`TorchFunctionMode` records which layer each tensor came from (the data flow
parallel/roles/inference.py reads roles from), and the random functions a training
forward draws from torch's global generator. Parameters are never read:
meta parameters are stood in for by zero-stride tensors of their shape, so
a model too large to build whole can still be traced.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tpctl.parallel.roles.experts import holds_experts
from tpctl.parallel.roles.plan import logits_of
from tpctl.parallel.roles.probes import CacheOff, is_experts, is_norm, on_cpu, traced_width

TRACE_SEQ = 4
TRACE_BATCH = 2

_MATMULS = {torch.matmul, torch.bmm, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.bmm,
            torch.einsum, F.scaled_dot_product_attention, torch.baddbmm, torch.Tensor.baddbmm}


@dataclass
class _Node:
    # input, linear, embedding, norm, dropout, attention, elementwise (a
    # parameter holder measured to act on each element alone), layer (other
    # parameter holder)
    kind: str
    name: str  # module name ("" for ops)
    inputs: frozenset  # ids of the nodes this one reads (through any ops in between)
    operands: list = field(default_factory=list)  # attention: provenance of each operand
    shape: tuple = ()  # attention: shape of the first operand (the queries)
    # A parameter holder: its own parameters its forward returns as they are
    # (GPT-NeoX-Japanese's attention returns its dense_bias for its block to add).
    returns: tuple = ()


class _Trace(TorchFunctionMode):
    """Records, for every tensor, the nearest layers (nodes) it came from."""

    def __init__(self, params: set[int], stand_ins: set[int]):
        super().__init__()
        self.nodes: list[_Node] = []
        self.params = params
        self.stand_ins = stand_ins
        self._prov: dict[int, frozenset] = {}
        self._alive: list[torch.Tensor] = []  # keeps ids unique during the trace
        self.read: set[int] = set()  # ids of the parameters some op read (a module's own never read: unread)
        self.paused = False  # a probe runs inside a hook: its ops are no part of the model's flow

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
        self.read.update(id(t) for t in _tensors((args, kwargs)) if id(t) in self.params)
        if self.paused:
            out = _skip_grouped_mm(func, args, kwargs, self.stand_ins)  # (an experts module's own forward)
            return func(*args, **kwargs) if out is None else out
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


def is_elementwise(module: nn.Module, args, kwargs, out) -> bool:
    """Whether `module`, called on one tensor giving one of its shape, acts
    on each element alone (a learned activation, a scalar gate): a copy
    with random parameters, run on a random input and on the same input
    with a random half of its elements changed, gives bitwise the same
    output at the elements left alone, and another at those changed."""
    if kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor) or not isinstance(out, torch.Tensor) \
            or not args[0].is_floating_point() or tuple(out.shape) != tuple(args[0].shape):
        return False
    if any(b.is_meta for b in module.buffers()) or len(list(module.parameters())) != len(module._parameters):
        return False  # (its own parameters only: a module holding others is no elementwise op)
    gen = torch.Generator().manual_seed(6)
    clone = copy.copy(module)  # shallow: its own parameters made anew, random
    clone._parameters = {a: None if p is None else nn.Parameter(
        torch.randn(p.shape, generator=gen).to(p.dtype) * 0.5, requires_grad=False) for a, p in module._parameters.items()}
    a = torch.randn(args[0].shape, generator=gen).to(args[0].dtype)
    for _ in range(2):
        changed = torch.rand(a.shape, generator=gen) < 0.5
        b = torch.where(changed, torch.randn(a.shape, generator=gen).to(a.dtype), a)
        with torch.no_grad():
            ya, yb = clone.forward(a), clone.forward(b)  # (forward itself: the copy shares the hooks)
        if not isinstance(ya, torch.Tensor) or ya.shape != a.shape or not torch.equal(ya[~changed], yb[~changed]) \
                or torch.equal(ya[changed], yb[changed]):
            return False
    return True


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
    return _skip_grouped_mm(func, args, kwargs, stand_ins)


def _skip_grouped_mm(func, args, kwargs, stand_ins: set[int]):
    """torch._grouped_mm's output (zeros of its shape) where an operand is a
    stand-in or on the meta device: transformers' stacked experts call it
    by default (`experts_implementation="grouped_mm"`), and its kernels
    refuse a stand-in's zero strides ("Invalid strides/sizes") and, on
    meta, anything but bf16. A 2-D input (every expert's rows, `offs`
    ending each expert's) times one [K, N] matrix per expert gives the
    rows' [M, N]; 3-D times 3-D, one product per expert. None (computed as
    it is) for any other call."""
    if func is not getattr(torch, "_grouped_mm", None):
        return None
    a = args[0] if args else kwargs["mat_a"]
    b = args[1] if len(args) > 1 else kwargs["mat_b"]
    if not (a.is_meta or b.is_meta or _stand_in(a, stand_ins) or _stand_in(b, stand_ins)):
        return None
    dtype = kwargs.get("out_dtype") or a.dtype
    if a.dim() == 2 and b.dim() == 3:
        shape = (a.shape[0], b.shape[-1])
    elif a.dim() == 3 and b.dim() == 3:
        shape = (a.shape[0], a.shape[1], b.shape[-1])
    else:
        return None  # (the weight-gradient forms: never in a forward's trace)
    return a.new_zeros(shape, dtype=dtype)


def _stand_in(t: torch.Tensor, stand_ins: set[int]) -> bool:
    """A stand-in, or a view of one: Mixtral's, Qwen3-MoE's, OLMoE's experts
    (not transposed) hand grouped_mm `weight.transpose(-2, -1)`, a new
    tensor, not the stand-in itself. A stand-in's every stride is 0 (one
    element expanded) and so is any view's; grouped_mm refuses such an
    operand anyway ("Invalid strides/sizes"), so nothing computable is
    skipped."""
    return id(t) in stand_ins or t.numel() > 1 and not any(t.stride())


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def own_params(module: nn.Module) -> dict[str, nn.Parameter]:
    """A module's own parameters, less those that are also a child's (by
    identity): a tied alias (BERT's LM head registers `bias`, the very
    parameter its decoder Linear holds as its bias) is the child's, read by
    the child's forward, and makes its holder no layer of its own."""
    children = {id(p) for child in module.children() for p in child.parameters()}
    return {a: p for a, p in module._parameters.items() if p is not None and id(p) not in children}


def _unread(module: nn.Module, out, read: set[int]) -> bool:
    """Whether no op read any of a module's own parameters (own_params) and
    its call did not return one for a caller to read: BERT's LM head's
    `bias` where transformers leaves it untied from the decoder's (as with
    tie_word_embeddings=False). They change nothing it computes, so it is a
    container, and its output keeps the provenance its children gave it
    (the decoder's: the LM head)."""
    own = own_params(module).values()
    return bool(own) and not any(id(p) in read or any(t is p for t in _tensors(out)) for p in own)


def _dropout_hooks(model: nn.Module, draws: Optional["_Draws"]) -> list:
    """Hooks counting, in `draws`, whether a Dropout module is running (its
    draws are its own, not the forward's); none without `draws`."""
    handles = []
    for module in model.modules() if draws is not None else ():
        if isinstance(module, nn.Dropout):
            handles.append(module.register_forward_pre_hook(lambda *a: setattr(draws, "in_dropout", draws.in_dropout + 1)))
            handles.append(module.register_forward_hook(lambda *a: setattr(draws, "in_dropout", draws.in_dropout - 1)))
    return handles


def _never_entered(model: nn.Module, calls: dict, holders: tuple, read: set[int], unread: Optional[dict]) -> None:
    """Modules the forward never called, none of whose own parameters any
    op read (an encoder-decoder's cross-attention, which its causal LM's
    forward leaves unused; a vision tower): nothing they hold reaches the
    output, so mode=none never trains them, and `unread` gets them (held
    whole on every rank, never trained: rewrite.py). What is inside a module
    run whole or an experts module is its own."""
    if unread is None:
        return
    for name, module in model.named_modules():
        own = own_params(module)
        if name and own and name not in calls and not (holders and name.startswith(holders)) \
                and not any(id(p) in read for p in own.values()):
            unread.setdefault(name, tuple(own))


def _kind(module: nn.Module) -> Optional[str]:
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Embedding):
        return "embedding"
    if is_norm(module):
        return "norm"
    if isinstance(module, nn.Dropout):
        return "dropout"
    if is_experts(module) or holds_experts(module):
        return "experts"
    if own_params(module):
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


def _put_stand_ins(model: nn.Module) -> tuple[dict, dict]:
    """Every meta parameter of `model` replaced by a zero-stride stand-in
    (one element expanded: the trace never needs values, and a large model
    is never materialised); returns ((module, attr) -> the original, id of
    an original -> its stand-in), a shared parameter one stand-in."""
    originals, stand_ins = {}, {}
    for module in model.modules():
        for attr, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                if id(p) not in stand_ins:
                    stand_ins[id(p)] = nn.Parameter(torch.full((), 0.02, dtype=p.dtype).expand(p.shape), requires_grad=False)
                originals[(module, attr)] = p
                module._parameters[attr] = stand_ins[id(p)]
    return originals, stand_ins


def trace(model: nn.Module, vocab_size: int = 2, seq: int = TRACE_SEQ, inputs: Optional[dict] = None,
          ids: Optional[torch.Tensor] = None, draws: Optional[_Draws] = None, flows: Optional[dict] = None,
          opaque: frozenset = frozenset(), unread: Optional[dict] = None):
    """Run `model` on `ids` (default: a batch of TRACE_BATCH x `seq` random
    token ids); return (nodes, the node ids the output came from, module
    name -> node ids of its calls). `inputs`, if given, is filled with module
    name -> (args, kwargs) of its first call (what a probe of the module's
    own forward runs it on), and `flows` with module name -> Flow of its
    first call. Modules named in `opaque` (run whole: roles/whole.py) are one
    node each, of kind "whole", what runs inside them not followed. With
    `draws`, the forward runs in training mode and `draws` records its
    random numbers. `unread`, if given, gets module name -> its own
    parameters where no op read them (_unread: a container, no node; or a
    module never called: _never_entered)."""
    originals, stand_ins = _put_stand_ins(model)
    params = {id(p) for p in model.parameters()}
    tracer = _Trace(params, {id(p) for p in stand_ins.values()})
    calls: dict[str, list[int]] = {}
    handles = []

    def hooks(name, module, kind):
        def before(mod, args, kwargs):
            mod._tpctl_in = tracer.prov((args, kwargs))
            # Inside an experts module, weights indexed by routing decisions
            # are no activations: it is one node, its ops not followed (and
            # so is a module run whole).
            tracer.paused = kind in ("experts", "whole")

        def after(mod, args, kwargs, out):
            tracer.paused = False
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else ()
            found = kind
            if kind == "layer" and _unread(mod, out, tracer.read):  # a container: no node, its output's provenance kept
                if unread is not None:
                    unread[name] = tuple(own_params(mod))
                return
            if kind == "norm" and shape:
                traced_width(mod, shape[-1])
            if kind == "layer":
                tracer.paused = True
                try:
                    found = "elementwise" if is_elementwise(mod, args, kwargs, out) else kind
                finally:
                    tracer.paused = False
            returned = tuple(a for a, p in mod._parameters.items() if p is not None and any(t is p for t in _tensors(out)))
            node = tracer.add(_Node(found, name, mod._tpctl_in, shape=shape, returns=returned))
            calls.setdefault(name, []).append(node)
            # Dropout, tables of constants and elementwise modules pass their
            # input's provenance on: they change no layout.
            tracer.tag(out, mod._tpctl_in if found in ("dropout", "table", "elementwise") else frozenset({node}))
        handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(module.register_forward_hook(after, with_kwargs=True))

    def keep(name):
        def before(mod, args, kwargs):
            inputs.setdefault(name, (args, kwargs))
            if flows is not None and name not in flows:
                hidden = hidden_arg(args, kwargs)
                flows[name] = Flow(tracer.prov(hidden), _shape(hidden))

        def after(mod, args, kwargs, out):
            if flows is not None and flows[name].out is None:
                flows[name].out = _shape(out[0] if isinstance(out, (tuple, list)) and out else out)
                flows[name].floating = any(t.is_floating_point() for t in _tensors(out))
        module = model.get_submodule(name)
        handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(module.register_forward_hook(after, with_kwargs=True))

    holders: tuple = ()  # experts modules and modules run whole: what is inside them is theirs
    for name, module in model.named_modules():
        kind = None if holders and name.startswith(holders) else "whole" if name in opaque else _kind(module)
        if kind is not None and name:
            hooks(name, module, kind)
            if kind in ("experts", "whole"):
                holders += (f"{name}.",)
        if inputs is not None:
            keep(name)
    handles += _dropout_hooks(model, draws)
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
        _never_entered(model, calls, holders, tracer.read, unread)
    finally:
        for h in handles:
            h.remove()
        for (module, attr), p in originals.items():
            module._parameters[attr] = p
        for module in model.modules():
            module.__dict__.pop("_tpctl_in", None)
        model.train(was_training)
    return tracer.nodes, out, calls


@dataclass
class Flow:
    """A module's first traced call: where its hidden states (first
    argument) came from, their shape, and its output's (the first of a
    tuple); () for what is not a tensor."""

    inputs: frozenset
    shape: tuple
    out: Optional[tuple] = None
    # whether its output holds a floating-point tensor (None: not returned
    # yet); False: indices only, through which no gradient flows
    floating: Optional[bool] = None


def hidden_arg(args, kwargs):
    """A module's hidden states: its first argument, or `hidden_states`."""
    return args[0] if args else kwargs.get("hidden_states")


def _shape(value) -> tuple:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else ()


def per_head_args(call, heads: int) -> list:
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
