"""Activation memory per rank of one forward + backward, with and without
`train.activation_checkpointing`, in each mode (gpt-small by default).

    python benchmarks/activation_memory.py                      # gpt-small, batch 4 x 128 tokens
    python benchmarks/activation_memory.py --batch 8 --seq 256 --modes none 1d-4

How it is measured (CPU): the peak resident set size of each rank's
process during the step, minus its resident size just before it. Linux's
/proc/self/clear_refs resets the peak (VmHWM) before the step; glibc's mmap
threshold is fixed (MALLOC_MMAP_THRESHOLD_) so every large tensor is its own
mapping, returned to the system when freed, and resident memory follows the
live tensors. Parameters and their gradients exist before the step (a
warm-up step allocated the gradients, which are zeroed, not freed), so the
difference is the activations (and transient buffers: logits, collective
buffers). The largest rank's number is reported.
"""

from __future__ import annotations

import argparse
import gc
import os

MODES = ("none", "1d-4", "2d-4", "2.5d-8-d2", "3d-8")  # layout names (tpctl.parallel.layout.Layout.parse)


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _step_peak_bytes(step) -> int:
    gc.collect()
    before = _rss_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    step()
    return (_rss_kib("VmHWM") - before) * 1024


def measure(layout_name: str, model: str, batch: int, seq: int) -> dict:
    """On each rank of a pool of `size` ranks: peak step memory without and
    with activation checkpointing."""
    import torch

    from tpctl.parallel.layout import Layout
    from tpctl.training.recompute import apply_activation_checkpointing
    from tpctl.config import compose_jobs
    from tpctl.parallel.layout import Layout
    from tpctl.training.build import build_run
    from tpctl.training.recompute import apply_activation_checkpointing

    cfg = compose_jobs([f"model={model}", "seed=0"])[0]
    # No step: the forward and backward alone, recomputed or not.
    run = build_run(cfg, layout=Layout.parse(layout_name), step=False)
    mode, net = run.par, run.model
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.model.vocab_size, (batch, seq + 1), generator=gen)
    x, y = mode.shard_batch(ids[:, :-1]), mode.shard_targets(ids[:, 1:])

    def step():
        loss = mode.cross_entropy(net(x), y, cfg.model.vocab_size).sum() / y.numel()
        loss.backward()

    step()  # warm-up: gradients allocated, thread pools started
    net.zero_grad(set_to_none=False)
    plain = _step_peak_bytes(step)
    net.zero_grad(set_to_none=False)
    apply_activation_checkpointing(net)
    checkpointed = _step_peak_bytes(step)
    return {"plain": plain, "checkpointed": checkpointed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES)
    args = parser.parse_args()
    # Inherited by the pool's processes (spawned below): large tensors are
    # mmapped and unmapped when freed, so RSS tracks live tensors.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from rich.console import Console
    from rich.table import Table

    from tpctl.launch.pool import DistPool
    from tpctl.parallel.layout import Layout

    table = Table(title=f"activation memory per rank, one forward+backward of {args.model}, "
                        f"batch {args.batch} x {args.seq} tokens (peak RSS increase, largest rank)")
    for col in ("mode", "ranks", "without", "with checkpointing", "saved", "ratio"):
        table.add_column(col, justify="right")
    for name in args.modes:
        size = Layout.parse(name).world
        Console(stderr=True).print(f"measuring {name} ...")
        pool = DistPool(size, timeout_s=1200)
        try:
            results = pool.run(measure, name, args.model, args.batch, args.seq)
        finally:
            pool.close()
        plain = max(r["plain"] for r in results)
        ckpt = max(r["checkpointed"] for r in results)
        table.add_row(name, str(size), f"{plain / 2**20:,.0f} MiB", f"{ckpt / 2**20:,.0f} MiB",
                      f"{(plain - ckpt) / 2**20:,.0f} MiB", f"{ckpt / plain:.2f}")
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
