"""Train the same model in every mode and print the numbers side by side.

    python benchmarks/compare_modes.py                 # gpt-tiny, 20 steps
    python benchmarks/compare_modes.py --steps 10 -- model.n_embd=256 model.n_layer=4

Each mode runs through `tpctl train` (real workers, gloo on CPU unless you
pass device=cuda) in its own run dir; the table shows per-rank parameter
memory, bytes handed to collectives per step and what ring algorithms send
for them (rank 0), step time and the loss curve's
largest deviation from mode=none, each also as a ratio to mode=none. On a
2-core machine 8 processes time-share the cores: step times measure overhead,
not speed-up.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tpctl.commands.run_dir import layout_overrides, read_metrics, read_summary, train_subprocess

CONFIGS = {name: layout_overrides(name) for name in
           ("none", "none-dp2", "1d-2", "1d-4", "1d-4-sp", "2d-4", "2d-4-dp2", "2.5d-8-d2", "3d-8")}


def run(name: str, extra: list[str], steps: int, root: Path) -> tuple[dict, list[dict]]:
    run_dir = root / name
    proc = train_subprocess([*CONFIGS[name], f"train.steps={steps}", "train.log_every=1", "train.eval_every=0",
                             "train.progress=false", *extra], run_dir)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return read_summary(run_dir), read_metrics(run_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--modes", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = parser.parse_args()
    names = ["none"] + [m for m in args.modes if m != "none"]
    results = {}
    with tempfile.TemporaryDirectory(prefix="tpctl-bench-") as tmp:
        for name in names:
            Console(stderr=True).print(f"running {name} ...")
            results[name] = run(name, args.overrides, args.steps, Path(tmp))

    ref_summary, ref_metrics = results["none"]
    # Skip the first steps: they include warm-up (allocations, thread pools).
    step_time = {n: statistics.median(r["step_time_s"] for r in m[len(m) // 4:]) for n, (_, m) in results.items()}
    table = Table(title=f"tpctl modes, {args.steps} steps, {' '.join(args.overrides) or 'defaults'}")
    for col in ("mode", "ranks", "params/rank", "vs none", "collective payload/step", "ring wire bytes/step",
                "step time", "vs none", "max |dloss|/loss"):
        table.add_column(col, justify="right")
    for name in names:
        summary, metrics = results[name]
        dev = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(metrics, ref_metrics))
        table.add_row(
            name, str(summary["size"] * summary["dp"]),
            f"{summary['param_bytes'] / 2**20:.2f} MiB", f"{summary['param_bytes'] / ref_summary['param_bytes']:.3f}",
            f"{summary['comm_bytes_per_step'] / 2**20:.2f} MiB", f"{summary['comm_wire_bytes_per_step'] / 2**20:.2f} MiB",
            f"{step_time[name] * 1000:.1f} ms", f"{step_time[name] / step_time['none']:.2f}",
            f"{dev:.1e}",
        )
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
