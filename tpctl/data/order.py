"""Which window each row of a run reads: `data.order` (epoch or random) and
the rows of a `data.mix` assigned to its sources.

Everything here is a function of the *global* row index (step x batch_size
+ row) and the seed: never of the rank, the layout or the world size. That
is what lets every layout read the same global batch and a run resumed in
another layout read the tokens the uninterrupted run would have read.

* `order=epoch`: a split of L tokens holds ``(L - 1) // seq_len`` windows of
  ``seq_len + 1`` tokens (window w starts at token w * seq_len; x and y share
  all but one token, as in nanoGPT). The i-th window a source reads is
  ``perm_e(i mod n)`` of epoch ``e = i // n``: each window once per epoch, in
  an order seeded by (seed, split, source, epoch).
* The permutation is a keyed Feistel network on the next even power of two
  with cycle walking: a bijection on range(n) evaluated per index, in O(1)
  memory. A full `torch.randperm` per epoch would cost 8 bytes per window
  on every rank (800 MB for 100M windows) and seconds per epoch (measured:
  benchmarks/data_order.py); this costs nothing up front and microseconds
  per batch.
* A mix's rows: row r goes to source j by earliest-deadline-first over one
  period of the weights (`MixSchedule`): after any n rows each source has
  floor or ceil of n x weight rows (strictly within 1 of it), so where
  batch_size x weight is an integer every step holds exactly that many.
"""

from __future__ import annotations

import hashlib
import heapq
from fractions import Fraction
from typing import Sequence

import numpy as np

ORDERS = ("epoch", "random")
ROUNDS = 6  # Feistel rounds: 4 make a pseudo-random permutation (Luby-Rackoff); 2 more for small domains
MAX_PERIOD = 1_000_000  # rows in one period of a mix's weights (the schedule is computed once, ~1 s at this size)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def n_windows(split_len: int, seq_len: int) -> int:
    """Windows of seq_len + 1 tokens, seq_len apart, in a split of split_len tokens."""
    return max((split_len - 1) // seq_len, 0)


def _keys(*parts) -> np.ndarray:
    """ROUNDS 64-bit round keys from `parts` (hashed: nearby seeds and
    epochs give unrelated permutations)."""
    h = hashlib.blake2b("/".join(map(str, ("tpctl.order", *parts))).encode(), digest_size=8 * ROUNDS)
    return np.frombuffer(h.digest(), dtype="<u8").astype(np.uint64)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every output bit depends on every input bit."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def permute(n: int, keys: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``perm(index)`` for the permutation of range(n) that `keys` choose."""
    index = np.asarray(index, dtype=np.uint64)
    if n <= 1:
        return index.astype(np.int64)
    bits = max(int(n - 1).bit_length(), 2)
    half = (bits + 1) // 2  # a balanced network on 2**(2*half) >= n values, fewer than 4n
    mask = np.uint64((1 << half) - 1)
    h = np.uint64(half)

    def feistel(x: np.ndarray) -> np.ndarray:
        left, right = x >> h, x & mask
        for k in keys:
            left, right = right, left ^ (_mix64(right ^ k) & mask)
        return (left << h) | right

    with np.errstate(over="ignore"):  # the multiplications wrap mod 2**64 on purpose
        out = feistel(index)
        # Cycle walking: a value outside range(n) is sent on until it lands
        # inside; the cycle through `index` holds one, so this ends, and it
        # keeps the map a bijection on range(n).
        outside = out >= np.uint64(n)
        while outside.any():
            out[outside] = feistel(out[outside])
            outside = out >= np.uint64(n)
    return out.astype(np.int64)


def epoch_windows(seed: int, split: str, source: int, n: int, reads: np.ndarray) -> np.ndarray:
    """The window index of the `reads`-th windows a source reads (0-based,
    counted over the whole run) under order=epoch: window ``perm_e(i % n)``
    of epoch ``e = i // n``."""
    reads = np.asarray(reads, dtype=np.int64)
    out = np.empty_like(reads)
    epochs = reads // n
    for e in np.unique(epochs):  # a batch spans at most a few epochs
        at = epochs == e
        out[at] = permute(n, _keys(seed, split, source, int(e)), reads[at] % n)
    return out


def epoch_of(reads: int, n: int) -> dict:
    """Where `reads` windows read leave a source: the epoch under way
    (0-based), the fraction of it read, and the windows of one epoch and
    those read in all."""
    return {"epoch": reads // n, "epoch_fraction": (reads % n) / n, "windows": n, "windows_read": reads}


# -- a mix: rows to sources ---------------------------------------------------


class MixSchedule:
    """Rows to sources in proportion to exact rational weights.

    The weights w_j = a_j / Q (Q: the least common denominator, the period)
    ask that after any n rows a source holds C_j(n) rows with
    |C_j(n) - n w_j| < 1. The k-th row of source j may then go no earlier
    than row floor((k-1)/w_j) + 1 and no later than row ceil(k/w_j) (1-based):
    unit jobs with release times and deadlines, which earliest-deadline-first
    schedules whenever any schedule exists (and one does: Tijdeman 1980,
    the chairman assignment problem). After Q rows every source holds
    exactly a_j, so the schedule repeats with period Q: it is computed once.
    """

    def __init__(self, weights: Sequence[Fraction]):
        total = sum(weights)
        shares = [Fraction(w) / total for w in weights]
        period = 1
        for s in shares:
            period = period * s.denominator // np.gcd(period, s.denominator)
        self.period = int(period)
        if self.period > MAX_PERIOD:
            raise ValueError(f"the weights' ratio repeats only every {self.period} rows (at most {MAX_PERIOD})")
        self.per_period = [int(s * self.period) for s in shares]
        self.source, self.rank = self._schedule()

    def _schedule(self) -> tuple[np.ndarray, np.ndarray]:
        """source[p]: the source of row p of a period; rank[p]: how many rows
        of that source come before it in the period."""
        q, counts = self.period, self.per_period
        source = np.empty(q, dtype=np.int32)
        rank = np.empty(q, dtype=np.int64)
        # The next job of each source not yet released: (release row, source, k).
        waiting = [(1, j, 1) for j, a in enumerate(counts) if a]
        heapq.heapify(waiting)
        ready: list = []  # (deadline row, source, k)
        for n in range(1, q + 1):
            while waiting and waiting[0][0] <= n:
                _, j, k = heapq.heappop(waiting)
                a = counts[j]
                heapq.heappush(ready, (-(-k * q // a), j, k))
                if k < a:
                    heapq.heappush(waiting, (k * q // a + 1, j, k + 1))
            deadline, j, k = heapq.heappop(ready)
            if deadline < n:  # cannot happen (EDF meets every deadline a schedule can): a bug, not bad input
                raise AssertionError(f"mix schedule missed a deadline at row {n}")
            source[n - 1], rank[n - 1] = j, k - 1
        return source, rank

    def assign(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, reads) of global rows `rows`: which source each row reads
        and how many rows of that source come before it in the run."""
        rows = np.asarray(rows, dtype=np.int64)
        periods, at = np.divmod(rows, self.period)
        source = self.source[at]
        return source, periods * np.asarray(self.per_period, dtype=np.int64)[source] + self.rank[at]

    def counts(self, rows: int) -> list[int]:
        """Rows of each source among the first `rows` global rows."""
        periods, at = divmod(int(rows), self.period)
        head = np.bincount(self.source[:at], minlength=len(self.per_period))
        return [periods * a + int(h) for a, h in zip(self.per_period, head)]
