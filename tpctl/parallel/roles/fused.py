"""Layouts of fused projections, as data, and how they are found.

A fused Linear computes several parts in one matrix: [q | k | v] with fewer
key/value heads (grouped- or multi-query attention), q, k and v interleaved
per head (GPT-NeoX, BLOOM: q0 k0 v0 q1 k1 v1 ...) or per key/value group
(Falcon), [gate | up] (Phi-3). A `FusedLayout` says, for every output
feature, which part it belongs to and which *unit* of that part (a head; a
hidden feature of the MLP). Tensor parallelism splits units, never features:
shard s of S holds units [s U/S, (s+1) U/S) of every part, and its rows of
the weight are those units' features *in their original order*, so the
module's own forward, run with this rank's head counts, splits the local
output exactly as it split the whole one.

The layout is not guessed from sizes or names: it is measured. One copy of
the module around the fused Linear (the attention or the MLP) is made with
random weights and run on the inputs it got in the role trace; the gradient
of each head of the attention's query, key and value operands (of each
hidden feature of the MLP's read-out input) with respect to the fused output
shows which features feed it. What does not decompose into disjoint units is
refused, with what was seen.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from tpctl.parallel.roles.probes import CacheOff
from tpctl.parallel.shard import Ranges, _merge

# Parts whose units are key/value heads: fewer of them than shards is
# allowed (multi-query attention, 8 KV heads at a split of 16), each head
# then held whole by every shard whose query heads read it, as Megatron
# does; the copies' gradients are partial sums (parallel/tensor/replicas.py sums them).
SHARED_PARTS = ("k", "v")


def held_units(count: int, shards: int, s: int) -> range:
    """Which of `count` heads (units) shard `s` of `shards` holds: its
    share, or (fewer heads than shards: shared key/value heads) the one its
    query heads read."""
    if count >= shards:
        return range(s * count // shards, (s + 1) * count // shards)
    return range(s * count // shards, s * count // shards + 1)


@dataclass(frozen=True)
class FusedLayout:
    names: tuple[str, ...]  # the parts, e.g. ("q", "k", "v") or ("gate", "up")
    units: tuple[int, ...]  # units (heads, hidden features) of each part
    part: tuple[int, ...]  # per output feature: its part
    unit: tuple[int, ...]  # per output feature: its unit within the part

    @property
    def features(self) -> int:
        return len(self.part)

    def width(self, p: int) -> int:
        """Features of part `p`."""
        return sum(1 for x in self.part if x == p)

    @classmethod
    @functools.lru_cache(maxsize=256)  # one per projection shape: a model's blocks share it
    def equal(cls, n: int, names: tuple[str, ...]) -> "FusedLayout":
        """`len(names)` equal contiguous parts (the built-in GPT's declared
        [q | k | v]); every feature its own unit."""
        k = len(names)
        size = n // k
        return cls(tuple(names), (size,) * k, tuple(f // size for f in range(n)), tuple(f % size for f in range(n)))

    @classmethod
    @functools.lru_cache(maxsize=256)  # one per projection shape: a model's blocks share it
    def heads(cls, n: int, heads: int, name: str) -> "FusedLayout":
        """A projection of `heads` contiguous heads (a separate k or v
        projection of grouped-query attention): one part."""
        size = n // heads
        return cls((name,), (heads,), (0,) * n, tuple(f // size for f in range(n)))

    def split_problem(self, shards: int, blocks: Optional[int] = None) -> Optional[str]:
        """Why the layout cannot be split `shards` ways, each shard stored
        in `blocks / shards` equal blocks (3d), or None: it can."""
        for name, count in zip(self.names, self.units):
            if count % shards == 0:
                continue
            if name in SHARED_PARTS and shards % count == 0:
                continue  # fewer key/value heads than shards: each shared by shards / count of them
            if name in SHARED_PARTS and count < shards:
                return f"{count} key/value heads ({name}) cannot be shared evenly by {shards} blocks of query heads"
            return f"{count} units ({name}) of the layout {self.describe()} do not split {shards} ways"
        per = (blocks or shards) // shards
        width = sum(b - a for a, b in self.shard_features(shards, 0))
        if width % per:
            return f"a shard's {width} features of the layout {self.describe()} do not split {per} ways"
        return None

    def shares(self, shards: int) -> bool:
        """Whether some shards hold the same key/value heads at this split."""
        return any(name in SHARED_PARTS and count < shards for name, count in zip(self.names, self.units))

    def held_units(self, p: int, shards: int, s: int) -> range:
        return held_units(self.units[p], shards, s)

    def holders(self, shards: int) -> torch.Tensor:
        """Per feature, how many of `shards` shards hold it: 1, or for a
        shared key/value head the shards whose query heads read it."""
        count = torch.zeros(self.features)
        for s in range(shards):
            for a, b in self.shard_features(shards, s):
                count[a:b] += 1
        return count

    @functools.cached_property
    def runs(self) -> tuple[tuple[int, int, int, int, int], ...]:
        """(first, end, part, first unit, step) of each run of consecutive
        features of one part whose units stay (step 0: one head's features)
        or go up by one per feature (step 1: features that are their own
        units). A split takes or leaves a unit's features together, so the
        splits below walk runs (a few per head), not features (tens of
        thousands per projection in a planner's dry run of a wide model)."""
        part, unit, n = self.part, self.unit, len(self.part)
        out, f = [], 0
        while f < n:
            g = f + 1
            step = 1 if g < n and part[g] == part[f] and unit[g] == unit[f] + 1 else 0
            while g < n and part[g] == part[f] and unit[g] == unit[g - 1] + step:
                g += 1
            out.append((f, g, part[f], unit[f], step))
            f = g
        return tuple(out)

    def shard_features(self, shards: int, s: int) -> Ranges:
        """Features of compute shard `s` of `shards`, in their original order."""
        held = [self.held_units(p, shards, s) for p in range(len(self.names))]
        out = []
        for a, b, part, unit, step in self.runs:
            h = held[part]
            if step == 0:
                if unit in h:
                    out.append((a, b))
                continue
            lo, hi = max(h.start, unit), min(h.stop, unit + b - a)
            if lo < hi:
                out.append((a + lo - unit, a + hi - unit))
        return _merge(out)

    def ranges(self, shards: int, blocks: int, index: int) -> Ranges:
        """Block `index` of `blocks` of the output dimension: block b lies in
        compute shard b // (blocks / shards) (3d stores a compute shard in
        q sub-blocks), at sub-block b % (blocks / shards) of its features."""
        per = blocks // shards
        shard, sub = divmod(index, per)
        held = self.shard_features(shards, shard)
        size = sum(b - a for a, b in held) // per
        return _take(held, sub * size, size)

    def describe(self) -> str:
        widths = "+".join(f"{u}" for u in self.units)
        parts = "|".join(self.names)
        if len(self.names) == 1:
            return f"[{parts}] {widths} heads"
        runs = 1 + sum(1 for f in range(1, self.features) if self.part[f] != self.part[f - 1])
        order = "contiguous" if runs == len(self.names) else "interleaved"
        return f"[{parts}] {widths} units, {order}"


def _take(ranges: Ranges, skip: int, count: int) -> Ranges:
    """`count` features of `ranges` (in their order) after the first `skip`."""
    out = []
    for a, b in ranges:
        if skip >= b - a:
            skip -= b - a
            continue
        a, skip = a + skip, 0
        take = min(count, b - a)
        if take <= 0:
            break
        out.append((a, a + take))
        count -= take
    return _merge(out)


# ---- measuring a layout ------------------------------------------------------

_ATTENTION_OPS = {torch.matmul, torch.bmm, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.bmm,
                  torch.einsum, torch.nn.functional.scaled_dot_product_attention, torch.baddbmm,
                  torch.Tensor.baddbmm}


class _Ops(TorchFunctionMode):
    """Records the products of two tensors that depend on the probed output."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _ATTENTION_OPS:
            grads = [a for a in list(args) + list(kwargs.values())
                     if isinstance(a, torch.Tensor) and a.requires_grad]
            if len(grads) >= 2:
                self.calls.append((func, grads))
        return out


class ProbeError(ValueError):
    pass


def real_copy(module: nn.Module, seed: int = 0) -> nn.Module:
    """A copy of `module` with random real weights (meta parameters too)
    that do not require gradients, for probing its forward."""
    clone = copy.deepcopy(module)
    gen = torch.Generator().manual_seed(seed)
    for sub in clone.modules():
        for attr, p in list(sub._parameters.items()):
            if p is not None:
                sub._parameters[attr] = nn.Parameter(
                    torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) * 0.5, requires_grad=False)
        for attr, b in list(sub._buffers.items()):
            if b is not None and b.is_meta:
                raise ProbeError(f"{type(sub).__name__}.{attr} is a buffer on the meta device")
    return clone


def _randomize(value, gen):
    """The probe's input: the first argument (the hidden states) random."""
    return torch.randn(value.shape, generator=gen, dtype=torch.float32).to(value.dtype)


def _run(owner: nn.Module, fused: str, args, kwargs, tap: Optional[str] = None, seed: int = 0):
    """Run a random-weight copy of `owner` with the output of its submodule
    `fused` as a leaf requiring grad; returns (that leaf, the recorded
    products, the input of submodule `tap`)."""
    clone = real_copy(owner, seed)
    clone.eval()
    gen = torch.Generator().manual_seed(seed + 1)
    args, kwargs = list(args), dict(kwargs)
    if args and isinstance(args[0], torch.Tensor):
        if args[0].is_floating_point():  # (the whole model's input: token ids, kept)
            args[0] = _randomize(args[0], gen)
    elif isinstance(kwargs.get("hidden_states"), torch.Tensor):
        kwargs["hidden_states"] = _randomize(kwargs["hidden_states"], gen)
    seen: dict = {}

    def leaf(mod, inputs, out):
        seen["y"] = out.detach().requires_grad_(True)
        return seen["y"]

    def grab(mod, inputs):
        seen["z"] = inputs[0]

    handles = [clone.get_submodule(fused).register_forward_hook(leaf)]
    if tap is not None:
        handles.append(clone.get_submodule(tap).register_forward_pre_hook(grab))
    ops = _Ops()
    try:
        with torch.enable_grad(), CacheOff(clone), ops:
            clone(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    if "y" not in seen:
        raise ProbeError(f"{fused} was not called")
    return seen["y"], ops.calls, seen.get("z")


def _feeds(y: torch.Tensor, value: torch.Tensor, gen) -> torch.Tensor:
    """Which features (last dim) of `y` `value` depends on."""
    weights = torch.randn(value.shape, generator=gen, dtype=torch.float32).to(value.dtype)
    (grad,) = torch.autograd.grad((value * weights).sum(), y, retain_graph=True, allow_unused=True)
    if grad is None:
        return torch.zeros(y.shape[-1], dtype=torch.bool)
    return (grad != 0).reshape(-1, y.shape[-1]).any(0)


def _units(y: torch.Tensor, operand: torch.Tensor, gen) -> list[torch.Tensor]:
    """The distinct feature sets of `y` that feed each head of `operand`
    (its leading dims: batch and heads, or batch x heads), in order."""
    sets: list[torch.Tensor] = []
    slots = operand.reshape(-1, *operand.shape[-2:]) if operand.dim() >= 3 else operand.unsqueeze(0)
    for slot in range(slots.shape[0]):
        feeds = _feeds(y, slots[slot], gen)
        if feeds.any() and not any(torch.equal(feeds, s) for s in sets):
            sets.append(feeds)
    return sets


def _layout(names: tuple[str, ...], per_part: list[list[torch.Tensor]], n: int, what: str) -> FusedLayout:
    part, unit = [-1] * n, [-1] * n
    for p, sets in enumerate(per_part):
        for u, feeds in enumerate(sets):
            for f in feeds.nonzero().flatten().tolist():
                if part[f] != -1:
                    raise ProbeError(f"{what}: feature {f} feeds both {names[part[f]]} unit {unit[f]} "
                                     f"and {names[p]} unit {u}")
                part[f], unit[f] = p, u
    unused = [f for f in range(n) if part[f] == -1]
    if unused:
        raise ProbeError(f"{what}: {len(unused)} of its {n} features (first {unused[0]}) feed no {'/'.join(names)}")
    return FusedLayout(names, tuple(len(s) for s in per_part), tuple(part), tuple(unit))


def attention_layout(owner: nn.Module, fused: str, args, kwargs) -> FusedLayout:
    """The layout of `fused`, the one Linear feeding the attention in
    `owner`: which of its features feed each head of q, k and v."""
    y, calls, _ = _run(owner, fused, args, kwargs)
    if not calls:
        raise ProbeError(f"{fused}: no product of two activations depends on it")
    func, operands = calls[0]
    if func is torch.nn.functional.scaled_dot_product_attention:
        q, k, v = operands[:3]
    elif len(calls) >= 2:
        q, k = operands[-2:]  # baddbmm's first operand is the added bias
        v = calls[1][1][-1]  # probabilities @ values
    else:
        raise ProbeError(f"{fused}: one product of activations, not attention's two")
    gen = torch.Generator().manual_seed(2)
    sets = [_units(y, t, gen) for t in (q, k, v)]
    return _layout(("q", "k", "v"), sets, y.shape[-1], fused)


def mlp_layout(owner: nn.Module, fused: str, read_out: str, args, kwargs) -> FusedLayout:
    """The layout of `fused`, a Linear of the MLP in `owner` wider than the
    input of its read-out `read_out`: which features feed each hidden
    feature the read-out reads (gate and up of a gated MLP)."""
    y, _, z = _run(owner, fused, args, kwargs, tap=read_out)
    if z is None:
        raise ProbeError(f"{read_out} was not called")
    hidden, n = z.shape[-1], y.shape[-1]
    gen = torch.Generator().manual_seed(3)
    # Binary search over units: log2(hidden) passes of (units with bit b
    # set) and of its complement; a feature feeding one unit is in exactly
    # one of each pair, and the bits spell its unit.
    bits = max(1, (hidden - 1).bit_length())
    index = torch.arange(hidden)
    unit = torch.zeros(n, dtype=torch.long)
    used = torch.zeros(n, dtype=torch.bool)
    for b in range(bits):
        mask = ((index >> b) & 1).bool()
        on, off = _feeds(y, z * mask, gen), _feeds(y, z * ~mask, gen)
        if (on & off).any():
            f = int((on & off).nonzero()[0])
            raise ProbeError(f"{fused}: feature {f} feeds several hidden features of {read_out}")
        unit |= on.long() << b
        used |= on | off
    if not used.all():
        f = int((~used).nonzero()[0])
        raise ProbeError(f"{fused}: feature {f} feeds nothing {read_out} reads")
    # Each unit's features, in order, are its parts (gate, then up).
    counts = torch.bincount(unit, minlength=hidden)
    if not (counts == counts[0]).all():
        raise ProbeError(f"{fused}: the hidden features of {read_out} are fed by unequal numbers of its features")
    k = int(counts[0])
    seen = [0] * hidden
    part = []
    for u in unit.tolist():
        part.append(seen[u])
        seen[u] += 1
    names = ("gate", "up") if k == 2 else tuple(f"part{i}" for i in range(k))
    return FusedLayout(names, (hidden,) * k, tuple(part), tuple(unit.tolist()))
