"""How right layout=auto is: the planner's predicted step time and peak
memory per rank beside the measured ones, for >= 20 choices of `--world`
gloo ranks on this machine (tpctl/cost/auto.py searches them; this script
measures a spread of its ranking, the pick included).

    python benchmarks/plan_accuracy.py                   # gpt-tiny, world 8, 24 choices
    python benchmarks/plan_accuracy.py --tiny            # the smoke run: world 2, 3 choices, 1-layer model
    python benchmarks/plan_accuracy.py --hardware cpu --count 24 --steps 8 -- model=gpt-tiny train.batch_size=16

Each choice trains `--steps` steps (after one warm-up) in a fresh pool of
ranks (so no choice inherits another's heap); measured: the median step
(each step as long as its slowest rank; the median, as `train layout=auto`
writes `measured_ms` and as --calibrate times the collectives: the step a
user sees, not the luckiest one) and each rank's peak RSS (VmHWM; glibc's mmap
threshold fixed at 1 MiB so freed tensors leave the resident set).
`--json PATH` writes every rank's step times beside each prediction.
Predicted: `search`'s step time on the hardware profile, and its peak
(the counted state, activations as the schedule holds them, temporaries,
and the profile's `base_bytes`, the process measured by
`tpctl plan --calibrate`). The last line:
    MAPE_step=..% max_mem_err=..% spearman=.. pick_gap=..%
pick_gap: the measured step of the predicted-fastest choice against the
fastest measured one.

    python benchmarks/plan_accuracy.py --recipes [NAME ...]   # `tpctl train --check` against real runs

--recipes: each recipe (configs/recipe/; all without names) trained for
`--steps` steps by `tpctl train` itself (workers forked as a real run's,
eval and checkpoints off), its largest rank's peak RSS (summary.json
peak_rss_bytes_max_rank) beside the peak `tpctl train --check` predicts for
its worst rank (cost/memory_check.py). The last line: max_mem_err=..%. On a machine shared with other work the step times
are noisy; choices run one after another, not interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

TINY = ["model=gpt-tiny", "model.n_layer=2", "model.n_embd=16", "model.n_head=2", "model.block_size=16",
        "train.batch_size=4", "train.seq_len=16"]


def measure(cfg_dict: dict, steps: int) -> dict:
    """On every rank of a fresh pool: `steps` training steps of the config."""
    import torch
    from omegaconf import OmegaConf

    from tpctl.launch.pool import pooled_run
    from tpctl.parallel import comm
    from tpctl.training.loop import peak_rss_bytes

    cfg = OmegaConf.create(cfg_dict)
    idle = _rss()
    run = pooled_run(cfg, schedule=False)
    built = _rss()
    par, step = run.par, run.step
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1), generator=gen)
    x, y = ids[:, :-1], ids[:, 1:]
    micros = step.micro_count
    batch = [(par.shard_batch(x, k, micros), par.shard_targets(y, k, micros)) for k in range(micros)]
    times, exposed = [], []
    for k in range(steps + 1):  # the first: warm-up
        comm.barrier()
        comm.STATS.reset()
        t0 = time.perf_counter()
        float(step(batch, k)["loss"])
        times.append(time.perf_counter() - t0)
        exposed.append(sum(comm.STATS.exposed_s.values()))
    return {"times": times[1:], "exposed": exposed[1:], "peak": peak_rss_bytes(), "idle": idle, "built": built}


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def measured(pool_class, world: int, cfg_dict: dict, steps: int, tries: int = 3) -> list[dict]:
    """`measure` on a fresh pool; a pool that does not start (its port
    taken by another process between choosing and binding it) is tried again."""
    for attempt in range(tries):
        pool = None
        try:
            pool = pool_class(world, timeout_s=300)
            return pool.run(measure, cfg_dict, steps)
        except Exception:
            if attempt == tries - 1:
                raise
        finally:
            if pool is not None:
                pool.close()
    raise AssertionError("unreachable")


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        for i, j in enumerate(order):
            r[j] = float(i)
        return r
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else 1.0


def spread(ranked: list, count: int) -> list:
    """`count` choices evenly over the ranking, the first (the pick) included."""
    if len(ranked) <= count:
        return list(ranked)
    return [ranked[round(i * (len(ranked) - 1) / (count - 1))] for i in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--count", type=int, default=24, help="choices measured (spread over the ranking)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json", help="write every rank's step times and the predictions here")
    parser.add_argument("--hardware", default="cpu")
    parser.add_argument("--tiny", action="store_true", help="the smoke run: world 2, 3 choices, a tiny model, 1 step")
    parser.add_argument("--recipes", nargs="*", help="predicted vs measured peak of real `tpctl train` runs of these recipes")
    parser.add_argument("overrides", nargs="*", help="config overrides (after --)")
    args = parser.parse_args()
    if args.recipes is not None:
        return recipes(args.recipes, args.steps)
    overrides = args.overrides or ["model=gpt-tiny", "train.batch_size=16", "train.seq_len=64"]
    if args.tiny:
        args.world, args.count, args.steps, overrides = 2, 3, 1, args.overrides or TINY
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(2**20))  # inherited by the pool's ranks

    from omegaconf import OmegaConf

    from tpctl.config import compose_jobs
    from tpctl.cost.auto import search
    from tpctl.cost.hardware import load_hardware
    from tpctl.launch.pool import DistPool

    cfg = compose_jobs(overrides)[0]
    hw = load_hardware(args.hardware)
    found = search(cfg, args.world, hw)
    chosen = spread(found.ranked, args.count)
    print(f"{len(found.ranked)} choices of {args.world} ranks fit; measuring {len(chosen)} on hardware={hw.name} "
          f"(base_bytes {hw.base_bytes / 2**20:.0f} MiB), {args.steps} steps each", flush=True)
    rows, dump = [], {}
    for cand in chosen:
        c = cand.choice.apply(OmegaConf.create(OmegaConf.to_container(cfg, resolve=True)))
        per_rank = measured(DistPool, args.world, OmegaConf.to_container(c, resolve=True), args.steps)
        rows.append((cand, step_time(per_rank), max(r["peak"] for r in per_rank), exposed_time(per_rank)))
        dump[cand.choice.name] = {"predicted_s": cand.step_time_s, "times": [r["times"] for r in per_rank],
                                  "exposed": [r["exposed"] for r in per_rank]}
        print(f"  {cand.choice.name:<34} predicted {cand.step_time_s * 1e3:8.2f} ms {cand.peak_bytes / 2**20:8.1f} MiB"
              f" | measured {rows[-1][1] * 1e3:8.2f} ms {rows[-1][2] / 2**20:8.1f} MiB", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dump, f, indent=1)
    report(rows, found.pick)


def step_time(per_rank: list[dict]) -> float:
    """The median step: each step lasts as long as its slowest rank."""
    return statistics.median(max(step) for step in zip(*(r["times"] for r in per_rank)))


def exposed_time(per_rank: list[dict]) -> float:
    """The median over steps of the time a rank's thread spent in
    collectives (issuing or waiting: comm.STATS.exposed_s), mean over ranks
    -- the measured side of the planner's exposed communication."""
    return statistics.median(statistics.fmean(step) for step in zip(*(r["exposed"] for r in per_rank)))


