"""Built-in models: plain PyTorch, parallelised from the outside by role."""

from __future__ import annotations

import torch

from ..schema import ModelConfig
from .gpt import GPT
from .mlp import TokenMLP

ARCHS = {"gpt": GPT, "mlp": TokenMLP}


def build_model(cfg: ModelConfig, seed: int) -> torch.nn.Module:
    """The whole model, initialised from `seed` exactly as in one process;
    every mode slices its shards from this, so initial weights never depend
    on the mode."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ARCHS[cfg.arch](cfg)
