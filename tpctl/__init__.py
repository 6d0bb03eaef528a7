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


def init_parallel(layout=None, *, seed: int = 0, device: str = "cpu", context: str = "ring", **dims):
    """The parallel machinery (parallel.parallelism.Parallelism: mesh, mode,
    data parallelism, context parallelism) of an initialised process group,
    for a `Layout` or its fields as keywords: init_parallel(mode="2d",
    size=4, dp=2); with cp=C, `context` is the attention across the cp
    ranks (ring or ulysses), and shard_batch/shard_targets give a rank its
    positions of each sequence."""
    from .parallel.layout import Layout
    from .parallel.parallelism import parallelism

    par = parallelism(layout or Layout(**dims), seed, device)
    par.cp.impl = context
    return par


def parallelize(model, tp, plan=None, verify: bool = False):
    """`model` made this rank's for `tp` (see init_parallel), in place: cut
    to its pipeline stage with pp > 1, its layers rewritten for the mode,
    attention across the cp ranks with cp > 1; returns the model.
    verify=True: prove the rewrite against the original first, module by
    module and block by block, as `tpctl train` does (parallel/verify/proof.py);
    raises parallel.verify.proof.RewriteRefused if it differs. Every rank must call it."""
    from .parallel.verify.proof import rewrite_verified

    done, _ = rewrite_verified(model, tp, plan, verify)
    return tp.cp.install(done.model, done.plan.roles)
