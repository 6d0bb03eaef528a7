"""Deterministic seeds derived from several parts (no Python hash salt, so
every process derives the same seed)."""

from __future__ import annotations

import zlib


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed mixing `parts` (ints, or strings by CRC32)."""
    h = 0x9E3779B97F4A7C15
    for part in parts:
        x = zlib.crc32(part.encode()) if isinstance(part, str) else part
        h = ((h ^ (x + 0x632BE59BD9B4E019)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    return h >> 1
