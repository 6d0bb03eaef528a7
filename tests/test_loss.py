"""The vocab-parallel cross entropy on one rank (parallel/tensor/loss.py): exact
against F.cross_entropy with and without padding columns, label smoothing,
row chunks and bf16 logits; and no waste: no fp32 copy of the logits block.
(Every mode's split over ranks: tests/test_layers.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tpctl.parallel.tensor import loss as loss_mod
from tpctl.parallel.tensor.loss import ChunkPolicy, vocab_parallel_cross_entropy

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
@pytest.mark.parametrize("fused", [False, True])  # the CPU's kernels, the CUDA policy's (run eagerly)
def test_matches_torch(monkeypatch, pad, smoothing, chunk, fused):
    if chunk:
        monkeypatch.setattr(loss_mod, "CHUNK_ELEMENTS", chunk)
    vocab = 50
    logits, targets = _case(vocab=vocab, pad=pad)
    ours_in = logits.clone().requires_grad_()
    ref_in = logits[:, :vocab].clone().requires_grad_()
    weights = torch.rand(len(targets), generator=torch.Generator().manual_seed(3))
    ours = vocab_parallel_cross_entropy(ours_in, targets, 0, vocab, None, smoothing, ChunkPolicy(fused=fused))
    ref = F.cross_entropy(ref_in, targets, reduction="none", label_smoothing=smoothing)
    torch.testing.assert_close(ours, ref, **TOL)
    (ours * weights).sum().backward()
    (ref * weights).sum().backward()
    torch.testing.assert_close(ours_in.grad[:, :vocab], ref_in.grad, **TOL)
    if pad:
        assert torch.equal(ours_in.grad[:, vocab:], torch.zeros(len(targets), pad))


@pytest.mark.parametrize("fused", [False, True])
def test_bf16_logits_keep_their_dtype_and_compute_in_fp32(fused):
    logits, targets = _case(dtype=torch.bfloat16)
    ours_in = logits.clone().requires_grad_()
    ref_in = logits.float().clone().requires_grad_()
    ours = vocab_parallel_cross_entropy(ours_in, targets, 0, 50, None, 0.0, ChunkPolicy(7 * 50, fused=fused))
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


def test_the_cuda_policy_sizes_chunks_for_the_device():
    """An 80 GB GPU: 1 GiB of fp32 per chunk (gpt-small's 16384 x 50257
    logits in 4 chunks, not the CPU's ~200); a small one never below the CPU's."""
    assert loss_mod.cuda_policy(80 * 2**30).elements == loss_mod.CUDA_CHUNK_MAX == 1 << 28
    assert loss_mod.cuda_policy(2**30).elements == loss_mod.CHUNK_ELEMENTS
    assert loss_mod.policy_for(torch.device("cpu")) == loss_mod.CPU_POLICY
    chunks = list(loss_mod.cuda_policy(80 * 2**30).rows(16384, 50257))
    assert len(chunks) == 4 and chunks[-1].stop == 16384
    assert all(c.start * 50257 * 2 % 16 == 0 for c in chunks), "bf16 chunks 16-byte aligned (inductor copies others)"


def test_a_compiler_that_fails_leaves_the_fused_chunks_eager(monkeypatch, capsys):
    monkeypatch.setenv("TPCTL_COMPILE_BACKEND", "no-such-backend")
    monkeypatch.setattr(loss_mod, "_FAILED", set())
    logits, targets = _case()
    got = vocab_parallel_cross_entropy(logits, targets, 0, 50, None, 0.0, ChunkPolicy(fused=True, compiled=True))
    torch.testing.assert_close(got, F.cross_entropy(logits, targets, reduction="none"), **TOL)
    assert "did not compile" in capsys.readouterr().err


@pytest.mark.parametrize("pad", [0, 6])  # the whole gradient from one kernel; the real columns' block
def test_the_fused_chunks_compile_without_a_graph_break(monkeypatch, pad):
    """The compiled policy's functions as torch.compile sees them (fullgraph:
    a graph break raises), through dynamo only (backend eager: no code is
    generated on a CPU), against the eager functions in chunks of 10 rows."""
    monkeypatch.setenv("TPCTL_COMPILE_BACKEND", "eager")
    logits, targets = _case(rows=24, vocab=50, pad=pad)
    weights = torch.rand(24, generator=torch.Generator().manual_seed(3))
    got, want = [], []
    for policy, out in ((ChunkPolicy(10 * 56, fused=True, compiled=True), got), (ChunkPolicy(10 * 56, fused=True), want)):
        x = logits.clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(x, targets, 0, 50, None, 0.1, policy)
        (loss * weights).sum().backward()
        out += [loss, x.grad]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
