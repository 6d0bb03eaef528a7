"""Attention masks as the families hand them to torch's attention, read:
plain causal, or a sliding window that cuts (the band transformers'
sliding masks draw). Documents (documents.py) and context parallelism
(split.py) recognise the family's own masks by these, never by its config."""

from __future__ import annotations

from typing import Optional

import torch


def seen_of(mask: torch.Tensor) -> Optional[torch.Tensor]:
    """A [..., L, L] mask as bool (True: seen): bool, or additive (0 seen,
    -inf or the dtype's lowest not); None if it is neither or not square."""
    if mask.dim() < 2 or mask.shape[-1] != mask.shape[-2]:
        return None
    if mask.dtype == torch.bool:
        return mask
    seen, hidden = mask == 0, mask <= torch.finfo(mask.dtype).min / 2
    return seen if bool((seen | hidden).all()) else None


def plain_causal(mask: torch.Tensor) -> bool:
    """A [..., L, L] mask of plain causal attention."""
    seen = seen_of(mask)
    return seen is not None and bool((seen == torch.ones(mask.shape[-2:], dtype=torch.bool,
                                                          device=mask.device).tril()).all())


def band_window(mask: torch.Tensor) -> Optional[int]:
    """The window W of a [..., L, L] sliding causal mask that cuts (W < L:
    query i sees key j iff 0 <= i - j < W, as transformers' sliding masks
    count it), the same for every row and head; None for any other mask."""
    seen = seen_of(mask)
    if seen is None:
        return None
    window = int(seen.reshape(-1, *seen.shape[-2:])[0, -1].sum())  # what the last query sees
    n = seen.shape[-1]
    if not 0 < window < n:
        return None
    i = torch.arange(n, device=mask.device)
    gap = i[:, None] - i[None, :]
    return window if bool((seen == ((gap >= 0) & (gap < window))).all()) else None
