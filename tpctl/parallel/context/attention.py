"""Causal attention over a sequence split across the cp ranks, exact to
fp32 round-off in the forward and the backward (docs/DESIGN.md, "Context
parallelism").

Ring (`RingAttention`): each rank keeps its queries and passes its key and
value block around the ring of cp ranks; each block's scores are merged
into the running output by their log-sum-exp (the online softmax), so no
rank ever holds the whole sequence's scores. A rank holds two zigzag chunks
of 2·cp (`zigzag_chunks`), so every rank does the same causal work; a pair
of chunks a query chunk cannot see is skipped. The backward recomputes each
block's probabilities from the saved log-sum-exp and passes the key and
value blocks around again with their gradient accumulators, which arrive
home after the last step.

Ulysses (`ulysses_attention`): an all-to-all turns the sequence split into a
head split (each rank then holds whole sequences of heads/cp heads), torch's
attention runs there, and the inverse all-to-all turns it back; the two are
each other's adjoint in the backward.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tpctl.parallel import comm


def zigzag_chunks(index: int, cp: int) -> tuple[int, int]:
    """The two chunks of 2·cp that ring rank `index` holds: one from the
    front, its mirror from the back (causal work balanced)."""
    return index, 2 * cp - 1 - index


def _visible(mine: tuple[int, ...], theirs: tuple[int, ...]):
    """(query chunk, key chunk, diagonal) of every pair a query sees: keys
    of earlier chunks whole, of its own chunk causally, later ones not."""
    for i, a in enumerate(mine):
        for j, b in enumerate(theirs):
            if b <= a:
                yield i, j, a == b


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, diagonal: bool) -> torch.Tensor:
    s = (q @ k.transpose(-2, -1)) * scale
    if diagonal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


# On a CPU, torch's flash kernel gives a block's output with its log-sum-exp,
# and its backward takes the merged output and log-sum-exp (so each block's
# gradients are its exact share): no block of scores is ever held whole.
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _flash(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and _FLASH is not None and t.dtype in (torch.float32, torch.float64, torch.bfloat16)


def _block(q, k, v, scale: float, diagonal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention output and log-sum-exp per query."""
    if _flash(q):
        out, lse = _FLASH(q, k, v, 0.0, diagonal, scale=scale)
        return out, lse
    s = _scores(q, k, scale, diagonal)
    lse = s.logsumexp(-1)
    return torch.exp(s - lse[..., None]) @ v, lse


def _block_grads(do, q, k, v, out, lse, delta, scale: float, diagonal: bool):
    """One block's share of dq, dk, dv, given the merged output and
    log-sum-exp of its queries (`delta`: rowsum(do * out))."""
    if _flash(q):
        return _FLASH_BACKWARD(do, q, k, v, out, lse, 0.0, diagonal, scale=scale)
    p = torch.exp(_scores(q, k, scale, diagonal) - lse[..., None])
    ds = p * (do @ v.transpose(-2, -1) - delta[..., None])
    return (ds @ k) * scale, (ds.transpose(-2, -1) @ q) * scale, p.transpose(-2, -1) @ do


# A pair of chunks may be masked beyond causality: by its queries' and keys'
# documents (data.documents, docs/DESIGN.md "Documents") and by the family's
# sliding window (a query sees the `window` positions up to itself, counted
# in global positions: the window transformers masks on the whole sequence).
# A query may see no key of a block; its block log-sum-exp is then -inf and
# its block output 0, and the merge must not form -inf - (-inf): `_safe`
# reads an infinite log-sum-exp as 0 where it is subtracted. Every query
# sees itself, so its merged log-sum-exp is finite and the backward's
# probabilities are exact.


