"""Small layers shared by several modes."""

from __future__ import annotations

import torch
import torch.nn as nn


class ParallelDropout(nn.Module):
    """Dropout drawing its mask from an explicit generator: the mesh's shared
    generator for activations replicated over the tensor-parallel group (all
    ranks must drop the same elements), its local one for sharded ones."""

    def __init__(self, p: float, generator: torch.Generator):
        super().__init__()
        self.p = p
        self.generator = generator

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = torch.empty_like(x).bernoulli_(1.0 - self.p, generator=self.generator)
        return x * keep / (1.0 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}"
