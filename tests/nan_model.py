"""A tiny model whose training loss turns NaN at a chosen step, for the
non-finite loss policy (train.on_nonfinite). Selected with
`model=custom model._target_=tests.nan_model.build model.nan_at=K`."""

from __future__ import annotations

import torch
import torch.nn as nn


class NanAt(nn.Module):
    def __init__(self, vocab_size: int, width: int, nan_at: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        self.nan_at = nan_at
        self.calls = 0  # training forwards on real data (not tracing, not eval)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.embed(ids))
        if self.training and torch.is_grad_enabled() and ids.device.type != "meta":
            self.calls += 1
            if self.calls == self.nan_at:  # one micro-batch per step: the step's forward
                return logits * float("nan")
        return logits


def build(vocab_size: int = 256, width: int = 16, nan_at: int = 3) -> NanAt:
    return NanAt(vocab_size, width, nan_at)
