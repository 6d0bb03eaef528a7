"""What each ZeRO stage holds and costs (gpt-small by default): for each
tensor mode and data-parallel degree, zero = 0..3 one after another on the
same ranks.

    python benchmarks/zero_memory.py                         # none and 2d-4, dp 2, 4, 8
    python benchmarks/zero_memory.py --modes none --dp 2 4 --steps 3 --seq 64 --zero 0 3

Per stage, the largest rank's:
  * bytes per parameter it holds between steps: parameters, gradients kept
    for the optimizer and AdamW state, counted from the tensors' storages
    (DataParallel.memory), per parameter of the rank's tensor-parallel shard,
    beside the ZeRO paper's formulas for fp32 weights and two fp32 moments
    (16; 4 + 4 + 8/Nd; 4 + 12/Nd; 16/Nd), and the relative difference (the
    chunks' padding rows are real bytes);
  * peak RSS while the model is built, sharded and trained (Linux's VmHWM;
    each stage in fresh processes, so nothing an earlier stage freed is
    reused; glibc's mmap threshold fixed at 1 MiB, so freed tensors leave
    the resident set), and its rise above the idle process;
  * the median step time relative to zero=0 in the same run.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

MODES = ("none", "2d-4")  # layout names (tpctl.parallel.layout.Layout.parse), dp added per run


def formula(zero: int, dp: int) -> float:
    """The ZeRO paper's bytes per parameter with fp32 weights, gradients and
    two AdamW moments over `dp` replicas (stage `zero`)."""
    return {0: 16.0, 1: 4 + 4 + 8 / dp, 2: 4 + 12 / dp, 3: 16 / dp}[zero]


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(layout_name: str, model: str, batch: int, seq: int, steps: int) -> dict:
    """On each rank of a fresh pool: train `layout_name` `steps` steps."""
    import torch
    from omegaconf import OmegaConf

    from tpctl.config import compose_jobs
    from tpctl.launch.pool import pooled_run
    from tpctl.parallel.layout import Layout
    from tpctl.training.build import build_step

    layout = Layout.parse(layout_name)
    cfg = compose_jobs([f"model={model}", f"train.batch_size={batch}", f"train.seq_len={seq}"])[0]
    OmegaConf.update(cfg, "optim.grad_clip", 1.0)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.model.vocab_size, (batch, seq + 1), generator=gen)
    gc.collect()
    idle = _kib("VmRSS")
    run = pooled_run(cfg, layout, step=False)
    par, net = run.par, run.model
    shard = sum(p.numel() for p in net.parameters())  # this rank's tensor-parallel shard, before ZeRO cuts it
    step = build_step(cfg, par, net, schedule=False)
    batch_ = [(par.shard_batch(ids[:, :-1]), par.shard_targets(ids[:, 1:]))]
    times = []
    for k in range(steps + 1):  # the first: warm-up
        t0 = time.perf_counter()
        float(step(batch_, k)["loss"])
        times.append(time.perf_counter() - t0)
    return {"shard": shard, **step.memory(), "peak_rss": _kib("VmHWM") * 1024, "idle_rss": idle * 1024,
            "step_s": statistics.median(times[1:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--modes", nargs="*", default=list(MODES))
    parser.add_argument("--dp", nargs="*", type=int, default=[2, 4, 8])
    parser.add_argument("--zero", nargs="*", type=int, default=[0, 1, 2, 3], help="the ZeRO stages measured")
    parser.add_argument("--rows", type=int, default=1, help="rows of the global batch per replica and row block")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # A fixed mmap threshold (inherited by the pool's processes) turns off
    # glibc's sliding one, under which a freed tensor's pages stay in the
    # heap and the resident set would never show what a stage frees.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(2**20))

    from rich.console import Console
    from rich.table import Table

    from tpctl.launch.pool import DistPool
    from tpctl.parallel.layout import Layout

    table = Table(title=f"ZeRO per rank: {args.model}, {args.seq} tokens x {args.rows} row(s) per replica and row "
                        f"block, median of {args.steps} steps (the largest rank)")
    for col in ("layout", "ranks", "zero", "params B/p", "grads B/p", "AdamW B/p", "total B/p", "formula", "vs formula",
                "peak RSS MiB", "above idle MiB", "step s", f"x zero={args.zero[0]}"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    for mode in args.modes:
        for dp in args.dp:
            layout = Layout.parse(mode).replace(dp=dp)
            batch = args.rows * dp * layout.geo.batch_split
            Console(stderr=True).print(f"measuring {layout.label()} ({layout.world} ranks, batch {batch}) ...")
            per_stage = []
            for zero in args.zero:
                pool = DistPool(layout.world, timeout_s=3600)
                try:
                    per_stage.append(pool.run(measure, layout.replace(zero=zero).name, args.model, batch, args.seq,
                                              args.steps))
                finally:
                    pool.close()
            first = None
            for zero, rows in zip(args.zero, per_stage):
                worst = max(rows, key=lambda r: r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"])
                per = {k: worst[k] / worst["shard"] for k in ("param_bytes", "grad_bytes", "optimizer_bytes")}
                total = sum(per.values())
                peak = max(r["peak_rss"] for r in rows)
                above = max(r["peak_rss"] - r["idle_rss"] for r in rows)
                step_s = max(r["step_s"] for r in rows)
                first = first or step_s
                head = zero == args.zero[0]
                table.add_row(layout.label() if head else "", str(layout.world) if head else "", str(zero),
                              f"{per['param_bytes']:.2f}", f"{per['grad_bytes']:.2f}", f"{per['optimizer_bytes']:.2f}",
                              f"{total:.2f}", f"{formula(zero, dp):.2f}", f"{total / formula(zero, dp) - 1:+.1%}",
                              f"{peak / 2**20:,.0f}", f"{above / 2**20:,.0f}", f"{step_s:.2f}", f"{step_s / first:.2f}")
    Console(width=180).print(table)


if __name__ == "__main__":
    main()
