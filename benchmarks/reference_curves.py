"""The curves of 15 reference layouts, for a restructuring that must not
change a bit: run this on the commit before and after, then compare.

    python benchmarks/reference_curves.py --out before.json       # on the old commit
    python benchmarks/reference_curves.py --out after.json --compare before.json

Each layout trains gpt-tiny (2 layers, dropout 0.1) on the built-in text for
a few steps through `tpctl train`, as a user would, with a validation pass;
the loss, grad-norm and val-loss of every step are written with all their
digits (repr of the float in metrics.jsonl). --compare exits 1 naming the
first layout and step whose numbers differ in any bit.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Every mode, dp with each ZeRO stage, pipeline stages, context parallelism,
# sequence parallelism and a composition of several.
LAYOUTS = {
    "none": "mode=none",
    "none-dp2-zero1": "mode=none dp=2 zero=1",
    "1d-2": "mode=1d size=2",
    "1d-2-sp": "mode=1d size=2 seq_parallel=true",
    "1d-4": "mode=1d size=4",
    "1d-2-dp2-zero2": "mode=1d size=2 dp=2 zero=2",
    "1d-2-dp2-zero3": "mode=1d size=2 dp=2 zero=3",
    "2d-4": "mode=2d size=4",
    "2d-4-dp2": "mode=2d size=4 dp=2",
    "2.5d-8-d2": "mode=2.5d size=8 depth=2",
    "3d-8": "mode=3d size=8",
    "none-pp2": "mode=none pp=2",
    "1d-2-pp2-dp2": "mode=1d size=2 pp=2 dp=2",
    "1d-2-cp2": "mode=1d size=2 cp=2",
    "none-cp2-ulysses": "mode=none cp=2 context.impl=ulysses",
}
COMMON = ("model.n_layer=2 model.n_embd=32 model.n_head=4 model.dropout=0.1 train.steps=6 train.batch_size=8 "
          "train.seq_len=32 train.log_every=1 train.eval_every=3 train.eval_batches=1 train.progress=false "
          "optim.warmup_steps=2")
KEYS = ("loss", "grad_norm", "val_loss")


def run(name: str, keys: str, tpctl: str, extra: str = "") -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [tpctl, "train", *keys.split(), *COMMON.split(), *extra.split(), f"hydra.run.dir={tmp}/run"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
        if done.returncode != 0:
            raise SystemExit(f"{name}: exit {done.returncode}\n{done.stderr[-2000:]}")
        rows = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    return [{k: repr(r[k]) for k in ("step", *KEYS) if k in r} for r in rows if any(k in r for k in KEYS)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--compare", help="a JSON of an earlier run: exit 1 unless every number is bit-identical")
    ap.add_argument("--tpctl", default=str(Path(sys.executable).with_name("tpctl")))
    ap.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS), help="default: all 15")
    ap.add_argument("--extra", default="", help="overrides added to every run (data.order=random: the curves of a "
                                                 "checkout from before data.order existed)")
    args = ap.parse_args()
    curves = {}
    for name in args.layouts:
        keys = LAYOUTS[name]
        start = time.monotonic()
        curves[name] = run(name, keys, args.tpctl, args.extra)
        print(f"{name:18s} {len(curves[name])} rows  {time.monotonic() - start:5.1f} s", flush=True)
    Path(args.out).write_text(json.dumps(curves, indent=1))
    if not args.compare:
        return 0
    before = json.loads(Path(args.compare).read_text())
    same = 0
    for name, rows in curves.items():
        if rows != before.get(name):
            diff = next((f"step {a.get('step')}: {a} vs {b}" for a, b in zip(rows, before.get(name) or []) if a != b),
                        "a different number of rows")
            print(f"DIFFERS {name}: {diff}")
        else:
            same += 1
    print(f"{same}/{len(curves)} layouts bit-identical (loss, grad_norm, val_loss of every step)")
    return 0 if same == len(curves) else 1


if __name__ == "__main__":
    sys.exit(main())
