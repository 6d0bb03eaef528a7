"""Small layers shared by several modes."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from tpctl.parallel.roles.probes import is_rms_norm, norm_eps, norm_offset, norm_width, sums_squares


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


class SplitNorm(nn.Module):
    """LayerNorm (or RMSNorm, rms=True) over a hidden dimension split across
    `group`: the row moments are one all-reduce of the stacked partial sums
    (and one in the backward, through autograd). It computes in fp32 whatever
    autocast's dtype (the moments, their all-reduce and the output), as
    autocast runs nn.LayerNorm, so the residual stream's precision matches
    mode=none. Called with a gate (a Mamba-2 mixer's gated RMSNorm), x is
    multiplied by silu(gate) before the norm (gate "before"), or the output
    after it ("after": FalconH1's norm_before_gate)."""

    def __init__(self, weight, bias, hidden: int, eps: float, group, rms: bool = False, offset: float = 0.0,
                 features=None, gate: str = "before"):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.hidden, self.eps, self.group, self.rms = hidden, eps, group, rms
        self.offset = offset  # the weight enters as (offset + weight): Gemma's RMSNorm has 1
        # The (start, stop) ranges of the hidden features this rank holds:
        # what the start-up check compares, with or without a weight.
        self.features = features
        self.gate = gate

    def forward(self, x: torch.Tensor, gate: Optional[torch.Tensor] = None) -> torch.Tensor:
        from tpctl.parallel.comm import sum_shared

        x = upcast(x)
        if gate is not None and self.gate == "before":
            x = x * nn.functional.silu(upcast(gate))
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
        y = y if self.bias is None else y + self.bias
        return y * nn.functional.silu(upcast(gate)) if gate is not None and self.gate == "after" else y

    @classmethod
    def like(cls, module: nn.Module, features, shard, group, copies: int = 1) -> "SplitNorm":
        """The split version of `module` (a LayerNorm or RMSNorm) holding
        the hidden features `features` (ranges), its parameters sharded by
        `shard(param, features)`. `copies`: how many ranks of `group` hold
        each feature (a key/value head shared by several blocks of query
        heads), so the summed moments count every feature that many times."""
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        offset = norm_offset(module)
        # (an L2 norm: the squares' sum, not their mean -- divided by the copies of each feature only)
        hidden = copies if sums_squares(module) else norm_width(module) * copies
        return cls(None if weight is None else shard(weight, features), None if bias is None else shard(bias, features),
                   hidden, norm_eps(module), group, rms=is_rms_norm(module), offset=offset, features=features)


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



def hold_stream_tensors(model: nn.Module, plan, mode, ctx) -> None:
    """Tensors as wide as the stream that a module holds itself and adds to
    (or multiplies into) it outside any Linear (RolePlan.stream_tensors),
    held as this rank's piece of the stream holds its features
    (mode.stream_spec). A parameter is sharded so: a rank's gradient is its
    rows' part, summed over the ranks holding the same features (where the
    stream's features are whole, it is replicated, its gradient partial
    where the stream is split by sequence). A buffer of constants stays
    whole (a lazy model computes it, export and checkpoints read it whole)
    and is cut for the module's own forward only (`StreamTables`)."""
    for owner, attrs in getattr(plan, "stream_tensors", {}).items():
        module = model.get_submodule(owner)
        ctx.name = owner
        params = [a for a in attrs if a in module._parameters]
        for attr in params if mode.rewrites else ():
            full = module._parameters[attr]
            spec = mode.stream_spec(full)
            if spec is None:
                mode.replicated(full, "tp", partial=mode.splits_stream(ctx))
            else:
                setattr(module, attr, ctx.shard(full, spec))
        tables = tuple(a for a in attrs if a not in params)
        if tables and mode.stream_spec(torch.empty(0, device="meta")) is not None:
            hooks = StreamTables(tables, mode)
            module.register_forward_pre_hook(hooks.cut)
            module.register_forward_hook(hooks.restore, always_call=True)


class StreamTables:
    """Forward hooks of a module reading buffers of constants as wide as
    the stream (CTRL's `pos_encoding[position_ids]`, added to the
    embeddings): for the call each is this rank's features of it, after
    it the whole one again. (The forward may replace the buffer by its own
    cast: CTRL's `.to(device, dtype)`; the next call cuts the whole one again.)"""

    def __init__(self, attrs: tuple, mode):
        self.attrs, self.mode = attrs, mode
        self.whole: dict = {}

    def cut(self, module: nn.Module, args) -> None:
        for attr in self.attrs:
            full = self.whole[attr] = module._buffers[attr]
            module._buffers[attr] = self.mode.stream_spec(full).slice(full)

    def restore(self, module: nn.Module, args, out) -> None:
        for attr, full in self.whole.items():
            module._buffers[attr] = full
        self.whole.clear()
