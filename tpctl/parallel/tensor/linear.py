"""The Linear a mode gets by default for each linear role (qkv, attn_in,
mlp_in, attn_out, mlp_out, lm_head): this rank's shard of the weight, run
by the mode's `linear_fn(role)`, plus this rank's piece of the bias (held
as the mode's `output_spec` says). A new mode that defines `weight_spec`,
`output_spec` and `linear_fn` converts every Linear with it
(`ParallelMode.convert_linear`; `registry.register` fills in the
`convert_<role>` a mode leaves out)."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn

# The roles whose module is an nn.Linear (or a Conv1D made one).
LINEAR_ROLES = ("qkv", "attn_in", "mlp_in", "attn_out", "mlp_out", "lm_head")


class ShardedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], fn: Callable):
        super().__init__()
        self.weight, self.bias, self.fn = weight, bias, fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fn(x, self.weight)
        # The output is in the compute dtype under autocast; the bias, an fp32 master, follows it.
        return y if self.bias is None else y + self.bias.to(y.dtype)


def default_converter(role: str) -> Callable:
    """A `convert_<role>` method that converts with `convert_linear`."""
    def convert(self, module: nn.Linear, ctx) -> nn.Module:
        return self.convert_linear(module, ctx, role)

    convert.__name__ = f"convert_{role}"
    return convert
