"""tpctl: tensor-parallel training (1D, 2D, 2.5D, 3D) for plain PyTorch models.

The CLI (`tpctl train ...`) is one user of this API; a custom training loop
is another:

    import torch.distributed as dist, tpctl
    dist.init_process_group("gloo")                 # e.g. under torchrun
    tp = tpctl.init_parallel(mode="2d", size=4)     # mesh + mode
    model = tpctl.parallelize(MyModel(), tp)        # rewrite by the model's tp_plan
    logits = model(tp.shard_batch(ids))             # this rank's rows
    loss_sum = tp.cross_entropy(logits, tp.shard_targets(targets), vocab_size).sum()
    (loss_sum / targets.numel()).backward()
    tp.sync_grads(model); tp.clip_grad_norm_(model, 1.0); optimizer.step()
    print(tp.global_mean(loss_sum, targets.numel()))
"""

from __future__ import annotations

__version__ = "0.1.0"


def init_parallel(mode: str = "none", size: int = 1, depth: int = 1, dp: int = 1, seed: int = 0,
                  seq_parallel: bool = False, device: str = "cpu"):
    """The mesh of an initialised process group, and the mode acting on it."""
    from .mesh import init_mesh
    from .parallel import get_mode

    return get_mode(init_mesh(mode, size, depth, dp, seed, device), seq_parallel=seq_parallel)


def parallelize(model, tp, plan=None):
    """Rewrite `model`'s layers in place for the mode `tp` (see init_parallel)."""
    from .parallel.base import parallelize as _parallelize

    return _parallelize(model, tp, plan)
