"""Small layers shared by several modes."""

from __future__ import annotations

import functools
from typing import Optional

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


def linear_grads(grad: torch.Tensor, x: torch.Tensor, need_weight: bool, need_bias: bool):
    """The weight's and the bias's gradients of Y = X W^T + b (None where not
    needed), from Y's gradient and X (rows on every dim but the last): the
    products autograd's linear backward makes, written out so a custom
    function takes them in its own backward (a torch.autograd.grad there
    would be a backward of its own, and under activation checkpointing
    recompute the whole block again)."""
    rows = grad.reshape(-1, grad.shape[-1])
    grad_w = rows.t().mm(x.reshape(-1, x.shape[-1])) if need_weight else None
    return grad_w, rows.sum(0) if need_bias else None


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
        return x * self.keep(x) / (1.0 - self.p)

    def keep(self, x: torch.Tensor) -> torch.Tensor:
        """The mask of `x`'s elements kept (1) or dropped (0)."""
        return torch.empty_like(x).bernoulli_(1.0 - self.p, generator=self.generator)

    def extra_repr(self) -> str:
        return f"p={self.p}"


def is_norm(module: nn.Module) -> bool:
    """LayerNorm and RMSNorm, PyTorch's or a model's own (LlamaRMSNorm, ...)."""
    if isinstance(module, (nn.LayerNorm, getattr(nn, "RMSNorm", nn.LayerNorm))):
        return True
    name = type(module).__name__
    if not name.endswith(("RMSNorm", "LayerNorm")):
        return False
    weight = getattr(module, "weight", None)
    if weight is None:  # a norm without parameters (OLMo's LayerNorm): its width is its normalized_shape
        shape = getattr(module, "normalized_shape", None)
        return isinstance(shape, (tuple, list, torch.Size)) and len(shape) == 1
    # (a 2-d weight: one row per head, Cohere's q/k LayerNorm over each head)
    return isinstance(weight, torch.Tensor) and weight.dim() in (1, 2)


def is_experts(module: nn.Module) -> bool:
    """A module holding a set of expert weights: 3-d parameters, one slice
    per expert."""
    three = [p for p in module.parameters(recurse=False) if p.dim() == 3]
    return len(three) >= 2 and len({p.shape[0] for p in three}) == 1


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

    def __init__(self, weight, bias, hidden: int, eps: float, group, rms: bool = False, offset: float = 0.0,
                 features=None):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.hidden, self.eps, self.group, self.rms = hidden, eps, group, rms
        self.offset = offset  # the weight enters as (offset + weight): Gemma's RMSNorm has 1
        # The (start, stop) ranges of the hidden features this rank holds:
        # what the start-up check compares, with or without a weight.
        self.features = features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from .comm import sum_shared

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
            y = y * (self.weight + self.offset if self.offset else self.weight)
        return y if self.bias is None else y + self.bias

    @classmethod
    def like(cls, module: nn.Module, features, shard, group, copies: int = 1) -> "SplitNorm":
        """The split version of `module` (a LayerNorm or RMSNorm) holding
        the hidden features `features` (ranges), its parameters sharded by
        `shard(param, features)`. `copies`: how many ranks of `group` hold
        each feature (a key/value head shared by several blocks of query
        heads), so the summed moments count every feature that many times."""
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        offset = norm_offset(module)
        return cls(None if weight is None else shard(weight, features), None if bias is None else shard(bias, features),
                   norm_width(module) * copies, norm_eps(module), group, rms=is_rms_norm(module), offset=offset,
                   features=features)


def norm_width(module: nn.Module) -> int:
    """The features a norm normalises over: its weight's, or (a norm
    without parameters, OLMo's LayerNorm) its normalized_shape."""
    weight = getattr(module, "weight", None)
    return weight.shape[-1] if weight is not None else module.normalized_shape[-1]


class CacheOff:
    """A model's key/value cache off while tpctl runs its own forwards
    (tracing, measuring a layout, verifying, training), whatever its config
    says: `transformers` reads `config.use_cache` at every call and, with it
    on, threads one cache object through the layers, so a module called
    twice sees the keys of the first call. Reusable; the user's setting is
    put back on exit (generation turns the cache on explicitly)."""

    def __init__(self, model: nn.Module):
        found = {}
        for module in model.modules():
            config = getattr(module, "config", None)
            if isinstance(getattr(config, "use_cache", None), bool):
                found[id(config)] = config
        self.configs = list(found.values())
        self._saved: list[bool] = []

    def __enter__(self) -> "CacheOff":
        self._saved = [c.use_cache for c in self.configs]
        for c in self.configs:
            c.use_cache = False
        return self

    def __exit__(self, *exc) -> None:
        for c, value in zip(self.configs, self._saved):
            c.use_cache = value


def on_cpu(probe):
    """Run `probe` (a measurement of what a module's forward computes) with
    the CPU as the default device: a model built under `with
    torch.device("meta")` must not turn the probe's own tensors into shapes
    without values."""
    @functools.wraps(probe)
    def run(*args, **kwargs):
        with torch.device("cpu"):
            return probe(*args, **kwargs)
    return run


