"""The global batch of each step, of which a rank reads only its rows.

docs/DESIGN.md, section 2: "the global batch of each step is the same whatever
the mode; a rank reads only the rows it holds". Both halves live in
``TokenData.batch``: the windows of *all* rows of a step are a function of
(seed, split, step) alone (``windows``: data.order and data.mix, order.py),
so every rank agrees on them without communicating, and a rank then reads
only the windows of its rows.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from .corpora import DataInfo, split_bounds
from .order import epoch_of, epoch_windows, n_windows
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


class _Stream:
    """One corpus of a run: its tokens and where its splits lie in them."""

    def __init__(self, tokens, bounds: dict, info: DataInfo):
        self.tokens, self.bounds, self.info = tokens, bounds, info

    def split_len(self, split: str) -> int:
        start, stop = self.bounds[split]
        return stop - start


class TokenData:
    """The train / val token streams of a run and the batch of each step."""

    def __init__(self, cfg, info: DataInfo):
        self.seq_len = int(cfg.train.seq_len)
        self.batch_size = int(cfg.train.batch_size)
        self.seed = int(cfg.seed)
        self.order = cfg.data.get("order", "epoch")
        self.info = info
        self.streams = [_Stream(self._tokens_of(cfg, part), split_bounds(part.n_tokens, cfg.data.val_fraction,
                                                                         part.n_val), part)
                        for part in (info.sources or (info,))]
        self.schedule = self.entries = None
        if info.sources:
            from .mix import mix_entries, schedule_of

            self.schedule, self.entries = schedule_of(cfg.data), mix_entries(cfg.data)
        # One corpus (not a mix): its tokens and splits, as they always were.
        self.tokens, self.bounds = self.streams[0].tokens, self.streams[0].bounds

    def _tokens_of(self, cfg, info: DataInfo):
        if info.path is None:
            # Synthetic: the same generator and seed on every rank give the
            # same stream; it is small enough to hold in memory.
            g = torch.Generator().manual_seed(self.seed)
            ids = torch.randint(0, info.vocab_size, (info.n_tokens,), generator=g)
            return ids.numpy().astype(np.uint16 if info.vocab_size <= 1 << 16 else np.int32)
        # Memory-mapped: each rank pages in only the windows it reads.
        tokens = _open_tokens(info)
        if len(tokens) != info.n_tokens:
            raise RuntimeError(f"{info.path} holds {len(tokens)} tokens, "
                               f"prepare_data saw {info.n_tokens}: did it change during the run?")
        return tokens

    def __len__(self) -> int:
        return self.info.n_tokens

    def split_len(self, split: str) -> int:
        return sum(s.split_len(split) for s in self.streams)

    def windows(self, split: str, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, offset) of all ``batch_size`` rows of ``step``: which
        corpus each row reads (0 without a mix) and where its window starts
        in that corpus's ``split``. A function of (seed, split, step) and the
        config alone: the global row step * batch_size + r is what decides."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        # The micro-batches of a step (and data_hash) ask for the same step
        # again: keep the last answer (the permutation costs ~1 ms a batch).
        cached = getattr(self, "_last", None)
        if cached is not None and cached[0] == (split, step):
            return cached[1]
        self._last = ((split, step), self._windows(split, step))
        return self._last[1]

    def _windows(self, split: str, step: int) -> tuple[np.ndarray, np.ndarray]:
        rows = step * self.batch_size + np.arange(self.batch_size, dtype=np.int64)
        if self.schedule is None:
            source, reads = np.zeros(self.batch_size, dtype=np.int64), rows
        else:
            source, reads = self.schedule.assign(rows)
        offsets = np.empty(self.batch_size, dtype=np.int64)
        for s in np.unique(source).tolist():
            at = source == s
            length = self.streams[s].split_len(split)
            if self.order == "epoch":
                offsets[at] = epoch_windows(self.seed, split, s, n_windows(length, self.seq_len), reads[at]) * self.seq_len
            else:
                # A window starting at o reads tokens o .. o+seq_len inclusive.
                # One corpus: the generator it always had (random-order curves unchanged).
                label = split if self.schedule is None else f"{split}/{s}"
                g = torch.Generator().manual_seed(_step_seed(self.seed, label, step))
                offsets[at] = torch.randint(0, length - self.seq_len, (self.batch_size,), generator=g).numpy()[at]
        return source, offsets

    def offsets(self, split: str, step: int) -> torch.Tensor:
        """Start offsets (within its corpus's ``split``) of all ``batch_size`` rows of ``step``."""
        return torch.from_numpy(self.windows(split, step)[1].copy())  # a copy: the windows are cached

    def _read(self, split: str, step: int, rows: list[int]) -> tuple[np.ndarray, list[int]]:
        """The windows of rows ``rows`` of ``step`` ([len(rows), seq_len + 1]
        int64) and each one's first token in its corpus's stream."""
        if any(not 0 <= r < self.batch_size for r in rows):
            raise IndexError(f"rows {rows} outside the global batch range(0, {self.batch_size})")
        source, offsets = self.windows(split, step)
        windows = np.empty((len(rows), self.seq_len + 1), dtype=np.int64)
        starts = []
        for i, r in enumerate(rows):
            stream = self.streams[source[r]]
            o = stream.bounds[split][0] + int(offsets[r])
            windows[i] = stream.tokens[o:o + self.seq_len + 1]
            starts.append(o)
        return windows, starts

    def batch(self, split: str, step: int, rows: Sequence[int],
              vocab_size: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``rows`` of the global batch of ``step``: ``x, y`` int64 of shape
        ``[len(rows), seq_len]`` with ``y`` = ``x`` shifted left by one token.
        The windows of all rows are computed (cheap), only the requested ones
        are read. With ``vocab_size``, an id outside [0, vocab_size) raises
        TokenOutOfRange naming where it lies (a file damaged after the
        start-up scan, or ids a model the launcher could not check cannot
        embed): the 1d embedding would give it a zero vector, silently."""
        rows = list(rows)
        windows, starts = self._read(split, step, rows)
        if vocab_size is not None and windows.size:
            at = first_outside(windows.reshape(-1), vocab_size)
            if at is not None:
                i, j = divmod(at, self.seq_len + 1)
                source = self.windows(split, step)[0][rows[i]]
                raise TokenOutOfRange(split, step, int(windows[i, j]), vocab_size,
                                      self._where(int(source), starts[i] + j))
        w = torch.from_numpy(windows)
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def batch_hash(self, split: str, step: int) -> str:
        """A hash of the token ids of the whole global batch of ``step`` (every
        row, x and y): metrics.jsonl's ``data_hash``. Equal hashes in two
        runs: the step read the same tokens, whatever the layouts."""
        windows, _ = self._read(split, step, list(range(self.batch_size)))
        return hashlib.blake2b(windows.astype("<i8").tobytes(), digest_size=8).hexdigest()

    def progress(self, steps: int) -> dict:
        """How far ``steps`` steps take the train split, for summary.json:
        ``data_epoch`` (the epoch under way, 0-based) and
        ``data_epoch_fraction`` (the share of it read), or per corpus of a mix
        ``data_sources``; ``data``, the same in words. Under order=random:
        windows read over windows held (no window is promised to be read)."""
        rows = steps * self.batch_size
        windows = [n_windows(s.split_len("train"), self.seq_len) for s in self.streams]

        def words(p: dict) -> str:
            return (f"epoch {p['epoch']}, {100 * p['epoch_fraction']:.1f}% of it read "
                    f"({p['windows']:,} windows an epoch, {p['windows_read']:,} read in all)")

        if self.schedule is None:
            p = epoch_of(rows, windows[0])
            return {"data": f"{words(p)}, order {self.order}", "data_epoch": p["epoch"],
                    "data_epoch_fraction": p["epoch_fraction"]}
        sources = [{"path": e.path, "weight": e.written, "rows": c, **epoch_of(c, n)}
                   for e, c, n in zip(self.entries, self.schedule.counts(rows), windows)]
        return {"data": "; ".join(f"{p['path']} (weight {p['weight']}): {words(p)}" for p in sources)
                + f", order {self.order}", "data_sources": sources}

    def _where(self, source: int, i: int) -> str:
        stream = self.streams[source]
        if isinstance(stream.tokens, ShardedTokens):
            return stream.tokens.where(i)
        return f"token {i} of {stream.info.path or 'the synthetic stream'}"

    def describe(self) -> str:
        return (f"{self.info.description}; train {self.split_len('train')} / "
                f"val {self.split_len('val')} tokens; order {self.order}")

    def __repr__(self) -> str:
        return f"TokenData({self.describe()})"
