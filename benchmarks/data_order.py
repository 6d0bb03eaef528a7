"""data.order=epoch: what its permutation costs, and a resume in other
layouts reading the same tokens.

    python benchmarks/data_order.py                         # both parts
    python benchmarks/data_order.py --windows 1e6 1e8 --layouts   # the cost only
    python benchmarks/data_order.py --windows --layouts none 3d-8  # two resumes only

The cost: a whole `torch.randperm` of an epoch's window indices (what a
shuffled sampler holds on every rank) against the Feistel permutation of
tpctl/data/order.py, which computes only the rows of a batch.

The resumes: one run of `--steps` steps in the save layout (1d-2) writes a
checkpoint halfway; the same config resumed from it in every other layout
must log the same `data_hash` for every later step (the token ids of the
global batch) and the same loss (within 1e-6). The corpus is small enough
that an epoch ends inside the resumed steps.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SAVE = ("1d-2", "mode=1d size=2")
# Fewer ranks (1), as many (2) and more (4, 8); every family of layout.
LAYOUTS = {
    "none": "mode=none",
    "none-dp2-zero1": "mode=none dp=2 zero=1",
    "none-pp2": "mode=none pp=2",
    "1d-2-cp2": "mode=1d size=2 cp=2",
    "1d-4": "mode=1d size=4",
    "2d-4": "mode=2d size=4",
    "1d-2-dp2-zero2": "mode=1d size=2 dp=2 zero=2",
    "2.5d-8-d2": "mode=2.5d size=8 depth=2",
    "3d-8": "mode=3d size=8",
}
# 600 bytes of the built-in text: 33 train windows of 16 tokens, 4 steps of 8 rows an epoch.
COMMON = ("model=gpt-tiny model.n_layer=2 model.n_embd=32 model.n_head=4 optim.eps=1e-5 data.max_bytes=600 "
          "train.batch_size=8 train.seq_len=16 train.log_every=1 train.eval_every=0 train.progress=false seed=3")


def permutation_cost(windows: list[int], batch: int = 512) -> None:
    import torch

    from tpctl.data.order import epoch_windows

    for n in windows:
        t = time.perf_counter()
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
        full_s = time.perf_counter() - t
        mb = perm.numel() * perm.element_size() / 2**20
        del perm
        rows = np.arange(batch) + n // 2
        epoch_windows(0, "train", 0, n, rows)  # warm
        t = time.perf_counter()
        for step in range(100):
            epoch_windows(0, "train", 0, n, rows + step * batch)
        per_batch = (time.perf_counter() - t) / 100
        print(f"{n:>13,} windows: randperm {full_s:7.3f} s and {mb:8.1f} MiB per epoch and rank; "
              f"feistel {per_batch * 1e6:7.1f} us per batch of {batch} rows, nothing held", flush=True)


def train(keys: str, run: Path, steps: int, extra: str = "") -> list[dict]:
    cmd = [sys.executable, "-m", "tpctl.cli", "train", *keys.split(), *COMMON.split(), f"train.steps={steps}",
           *extra.split(), f"hydra.run.dir={run}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{keys}: exit {done.returncode}\n{done.stderr[-2000:]}")
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def resumes(names: list[str], steps: int) -> int:
    half = steps // 2
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        first = Path(tmp) / "first"
        reference = train(SAVE[1], first, steps, f"checkpoint.every={half}")
        summary = json.loads((first / "summary.json").read_text())
        print(f"save layout {SAVE[0]}: {steps} steps in {time.perf_counter() - t:.0f} s; {summary['data']}")
        print("| resumed in | ranks | steps | data_hash equal | max rel. loss difference |")
        print("|---|---|---|---|---|")
        for name in names:
            got = train(LAYOUTS[name], Path(tmp) / name, steps, f"train.resume={first / 'checkpoints' / f'step_{half}'}")
            want = reference[half:]
            same = [g["data_hash"] for g in got] == [w["data_hash"] for w in want]
            rel = max(abs(g["loss"] - w["loss"]) / abs(w["loss"]) for g, w in zip(got, want))
            ranks = _ranks(LAYOUTS[name])
            ok = same and rel <= 1e-6 and [g["step"] for g in got] == list(range(half + 1, steps + 1))
            bad += not ok
            print(f"| {name} | {ranks} | {half + 1}-{steps} | {'yes' if same else 'NO'} | {rel:.1e} |", flush=True)
    print(f"{len(names) - bad} of {len(names)} layouts read the same tokens and continue the loss within 1e-6")
    return 1 if bad else 0


def _ranks(keys: str) -> int:
    kv = dict(k.split("=") for k in keys.split())
    return int(kv.get("size", 1)) * int(kv.get("dp", 1)) * int(kv.get("pp", 1)) * int(kv.get("cp", 1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--windows", nargs="*", type=float, default=[1e6, 1e7, 1e8],
                   help="epoch sizes to price (none: skip)")
    p.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS),
                   help="layouts to resume in (none: skip)")
    p.add_argument("--steps", type=int, default=8, help="steps of each run; the checkpoint is at half")
    args = p.parse_args()
    if args.windows:
        permutation_cost([int(n) for n in args.windows])
    return resumes(args.layouts, args.steps) if args.layouts else 0


if __name__ == "__main__":
    sys.exit(main())
