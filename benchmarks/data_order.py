"""data.order=epoch: what its permutation costs, and a resume in other
layouts reading the same tokens.

    python benchmarks/data_order.py                         # both parts
    python benchmarks/data_order.py --windows 1e6 1e8 --layouts   # the cost only
    python benchmarks/data_order.py --windows --layouts none 3d-8  # two resumes only
    python benchmarks/data_order.py --windows --save 2d-4-pp2-dp2-z1 --layouts none 1d-2 3d-8

The cost: a whole `torch.randperm` of an epoch's window indices (what a
shuffled sampler holds on every rank) against the Feistel permutation of
tpctl/data/order.py, which computes only the rows of a batch.

The resumes: one run of `--steps` steps in the save layout (`--save`, a
layout name as Layout.parse reads it: 1d-2 by default, cheap for the smoke
run; issue 49's protocol saves at 2d-4-pp2-dp2-z1, docs/benchmarks.md)
writes a checkpoint halfway; the same config resumed from it in every
other layout (`--layouts`, any layout names) must log the same `data_hash`
for every later step (the token ids of the global batch) and the same loss
(within 1e-6). The corpus is small enough that an epoch ends inside the
resumed steps.
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
sys.path.insert(0, str(ROOT))
from tpctl.errors import ConfigError  # noqa: E402
from tpctl.parallel.layout import Layout  # noqa: E402

SAVE = "1d-2"
# Against the default save (2 ranks): fewer ranks (1), as many (2) and more
# (4, 8); every family of layout.
LAYOUTS = ["none", "none-dp2-z1", "none-pp2", "1d-2-cp2", "1d-4", "2d-4", "1d-2-dp2-z2", "2.5d-8-d2", "3d-8"]
# 600 bytes of the built-in text: 33 train windows of 16 tokens, so the 33rd
# row (step 5 of 8 rows) starts the second epoch, inside the resumed steps.
# Two layers: enough for pp=2 (one block a stage).
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


def keys(name: str) -> str:
    """The `tpctl train` keys of layout `name` (`2d-4-pp2-dp2-z1`: mode=2d size=4 pp=2 dp=2 zero=1)."""
    layout = Layout.parse(name)
    # 8 rows cut by dp and 2d's row split leave too few for the default
    # number of micro-batches (at least 3): two fit every layout here.
    micro = ["pipeline.microbatches=2"] if layout.pp > 1 else []
    return " ".join(layout.overrides() + micro)


def resumes(save: str, names: list[str], steps: int) -> int:
    half = steps // 2
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        first = Path(tmp) / "first"
        reference = train(keys(save), first, steps, f"checkpoint.every={half}")
        summary = json.loads((first / "summary.json").read_text())
        print(f"save layout {save} ({Layout.parse(save).world} ranks): {steps} steps in "
              f"{time.perf_counter() - t:.0f} s; {summary['data']}")
        print("| resumed in | ranks | steps | data_hash equal | max rel. loss difference | wall |")
        print("|---|---|---|---|---|---|")
        for name in names:
            t = time.perf_counter()
            got = train(keys(name), Path(tmp) / name, steps, f"train.resume={first / 'checkpoints' / f'step_{half}'}")
            want = reference[half:]
            same = [g["data_hash"] for g in got] == [w["data_hash"] for w in want]
            rel = max(abs(g["loss"] - w["loss"]) / abs(w["loss"]) for g, w in zip(got, want))
            ranks = Layout.parse(name).world
            ok = same and rel <= 1e-6 and [g["step"] for g in got] == list(range(half + 1, steps + 1))
            bad += not ok
            print(f"| {name} | {ranks} | {half + 1}-{steps} | {'yes' if same else 'NO'} | {rel:.1e} | "
                  f"{time.perf_counter() - t:.0f} s |", flush=True)
    print(f"{len(names) - bad} of {len(names)} layouts read the same tokens and continue the loss within 1e-6")
    return 1 if bad else 0


def _layout(name: str) -> str:
    """argparse's check of a layout name (Layout.parse's error as its message)."""
    try:
        Layout.parse(name).validate()
    except (ValueError, ConfigError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return name


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--windows", nargs="*", type=float, default=[1e6, 1e7, 1e8],
                   help="epoch sizes to price (none: skip)")
    p.add_argument("--save", type=_layout, default=SAVE, help=f"layout that writes the checkpoint (default {SAVE})")
    p.add_argument("--layouts", nargs="*", type=_layout, default=LAYOUTS,
                   help="layout names to resume in (default: %(default)s; none given: skip)")
    p.add_argument("--steps", type=int, default=8, help="steps of each run; the checkpoint is at half")
    args = p.parse_args()
    if args.windows:
        permutation_cost([int(n) for n in args.windows])
    return resumes(args.save, args.layouts, args.steps) if args.layouts else 0


if __name__ == "__main__":
    sys.exit(main())