def _probe_copy(module: nn.Module, fill) -> nn.Module:
    """A copy of the leaf `module` with real parameters `fill(name, shape)`.
    Shallow: its own parameters are new, so the module's real weights (a
    vocabulary-sized table) are never copied."""
    import copy

    clone = copy.copy(module)
    # A parameter registered as None (LayerNorm(bias=False)) stays None: the
    # forward reads it as an attribute.
    clone._parameters = {name: None if p is None else nn.Parameter(fill(name, tuple(p.shape)), requires_grad=False)
                         for name, p in module._parameters.items()}
    return clone


@on_cpu
def norm_offset(module: nn.Module) -> float:
    """How the norm's weight enters its own forward, measured: 0 for
    x_hat * w (+ b), 1 for x_hat * (1 + w) (Gemma). The split norm then
    checks its arithmetic against the module's on random weights; anything
    else is refused, naming the module's class."""
    weight = getattr(module, "weight", None)
    if weight is None:
        return 0.0
    hidden = weight.shape[-1]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, hidden, generator=gen)
    w, b = torch.randn(hidden, generator=gen), torch.randn(hidden, generator=gen)
    eps = norm_eps(module)
    if is_rms_norm(module):
        x_hat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    else:
        x_hat = (x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + eps)
    with torch.no_grad():
        got = _probe_copy(module, lambda name, shape: w if name == "weight" else b)(x).float()
    bias = b if getattr(module, "bias", None) is not None else 0.0
    for offset in (0.0, 1.0):
        if torch.allclose(got, x_hat * (w + offset) + bias, rtol=1e-4, atol=1e-5):
            return offset
    raise ValueError(f"the norm {type(module).__name__} computes neither x_hat * w nor x_hat * (1 + w) "
                     f"(largest difference {(got - x_hat * w - bias).abs().max().item():.2e}): tpctl cannot split it")


@on_cpu
def embedding_semantics(module: nn.Module) -> tuple[float, Optional[int]]:
    """(scale, padding_idx) of an embedding's own forward, measured: its
    output must be scale * weight[ids] (Gemma scales by sqrt(hidden) inside
    the embedding); padding_idx (whose row gets no gradient) is the module's."""
    weight = module.weight
    n = min(weight.shape[0], 16)
    gen = torch.Generator().manual_seed(0)
    # Only the rows probed: a table of the whole vocabulary would cost its
    # full size on every rank at start-up.
    w = torch.randn((n, weight.shape[1]), generator=gen)
    ids = torch.arange(n).reshape(1, n)
    probe = _probe_copy(module, lambda name, shape: w)
    if getattr(probe, "padding_idx", None) is not None:
        probe.padding_idx = None  # it may lie beyond the probe's n rows; it is read from the module below
    with torch.no_grad():
        got = probe(ids).float()
    plain = torch.nn.functional.embedding(ids, w)
    scale = (got * plain).sum().item() / (plain * plain).sum().item()
    if not torch.allclose(got, plain * scale, rtol=1e-5, atol=1e-6):
        raise ValueError(f"the embedding {type(module).__name__} does not compute scale * weight[ids]: "
                         "tpctl cannot split it")
    pad = getattr(module, "padding_idx", None)
    return (1.0 if abs(scale - 1.0) < 1e-7 else scale), (pad if isinstance(pad, int) else None)


def vocab_block_lookup(ids: torch.Tensor, table: torch.Tensor, vocab_start: int,
                       padding_idx: Optional[int] = None) -> torch.Tensor:
    """Embeddings of `ids` from a table holding rows [vocab_start,
    vocab_start + len(table)) of the vocabulary; ids outside it give zeros,
    so summing over the ranks holding the other blocks completes the lookup.
    The row `padding_idx` (of the whole vocabulary) gets no gradient."""
    local = ids - vocab_start
    outside = (local < 0) | (local >= table.shape[0])
    pad = None if padding_idx is None or not 0 <= padding_idx - vocab_start < table.shape[0] \
        else padding_idx - vocab_start
    out = torch.nn.functional.embedding(local.masked_fill(outside, 0), table, padding_idx=pad)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


def linearize(model: nn.Module) -> nn.Module:
    """Replace every GPT-2 style `Conv1D` (y = x W + b, W stored in x out)
    by the equivalent `nn.Linear` (W stored out x in), in place; records the
    transposed parameter names in `model.tpctl_transposed`."""
    transposed = set(getattr(model, "tpctl_transposed", ()))
    for name, module in list(model.named_modules()):
        if type(module).__name__ != "Conv1D" or not hasattr(module, "nf"):
            continue
        weight = module.weight
        linear = nn.Linear(module.nx, module.nf, bias=module.bias is not None, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            if not weight.is_meta:
                linear.weight.copy_(weight.t())
                if module.bias is not None:
                    linear.bias.copy_(module.bias)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, linear)
        transposed.add(f"{name}.weight")
    model.tpctl_transposed = transposed
    return model
