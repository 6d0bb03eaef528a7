"""A token-wise residual MLP language model: the smallest model that still
has every layer kind but attention (embedding, norms, linears with bias, an
untied LM head with bias)."""

from __future__ import annotations

import torch
import torch.nn as nn

from tpctl.schema import ModelConfig
from .gpt import MLP


class MLPBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class TokenMLP(nn.Module):
    tp_plan = {
        "wte": "embedding",
        "blocks.*.norm": "norm",
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
        self.blocks = nn.ModuleList(MLPBlock(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=True)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))
