"""A nanoGPT-style decoder written as plain PyTorch.

It knows nothing of parallelism. Two habits make it rewritable: attention
reads the number of heads from the width of the tensor it receives (a rank
may hold only some heads), and the model returns logits, leaving the loss to
the caller (a parallel cross entropy never sees full logits).
`tp_plan` maps module names to roles; each parallel mode maps roles to layers.
Initial values come from `models.init` (see `build_model`).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..schema import ModelConfig


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # fused [q|k|v]
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        batch, seq, _ = qkv.shape
        q, k, v = (t.view(batch, seq, -1, self.head_dim).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
        if self.training and self.attn_drop.p > 0:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
            causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
            att = self.attn_drop(att.masked_fill(~causal, float("-inf")).softmax(dim=-1))
            y = att @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(batch, seq, -1)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, cfg.mlp_ratio * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    tp_plan = {
        "wte": "embedding",
        "wpe": "pos_embedding",
        "drop": "dropout",
        "blocks.*.ln_1": "norm",
        "blocks.*.ln_2": "norm",
        "blocks.*.attn.qkv": "qkv",
        "blocks.*.attn.attn_drop": "attn_dropout",
        "blocks.*.attn.proj": "attn_out",
        "blocks.*.attn.resid_drop": "dropout",
        "blocks.*.mlp.fc": "mlp_in",
        "blocks.*.mlp.proj": "mlp_out",
        "blocks.*.mlp.drop": "dropout",
        "ln_f": "norm",
        "lm_head": "lm_head",
    }

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    def init_std(self, name: str) -> float:
        """GPT-2's initial weights: N(0, 0.02), scaled down for the
        projections into the residual stream (used by models.init)."""
        return 0.02 / math.sqrt(2 * self.cfg.n_layer) if name.endswith("proj.weight") else 0.02

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))
