"""Vocab-parallel cross entropy: each rank holds a block of the vocabulary's
logits for its rows. Three numbers per row cross the wire (max, and the
stacked sum-exp / target logit / logit sum); the backward is local.

No waste, as F.cross_entropy: the logits block is read in row chunks, so the
only fp32 temporaries are one chunk wide (never an fp32 copy of the whole
block, whatever the logits' dtype); the backward recomputes each chunk's
probabilities from the logits it keeps (the logits are saved, not a
probabilities block beside them). Padding columns of a padded vocabulary are
a suffix of the last block: they are sliced off, never masked, and a block
without padding is used as it is.

How wide a chunk is and what computes it is a `ChunkPolicy`, chosen by the
logits' device (`policy_for`) or passed in, so the CUDA policy's code runs
(and is tested) on a CPU too:

  * CPU: 4M elements (16 MiB of fp32), the memory table of docs/benchmarks.md;
  * CUDA (`fused`): the forward's sums and the backward's gradient are one
    function each that torch.compile turns into one kernel reading the
    logits in their own dtype: no fp32 temporary at all, so the whole block
    is one chunk (a 4M-element chunk would be ~200 launches of small kernels
    per loss on gpt-small's logits, which cost more than the math). Without
    a compiler the same functions run eagerly, in chunks sized for the
    device (1/64 of its memory, at most 1 GiB of fp32).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from tpctl.errors import warning
from tpctl.parallel import comm

# Elements of the largest fp32 temporary on a CPU (one chunk of rows): 4M = 16 MiB.
CHUNK_ELEMENTS = 1 << 22
# On a GPU: the device's memory / 64, between the CPU's chunk and 1 GiB of fp32.
CUDA_CHUNK_MAX = 1 << 28


@dataclass(frozen=True)
class ChunkPolicy:
    """How the loss walks the logits: `elements` per fp32 chunk (None: the
    module's CHUNK_ELEMENTS, read at call time), and `fused`: each chunk
    through `chunk_stats` / `chunk_grad` (compiled where `compiled`),
    instead of the in-place eager kernels."""

    elements: Optional[int] = None
    fused: bool = False
    compiled: bool = False

    def rows(self, rows: int, width: int):
        """The row slices of a [rows, width] block."""
        step = max(1, (self.elements or CHUNK_ELEMENTS) // max(1, width))
        if self.fused and step >= 8:
            # Whole multiples of 8 rows keep every chunk 16-byte aligned, whatever the
            # width: inductor copies an input that is not (a pass over the chunk).
            step -= step % 8
        for start in range(0, rows, step):
            yield slice(start, min(rows, start + step))


CPU_POLICY = ChunkPolicy()


def cuda_policy(total_memory: int, compiled: bool = True) -> ChunkPolicy:
    """The GPU's policy for a device of `total_memory` bytes."""
    elements = min(CUDA_CHUNK_MAX, max(CHUNK_ELEMENTS, total_memory // 64 // 4))
    return ChunkPolicy(elements, fused=True, compiled=compiled)


@functools.lru_cache(maxsize=None)
def _device_policy(index: int) -> ChunkPolicy:
    import importlib.util

    memory = torch.cuda.get_device_properties(index).total_memory
    # Inductor makes CUDA kernels with Triton; without it the same math runs eagerly.
    return cuda_policy(memory, compiled=importlib.util.find_spec("triton") is not None)


def policy_for(device: torch.device) -> ChunkPolicy:
    if device.type == "cuda":
        return _device_policy(device.index if device.index is not None else torch.cuda.current_device())
    return CPU_POLICY


def chunk_stats(block: torch.Tensor, row_max: torch.Tensor, smoothing: bool) -> torch.Tensor:
    """[2, rows]: sum of exp(logit - max) and (smoothing) the sum of logit - max,
    in fp32 whatever the block's dtype (compiled: one pass over the block)."""
    shifted = block.float() - row_max.unsqueeze(-1)
    sums = shifted.sum(-1) if smoothing else torch.zeros_like(row_max)
    return torch.stack([shifted.exp().sum(-1), sums])


def chunk_grad(logits: torch.Tensor, log_norm: torch.Tensor, local_t: torch.Tensor, in_block: torch.Tensor,
               grad_loss: torch.Tensor, smoothing: float, vocab_size: int) -> torch.Tensor:
    """The gradient of a chunk in the logits' dtype: (softmax - smoothed
    one-hot) x the rows' upstream gradient; the one-hot as a comparison of
    column indices, so a compiler fuses it all into one elementwise pass."""
    g = (logits.float() - log_norm.unsqueeze(-1)).exp() - smoothing / vocab_size
    cols = torch.arange(logits.shape[-1], device=logits.device)
    hit = (cols == local_t.unsqueeze(-1)) & in_block.unsqueeze(-1)
    g = g - torch.where(hit, 1.0 - smoothing, 0.0)
    return (g * grad_loss.unsqueeze(-1)).to(logits.dtype)


@functools.lru_cache(maxsize=None)
def _compiled(fn, backend: str):
    # fullgraph: these are straight-line tensor math; a break would be a bug, not a slow path.
    return torch.compile(fn, backend=backend, fullgraph=True, dynamic=None)


# Backends that failed to compile a chunk in this process: the same math runs eagerly.
_FAILED: set = set()


def _backend() -> str:
    # train.compile's test hook (training/compile.py) names the backend here too.
    return os.environ.get("TPCTL_COMPILE_BACKEND", "inductor")


def _walk(policy: ChunkPolicy, rows: int, width: int):
    """The chunks a block is computed in: one where each is a compiled
    kernel (no temporary to bound), else the policy's."""
    if policy.fused and policy.compiled and _backend() not in _FAILED:
        return [slice(0, rows)]
    return policy.rows(rows, width)


def _call(policy: ChunkPolicy, fn, *args):
    backend = _backend()
    if policy.compiled and backend not in _FAILED:
        try:
            return _compiled(fn, backend)(*args)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # a compiler that cannot build it here: slower, not wrong
            _FAILED.add(backend)
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            warning(f"the loss's fused chunks did not compile ({type(e).__name__}: {first[:200]}); "
                    "they run eagerly (the same math, slower)")
    return fn(*args)


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, vocab_size, group, smoothing, policy):
        rows, width = logits.shape
        # Columns of this block inside the real vocabulary (the rest: padding).
        real = max(0, min(width, vocab_size - vocab_start))
        block = logits if real == width else logits[:, :real]
        if real > 0:
            row_max = block.amax(dim=-1).float()
        else:  # a block of padding only: contributes nothing
            row_max = torch.full((rows,), float("-inf"), device=logits.device)
        comm.all_reduce(row_max, group, op=dist.ReduceOp.MAX)
        local_t = targets - vocab_start
        in_block = (local_t >= 0) & (local_t < real)
        local_t = local_t.clamp(0, max(real, 1) - 1)  # an index inside the real columns
        stats = torch.zeros(3, rows, device=logits.device)  # sum exp, target logit, logit sum
        target = logits.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).float() - row_max
        stats[1] = torch.where(in_block, target, 0.0)
        for r in _walk(policy, rows, real) if real > 0 else ():
            if policy.fused:
                stats[0::2, r] = _call(policy, chunk_stats, block[r], row_max[r], bool(smoothing))
                continue
            shifted = block[r] - row_max[r].unsqueeze(-1)  # promotes to fp32: one chunk
            if smoothing:
                stats[2, r] = shifted.sum(-1)
            stats[0, r] = shifted.exp_().sum(-1)
            del shifted  # before the next chunk is made
        comm.all_reduce(stats, group)
        sum_exp, target_logit, sum_logits = stats
        log_z = sum_exp.log()
        loss = (1 - smoothing) * (log_z - target_logit) + smoothing * (log_z - sum_logits / vocab_size)
        # log Z relative to the true row max: the backward's softmax is exp(logit - max - log Z).
        ctx.save_for_backward(logits, row_max + log_z, local_t, in_block)
        ctx.smoothing, ctx.vocab_size, ctx.real, ctx.policy = smoothing, vocab_size, real, policy
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, log_norm, local_t, in_block = ctx.saved_tensors
        smoothing, real, policy = ctx.smoothing, ctx.real, ctx.policy
        rows, width = logits.shape
        chunks = list(_walk(policy, rows, real)) if real > 0 else []
        if policy.fused and real == width and len(chunks) == 1:  # one kernel makes the whole gradient
            return (_call(policy, chunk_grad, logits, log_norm, local_t, in_block, grad_loss, float(smoothing),
                          ctx.vocab_size), None, None, None, None, None, None)
        grad = torch.empty_like(logits)
        if real < width:
            grad[:, real:] = 0  # padding columns: no probability, no gradient
        block = grad if real == width else grad[:, :real]
        in_place = grad.dtype == torch.float32  # else each chunk is computed in fp32, then cast
        for r in chunks:
            if policy.fused:
                block[r] = _call(policy, chunk_grad, logits[r, :real], log_norm[r], local_t[r], in_block[r],
                                 grad_loss[r], float(smoothing), ctx.vocab_size)
                continue
            out = block[r] if in_place else None
            g = torch.sub(logits[r, :real], log_norm[r].unsqueeze(-1), out=out).exp_()  # the softmax
            if smoothing:
                g -= smoothing / ctx.vocab_size
            g.scatter_add_(-1, local_t[r].unsqueeze(-1), (-(1 - smoothing) * in_block[r].float()).unsqueeze(-1))
            g *= grad_loss[r].unsqueeze(-1)
            if not in_place:
                block[r] = g
            del g
        return grad, None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                                 vocab_size: int, group: Optional[dist.ProcessGroup],
                                 label_smoothing: float = 0.0, policy: Optional[ChunkPolicy] = None) -> torch.Tensor:
    """Per-row loss for `logits` [N, width] holding columns
    [vocab_start, vocab_start + width) of a vocabulary of `vocab_size` real
    entries (columns past it are padding), the other columns living on the
    ranks of `group`. `policy`: how the logits are walked (None: the
    device's, `policy_for`)."""
    policy = policy or policy_for(logits.device)
    return _VocabParallelCE.apply(logits, targets, vocab_start, vocab_size, group, label_smoothing, policy)
