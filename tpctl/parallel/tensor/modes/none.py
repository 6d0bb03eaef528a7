"""mode=none: one tensor-parallel rank; the reference every mode must match.
Layers stay as written (only dropout draws from the mesh's generator, so a
run is reproducible from its seed); data parallelism still applies."""

from __future__ import annotations

import torch.nn as nn

from tpctl.errors import ConfigError
from tpctl.parallel.dropout import ParallelDropout
from tpctl.parallel.geometry import Geometry
from tpctl.parallel.registry import register
from tpctl.parallel.tensor.mode import ParallelMode


@register
class NoParallel(ParallelMode):
    name = "none"
    replicated_activations = True
    rewrites = False

    @classmethod
    def geometry(cls, size: int, depth: int = 1) -> Geometry:
        if size != 1:
            raise ConfigError("size", size, "mode=none runs one tensor-parallel rank: expected size=1 (use dp for replicas)")
        return Geometry(cls.name, 1, 1, 1, 1, 1, 1, 1)

    @classmethod
    def variants(cls, size: int) -> list[dict]:
        return [{}] if size == 1 else []

    def _keep(self, module: nn.Module, ctx) -> nn.Module:
        return module

    convert_embedding = convert_pos_embedding = convert_qkv = convert_attn_in = convert_attn_out = _keep
    convert_mlp_in = convert_mlp_out = convert_norm = convert_lm_head = convert_proj_norm = _keep
    convert_experts = convert_router = convert_pos_table = convert_untrained = _keep

    def convert_dropout(self, module: nn.Dropout, ctx) -> nn.Module:
        return ParallelDropout(module.p, self.mesh.rng_local)

    convert_attn_dropout = convert_dropout
