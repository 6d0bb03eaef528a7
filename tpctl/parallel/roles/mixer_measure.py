"""A mixer's head split MEASURED before it is used (roles/mixers.py): the
S shards of a split, each a copy of the mixer holding its block of every
tensor with its integer attributes set to the shard's (`shard_of`), run
the mixer's own forward on random weights and input, and their outputs
must sum to the whole mixer's (`measure`). Shards of a mixer with a sum
inside it run side by side, as the rewrite's collectives make them run:
each pass records what every shard hands the sum (Mamba-1's x_proj
products; the features of a norm over the whole inner width, MiniMax's),
and the next pass gives each shard the others' (`_shard_outputs`)."""

from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.nn as nn

from tpctl.parallel.roles.fused import real_copy
from tpctl.parallel.roles.mixer_dims import REPLICA

# (`split` below: a mixers.MixerSplit, which imports this module; not imported back)


def shard_of(module: nn.Module, split, shards: int, s: int) -> nn.Module:
    """A copy of (real) `module` holding shard s of `shards`, its attributes
    the shard's (for measuring: parameters not requiring gradients)."""
    shard = copy.deepcopy(module)
    for name, _, _ in split.dims:
        owner, _, leaf = name.rpartition(".")
        held = shard.get_submodule(owner)
        t = getattr(held, leaf)
        if name in split.whole():
            piece = t / shards
        elif split.ranges(name, shards, s)[0] == REPLICA:
            piece = t
        else:
            dim, ranges = split.ranges(name, shards, s)
            piece = torch.cat([t.narrow(dim, a, b - a) for a, b in ranges], dim)
        if leaf in held._parameters:
            held._parameters[leaf] = nn.Parameter(piece, requires_grad=False)
        else:
            held._buffers[leaf] = piece
    for owner, attr, value in split.shard_attrs(shards):
        setattr(shard.get_submodule(owner), attr, value)
    return shard


def measure(module: nn.Module, split, args, kwargs) -> Optional[str]:
    """None where the shards' outputs of the module's own forward sum to
    its whole output (random weights and input, the smallest split the
    groups allow), else what differs."""
    # (the unit: a group; with one group, whose B and C every shard holds whole, a head; more than one: mixer_split)
    units = split.groups if split.groups > 1 else split.heads
    shards = next(d for d in range(2, units + 1) if units % d == 0)
    clone = real_copy(module, seed=5).float()  # (in fp32 whatever the model's dtype: 1e-5 is fp32's round-off)
    if split.torch_path():  # (the path the split mixer runs: its own flag cleared, as tensor/whole.py's _torch_path)
        clone.training = False
    gen = torch.Generator().manual_seed(6)
    if args:
        args = [torch.randn(a.shape, generator=gen) if i == 0 else a for i, a in enumerate(args)]
    else:  # (hidden states passed by name: FalconH1's)
        kwargs = {**kwargs, "hidden_states": torch.randn(kwargs["hidden_states"].shape, generator=gen)}
    with torch.no_grad():
        # (the shards copied before the whole call: a module keeping state from its last call, RecurrentGemma's
        # conv and recurrence caches with use_cache on, would hand them on whole)
        try:
            pieces = [shard_of(clone, split, shards, s) for s in range(shards)]
        except Exception as e:  # the tensors do not cut as the layout says: not its layout
            return f"its tensors do not cut into shards of heads: {type(e).__name__}: {e}"
        whole = _first(clone(*args, **kwargs))
        try:
            parts = _shard_outputs(pieces, split, args, kwargs)
        except Exception as e:  # the forward does not run on the shard: not its layout
            return f"its forward does not run on a shard of heads: {type(e).__name__}: {e}"
    total = sum(parts[1:], parts[0])
    off = (total - whole).abs().max().item() / max(whole.abs().max().item(), 1e-30)
    # Round-off is ~1e-7 of the output's scale; a wrong layout moves it by O(1).
    return None if off <= 1e-5 else f"{shards} shards' outputs sum to the whole output only within {off:.2g} of its scale"


def _shard_outputs(shards: list, split, args, kwargs) -> list:
    """Each shard's output of its own forward. With sums across the shards
    inside the mixer (split.reduced: Mamba-1's x_proj, its partial products
    summed; split.moments: a norm over the whole inner width, its rows'
    moments summed) the shards run side by side as the rewrite runs them: a
    pass records what each shard contributes (its partial product; the
    norm's input, its features) and the next gives each shard the others'
    from the pass before (what the rewrite's all-reduce sums). One pass
    more than there are sums, so that a sum read after another is right."""
    if not split.reduced and not split.moments:
        return [_first(shard(*args, **kwargs)) for shard in shards]
    book = _Book(len(shards))

    def summed(s, name):
        def hook(module, inputs, out):
            book.now[s][name] = out
            return sum((book.seen[t][name] for t in range(len(shards)) if t != s and name in book.seen[t]), out)
        return hook

    for name, _, _ in split.moments:
        for s, shard in enumerate(shards):
            owner, _, leaf = name.rpartition(".")
            setattr(shard.get_submodule(owner), leaf, _MomentsAcross(shard.get_submodule(name), s, name, book))
    for _ in range(1 + len(split.reduced) + len(split.moments)):
        hooks = [shard.get_submodule(name).register_forward_hook(summed(s, name))
                 for s, shard in enumerate(shards) for name, _ in split.reduced]
        try:
            outs = [_first(shard(*args, **kwargs)) for shard in shards]
        finally:
            for h in hooks:
                h.remove()
        book.turn()
    return outs


class _Book:
    """(measuring) What each shard contributed to a sum across shards, in
    this pass (now) and the one before (seen), by the sum's name."""

    def __init__(self, shards: int):
        self.seen: list[dict] = [{} for _ in range(shards)]
        self.now: list[dict] = [{} for _ in range(shards)]

    def turn(self) -> None:
        self.seen, self.now = self.now, [{} for _ in self.now]


class _MomentsAcross(nn.Module):
    """(measuring) Shard s's norm over its block of a whole width's features
    (MOMENTS), its moments those of the whole width: the norm run on the
    whole features (the other shards' from the pass before, their places
    this shard's own on the first), its parameters this shard's in every
    block, and this shard's block kept -- what the rewrite's sum of the
    moments across ranks computes (tensor/layers.SplitNorm), with the
    module's own arithmetic."""

    def __init__(self, norm: nn.Module, s: int, name: str, book: _Book):
        super().__init__()
        shards = len(book.now)
        self.whole = copy.deepcopy(norm)
        for leaf, t in [*norm.named_parameters(recurse=False), *norm.named_buffers(recurse=False)]:
            tiled = t.repeat(*([1] * (t.dim() - 1)), shards)
            if leaf in norm._parameters:
                self.whole._parameters[leaf] = nn.Parameter(tiled, requires_grad=False)
            else:
                self.whole._buffers[leaf] = tiled
        self.s, self.name, self.book = s, name, book

    def forward(self, x, *gate):
        # (a gated norm, Mamba-2's, is called with its gate: features of the same heads, cut alike)
        self.book.now[self.s][self.name] = (x, *gate)
        seen = [seen.get(self.name, (x, *gate)) for seen in self.book.seen]
        whole = [torch.cat([mine if t == self.s else theirs[i] for t, theirs in enumerate(seen)], -1)
                 for i, mine in enumerate((x, *gate))]
        return self.whole(*whole).narrow(-1, self.s * x.shape[-1], x.shape[-1])


def _first(out):
    return out[0] if isinstance(out, tuple) else out
