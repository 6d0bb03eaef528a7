"""A model the start-up verification must refuse whatever tpctl learns
about fused layouts: its tp_plan declares a fused projection `qkv` (which
tpctl slices as [q | k | v]) while its forward reads that projection's rows
interleaved per head (q0 k0 v0 q1 k1 v1 ..., as GPT-NeoX and BLOOM store
theirs). Each rank's qkv computes its own rows exactly right; only the
attention's output is wrong, so only the block check can see it.

`width_scaled` is the same model with [q | k | v] read as [q | k | v], whose
forward scales the embeddings by the square root of the table's width as it
finds it: a rank holding a slice of the hidden dimension scales by the wrong
number. Every module and block is right; only the embedding stage (the
model's own forward around its top-level modules) is wrong.

Used by test_verify.py, in the pool and through
`model=custom model._target_=tests.verify_models.interleaved`."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class InterleavedAttention(nn.Module):
    def __init__(self, width: int, n_heads: int, interleaved: bool = True):
        super().__init__()
        self.head_dim, self.interleaved = width // n_heads, interleaved
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(x)
        if self.interleaved:  # per head, its q, k and v rows side by side
            q, k, v = qkv.view(b, t, -1, 3 * self.head_dim).transpose(1, 2).split(self.head_dim, dim=-1)
        else:
            q, k, v = (part.view(b, t, -1, self.head_dim).transpose(1, 2) for part in qkv.chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class Layer(nn.Module):
    def __init__(self, width: int, n_heads: int, interleaved: bool):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = InterleavedAttention(width, n_heads, interleaved)
        self.ln_2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 2 * width)
        self.out = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class Interleaved(nn.Module):
    tp_plan = {"tokens": "embedding", "blocks.*.ln_1": "norm", "blocks.*.ln_2": "norm", "blocks.*.attn.qkv": "qkv",
               "blocks.*.attn.proj": "attn_out", "blocks.*.fc": "mlp_in", "blocks.*.out": "mlp_out",
               "ln_f": "norm", "head": "lm_head"}

    def __init__(self, vocab_size: int, width: int, n_heads: int, depth: int, interleaved: bool = True,
                 scale_by_width: bool = False):
        super().__init__()
        self.scale_by_width = scale_by_width
        self.tokens = nn.Embedding(vocab_size, width)
        self.blocks = nn.ModuleList(Layer(width, n_heads, interleaved) for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids)
        if self.scale_by_width:
            x = x * self.tokens.weight.shape[1] ** 0.5
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def interleaved(vocab_size: int = 256, width: int = 32, n_heads: int = 4, depth: int = 2) -> Interleaved:
    return Interleaved(vocab_size, width, n_heads, depth)


def width_scaled(vocab_size: int = 256, width: int = 32, n_heads: int = 4, depth: int = 2) -> Interleaved:
    return Interleaved(vocab_size, width, n_heads, depth, interleaved=False, scale_by_width=True)
