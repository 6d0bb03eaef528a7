"""What overlapping SUMMA's broadcasts with its matmuls buys: forward +
backward of one 2d Linear, with and without prefetching step t+1's
broadcasts (and async reduces), side by side.

    python benchmarks/summa_overlap.py                   # 4 ranks (q=2), gloo on CPU
    python benchmarks/summa_overlap.py --tokens 8192 --hidden 2048 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from tpctl.launch.pool import DistPool  # noqa: E402


def time_linear(tokens: int, hidden: int, repeats: int, threads: int) -> dict[bool, list[float]]:
    import time

    import torch
    import torch.distributed as dist

    import tpctl

    torch.set_num_threads(threads)
    tp = tpctl.init_parallel(mode="2d", size=4)
    grid = tp.mode.grid
    layer = tpctl.parallelize(torch.nn.Sequential(torch.nn.Linear(hidden, hidden)), tp, {"0": "mlp_in"})[0]
    x = torch.randn(tokens // grid.q, hidden // grid.q, requires_grad=True)
    out = {}
    for overlap in (True, False, True, False):  # interleaved: drift hits both
        grid.overlap = overlap
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            layer(x).sum().backward()
            dist.barrier()
            times.append(time.perf_counter() - start)
        out.setdefault(overlap, []).extend(times)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args()
    pool = DistPool(4, timeout_s=600)
    try:
        results = pool.run(time_linear, args.tokens, args.hidden, args.repeats, args.threads)
    finally:
        pool.close()
    times = results[0]  # barriers make every rank's time the same
    with_, without = statistics.median(times[True]), statistics.median(times[False])
    table = Table(title=f"2d Linear fwd+bwd, {args.tokens} tokens x {args.hidden}->{args.hidden}, 4 ranks, median of {2 * args.repeats}")
    for col in ("overlap", "time", "vs lock-step"):
        table.add_column(col, justify="right")
    table.add_row("prefetch + async reduce", f"{with_ * 1000:.1f} ms", f"{with_ / without:.3f}")
    table.add_row("lock-step", f"{without * 1000:.1f} ms", "1.000")
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
