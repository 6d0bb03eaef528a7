"""The static geometry of a tensor grid -- how its ranks split the batch,
the hidden dimension, the heads and the vocabulary -- and the arithmetic
shared by the modes and the planner. Each mode computes its own geometry
(`ParallelMode.geometry`); `layout.Layout` looks it up. Pure arithmetic, no
torch.distributed, so the launcher can validate a config before starting
any worker."""

from __future__ import annotations

import math
from dataclasses import dataclass


def exact_root(n: int, k: int) -> int | None:
    """The integer r with r**k == n, or None."""
    r = round(n ** (1.0 / k))
    for cand in (r - 1, r, r + 1):
        if cand >= 1 and cand**k == n:
            return cand
    return None


@dataclass(frozen=True)
class Geometry:
    mode: str
    size: int
    depth: int
    # q: the side of the 2d/2.5d square or the 3d cube (1 for none/1d).
    q: int
    # The global batch is split into this many row blocks inside one
    # tensor-parallel group (1 for none/1d: every rank sees every row).
    batch_split: int
    # Every matrix dimension of a linear must divide by this, and the
    # number of attention heads by `head_split`.
    hidden_split: int
    head_split: int
    # The vocabulary is padded up to a multiple of this.
    vocab_multiple: int


def padded_vocab(vocab_size: int, multiple: int) -> int:
    return math.ceil(vocab_size / multiple) * multiple


# Bytes one rank sends, on average, for each byte of the full (gathered or
# reduced) tensor, with the bandwidth-optimal ring / pipelined algorithms of
# a group of p ranks: an all-reduce is a reduce-scatter plus an all-gather.
# comm.py counts with it, the planner predicts with it.
WIRE_FACTOR = {
    "all_reduce": lambda p: 2 * (p - 1) / p,
    "all_gather": lambda p: (p - 1) / p,
    "reduce_scatter": lambda p: (p - 1) / p,
    "broadcast": lambda p: (p - 1) / p,
    "reduce": lambda p: (p - 1) / p,
    # Point to point (pipeline stages): what is sent is what crosses the wire.
    "send": lambda p: 1.0,
    # Context parallelism: a ring step sends its whole block to the next
    # rank; an all-to-all keeps 1/p of its tensor at home.
    "ring_pass": lambda p: 1.0,
    "all_to_all": lambda p: (p - 1) / p,
}
