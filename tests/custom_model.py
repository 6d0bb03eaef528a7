"""A model tpctl did not write, in its own style: separate projections, an
nn.Sequential feed-forward, a stored head count, RMSNorm and LayerNorm mixed,
learned positions, an untied read-out, and no tp_plan. Used by test_models.py
through `model=custom model._target_=tests.custom_model.build`."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Mixer(nn.Module):
    def __init__(self, width: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads  # reshapes below use the stored head count
        self.to_q = nn.Linear(width, width, bias=False)
        self.to_k = nn.Linear(width, width, bias=False)
        self.to_v = nn.Linear(width, width, bias=False)
        self.merge = nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, _ = h.shape
        q, k, v = (f(h).view(b, t, self.n_heads, -1).transpose(1, 2) for f in (self.to_q, self.to_k, self.to_v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.merge(y.transpose(1, 2).reshape(b, t, -1))


class Layer(nn.Module):
    def __init__(self, width: int, n_heads: int):
        super().__init__()
        self.pre = nn.LayerNorm(width)
        self.mixer = Mixer(width, n_heads)
        self.post = nn.RMSNorm(width, eps=1e-6)
        self.ff = nn.Sequential(nn.Linear(width, 3 * width), nn.GELU(), nn.Linear(3 * width, width))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.mixer(self.pre(h))
        return h + self.ff(self.post(h))


class Toy(nn.Module):
    def __init__(self, vocab_size: int, width: int, n_heads: int, depth: int, max_len: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, width)
        self.places = nn.Embedding(max_len, width)
        self.stack = nn.ModuleList(Layer(width, n_heads) for _ in range(depth))
        self.final = nn.LayerNorm(width)
        self.readout = nn.Linear(width, vocab_size, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tokens(ids) + self.places(torch.arange(ids.shape[1], device=ids.device))
        for layer in self.stack:
            h = layer(h)
        return self.readout(self.final(h))


def build(vocab_size: int = 256, width: int = 32, n_heads: int = 4, depth: int = 2, max_len: int = 64) -> Toy:
    return Toy(vocab_size, width, n_heads, depth, max_len)
