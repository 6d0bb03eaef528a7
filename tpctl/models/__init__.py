"""Built-in models: plain PyTorch, parallelised from the outside by role."""

from __future__ import annotations

import torch

from ..schema import ModelConfig
from .gpt import GPT
from .init import ParamInit
from .mlp import TokenMLP

__all__ = ["ARCHS", "GPT", "TokenMLP", "ParamInit", "build_model"]

ARCHS = {"gpt": GPT, "mlp": TokenMLP}


def build_model(cfg: ModelConfig, seed: int, lazy: bool = False) -> torch.nn.Module:
    """A built-in model whose initial weights are fixed by `seed` alone
    (each parameter from its own generator, see models.init), so every mode
    slices its shards from the same whole model.

    lazy=True leaves the parameters on the meta device with the initialiser
    attached as `model.tpctl_init`: `parallelize` then makes each parameter
    whole only to slice this rank's shard, one at a time.
    """
    with torch.device("meta"):
        model = ARCHS[cfg.arch](cfg)
    model.tpctl_init = ParamInit(model, seed)
    if not lazy:
        model.tpctl_init.materialize(model)
    return model
