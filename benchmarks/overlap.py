"""What train.overlap buys in each mode: every mode beside its `-blocking`
twin (the same run with each collective waited for at once), in one pool,
rounds alternating the rows (cost.measure.bench, as `tpctl bench`), so both
see the same load. Prints per mode the step-time ratio overlapped /
blocking (< 1: overlap is faster), the communication a rank's thread was
exposed to (comm.STATS.exposed_s) in each, and whether the first losses are
bitwise equal.

    python benchmarks/overlap.py                                 # gpt-small, 1d/1d+sp/2d on 4 ranks, 2.5d/3d on 8
    python benchmarks/overlap.py --model gpt-tiny --size 4 --modes 1d 2d --rounds 2
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-small")
    ap.add_argument("--size", type=int, default=None, help="ranks for every mode (default: 4, and 8 for 2.5d/3d)")
    ap.add_argument("--modes", nargs="+", default=["1d", "1d+sp", "2d", "2.5d", "3d"])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("overrides", nargs="*", help="config overrides (after --), e.g. train.batch_size=8")
    args = ap.parse_args()
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
