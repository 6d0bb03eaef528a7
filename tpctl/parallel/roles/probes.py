"""What a module is and what its forward computes, read from the module
itself or measured on copies of it: norms and their arithmetic, embeddings'
scale, expert holders, the key/value cache turned off while tpctl runs its
own forwards. The roles are read with these (inference, tracing), the modes
rewrite with them, and the start-up proof compares with them."""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn as nn


def is_norm(module: nn.Module) -> bool:
    """LayerNorm and RMSNorm, PyTorch's or a model's own (LlamaRMSNorm, ...)."""
    if isinstance(module, (nn.LayerNorm, getattr(nn, "RMSNorm", nn.LayerNorm))):
        return True
    name = type(module).__name__
    if name.endswith("L2Norm"):  # (Dory's: x / |x|, a sum of squares; Llama 4's, a mean, stays a plain op)
        return sums_squares(module)
    if not name.endswith(("RMSNorm", "LayerNorm")):
        return False
    weight = getattr(module, "weight", None)
    if weight is None:  # a norm without parameters (OLMo's LayerNorm): its width is its normalized_shape
        shape = getattr(module, "normalized_shape", None)
        if shape is None and not any(True for _ in module.parameters()):
            # One that does not store it (NanoChat's RMSNorm over the stream
            # and over each head): the tracer records the width it is called
            # with (`traced_width`); unrecognised, it would run on whatever
            # piece of its features a rank holds.
            return True
        return isinstance(shape, (tuple, list, torch.Size)) and len(shape) == 1
    # (a 2-d weight: one row per head, Cohere's q/k LayerNorm over each head)
    return isinstance(weight, torch.Tensor) and weight.dim() in (1, 2)


def is_experts(module: nn.Module) -> bool:
    """A module holding a set of expert weights: 3-d parameters, one slice
    per expert."""
    three = [p for p in module.parameters(recurse=False) if p.dim() == 3]
    return len(three) >= 2 and len({p.shape[0] for p in three}) == 1


def is_rms_norm(module: nn.Module) -> bool:
    """An RMSNorm, or an L2 norm (one moment: the squares)."""
    return is_norm(module) and ("RMSNorm" in type(module).__name__ or sums_squares(module))


def sums_squares(module: nn.Module) -> bool:
    """Whether `module` is a norm without parameters that divides by the
    root of the sum of squares (+ eps), not their mean: an L2 norm onto the
    unit sphere (Dory's DoryL2Norm, nGPT's), measured."""
    if not type(module).__name__.endswith("L2Norm") or any(True for _ in module.parameters()):
        return False
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    eps = next((float(getattr(module, a)) for a in ("eps", "variance_epsilon", "epsilon")
                if isinstance(getattr(module, a, None), (int, float))), 1e-6)
    try:
        with torch.no_grad():
            got = type(module).forward(module, x).float()  # (not its hooks: a trace's would record the call)
    except Exception:  # (a forward that is no norm of one tensor)
        return False
    return got.shape == x.shape and torch.allclose(got, x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps),
                                                   rtol=1e-5, atol=1e-6)


def norm_eps(module: nn.Module) -> float:
    for attr in ("eps", "variance_epsilon", "epsilon"):
        value = getattr(module, attr, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return 1e-6 if is_rms_norm(module) else 1e-5


def norm_width(module: nn.Module) -> int:
    """The features a norm normalises over: its weight's, or (a norm
    without parameters, OLMo's LayerNorm) its normalized_shape, or the
    width the tracer saw it called with (NanoChat's)."""
    weight = getattr(module, "weight", None)
    if weight is not None:
        return weight.shape[-1]
    shape = getattr(module, "normalized_shape", None)
    if shape is not None:
        return shape[-1]
    width = getattr(module, "tpctl_traced_width", None)
    if width is None:
        raise ValueError(f"the norm {type(module).__name__} stores no width (no weight, no normalized_shape) and "
                         "no trace measured it: tpctl cannot split it")
    return width


def traced_width(module: nn.Module, width: int) -> None:
    """Record the width a norm storing none of its own was called with;
    ValueError if it is called with two (one module over two sizes)."""
    if getattr(module, "weight", None) is not None or getattr(module, "normalized_shape", None) is not None:
        return
    seen = getattr(module, "tpctl_traced_width", None)
    if seen is not None and seen != width:
        raise ValueError(f"the norm {type(module).__name__} without parameters is called over {seen} and "
                         f"{width} features: tpctl cannot split it")
    module.tpctl_traced_width = width


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
def norm_offset(module: nn.Module, rms: Optional[bool] = None) -> float:
    """How the norm's weight enters its own forward, measured: 0 for
    x_hat * w (+ b), 1 for x_hat * (1 + w) (Gemma). The split norm then
    checks its arithmetic against the module's on random weights; anything
    else is refused, naming the module's class. `rms`: whether x_hat is an
    RMSNorm's, where its class's name does not say (a Mamba-2 mixer's
    gated norm, *RMSNormGated); default is_rms_norm."""
    weight = getattr(module, "weight", None)
    if weight is None:
        return 0.0
    hidden = weight.shape[-1]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, hidden, generator=gen)
    w, b = torch.randn(hidden, generator=gen), torch.randn(hidden, generator=gen)
    eps = norm_eps(module)
    if is_rms_norm(module) if rms is None else rms:
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
