"""Vocab-parallel cross entropy: each rank holds a block of the vocabulary's
logits for its rows. Three numbers per row cross the wire (max, and the
stacked sum-exp / target logit / logit sum); the backward is local."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .. import comm


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, vocab_size, group, smoothing):
        width = logits.shape[-1]
        cols = torch.arange(vocab_start, vocab_start + width, device=logits.device)
        valid = cols < vocab_size  # padding columns of a padded vocabulary
        logits = logits.float().masked_fill(~valid, float("-inf"))
        row_max = logits.max(dim=-1).values
        comm.all_reduce(row_max, group, op=dist.ReduceOp.MAX)
        shifted = logits - row_max.unsqueeze(-1)
        exp = shifted.exp()
        local_t = targets - vocab_start
        in_block = (local_t >= 0) & (local_t < width)
        local_t = local_t.clamp(0, width - 1)
        target_logit = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1) * in_block
        stats = torch.stack([exp.sum(-1), target_logit, shifted.masked_fill(~valid, 0.0).sum(-1)])
        comm.all_reduce(stats, group)
        sum_exp, target_logit, sum_logits = stats
        log_z = sum_exp.log()
        loss = (1 - smoothing) * (log_z - target_logit) + smoothing * (log_z - sum_logits / vocab_size)
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local_t, in_block, valid)
        ctx.smoothing, ctx.vocab_size = smoothing, vocab_size
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        probs, local_t, in_block, valid = ctx.saved_tensors
        grad = probs.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_t] -= (1 - ctx.smoothing) * in_block.to(grad.dtype)
        if ctx.smoothing:
            grad -= (ctx.smoothing / ctx.vocab_size) * valid.to(grad.dtype)
        return grad * grad_loss.unsqueeze(-1), None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                                 vocab_size: int, group: Optional[dist.ProcessGroup],
                                 label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-row loss for `logits` [N, width] holding columns
    [vocab_start, vocab_start + width) of a vocabulary of `vocab_size` real
    entries (columns past it are padding), the other columns living on the
    ranks of `group`."""
    return _VocabParallelCE.apply(logits, targets, vocab_start, vocab_size, group, label_smoothing)
