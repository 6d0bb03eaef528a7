"""Small layers shared by several modes."""

from __future__ import annotations

import torch
import torch.nn as nn


def to_compute(t: torch.Tensor) -> torch.Tensor:
    """`t` in autocast's compute dtype (bf16 under precision=bf16) when
    autocast is on for its device, else unchanged. Parallel layers cast
    their inputs and weights *before* a collective, so activations and
    gathered or broadcast weights cross the wire in the compute dtype (half
    the bytes of fp32) and custom autograd functions see one dtype in
    forward and backward; the fp32 master weight gets its gradient through
    the cast, in fp32, as with autocast's own casts."""
    device = t.device.type
    if t.is_floating_point() and torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        if t.dtype != dtype:
            return t.to(dtype)
    return t


def upcast(t: torch.Tensor) -> torch.Tensor:
    """A half-precision tensor in fp32 (statistics are accumulated in fp32)."""
    return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t


class ParallelDropout(nn.Module):
    """Dropout drawing its mask from an explicit generator: the mesh's shared
    generator for activations replicated over the tensor-parallel group (all
    ranks must drop the same elements), its local one for sharded ones."""

    def __init__(self, p: float, generator: torch.Generator):
        super().__init__()
        self.p = p
        self.generator = generator

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = torch.empty_like(x).bernoulli_(1.0 - self.p, generator=self.generator)
        return x * keep / (1.0 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}"


def is_norm(module: nn.Module) -> bool:
    """LayerNorm and RMSNorm, PyTorch's or a model's own (LlamaRMSNorm, ...)."""
    if isinstance(module, (nn.LayerNorm, getattr(nn, "RMSNorm", nn.LayerNorm))):
        return True
    name = type(module).__name__
    weight = getattr(module, "weight", None)
    return name.endswith(("RMSNorm", "LayerNorm")) and isinstance(weight, torch.Tensor) and weight.dim() == 1


def is_rms_norm(module: nn.Module) -> bool:
    return is_norm(module) and "RMSNorm" in type(module).__name__


def norm_eps(module: nn.Module) -> float:
    for attr in ("eps", "variance_epsilon", "epsilon"):
        value = getattr(module, attr, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return 1e-6 if is_rms_norm(module) else 1e-5


class SplitNorm(nn.Module):
    """LayerNorm (or RMSNorm, rms=True) over a hidden dimension split across
    `group`: the row moments are one all-reduce of the stacked partial sums
    (and one in the backward, through autograd). It computes in fp32 whatever
    autocast's dtype (the moments, their all-reduce and the output), as
    autocast runs nn.LayerNorm, so the residual stream's precision matches
    mode=none."""

    def __init__(self, weight, bias, hidden: int, eps: float, group, rms: bool = False):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.hidden, self.eps, self.group, self.rms = hidden, eps, group, rms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ..comm import sum_shared

        x = upcast(x)
        if self.rms:
            mean_square = sum_shared((x * x).sum(-1), self.group) / self.hidden
            y = x * torch.rsqrt(mean_square + self.eps).unsqueeze(-1)
        else:
            sums = sum_shared(torch.stack([x.sum(-1), (x * x).sum(-1)]), self.group)
            mean = sums[0] / self.hidden
            var = sums[1] / self.hidden - mean * mean
            y = (x - mean.unsqueeze(-1)) * torch.rsqrt(var + self.eps).unsqueeze(-1)
        if self.weight is not None:
            y = y * self.weight
        return y if self.bias is None else y + self.bias

    @classmethod
    def like(cls, module: nn.Module, shard, group) -> "SplitNorm":
        """The split version of `module` (a LayerNorm or RMSNorm), its
        parameters sharded by `shard(param)`."""
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        hidden = weight.shape[-1] if weight is not None else module.normalized_shape[-1]
        return cls(None if weight is None else shard(weight), None if bias is None else shard(bias),
                   hidden, norm_eps(module), group, rms=is_rms_norm(module))


class Lookup(nn.Module):
    """An embedding table holding a (sharded) parameter as given."""

    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, self.weight)


def vocab_block_lookup(ids: torch.Tensor, table: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """Embeddings of `ids` from a table holding rows [vocab_start,
    vocab_start + len(table)) of the vocabulary; ids outside it give zeros,
    so summing over the ranks holding the other blocks completes the lookup."""
    local = ids - vocab_start
    outside = (local < 0) | (local >= table.shape[0])
    out = torch.nn.functional.embedding(local.masked_fill(outside, 0), table)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)
