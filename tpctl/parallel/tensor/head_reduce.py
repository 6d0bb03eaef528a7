"""A Linear inside attention that reads all heads of one projection's
output and makes one value per head (`head_reduce`: Doge's `dt_proj`, from
all value heads to one dynamic-mask rate per head), split by heads.

Each rank holds its heads of the projection it reads (its input features,
held as that projection's output is: where its bias lands), so its product
with the matching columns of the weight is a partial sum over the ranks
splitting those heads, of every head's value; a reduce-scatter over those
ranks (the group splitting the projection's output: `output_group`) sums it
and leaves each rank its own heads' values (backward: an all-gather), then
its heads' entries of the bias. Ranks with other rows and the same heads
hold the same columns and bias entries, their gradients partial (2d:
the projection's output spec says so). Exact: one sum of the same terms.
Refused with the reason where its heads are not whole on one rank each (key/value
heads shared by several ranks) or do not split as the group does.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from tpctl.parallel import comm
from tpctl.parallel.roles.fused import held_units


class HeadReduce(nn.Module):
    """x (this rank's heads of a projection's output) -> this rank's
    heads' values: its partial product, reduce-scattered over `group`."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], group):
        super().__init__()
        self.weight, self.bias, self.group = weight, bias, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight.to(x.dtype))
        y = comm.reduce_scatter_along(y, self.group, y.dim() - 1)
        return y if self.bias is None else y + self.bias.to(y.dtype)


def reduce_problem(heads, out_features: int, split: int) -> Optional[str]:
    """Why a per-head reduction of `out_features` values over an
    attention's `heads` (roles.plan.Heads) cannot split `split` ways."""
    if out_features not in (heads.heads, heads.kv_heads):
        return f"its {out_features} outputs are not one per head ({heads.heads} query, {heads.kv_heads} key/value heads)"
    if out_features % split:
        return (f"one value per head of {out_features} heads, which do not split {split} ways (key/value heads "
                "shared by several ranks)")
    return None


def convert_head_reduce(mode, module: nn.Linear, ctx) -> nn.Module:
    """`mode`'s HeadReduce for `module` (ctx: the rewrite's context)."""
    source = mode.sources[ctx.name]
    role, layout = mode.source_roles[source], mode.layouts.get(source)
    split = mode.geo.head_split
    # Where this rank's features of the source's output are, and who else holds them.
    features = mode.output_spec(torch.empty(module.in_features, device="meta"), role, layout)
    weight_spec = dataclasses.replace(features, full_shape=tuple(module.weight.shape), index=(None, features.index[0]))
    weight = ctx.shard(module.weight, weight_spec)
    held = held_units(module.out_features, split, mode.head_block())
    bias = None
    if module.bias is not None:
        bias = ctx.shard(module.bias, dataclasses.replace(features, full_shape=tuple(module.bias.shape),
                                                         index=(((held.start, held.stop),),)))
    group = mode.output_group(role)
    if not ctx.shapes_only and comm.group_size(group) != split or \
            not ctx.shapes_only and split > 1 and comm.group_rank(group) != mode.head_block():
        raise ValueError(f"{ctx.name}: the ranks splitting {source}'s heads are not its output's group in head order")
    return HeadReduce(weight, bias, group)
