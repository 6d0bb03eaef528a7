"""What train.overlap buys in each mode: every mode beside its `-blocking`
twin (the same run with each collective waited for at once), in one pool,
rounds alternating the rows (cost.measure.bench, as `tpctl bench`), so both
see the same load. Prints per mode the step-time ratio overlapped /
blocking (< 1: overlap is faster), the communication a rank's thread was
exposed to (comm.STATS.exposed_s) in each, and whether the first losses are
bitwise equal.

    python benchmarks/overlap.py                                 # gpt-small, 1d/1d+sp/2d on 4 ranks, 2.5d/3d on 8
    python benchmarks/overlap.py --model gpt-tiny --size 4 --modes 1d 2d --rounds 2
    python benchmarks/overlap.py --cpu --modes 1d 1d+sp          # where a step's CPU goes, both paths

--cpu: both paths of each mode built in one pool, single steps alternating
between them, each step's wall time, the CPU time of the rank's main
thread (Python, the products, issuing and waiting) and of its whole
process (also gloo's threads, which run the collectives): the overhead the
asynchronous path adds on the main thread shows as a CPU difference, the
cores it competes for as a wall difference at equal CPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from tpctl.config import compose_jobs  # noqa: E402
from tpctl.cost.measure import bench, check  # noqa: E402


def measure(model: str, modes: list[str], size: int, steps: int, rounds: int, overrides: list[str]) -> dict:
    cfg = compose_jobs([f"model={model}", *overrides])[0]
    rows = [m + suffix for m in modes for suffix in ("", "-blocking")]
    check(cfg, rows, size, None)
    return bench(cfg, rows, size, steps, rounds, warmup=1, timeout_s=3600)


def _cpu_steps(cfg_dict: dict, steps: int) -> dict:
    """On a pool rank: the run built with overlap on and off, `steps`
    single steps of each alternating; per path the medians of wall, main
    thread CPU and process CPU per step (ms)."""
    import statistics
    import time

    import torch
    from omegaconf import OmegaConf

    from tpctl.launch.pool import pooled_run
    from tpctl.parallel import comm

    runs = {}
    for on in (True, False):
        cfg = OmegaConf.create(cfg_dict)
        cfg.train.overlap = on
        runs[on] = pooled_run(cfg, verify=False, schedule=False)
    ids = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1),
                        generator=torch.Generator().manual_seed(0))
    got: dict = {True: [], False: []}
    for i in range(steps + 1):
        for on, run in runs.items():
            batch = [(run.par.shard_batch(ids[:, :-1]), run.par.shard_targets(ids[:, 1:]))]
            comm.barrier()
            t, c, p = time.perf_counter(), time.thread_time(), time.process_time()
            float(run.step.finish(run.step.forward_backward(batch, i), i)["loss"])
            if i:  # the first step of each warms up
                got[on].append((time.perf_counter() - t, time.thread_time() - c, time.process_time() - p))
    return {on: [statistics.median(x[k] for x in rows) * 1e3 for k in range(3)] for on, rows in got.items()}


def cpu_table(args) -> None:
    from tpctl.launch.pool import DistPool
    from omegaconf import OmegaConf

    table = Table(title=f"CPU per step, overlapped vs blocking: {args.model}, {args.steps} alternating steps")
    for c in ("mode", "ranks", "wall ms (on / off)", "main-thread CPU ms (on / off)", "process CPU ms (on / off)"):
        table.add_column(c, justify="left" if c == "mode" else "right")
    for m in args.modes:
        size = args.size or (8 if m in ("2.5d", "3d") else 4)
        mode, sp = (m[:-3], True) if m.endswith("+sp") else (m, False)
        cfg = compose_jobs([f"model={args.model}", f"mode={mode}", f"size={size}", f"seq_parallel={sp}",
                            *(["depth=2"] if mode == "2.5d" else []), *args.overrides])[0]
        pool = DistPool(size, timeout_s=3600)
        try:
            per_rank = pool.run(_cpu_steps, OmegaConf.to_container(cfg, resolve=True), args.steps)
        finally:
            pool.close()
        mean = {on: [sum(r[on][k] for r in per_rank) / len(per_rank) for k in range(3)] for on in (True, False)}
        table.add_row(m, str(size), *(f"{mean[True][k]:,.1f} / {mean[False][k]:,.1f}" for k in range(3)))
    Console(width=200).print(table)
    print("medians per rank, averaged over the ranks; CPU gloo ranks")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-small")
    ap.add_argument("--size", type=int, default=None, help="ranks for every mode (default: 4, and 8 for 2.5d/3d)")
    ap.add_argument("--modes", nargs="+", default=["1d", "1d+sp", "2d", "2.5d", "3d"])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("overrides", nargs="*", help="config overrides (after --), e.g. train.batch_size=8")
    ap.add_argument("--cpu", action="store_true", help="where a step's CPU goes on each path (see above)")
    args = ap.parse_args()
    if args.cpu:
        return cpu_table(args)
    by_size: dict[int, list[str]] = {}
    for m in args.modes:
        by_size.setdefault(args.size or (8 if m in ("2.5d", "3d") else 4), []).append(m)
    table = Table(title=f"overlapped vs blocking: {args.model}, {args.rounds} alternating rounds x {args.steps} steps")
    for c in ("mode", "ranks", "overlapped ms", "blocking ms", "ratio", "exposed comm ms (overlapped / blocking)",
              "step-1 loss bitwise equal"):
        table.add_column(c, justify="left" if c == "mode" else "right")
    for size, modes in by_size.items():
        results = measure(args.model, modes, size, args.steps, args.rounds, args.overrides)
        for m in modes:
            on, off = results[m], results[m + "-blocking"]
            table.add_row(m, str(size), f"{on['median_s'] * 1e3:,.1f}", f"{off['median_s'] * 1e3:,.1f}",
                          f"{on['median_s'] / off['median_s']:.3f}",
                          f"{on['exposed_comm_s'] * 1e3:,.1f} / {off['exposed_comm_s'] * 1e3:,.1f}",
                          str(on["first_loss"] == off["first_loss"]))
    Console(width=200).print(table)
    print("ratio: median step overlapped / blocking (< 1: overlap is faster); CPU gloo ranks")


if __name__ == "__main__":
    main()
