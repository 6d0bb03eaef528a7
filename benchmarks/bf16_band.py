"""How far does precision=bf16 move the loss curve? One fp32 run of
mode=none, then one bf16 run per mode, all through `tpctl train` (real
workers, gloo on CPU), the same model, data, seed and batches.

    python benchmarks/bf16_band.py                       # gpt-tiny, 50 steps, the default text
    python benchmarks/bf16_band.py --steps 20 --out runs -- model.n_layer=4

For every bf16 run the table gives the largest and mean per-step relative
deviation of its loss from fp32 mode=none (the band tests/test_train_features.py
holds every mode to) and from bf16 mode=none (how much the parallel
algorithm adds to bf16 rounding: reductions of partial sums in bf16),
and its comm bytes per step against its fp32 run's where there is one.
With --out the run dirs are kept (`tpctl report` plots them).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tpctl.commands.run_dir import layout_overrides, read_metrics, read_summary, train_subprocess

MODES = {name: layout_overrides(name) for name in ("none", "1d-2", "1d-4-sp", "2d-4", "2.5d-8-d2", "3d-8")}


def run(name: str, precision: str, extra: list[str], steps: int, root: Path) -> tuple[dict, list[dict]]:
    run_dir = root / f"{name}-{precision}"
    proc = train_subprocess([*MODES[name], "model=gpt-tiny", f"precision={precision}", f"train.steps={steps}",
                             "train.log_every=1", "train.eval_every=0", "train.progress=false", *extra], run_dir)
    if proc.returncode != 0:
        raise SystemExit(f"{name} {precision} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return read_summary(run_dir), read_metrics(run_dir)


def deviations(curve: list[dict], reference: list[dict]) -> list[float]:
    return [abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(curve, reference)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    parser.add_argument("--fp32-modes", nargs="*", default=["none"], choices=list(MODES),
                        help="modes also run in fp32 (for the bytes/step ratio); none always is")
    parser.add_argument("--out", type=Path, help="keep the run dirs here")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = parser.parse_args()
    console = Console(stderr=True)
    results: dict[tuple[str, str], tuple[dict, list[dict]]] = {}
    with tempfile.TemporaryDirectory(prefix="tpctl-bf16-") as tmp:
        root = args.out or Path(tmp)
        jobs = [(m, "fp32") for m in dict.fromkeys(["none", *args.fp32_modes])]
        jobs += [(m, "bf16") for m in dict.fromkeys(["none", *args.modes])]
        for name, precision in jobs:
            console.print(f"running {name} {precision} ...")
            results[name, precision] = run(name, precision, args.overrides, args.steps, root)

    fp32_ref, bf16_ref = results["none", "fp32"][1], results["none", "bf16"][1]
    table = Table(title=f"bf16 against fp32, {args.steps} steps, gpt-tiny {' '.join(args.overrides)}")
    for col in ("mode", "max rel. dev. vs fp32 none", "mean", "max vs bf16 none", "final loss",
                "fp32 none", "bytes/step vs fp32"):
        table.add_column(col, justify="right")
    report = {}
    for name in dict.fromkeys(["none", *args.modes]):
        summary, curve = results[name, "bf16"]
        to_fp32, to_bf16 = deviations(curve, fp32_ref), deviations(curve, bf16_ref)
        fp32 = results.get((name, "fp32"))
        ratio = summary["comm_bytes_per_step"] / fp32[0]["comm_bytes_per_step"] if fp32 and fp32[0]["comm_bytes_per_step"] else None
        report[name] = {"max_rel_vs_fp32_none": max(to_fp32), "mean_rel_vs_fp32_none": sum(to_fp32) / len(to_fp32),
                        "max_rel_vs_bf16_none": max(to_bf16), "final_loss": curve[-1]["loss"],
                        "comm_bytes_ratio_to_fp32": ratio}
        table.add_row(name, f"{max(to_fp32):.2e}", f"{sum(to_fp32) / len(to_fp32):.2e}", f"{max(to_bf16):.2e}",
                      f"{curve[-1]['loss']:.4f}", f"{fp32_ref[-1]['loss']:.4f}", "-" if ratio is None else f"{ratio:.3f}")
    Console().print(table)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
