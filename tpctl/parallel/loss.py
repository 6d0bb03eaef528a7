"""Vocab-parallel cross entropy: each rank holds a block of the vocabulary's
logits for its rows. Three numbers per row cross the wire (max, and the
stacked sum-exp / target logit / logit sum); the backward is local.

No waste, as F.cross_entropy: the logits block is read in row chunks of at
most CHUNK_ELEMENTS, so the only fp32 temporaries are one chunk wide (never
an fp32 copy of the whole block, whatever the logits' dtype); the backward
recomputes each chunk's probabilities from the logits it keeps (the logits
are saved, not a probabilities block beside them). Padding columns of a
padded vocabulary are a suffix of the last block: they are sliced off, never
masked, and a block without padding is used as it is.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from . import comm

# Elements of the largest fp32 temporary (one chunk of rows): 4M = 16 MiB.
CHUNK_ELEMENTS = 1 << 22


def _row_chunks(rows: int, width: int):
    step = max(1, CHUNK_ELEMENTS // max(1, width))
    for start in range(0, rows, step):
        yield slice(start, min(rows, start + step))


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, vocab_size, group, smoothing):
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
        for r in _row_chunks(rows, real) if real > 0 else ():
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
        ctx.smoothing, ctx.vocab_size, ctx.real = smoothing, vocab_size, real
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, log_norm, local_t, in_block = ctx.saved_tensors
        smoothing, real = ctx.smoothing, ctx.real
        rows, width = logits.shape
        grad = torch.empty_like(logits)
        if real < width:
            grad[:, real:] = 0  # padding columns: no probability, no gradient
        block = grad if real == width else grad[:, :real]
        in_place = grad.dtype == torch.float32  # else each chunk is computed in fp32, then cast
        for r in _row_chunks(rows, real) if real > 0 else ():
            out = block[r] if in_place else None
            g = torch.sub(logits[r, :real], log_norm[r].unsqueeze(-1), out=out).exp_()  # the softmax
            if smoothing:
                g -= smoothing / ctx.vocab_size
            g.scatter_add_(-1, local_t[r].unsqueeze(-1), (-(1 - smoothing) * in_block[r].float()).unsqueeze(-1))
            g *= grad_loss[r].unsqueeze(-1)
            if not in_place:
                block[r] = g
            del g
        return grad, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                                 vocab_size: int, group: Optional[dist.ProcessGroup],
                                 label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-row loss for `logits` [N, width] holding columns
    [vocab_start, vocab_start + width) of a vocabulary of `vocab_size` real
    entries (columns past it are padding), the other columns living on the
    ranks of `group`."""
    return _VocabParallelCE.apply(logits, targets, vocab_start, vocab_size, group, label_smoothing)