def _safe(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _band(a: int, b: int, chunk: int, window: int, device) -> torch.Tensor:
    """[chunk, chunk] bool: which keys of chunk b each query of chunk a sees
    through a sliding `window` (0 <= query - key < window)."""
    at = torch.arange(chunk, device=device)
    gap = (a - b) * chunk + at[:, None] - at[None, :]
    return (gap >= 0) & (gap < window)


def _pair_mask(doc: torch.Tensor, a: int, b: int, chunk: int, diagonal: bool) -> torch.Tensor:
    """[rows, 1, chunk, chunk] bool: which keys of chunk b each query of
    chunk a sees (same document; causal on the diagonal)."""
    qd, kd = doc[:, a * chunk:(a + 1) * chunk], doc[:, b * chunk:(b + 1) * chunk]
    seen = qd[:, :, None] == kd[:, None, :]
    if diagonal:
        seen = seen & torch.ones(chunk, chunk, dtype=torch.bool, device=doc.device).tril()
    return seen[:, None]


def _chunks_seen(doc: torch.Tensor, chunk: int) -> list[list[bool]]:
    """[a][b]: some query of chunk a sees a key of an earlier chunk b. A
    row's document ids never decrease along it, so that is the case exactly
    when a row's first id in a equals its last id in b: one look at the host
    per forward, not one per pair of chunks (a sync each on a GPU)."""
    first, last = doc[:, ::chunk], doc[:, chunk - 1::chunk]
    return (first[:, :, None] == last[:, None, :]).any(0).tolist()


class Masks:
    """What masks a ring's pairs of chunks beyond causality: `doc`, the
    whole rows' document ids [rows, T] (data.documents), and a sliding
    `window`; either may be None."""

    def __init__(self, doc: torch.Tensor | None, window: int | None, chunk: int):
        self.doc, self.window, self.chunk = doc, window, chunk
        self.seen = _chunks_seen(doc, chunk) if doc is not None else None

    def pairs(self, mine: tuple[int, ...], theirs: tuple[int, ...], device):
        """_visible's pairs as (i, j, diagonal, mask): less the pairs no
        query of which sees any key (a chunk of other documents, or wholly
        beyond the window, is skipped as causality's are); `mask` None where
        only causality masks the pair (torch's kernel computes it), else
        [rows or 1, 1, chunk, chunk] bool."""
        chunk, window = self.chunk, self.window
        for i, j, diagonal in _visible(mine, theirs):
            a, b = mine[i], theirs[j]
            if self.doc is not None and not diagonal and not self.seen[a][b]:
                continue
            band = None
            if window is not None:
                nearest = 0 if diagonal else (a - b - 1) * chunk + 1  # the pair's closest query and key
                if nearest >= window:
                    continue
                if (a - b + 1) * chunk - 1 >= window:  # its farthest pair of positions is beyond the window
                    band = _band(a, b, chunk, window, device)[None, None]
            if self.doc is not None:
                mask = _pair_mask(self.doc, a, b, chunk, diagonal)
                yield i, j, diagonal, mask if band is None else mask & band
            else:
                yield i, j, diagonal, band


def _masked_block(q, k, v, scale: float, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = ((q @ k.transpose(-2, -1)) * scale).masked_fill(~mask, float("-inf"))
    lse = s.logsumexp(-1)
    return torch.exp(s - _safe(lse)[..., None]) @ v, lse


def _masked_block_grads(do, q, k, v, lse, delta, scale: float, mask: torch.Tensor):
    s = ((q @ k.transpose(-2, -1)) * scale).masked_fill(~mask, float("-inf"))
    p = torch.exp(s - lse[..., None])
    ds = p * (do @ v.transpose(-2, -1) - delta[..., None])
    return (ds @ k) * scale, (ds.transpose(-2, -1) @ q) * scale, p.transpose(-2, -1) @ do


class RingAttention(torch.autograd.Function):
    """q, k, v: [batch, heads, 2 chunks, head_dim] of this rank's zigzag
    chunks; `ranks`: the cp group's global ranks in ring order; `doc`: the
    whole rows' document ids [batch, 2·cp chunks] (data.documents), or None;
    `window`: the family's sliding window in positions, or None."""

    @staticmethod
    def forward(ctx, q, k, v, group, ranks, index, scale, doc=None, window=None):
        cp = len(ranks)
        qs = q.chunk(2, dim=2)
        # Merged in fp32 whatever the inputs (bf16 under autocast): the
        # rescaling of earlier blocks would round each time.
        out = [torch.zeros(c.shape, dtype=torch.float32, device=c.device) for c in qs]
        lse = [torch.full(c.shape[:-1], float("-inf"), dtype=torch.float32, device=c.device) for c in qs]
        kv = torch.stack([k, v])
        masks = Masks(doc, window, qs[0].shape[2])
        for step in range(cp):
            if step < cp - 1:  # the next block travels while this one is computed
                nxt, works = comm.ring_pass(kv, group, ranks)
            ks, vs = kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2)
            mine, theirs = zigzag_chunks(index, cp), zigzag_chunks((index - step) % cp, cp)
            for i, j, diagonal, mask in masks.pairs(mine, theirs, q.device):
                if mask is None:
                    block_out, block_lse = _block(qs[i], ks[j], vs[j], scale, diagonal)
                else:
                    block_out, block_lse = _masked_block(qs[i], ks[j], vs[j], scale, mask)
                merged = torch.logaddexp(lse[i], block_lse)
                at = merged if mask is None else _safe(merged)
                out[i] = out[i] * torch.exp(lse[i] - at)[..., None] + block_out * torch.exp(block_lse - at)[..., None]
                lse[i] = merged
            if step < cp - 1:
                for w in works:
                    w.wait()
                kv = nxt
        out, lse = _positions_major(out, q.dtype), torch.cat(lse, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.ranks, ctx.index, ctx.scale, ctx.masks = group, ranks, index, scale, masks
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        cp, scale, index = len(ctx.ranks), ctx.scale, ctx.index
        grad = grad.contiguous()
        qs, dos, outs = q.chunk(2, dim=2), grad.chunk(2, dim=2), out.chunk(2, dim=2)
        lses = lse.chunk(2, dim=2)
        # rowsum(dO * O): the softmax backward's correction, per query.
        deltas = (grad * out).sum(-1).chunk(2, dim=2)
        dq = torch.zeros_like(q)
        dqs = dq.chunk(2, dim=2)
        kv = torch.stack([k, v])
        dkv = torch.zeros_like(kv)
        for step in range(cp):
            if step < cp - 1:
                nxt, works = comm.ring_pass(kv, ctx.group, ctx.ranks)
            ks, vs = kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2)
            dks, dvs = dkv[0].chunk(2, dim=2), dkv[1].chunk(2, dim=2)
            mine, theirs = zigzag_chunks(index, cp), zigzag_chunks((index - step) % cp, cp)
            for i, j, diagonal, mask in ctx.masks.pairs(mine, theirs, q.device):
                if mask is None:
                    dq_, dk_, dv_ = _block_grads(dos[i], qs[i], ks[j], vs[j], outs[i], lses[i], deltas[i], scale,
                                                 diagonal)
                else:
                    dq_, dk_, dv_ = _masked_block_grads(dos[i], qs[i], ks[j], vs[j], lses[i], deltas[i], scale, mask)
                dqs[i].add_(dq_)
                dks[j].add_(dk_)
                dvs[j].add_(dv_)
            # The accumulators follow their block; after the last step they
            # are back with the block's owner.
            got, dworks = comm.ring_pass(dkv, ctx.group, ctx.ranks)
            for w in dworks + (works if step < cp - 1 else []):
                w.wait()
            dkv = got
            if step < cp - 1:
                kv = nxt
        return dq, dkv[0], dkv[1], None, None, None, None, None, None


def _positions_major(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """[batch, heads, positions, head_dim] laid out position-major, as
    torch's attention returns it: the model's `transpose(1, 2)` and reshape
    then reuse this storage, where a head-major output was copied, one more
    output per layer held until the backward (measured: benchmarks/cp_memory.py)."""
    b, h, _, d = parts[0].shape
    out = torch.empty(b, sum(p.shape[2] for p in parts), h, d, dtype=dtype, device=parts[0].device).transpose(1, 2)
    torch.cat(parts, dim=2, out=out)
    return out


def ring_attention(q, k, v, group, ranks: list[int], index: int, scale: float | None = None,
                   doc: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return RingAttention.apply(q, k, v, group, ranks, index, scale, doc, window)


def _seq_to_heads(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """[B, H, L, D] (this rank's L positions of every head) -> [B, H/cp,
    cp·L, D] (every position of this rank's heads, in cp-rank order)."""
    b, h, n, d = x.shape
    got = comm.all_to_all(x.reshape(b, cp, h // cp, n, d).transpose(0, 1), group)
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * n, d)


def _heads_to_seq(y: torch.Tensor, group, cp: int) -> torch.Tensor:
    """The inverse of `_seq_to_heads`."""
    b, h, t, d = y.shape
    got = comm.all_to_all(y.reshape(b, h, cp, t // cp, d).permute(2, 0, 1, 3, 4), group)
    # Position-major, as `_positions_major` (the one copy it needs made into that layout).
    out = torch.empty(b, t // cp, cp, h, d, dtype=got.dtype, device=got.device)
    out.copy_(got.permute(1, 3, 0, 2, 4))
    return out.view(b, t // cp, cp * h, d).transpose(1, 2)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, cp):
        ctx.group, ctx.cp = group, cp
        return _seq_to_heads(x, group, cp)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad.contiguous(), ctx.group, ctx.cp), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group, cp):
        ctx.group, ctx.cp = group, cp
        return _heads_to_seq(y, group, cp)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad.contiguous(), ctx.group, ctx.cp), None, None


def ulysses_attention(q, k, v, group, cp: int, scale: float | None = None, doc: torch.Tensor | None = None,
                      window: int | None = None) -> torch.Tensor:
    """q, k, v: [batch, heads, L, head_dim] of this rank's contiguous L
    positions; heads divisible by cp (checked before start). `doc`: the
    whole rows' document ids (data.documents), or None; `window`: the
    family's sliding window, or None."""
    q, k, v = (_SeqToHeads.apply(t, group, cp) for t in (q, k, v))
    if doc is None and window is None:
        return _HeadsToSeq.apply(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale), group, cp)
    # Whole sequences in global order (rank r held the r-th run): one process's mask.
    t = torch.arange(q.shape[2], device=q.device)
    gap = t[:, None] - t[None, :]
    seen = (gap >= 0) if window is None else (gap >= 0) & (gap < window)
    if doc is not None:
        seen = seen & (doc[:, :, None] == doc[:, None, :])
    seen = seen[None, None] if seen.dim() == 2 else seen[:, None]
    return _HeadsToSeq.apply(F.scaled_dot_product_attention(q, k, v, attn_mask=seen, scale=scale), group, cp)


def gathered_attention(q, k, v, dropout, group, held: torch.Tensor, mine: torch.Tensor,
                       doc: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention with dropout on the probabilities (tpctl's GPT,
    models.gpt.dropped_attention), over a sequence split across the cp
    ranks: every rank gathers the whole sequence's keys and values and
    scores its own queries against them, so its probabilities are rows of
    the matrix one process computes, and `dropout` (drawing the whole
    matrix's mask by global position, context.ContextDropout) drops exactly
    the elements one process drops. It holds [L, cp·L] scores per head, as
    the one-process path holds [cp·L, cp·L]; ring and Ulysses cannot be
    used, their blocks' probabilities are never the final ones.
    `held`: the global position of every gathered row (the ranks' positions
    in rank order); `mine`: this rank's query positions; `doc`: the whole
    rows' document ids (data.documents), or None."""
    kv = comm.gather_along(torch.stack((k, v)), group, dim=3)[:, :, :, torch.argsort(held)]
    k, v = kv[0], kv[1]
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    seen = mine[:, None] >= torch.arange(k.shape[-2], device=q.device)[None, :]
    if doc is not None:
        seen = (seen & (doc[:, mine][:, :, None] == doc[:, None, :]))[:, None]
    return dropout(scores.masked_fill(~seen, float("-inf")).softmax(dim=-1)) @ v
