"""Communication beside compute (train.overlap) changes no bit, and the
collective wrappers copy nothing: every tensor parallel/comm.py allocates
in a training step is a collective's own output buffer."""

from __future__ import annotations

import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import build, build_trainer, layouts, tiny_config

OVERLAP_LAYOUTS = layouts("1d-4", "1d-4-sp", "2d-4", "2.5d-8-d2", "3d-8")


def _curve_and_weights(layout, overlap: bool, steps: int = 3):
    cfg = tiny_config(steps, mode=layout.mode, size=layout.size, depth=layout.depth, dp=layout.dp,
                      seq_parallel=layout.seq_parallel, **{"train.overlap": overlap, "train.verify_rewrite": False})
    trainer = build_trainer(cfg, layout)
    losses = [r["loss"] for r in trainer.fit()]
    return losses, [p.detach().clone() for p in trainer.model.parameters()]


def _overlap_equals_blocking(layout) -> bool:
    on, on_weights = _curve_and_weights(layout, True)
    off, off_weights = _curve_and_weights(layout, False)
    assert on[-1] < on[0], on
    return on == off and all(torch.equal(a, b) for a, b in zip(on_weights, off_weights))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", OVERLAP_LAYOUTS.values(), ids=list(OVERLAP_LAYOUTS))
def test_overlap_is_bitwise_the_blocking_path(pool, layout):
    assert all(pool.run(_overlap_equals_blocking, layout))


def _issued_ahead(layout) -> tuple[int, int]:
    """What train.overlap issues ahead in a step's second forward and
    backward, and how much of it could be: 2.5d, the depth sums in flight
    when the backward ends (of the weights summed over depth alone); 3d, the
    linears whose weight gather the previous linear issued (of all but the
    first)."""
    from tpctl.parallel.shard import spec_of

    cfg = tiny_config(2, mode=layout.mode, size=layout.size, depth=layout.depth, **{"train.verify_rewrite": False})
    run = build(cfg, layout)
    ids = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(0))
    batch = [(run.par.shard_batch(ids[:, :-1]), run.par.shard_targets(ids[:, 1:]))]
    mode = run.par.mode
    for step in range(2):
        loss = run.step.forward_backward(batch, step)
        if layout.mode == "2.5d":
            depth = [p for p in run.model.parameters() if mode.sums_during_backward(spec_of(p))]
            got = (len(mode.depth_sums.pending), len(depth))
        else:
            got = (mode.prefetch.used, sum(1 for m in run.model.modules() if type(m).__name__ == "Linear3D") - 1)
            mode.prefetch.used = 0
        run.step.finish(loss, step)
    return got


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", layouts("2.5d-8-d2", "3d-8").values(), ids=["2.5d", "3d"])
def test_overlap_issues_ahead(pool, layout):
    for issued, could in pool.run(_issued_ahead, layout):
        assert issued == could > 0


class _CommAllocations(TorchDispatchMode):
    """Bytes of every tensor allocated by an operation whose nearest tpctl
    caller is parallel/comm.py (an output sharing no storage with an input)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _caller_is_comm():
            inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
            self.bytes += sum(t.untyped_storage().nbytes() for t in _tensors(out)
                              if t.untyped_storage().data_ptr() not in inputs)
        return out


def _tensors(tree):
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _caller_is_comm() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename.replace("\\", "/")
        if "/tpctl/" in name and not name.endswith("/tests/test_overlap.py"):
            return name.endswith("/tpctl/parallel/comm.py")
        frame = frame.f_back
    return False


def _wrapper_bytes(layout) -> tuple[int, int]:
    """What comm.py allocates in one forward and backward of 1d, and what
    the collectives need: an all-reduce nothing (in place), an all-gather
    and a reduce-scatter their outputs and, along the sequence of [batch,
    seq, hidden] activations (1d+SP), their inputs' blocks laid out in rank
    order (an all-gather's input, a reduce-scatter's)."""
    from tpctl.parallel import comm

    cfg = tiny_config(1, mode="1d", size=layout.size, dp=layout.dp, seq_parallel=layout.seq_parallel,
                      **{"train.verify_rewrite": False})
    run = build(cfg, layout)
    ids = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(0))
    batch = [(run.par.shard_batch(ids[:, :-1]), run.par.shard_targets(ids[:, 1:]))]
    comm.STATS.reset()
    with _CommAllocations() as counted:
        run.step.forward_backward(batch, 0)
    gathered, scattered = comm.STATS.bytes["all_gather"], comm.STATS.bytes["reduce_scatter"]
    needed = gathered + scattered // layout.size + gathered // layout.size + scattered
    return counted.bytes, needed


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", layouts("1d-4", "1d-4-sp").values(), ids=["1d", "1d-sp"])
def test_1d_collective_wrappers_copy_nothing(pool, layout):
    for counted, needed in pool.run(_wrapper_bytes, layout):
        assert counted == needed
