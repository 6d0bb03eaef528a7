"""What a checkpoint costs: bytes on disk against the model + AdamW state,
and the time to save one, for a real run through `tpctl train`.

    python benchmarks/checkpoint_cost.py                        # gpt-small, 3d, size 8
    python benchmarks/checkpoint_cost.py --mode 2d --size 4 -- model=gpt-tiny

It trains `--steps` steps saving a checkpoint after each (checkpoint.every=1),
then resumes once from the last one (in the same layout) to time loading.
Bytes: every file of the checkpoint (DCP data, its .metadata, the manifest)
against 3 x 4 bytes per parameter of the whole model (fp32 weights, exp_avg,
exp_avg_sq): a ratio near 1 means no replica was written twice. Save time:
the collective save as rank 0 logs it (every rank waits for the last one).
On a 2-core machine the 8 ranks time-share the cores.
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import tempfile
import time
from pathlib import Path

from tpctl.commands.run_dir import read_metrics, train_subprocess


def whole_params(overrides: list[str]) -> int:
    """Parameters of the whole model (tied once), built on the meta device."""
    from tpctl.config import compose_jobs
    from tpctl.models import build_model

    model = build_model(compose_jobs(overrides)[0].model, 0, lazy=True)
    return sum(math.prod(p.shape) for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", default="3d")
    parser.add_argument("--size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="more tpctl train overrides (after --)")
    args = parser.parse_args()
    overrides = ["model=gpt-small", "data=synthetic", "train.batch_size=4", "train.seq_len=32",
                 f"mode={args.mode}", f"size={args.size}", "train.eval_every=0", "train.log_every=1",
                 "train.progress=false", *args.overrides]
    params = whole_params(overrides)
    with tempfile.TemporaryDirectory(prefix="tpctl-ckpt-bench-") as tmp:
        run = Path(tmp) / "run"
        common = [*overrides, "checkpoint.every=1", "checkpoint.keep=0"]
        train_subprocess([*common, f"train.steps={args.steps}"], run).check_returncode()
        log = (run / "logs" / "rank0.log").read_text()
        saves = [float(s) for s in re.findall(r"checkpoint \S+ written in ([0-9.]+)s", log)]
        step_times = [m["step_time_s"] for m in read_metrics(run)]
        last = run / "checkpoints" / f"step_{args.steps}"
        files = [p for p in last.iterdir() if p.is_file()]
        on_disk = sum(p.stat().st_size for p in files)
        distcp = sum(p.stat().st_size for p in files if p.suffix == ".distcp")
        # Resume once more in the same layout, one more step, to time loading.
        started = time.perf_counter()
        train_subprocess([*common, f"train.steps={args.steps + 1}", f"train.resume={last}", "checkpoint.at_end=false",
                          "checkpoint.every=0"], run).check_returncode()
        resume_run_s = time.perf_counter() - started
        loads = re.findall(r"checkpoint \S+ loaded in ([0-9.]+)s", (run / "logs" / "rank0.log").read_text())
    state = params * 4 * 3
    print(f"model: {params / 1e6:.2f}M parameters; weights + exp_avg + exp_avg_sq = {state / 2**20:,.1f} MiB")
    print(f"checkpoint on disk: {on_disk / 2**20:,.1f} MiB in {len(files)} files "
          f"(DCP data {distcp / 2**20:,.1f} MiB); ratio to model+optimizer: {on_disk / state:.3f}")
    print(f"save time ({args.mode} size {args.size}, {len(saves)} saves): median {statistics.median(saves):.2f}s, "
          f"all {', '.join(f'{s:.2f}' for s in saves)}")
    # A logged step's time runs from the previous log line, so it includes
    # the save after the previous step: take those out.
    train_s = (sum(step_times) - sum(saves[:-1])) / len(step_times)
    print(f"training step time (mean, saves taken out): {train_s:.2f}s")
    print(f"load time (rank 0, same layout): {loads[-1] if loads else '?'}s; "
          f"a resumed run of one step, start to end: {resume_run_s:.1f}s")


if __name__ == "__main__":
    main()
