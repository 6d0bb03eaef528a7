"""A training step wastes nothing a plain PyTorch loop would not:

  * host syncs: the loop reads the device at most once per logged step (the
    loss, the gradient norm, a validation loss and the step-1 loss fetched
    together), in every kind of layout (tensor-parallel, data-parallel);
    counted with a TorchDispatchMode (every .item(), float(), bool() of a
    tensor reaches aten._local_scalar_dense) and a patched Tensor.tolist;
  * the gradient norm makes no copy of any gradient (foreach norms).
"""

from __future__ import annotations

import pytest
import torch

from cli_support import scaled
from conftest import build_trainer, tiny_config
from tpctl.launch.pool import DistPool

# A pool of 4 ranks: tensor parallelism, data parallelism and both.
LAYOUTS = ("none-dp4", "1d-2-dp2", "2d-4")


@pytest.fixture(scope="module")
def pool4():
    p = DistPool(4, timeout_s=scaled(180))
    yield p
    p.close()


class SyncCounter:
    """Counts reads of a tensor's value by the host while active. The
    optimizer's own reads are left out: AdamW keeps its step counters on the
    host on every device (a plain loop makes the same reads, and they wait
    for nothing)."""

    def __init__(self, optimizer):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self
        self.count, self.in_optimizer = 0, False

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten._local_scalar_dense.default and not counter.in_optimizer:
                    counter.count += 1
                return func(*args, **(kwargs or {}))

        self.mode = Mode()
        step = optimizer.step

        def wrapped(*a, **k):
            self.in_optimizer = True
            try:
                return step(*a, **k)
            finally:
                self.in_optimizer = False

        optimizer.step = wrapped
        self._tolist = torch.Tensor.tolist

    def __enter__(self):
        counter, tolist = self, self._tolist

        def counting_tolist(t):
            counter.count += 1
            return tolist(t)

        torch.Tensor.tolist = counting_tolist
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        torch.Tensor.tolist = self._tolist


def _count_syncs(key: str, steps: int, log_every: int, eval_every: int) -> tuple[int, int]:
    from tpctl.config import default_config
    from tpctl.parallel.layout import Layout

    # The default learning rate: nothing here depends on the curve.
    cfg = tiny_config(steps, **Layout.parse(key).to_dict(), **{"train.log_every": log_every, "train.eval_every": eval_every,
                                                               "train.eval_batches": 2,
                                                               "optim.lr": default_config().optim.lr})
    trainer = build_trainer(cfg, pooled=False)
    # The batches are read from host memory (token offsets drawn on the host
    # generator): made beforehand, so that only the step's own reads count.
    batches = {(split, k): list(trainer._micro_batches(split, k))
               for split, n in (("train", steps), ("val", cfg.train.eval_batches)) for k in range(n)}
    trainer._micro_batches = lambda split, k: iter(batches[(split, k)])
    with SyncCounter(trainer.optimizer) as counter:
        records = trainer.fit()
    assert all(isinstance(r["loss"], float) and isinstance(r["grad_norm"], float) for r in records)
    assert isinstance(trainer.first_loss, float)
    return counter.count, len(records)


@pytest.mark.parametrize("key", LAYOUTS)
def test_one_host_sync_per_logged_step(pool4, key):
    for count, logged in pool4.run(_count_syncs, key, 6, 3, 0):
        assert logged == 2
        assert count <= logged, f"{count} host syncs for {logged} logged steps"


def test_evaluation_adds_no_sync(pool4):
    for count, logged in pool4.run(_count_syncs, "2d-4", 4, 2, 2):
        assert count <= logged == 2
