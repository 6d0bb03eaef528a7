"""The vocab-parallel cross entropy on one rank (parallel/loss.py): exact
against F.cross_entropy with and without padding columns, label smoothing,
row chunks and bf16 logits; and no waste: no fp32 copy of the logits block.
(Every mode's split over ranks: tests/test_layers.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tpctl.parallel import loss as loss_mod
from tpctl.parallel.loss import vocab_parallel_cross_entropy

TOL = dict(rtol=1e-5, atol=1e-6)


def _case(rows=24, vocab=50, pad=0, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(rows, vocab + pad, generator=g)).to(dtype)
    if pad:  # what a padded LM head would put there: anything, it must not count
        logits[:, vocab:] = 100.0
    targets = torch.randint(0, vocab, (rows,), generator=g)
    return logits, targets


@pytest.mark.parametrize("pad", [0, 6])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("chunk", [None, 7 * 56])  # default, and a few rows per chunk (a ragged last one)
def test_matches_torch(monkeypatch, pad, smoothing, chunk):
    if chunk:
        monkeypatch.setattr(loss_mod, "CHUNK_ELEMENTS", chunk)
    vocab = 50
    logits, targets = _case(vocab=vocab, pad=pad)
    ours_in = logits.clone().requires_grad_()
    ref_in = logits[:, :vocab].clone().requires_grad_()
    weights = torch.rand(len(targets), generator=torch.Generator().manual_seed(3))
    ours = vocab_parallel_cross_entropy(ours_in, targets, 0, vocab, None, smoothing)
    ref = F.cross_entropy(ref_in, targets, reduction="none", label_smoothing=smoothing)
    torch.testing.assert_close(ours, ref, **TOL)
    (ours * weights).sum().backward()
    (ref * weights).sum().backward()
    torch.testing.assert_close(ours_in.grad[:, :vocab], ref_in.grad, **TOL)
    if pad:
        assert torch.equal(ours_in.grad[:, vocab:], torch.zeros(len(targets), pad))


def test_bf16_logits_keep_their_dtype_and_compute_in_fp32():
    logits, targets = _case(dtype=torch.bfloat16)
    ours_in = logits.clone().requires_grad_()
    ref_in = logits.float().clone().requires_grad_()
    ours = vocab_parallel_cross_entropy(ours_in, targets, 0, 50, None)
    ref = F.cross_entropy(ref_in, targets, reduction="none")
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref, **TOL)
    ours.sum().backward()
    ref.sum().backward()
    assert ours_in.grad.dtype == torch.bfloat16
    torch.testing.assert_close(ours_in.grad, ref_in.grad.to(torch.bfloat16))


def test_a_block_of_padding_only_has_no_gradient():
    """A rank whose block lies past the real vocabulary (vocab_start + width
    beyond it): it adds nothing to the sums, and gets a zero gradient."""
    logits, targets = _case(vocab=10)
    x = logits.clone().requires_grad_()
    vocab_parallel_cross_entropy(x, targets, 60, 50, None).sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))


def _peak_bytes(fn) -> int:
    from tpctl.cost.measure import peak_allocated_bytes

    return peak_allocated_bytes(fn)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_fp32_copy_of_the_logits_block(monkeypatch, dtype):
    """The forward's temporaries are one row chunk wide; the backward adds the
    gradient block (which autograd needs) and one chunk. The previous version
    held four fp32 blocks at once (8x the block in bf16)."""
    monkeypatch.setattr(loss_mod, "CHUNK_ELEMENTS", 64 * 1000, raising=False)
    logits, targets = _case(rows=1024, vocab=1000, dtype=dtype)
    logits.requires_grad_()
    block = logits.numel() * logits.element_size()
    chunk_fp32 = 64 * 1000 * 4
    holder = {}

    def forward():
        holder["loss"] = vocab_parallel_cross_entropy(logits, targets, 0, 1000, None)

    forward_peak = _peak_bytes(forward)
    backward_peak = _peak_bytes(lambda: holder.pop("loss").sum().backward())
    slack = 2 * chunk_fp32 + 2**16  # two chunk-wide temporaries (a bf16 chunk is upcast on the way)
    assert forward_peak < slack, (forward_peak, block)
    assert backward_peak < block + slack, (backward_peak, block)
