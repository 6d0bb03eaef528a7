"""The global batch of each step, of which a rank reads only its rows.

docs/DESIGN.md, section 2: "the global batch of each step is the same whatever
the mode; a rank reads only the rows it holds". Both halves live in
``TokenData.batch``: the window offsets of *all* rows of a step come from a
generator seeded by (seed, split, step) alone, so every rank agrees on them
without communicating, and a rank then reads only the windows of its rows.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from .corpora import DataInfo, split_bounds
from .shards import SPLITS, ShardedTokens, read_index, stream_paths
from .token_ids import TokenOutOfRange, first_outside


def _step_seed(seed: int, split: str, step: int) -> int:
    """A generator seed that depends on (seed, split, step) only -- not on the
    rank, mode, tensor-parallel size or dp -- so all ranks draw the same
    offsets. Hashed so nearby steps/seeds give unrelated streams."""
    h = hashlib.blake2b(f"tpctl.data/{seed}/{split}/{step}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


def _open_tokens(info: DataInfo):
    """The token stream of ``info``: one memmap, or a prepared directory's
    train shards then val shards end to end (``ShardedTokens``)."""
    if not Path(info.path).is_dir():
        return np.memmap(info.path, dtype=np.dtype(info.dtype), mode="r")
    return ShardedTokens(stream_paths(info.path, read_index(info.path)), np.dtype(info.dtype))


class TokenData:
    """The train / val token streams of a run and the batch of each step."""

    def __init__(self, cfg, info: DataInfo):
        self.seq_len = int(cfg.train.seq_len)
        self.batch_size = int(cfg.train.batch_size)
        self.seed = int(cfg.seed)
        self.info = info
        if info.path is None:
            # Synthetic: the same generator and seed on every rank give the
            # same stream; it is small enough to hold in memory.
            g = torch.Generator().manual_seed(self.seed)
            ids = torch.randint(0, info.vocab_size, (info.n_tokens,), generator=g)
            self.tokens = ids.numpy().astype(np.uint16 if info.vocab_size <= 1 << 16 else np.int32)
        else:
            # Memory-mapped: each rank pages in only the windows it reads.
            self.tokens = _open_tokens(info)
            if len(self.tokens) != info.n_tokens:
                raise RuntimeError(f"{info.path} holds {len(self.tokens)} tokens, "
                                   f"prepare_data saw {info.n_tokens}: did it change during the run?")
        self.bounds = split_bounds(info.n_tokens, cfg.data.val_fraction, info.n_val)

    def __len__(self) -> int:
        return self.info.n_tokens

    def split_len(self, split: str) -> int:
        start, stop = self.bounds[split]
        return stop - start

    def offsets(self, split: str, step: int) -> torch.Tensor:
        """Start offsets (within ``split``) of all ``batch_size`` rows of ``step``."""
        if split not in self.bounds:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        g = torch.Generator().manual_seed(_step_seed(self.seed, split, step))
        # A window starting at o reads tokens o .. o+seq_len inclusive.
        return torch.randint(0, self.split_len(split) - self.seq_len, (self.batch_size,), generator=g)

    def batch(self, split: str, step: int, rows: Sequence[int],
              vocab_size: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``rows`` of the global batch of ``step``: ``x, y`` int64 of shape
        ``[len(rows), seq_len]`` with ``y`` = ``x`` shifted left by one token.
        The offsets of all rows are drawn (cheap), only the requested windows
        are read. With ``vocab_size``, an id outside [0, vocab_size) raises
        TokenOutOfRange naming where it lies (a file damaged after the
        start-up scan, or ids a model the launcher could not check cannot
        embed): the 1d embedding would give it a zero vector, silently."""
        offsets = self.offsets(split, step).tolist()
        rows = list(rows)
        if any(not 0 <= r < self.batch_size for r in rows):
            raise IndexError(f"rows {rows} outside the global batch range(0, {self.batch_size})")
        base = self.bounds[split][0]
        windows = np.empty((len(rows), self.seq_len + 1), dtype=np.int64)
        for i, r in enumerate(rows):
            o = base + offsets[r]
            windows[i] = self.tokens[o:o + self.seq_len + 1]
        if vocab_size is not None and windows.size:
            at = first_outside(windows.reshape(-1), vocab_size)
            if at is not None:
                i, j = divmod(at, self.seq_len + 1)
                raise TokenOutOfRange(split, step, int(windows[i, j]), vocab_size,
                                      self._where(base + offsets[rows[i]] + j))
        w = torch.from_numpy(windows)
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def _where(self, i: int) -> str:
        if isinstance(self.tokens, ShardedTokens):
            return self.tokens.where(i)
        return f"token {i} of {self.info.path or 'the synthetic stream'}"

    def describe(self) -> str:
        return (f"{self.info.description}; train {self.split_len('train')} / "
                f"val {self.split_len('val')} tokens")

    def __repr__(self) -> str:
        return f"TokenData({self.describe()})"