def report(rows: list, pick) -> None:
    print("\n| choice | predicted ms | measured ms | err | exposed comm: pred / meas ms "
          "| predicted peak MiB | measured peak MiB | err | above base: pred / meas MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    step_errs, mem_errs = [], []
    for cand, step_s, peak, exposed in rows:
        se = cand.step_time_s / step_s - 1
        me = cand.peak_bytes / peak - 1
        step_errs.append(abs(se))
        mem_errs.append(abs(me))
        base = cand.parts["process"]
        print(f"| {cand.choice.name} | {cand.step_time_s * 1e3:.2f} | {step_s * 1e3:.2f} | {se:+.0%} | "
              f"{cand.exposed_comm_s * 1e3:.1f} / {exposed * 1e3:.1f} | "
              f"{cand.peak_bytes / 2**20:.1f} | {peak / 2**20:.1f} | {me:+.1%} | "
              f"{(cand.peak_bytes - base) / 2**20:.1f} / {(peak - base) / 2**20:.1f} |")
    measured = [row[1] for row in rows]
    picked = next(row[1] for row in rows if row[0] is pick)
    rho = spearman([row[0].step_time_s for row in rows], measured)
    print(f"\nMAPE_step={100 * statistics.fmean(step_errs):.1f}% max_mem_err={100 * max(mem_errs):.1f}% "
          f"spearman={rho:.2f} pick_gap={100 * (picked / min(measured) - 1):.1f}%")


def recipes(names: list[str], steps: int) -> None:
    """Each recipe's worst rank: `tpctl train --check`'s predicted peak beside
    a real run's (benchmarks/check_accuracy.py, which also keeps and reuses
    the measured peaks)."""
    from check_accuracy import recipes as check_recipes  # (this script's folder is on sys.path)

    check_recipes(names, steps, None, None)


if __name__ == "__main__":
    main()
