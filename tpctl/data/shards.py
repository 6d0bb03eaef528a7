"""A prepared corpus as it is read: the index, the shards it lists, and the
shards memory-mapped end to end as one stream (`ShardedTokens`).

The layout of a prepared directory (written by `prepare`)::

    index.json           what was prepared from what
    train-000000.bin     token ids, little-endian uint16 or uint32 (by the
    train-000001.bin     vocabulary), documents joined by the EOS id, cut
    val-000000.bin       into shards of ``shard_tokens`` ids
"""

from __future__ import annotations

import json
from bisect import bisect_right
from pathlib import Path
from typing import Sequence

import numpy as np

from . import DataError

FORMAT = "tpctl-corpus"
# Part of the no-op key: bump it when the bytes written for the same input change.
VERSION = 1
INDEX = "index.json"
SPLITS = ("train", "val")


def read_index(directory: str | Path) -> dict:
    path = Path(directory) / INDEX
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{directory}: no readable {INDEX} ({e}); prepare it with "
                        f"`tpctl prepare-data SRC... out={directory} tokenizer=...`") from None
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise DataError(f"{path}: not a tpctl-corpus version {VERSION} index: prepare it again")
    return index


def shard_paths(directory: str | Path, index: dict, split: str) -> list[Path]:
    return [Path(directory) / s["file"] for s in index["shards"][split]]


def stream_paths(directory: str | Path, index: dict) -> list[Path]:
    """The shards in the order training reads them: train, then val."""
    return [p for split in SPLITS for p in shard_paths(directory, index, split)]


def check_shards(directory: str | Path, index: dict) -> None:
    """Every shard present with the size the index gives it (a cheap stat)."""
    itemsize = np.dtype(index["dtype"]).itemsize
    for split in SPLITS:
        for s in index["shards"][split]:
            p = Path(directory) / s["file"]
            want = s["tokens"] * itemsize
            have = p.stat().st_size if p.is_file() else None
            if have != want:
                raise DataError(f"{p}: {'missing' if have is None else f'{have} bytes'}, the index says "
                                f"{want}: prepare the corpus again")


class ShardedTokens:
    """Shards memory-mapped end to end as one read-only sequence; a slice
    that crosses a shard boundary is joined (a window's worth), nothing else
    is read into memory."""

    def __init__(self, paths: Sequence[str | Path], dtype):
        self.paths = [Path(p) for p in paths if Path(p).stat().st_size]
        self.parts = [np.memmap(p, dtype=dtype, mode="r") for p in self.paths]
        self.starts = np.cumsum([0] + [len(p) for p in self.parts]).tolist()
        self.dtype = np.dtype(dtype)

    def where(self, i: int) -> str:
        """Where token `i` of the stream lies: `token <k> of <shard>`."""
        k = bisect_right(self.starts, i) - 1
        return f"token {i - self.starts[k]} of {self.paths[k]}"

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, key):
        if not isinstance(key, slice):
            i = int(key) + (len(self) if int(key) < 0 else 0)
            if not 0 <= i < len(self):
                raise IndexError(key)
            k = bisect_right(self.starts, i) - 1
            return self.parts[k][i - self.starts[k]]
        start, stop, step = key.indices(len(self))
        if step != 1:
            raise ValueError("ShardedTokens slices must be contiguous")
        pieces = []
        k = bisect_right(self.starts, start) - 1
        while start < stop:
            part = self.parts[k]
            a = start - self.starts[k]
            b = min(stop - self.starts[k], len(part))
            pieces.append(part[a:b])
            start += b - a
            k += 1
        if not pieces:
            return np.zeros(0, self.dtype)
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
