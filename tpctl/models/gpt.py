"""A nanoGPT-style decoder written as plain PyTorch.

It knows nothing of parallelism. Two habits make it rewritable: attention
reads the number of heads from the width of the tensor it receives (a rank
may hold only some heads), and the model returns logits, leaving the loss to
the caller (a parallel cross entropy never sees full logits).
`tp_plan` maps module names to roles; each parallel mode maps roles to layers.
Initial values come from `models.init` (see `build_model`).

Generation passes a `KVCache` to `forward`: each attention layer appends
this step's keys and values (of the heads and rows this rank holds, whatever
the mode) and attends over everything cached, and positions continue from
the cached length.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import handle_torch_function, has_torch_function

from tpctl.parallel.context import documents as docs_
from tpctl.schema import ModelConfig


class KVCache:
    """Keys and values of the tokens seen so far, one (k, v) per layer,
    each [batch, heads, tokens, head_dim] as the attention computed them."""

    def __init__(self, n_layer: int):
        self.layers: list = [None] * n_layer

    def length(self, layer: int = 0) -> int:
        """Tokens cached in `layer` (layer 0 before a forward: the position
        of the next token)."""
        return 0 if self.layers[layer] is None else self.layers[layer][0].shape[2]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this step's k, v to layer `layer`; return all of them."""
        if self.layers[layer] is not None:
            k = torch.cat([self.layers[layer][0], k], dim=2)
            v = torch.cat([self.layers[layer][1], v], dim=2)
        self.layers[layer] = (k, v)
        return k, v


def dropped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: nn.Module) -> torch.Tensor:
    """Causal attention with `dropout` on the probabilities, written out so
    the mask comes from the dropout module (whose generator the caller
    chose), not from inside torch's attention kernel. Like torch's own
    functions it answers to a TorchFunctionMode, so context parallelism can
    compute it across the ranks holding the sequence."""
    if has_torch_function((q, k, v)):
        return handle_torch_function(dropped_attention, (q, k, v), q, k, v, dropout)
    seq = q.shape[-2]
    att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    documents = docs_.current()
    # data.documents: causal within each document (Documents.mask), else causal.
    seen = documents.mask() if documents is not None else torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    return dropout(att.masked_fill(~seen, float("-inf")).softmax(dim=-1)) @ v


dropped_attention.tpctl_dropped_attention = True  # parallel.context.DROPPED_ATTENTION: cp may replace it


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # fused [q|k|v]
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        qkv = self.qkv(x)
        batch, seq, _ = qkv.shape
        q, k, v = (t.view(batch, seq, -1, self.head_dim).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
        past = 0
        if cache is not None:
            past = cache.length(layer)
            k, v = cache.update(layer, k, v)
        if past > 0:
            # New query t sees every cached key and the new ones up to itself
            # (one new token: all of them).
            mask = None if seq == 1 else torch.ones(seq, past + seq, dtype=torch.bool, device=x.device).tril(past)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        elif self.training and self.attn_drop.p > 0:
            y = dropped_attention(q, k, v, self.attn_drop)
        elif (documents := docs_.current()) is not None:
            # data.documents: no query sees another document's keys.
            documents.check(q)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=documents.mask())
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

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache, layer)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    # data.documents: parallel.context.documents.install gives it a setup;
    # its forward then masks across documents and restarts positions.
    tpctl_reads_documents = True
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

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        setup = getattr(self, docs_.SETUP, None)
        if setup is not None and cache is None:
            return self._forward_documents(idx, setup.of(idx))
        start = cache.length() if cache is not None else 0
        pos = torch.arange(start, start + idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for layer, block in enumerate(self.blocks):
            x = block(x, cache, layer) if cache is not None else block(x)
        return self.lm_head(self.ln_f(x))

    def _forward_documents(self, idx: torch.Tensor, documents: docs_.Documents) -> torch.Tensor:
        """data.documents: positions counted from each document's start, and
        the blocks run inside the documents (their attention masks them)."""
        x = self.drop(self.wte(idx) + documents.embed_positions(self.wpe))
        with documents:
            for block in self.blocks:
                x = block(x)
        return self.lm_head(self.ln_f(x))
