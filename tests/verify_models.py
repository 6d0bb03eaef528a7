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


# ---- mechanisms the check must accept (each exact in every mode) ---------------------------
#
# Traced models (no tp_plan), each with one mechanism the rewrite must carry
# and the check must accept, not refuse for an untrue reason:
#   * positions: learned absolute positions and a key projection with a bias,
#     whose gradient is zero in exact arithmetic (softmax ignores a shift
#     common to every key): original and rewrite hold only round-off there;
#   * head_norm_list: per-head q/k LayerNorms held as a ModuleList, one
#     norm (with its own weights) per head, as StableLM's qk_layernorm;
#   * fused_head_norms: a fused qkv split into heads, then q/k norms per head;
#   * mqa: one key/value head for all query heads (multi-query attention),
#     shared by every rank whose query heads read it; fused_mqa: the same
#     from one fused [q | k | v] projection (a rank's rows of it are partly
#     its own query heads, partly the shared head).


class Attention(nn.Module):
    def __init__(self, width: int, n_heads: int, mechanism: str):
        super().__init__()
        self.n_heads, self.head_dim, self.mechanism = n_heads, width // n_heads, mechanism
        if mechanism == "fused_head_norms":
            self.qkv = nn.Linear(width, 3 * width)
            self.q_norm, self.k_norm = nn.LayerNorm(self.head_dim), nn.LayerNorm(self.head_dim)
        elif mechanism == "fused_mqa":
            self.qkv = nn.Linear(width, width + 2 * self.head_dim)
            self.embed_dim = width  # a width the rewrite sets to the rank's (roles.HEAD_ATTRS)
        else:
            kv = self.head_dim if mechanism == "mqa" else width
            self.q, self.k, self.v = nn.Linear(width, width), nn.Linear(width, kv), nn.Linear(width, kv)
        if mechanism == "head_norm_list":
            self.q_norms = nn.ModuleList(nn.LayerNorm(self.head_dim) for _ in range(n_heads))
            self.k_norms = nn.ModuleList(nn.LayerNorm(self.head_dim) for _ in range(n_heads))
        self.proj = nn.Linear(width, width)

    def heads(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(*t.shape[:2], -1, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mechanism == "fused_head_norms":
            q, k, v = (self.heads(t) for t in self.qkv(x).chunk(3, dim=-1))
            q, k = self.q_norm(q), self.k_norm(k)
        elif self.mechanism == "fused_mqa":
            q, k, v = (self.heads(t) for t in self.qkv(x).split((self.embed_dim, self.head_dim, self.head_dim), dim=-1))
        else:
            q, k, v = self.heads(self.q(x)), self.heads(self.k(x)), self.heads(self.v(x))
        if self.mechanism in ("mqa", "fused_mqa"):  # the one key/value head, read by every query head
            k, v = (t[:, :1].expand(-1, q.shape[1], -1, -1) for t in (k, v))
        if self.mechanism == "head_norm_list":
            q = torch.cat([norm(h) for norm, h in zip(self.q_norms, q.split(1, dim=1))], dim=1)
            k = torch.cat([norm(h) for norm, h in zip(self.k_norms, k.split(1, dim=1))], dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(*x.shape[:2], -1))


class MechanismLayer(nn.Module):
    def __init__(self, width: int, n_heads: int, mechanism: str):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = Attention(width, n_heads, mechanism)
        self.fc, self.out = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class Mechanism(nn.Module):
    def __init__(self, vocab_size: int, width: int, n_heads: int, depth: int, mechanism: str, max_len: int = 64):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab_size, width), nn.Embedding(max_len, width)
        self.blocks = nn.ModuleList(MechanismLayer(width, n_heads, mechanism) for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        with torch.no_grad():  # norms unlike each other, so a norm applied to the wrong head shows
            for module in self.modules():
                if isinstance(module, nn.LayerNorm):
                    module.weight.uniform_(0.5, 1.5)
                    module.bias.normal_(0.0, 0.1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def mechanism(name: str, vocab_size: int = 256, width: int = 32, n_heads: int = 4, depth: int = 2) -> Mechanism:
    return Mechanism(vocab_size, width, n_heads, depth, name)
