"""`tpctl train --check` against real runs, and the check's own time.

    python benchmarks/check_accuracy.py [NAME ...]              # every recipe (or these): predicted vs measured peak
    python benchmarks/check_accuracy.py --save m.json [NAME ...] # ... and keep the measured peaks
    python benchmarks/check_accuracy.py --measured m.json        # the predictions again beside peaks measured before
    python benchmarks/check_accuracy.py --floors                 # a `tpctl train` worker's floor, tpctl and HF model
    python benchmarks/check_accuracy.py --timing --repeat 3      # --check's wall and CPU-s: gpt-small, the ~1B Llama

Measured: a real `tpctl train recipe=NAME` run of `--steps` steps (workers
forked from the warm server as any run's; eval, checkpoints and samples
off), the largest rank's peak resident set (summary.json
peak_rss_bytes_max_rank: VmHWM, glibc's heap as it is). Predicted: the peak
`tpctl train --check` prints for its worst rank (cost/memory_check.py
predict). A row per recipe: both, their ratio, and the part above the
process's floor. The last line: max_mem_err=..%.

--floors: the floor the check adds to every rank (the hardware profile's
train_base_bytes / train_base_bytes_hf, as `tpctl plan --calibrate`
measures them: cost/calibrate.py train_floors): one rank trains a
near-empty model 2 steps, its peak less what the planner counts above the
floor; a tpctl model and a Hugging Face one (transformers' modules are the
difference).

--timing: `tpctl train --check` as a user runs it, a fresh interpreter each
time: wall and CPU seconds (user+sys of the child), `--repeat` times each.
On a machine shared with other work, the CPU seconds are the idle
machine's wall time (one thread does the work).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHORT = ["train.eval_every=0", "checkpoint.every=0", "checkpoint.at_end=false", "train.progress=false",
         "train.sample_every=0"]
# The ~1B Llama of the check's timing (a Hugging Face LlamaForCausalLM, 1.2B parameters).
LLAMA_1B = ["model=llama-100m", "model.n_layer=16", "model.n_embd=2048", "model.n_head=32", "model.n_kv_head=8",
            "model.intermediate_size=8192", "model.vocab_size=128256"]
TIMED = {"gpt-small (recipe=gpt-small-1d)": ["recipe=gpt-small-1d"], "~1B Llama": LLAMA_1B}
MIB = 2**20


def predicted(overrides: list[str]):
    """(worst stage's peak, its part above the process, world) as --check predicts it."""
    from tpctl.cost.memory_check import predict
    from tpctl.config import compose_jobs, validate

    cfg = compose_jobs(overrides)[0]
    found = predict(cfg, built=validate(cfg))
    w = found.worst
    return w.peak, w.peak - w.parts["process"], found.layout.world


def measured(overrides: list[str], tmp: str, name: str) -> int:
    """The largest rank's peak RSS of a real `tpctl train` run."""
    run_dir = Path(tmp) / name
    proc = subprocess.run([sys.executable, "-m", "tpctl.cli", "train", *overrides, *SHORT, f"hydra.run.dir={run_dir}"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads((run_dir / "summary.json").read_text())["peak_rss_bytes_max_rank"]


def recipes(names: list[str], steps: int, save: str | None, reuse: str | None) -> None:
    from tpctl.config import RECIPE_DIR

    known = json.loads(Path(reuse).read_text()) if reuse else {}
    names = names or (sorted(known) if reuse else sorted(p.stem for p in RECIPE_DIR.glob("*.yaml")))
    print("| recipe | ranks | predicted peak MiB | measured peak MiB | predicted / measured | predicted above the floor MiB |")
    print("|---|---|---|---|---|---|")
    errs, peaks = [], dict(known)
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            overrides = [f"recipe={name}", f"train.steps={steps}"]
            peak, above, world = predicted(overrides)
            if name not in peaks:
                try:
                    peaks[name] = measured(overrides, tmp, name)
                except RuntimeError as e:
                    print(f"| {name} | failed: {e} |", flush=True)
                    continue
                if save:
                    Path(save).write_text(json.dumps(peaks, indent=1))
            real = peaks[name]
            errs.append(abs(peak / real - 1))
            print(f"| {name} | {world} | {peak / MIB:.1f} | {real / MIB:.1f} | {peak / real:.3f} ({peak / real - 1:+.1%}) "
                  f"| {above / MIB:.1f} |", flush=True)
    print(f"\nmax_mem_err={100 * max(errs, default=0):.1f}% over {len(errs)} recipes")


def floors() -> None:
    from tpctl.cost.calibrate import train_floors

    for key, value in train_floors().items():
        print(f"{key}: {value / MIB:.1f} MiB ({value:.0f} bytes)", flush=True)


def timing(repeat: int) -> None:
    print("| model | wall s | CPU s (user+sys) |")
    print("|---|---|---|")
    for what, overrides in TIMED.items():
        walls, cpus = [], []
        for _ in range(repeat):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "tpctl.cli", "train", "--check", *overrides], capture_output=True)
            walls.append(time.perf_counter() - t0)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
        print(f"| {what} | {', '.join(f'{w:.2f}' for w in walls)} | {', '.join(f'{c:.2f}' for c in cpus)} |", flush=True)
    print(f"\nload average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="recipes (default: all)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--save", help="write the measured peaks (bytes, by recipe) here")
    parser.add_argument("--measured", help="read measured peaks from here instead of running the recipes")
    parser.add_argument("--floors", action="store_true")
    parser.add_argument("--timing", action="store_true")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if args.floors:
        return floors()
    if args.timing:
        return timing(args.repeat)
    recipes(args.names, args.steps, args.save, args.measured)


if __name__ == "__main__":
    main()
