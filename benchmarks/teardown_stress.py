"""Stress check of the way workers end: many short `tpctl train` and
`tpctl generate` runs, a few at a time, each of which must exit 0 with no
"terminate called" and no "Fatal Python error" on its stderr (a finished
rank once died with SIGABRT in its teardown at random, more often on a
loaded machine: launch/worker.py, `leave`).

    python benchmarks/teardown_stress.py                     # 16 trainings, 8 generations, 2 at a time
    python benchmarks/teardown_stress.py --trainings 4 --generations 2 --parallel 2 --out /tmp/stress

Trainings cycle through mode=none dp=2, 1d size=2, 2d size=4 and 1d size=2
dp=2 on a tiny GPT, each writing a checkpoint at its end (DCP's import is
what keeps the world group alive after destroy_process_group); generations
decode from the first training's checkpoint in mode=none and 1d size=2.
Prints one line per run and a last line `runs N, failed F`; exits 1 when
any failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TINY = ["model=gpt-tiny", "model.n_embd=32", "model.n_layer=2", "model.block_size=32", "data.max_bytes=200000",
        "train.batch_size=8", "train.seq_len=16", "train.steps=6", "train.log_every=3", "train.eval_every=0",
        "train.progress=false", "checkpoint.every=0"]
LAYOUTS = [["mode=none", "dp=2"], ["mode=1d", "size=2"], ["mode=2d", "size=4"], ["mode=1d", "size=2", "dp=2"]]
GENERATE_LAYOUTS = [["mode=none"], ["mode=1d", "size=2"]]
BAD = ("terminate called", "Fatal Python error")


def tpctl(args: list[str], timeout: float) -> tuple[int, str, float]:
    started = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run([sys.executable, "-m", "tpctl.cli", *args], capture_output=True, text=True,
                              timeout=timeout, env=env)
        return done.returncode, done.stderr, time.perf_counter() - started
    except subprocess.TimeoutExpired as e:
        return -1, f"timed out after {timeout}s\n{e.stderr or ''}", time.perf_counter() - started


def verdict(name: str, result: tuple[int, str, float]) -> bool:
    code, stderr, seconds = result
    bad = [b for b in BAD if b in stderr]
    ok = code == 0 and not bad
    last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    print(f"{'ok    ' if ok else 'FAILED'} {name}: exit {code} in {seconds:.1f}s" + ("" if ok else f": {bad or last}"),
          flush=True)
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainings", type=int, default=16)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--out", default=None, help="where the run dirs go (default: a temporary directory)")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="tpctl-stress-"))
    started = time.perf_counter()

    def train(k: int) -> bool:
        layout = LAYOUTS[k % len(LAYOUTS)]
        run = out / f"train{k:02d}"
        return verdict(f"train {k} {' '.join(layout)}",
                       tpctl(["train", *TINY, *layout, f"seed={k}", f"hydra.run.dir={run}"], args.timeout))

    # The first training gives the generations their checkpoint.
    results = [train(0)]
    source = out / "train00" / "checkpoints" / f"step_6"

    def generate(k: int) -> bool:
        layout = GENERATE_LAYOUTS[k % len(GENERATE_LAYOUTS)]
        return verdict(f"generate {k} {' '.join(layout)}",
                       tpctl(["generate", str(source), "prompt=def ", "max_new_tokens=8", "temperature=0", *layout],
                             args.timeout))

    jobs = [lambda k=k: train(k) for k in range(1, args.trainings)]
    jobs += [lambda k=k: generate(k) for k in range(args.generations)] if source.is_dir() else []
    # Interleaved, so trainings and generations run beside each other.
    order = [j for pair in zip(jobs[:len(jobs) // 2], jobs[len(jobs) // 2:]) for j in pair] + jobs[2 * (len(jobs) // 2):]
    with ThreadPoolExecutor(args.parallel) as pool:
        results += list(pool.map(lambda job: job(), order))
    runs = args.trainings + (args.generations if source.is_dir() else 0)
    failed = runs - sum(results)
    print(f"runs {runs}, failed {failed} ({time.perf_counter() - started:.0f}s, {args.parallel} at a time, in {out})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
