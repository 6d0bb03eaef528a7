"""Dropout on an explicit generator: every component that drops
activations (the modes' layers, pipeline stages, context-parallel
attention) draws its masks through it, from the mesh's generators."""

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
        return x * self.keep(x) / (1.0 - self.p)

    def keep(self, x: torch.Tensor) -> torch.Tensor:
        """The mask of `x`'s elements kept (1) or dropped (0)."""
        return torch.empty_like(x).bernoulli_(1.0 - self.p, generator=self.generator)

    def extra_repr(self) -> str:
        return f"p={self.p}"
