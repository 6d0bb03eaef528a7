"""Pipeline schedules measured: gpt-small's shape with 8 blocks, per
schedule and number of micro-batches M, on P CPU ranks (gloo).

    python benchmarks/pipeline.py [--stages 2 4] [--micro 4 8] [--steps 3] [--seq 32] [--batch 16] [--tiny] [--json OUT]

For each P: the same world without stages (pp=1: P data-parallel replicas
of the whole model) is the reference; then pp=P with GPipe, 1F1B and the
interleaved 1F1B (2 chunks per rank, when the 8 blocks allow), each with
every M. Per row:

  * ms/step (median over the timed steps) and its ratio to pp=1 on the
    same world;
  * the bubble: measured (each rank's idle share of its steps: 1 - busy /
    wall, busy = its chunks' forwards, backwards and loss; mean over the
    ranks), the plan's (`tpctl plan`: the stages' FLOPs as the cut left
    them, PipelineSpec.bubble_for; equal stages give (p-1)/(v*m+p-1)), and
    the formula for the
    stages' measured costs (the slowest stage paces the steady state:
    wall = (m - 1 + (v-1)/v) * t_max + sum(t_r) / v, t_r a rank's busy
    time per micro-batch), which is what equal stages would give exactly;
  * stage 0's activation peak: the most bytes torch held at once during
    one forward_backward beyond what it held before (gradients already
    allocated), from the profiler's allocation events;
  * point-to-point bytes a step sends (comm.py's count, the stage-0 rank).

Every number comes from the ranks; nothing is assumed. On a shared
machine the ranks of a stage compete for cores with the other stages and
with the neighbours: the bubble is measured on that machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GPT_SMALL_8 = dict(vocab_size=50257, n_layer=8, n_head=12, n_embd=768, block_size=1024, dropout=0.0)
# --tiny: the same 8 blocks, narrow (a smoke run: tests/test_benchmarks.py).
TINY_8 = dict(vocab_size=256, n_layer=8, n_head=2, n_embd=16, block_size=64, dropout=0.0)


def _config(args, pp: int, schedule: str, m: int, dp: int):
    from omegaconf import OmegaConf

    from tpctl.config import default_config

    cfg = default_config(**(TINY_8 if args.tiny else GPT_SMALL_8))
    for key, value in {"pp": pp, "dp": dp, "train.batch_size": args.batch, "train.seq_len": args.seq,
                       "pipeline.schedule": schedule, "pipeline.microbatches": m,
                       "optim.warmup_steps": 0}.items():
        OmegaConf.update(cfg, key, value)
    if args.split and pp > 1 and schedule != "interleaved":
        cfg.pipeline.split = args.split[str(pp)]
    return cfg


def _measure(cfg_dict: dict, steps: int) -> dict:
    """On a pool rank: build the layout's model, run one warm-up step, time
    `steps` steps, then one forward_backward under the allocation profiler."""
    import torch
    from omegaconf import OmegaConf

    from tpctl.cost.measure import peak_allocated_bytes
    from tpctl.parallel import comm
    from tpctl.training.build import build_run

    torch.set_num_threads(1)
    cfg = OmegaConf.create(cfg_dict)
    run = build_run(cfg, schedule=False)  # a constant learning rate: nothing here reads the curve
    par, step = run.par, run.step
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1), generator=g)
    x, y = ids[:, :-1], ids[:, 1:]
    micros = step.micro_count

    def batches():
        return [(par.shard_batch(x, k, micros), par.shard_targets(y, k, micros)) for k in range(micros)]

    times, sends = [], []
    for i in range(steps + 1):
        comm.barrier()
        comm.STATS.reset()
        start = time.perf_counter()
        float(step(batches(), i)["loss"])
        if i:  # the first step warms up
            times.append(time.perf_counter() - start)
            sends.append(comm.STATS.bytes.get("send", 0))
    pipeline = par.pipeline
    timed = pipeline.timings[1:] if pipeline is not None else []
    out = {"times": times, "send_bytes": statistics.median(sends) if sends else 0,
           "bubble": pipeline.bubble() if pipeline is not None else None,
           "busy_per_micro": statistics.median(b for b, _ in timed) / micros if timed else None}
    # Stage 0's activations: one more forward_backward, gradients already held.
    step.optimizer.zero_grad(set_to_none=False)
    comm.barrier()
    out["act_peak"] = peak_allocated_bytes(lambda: step.forward_backward(batches()))
    comm.barrier()
    return out


def _run(pool_of, args, pp: int, schedule: str, m: int, world: int) -> dict:
    dp = world // pp
    cfg = _config(args, pp, schedule, m, dp)
    from omegaconf import OmegaConf

    from tpctl.config import check_layout
    from tpctl.parallel.layout import Layout

    layout = Layout.from_config(cfg)
    check_layout(cfg, layout)
    per_rank = pool_of(world).run(_measure, OmegaConf.to_container(cfg, resolve=True), args.steps)
    steps = [max(r["times"][k] for r in per_rank) for k in range(args.steps)]
    row = {"P": pp, "world": world, "schedule": schedule if pp > 1 else "pp=1 (dp)", "M": m if pp > 1 else None,
           "ms": statistics.median(steps) * 1e3, "act_peak_stage0": per_rank[0]["act_peak"],
           "send_bytes_stage0": per_rank[0]["send_bytes"]}
    if pp > 1:
        from tpctl.parallel.pipeline.stages import pipeline_of

        spec = pipeline_of(layout, cfg)
        from tpctl.cost.planner import model_shape, plan_split

        busy = [r["busy_per_micro"] for r in per_rank[:pp]]  # replica 0's stages, in pp order
        plan = plan_split(model_shape(cfg.model, cfg.seed), layout, cfg.train.batch_size, cfg.train.seq_len,
                          pipeline=spec)
        row.update(bubble=statistics.mean(r["bubble"] for r in per_rank), planned=plan.bubble,
                   planned_for_costs=spec.bubble_for(busy), busy_ms=[b * 1e3 for b in busy], in_flight=spec.in_flight(0),
                   v=spec.virtual, split=[len(r) for r in _cut(cfg, layout)])
    return row


def _cut(cfg, layout):
    """The blocks of each chunk (as the stages are cut)."""
    from tpctl.models import build_model
    from tpctl.training.build import build_parallelism

    par = build_parallelism(cfg, layout, groups=False)
    par.pipeline.assign(build_model(cfg.model, cfg.seed, lazy=True))
    return par.pipeline.blocks_of


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    p.add_argument("--micro", type=int, nargs="+", default=[4, 8])
    p.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--split", type=json.loads, default=None,
                   help='blocks per stage by P, e.g. \'{"2": [5, 3]}\' (default: balanced by parameters)')
    p.add_argument("--tiny", action="store_true", help="a narrow model of the same 8 blocks (a smoke run)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--reference-ms", type=json.loads, default=None,
                   help='pp=1 step times already measured, by world, e.g. \'{"4": 11260}\' (skips those runs)')
    args = p.parse_args()

    from tpctl.launch.pool import DistPool

    pools: dict[int, DistPool] = {}

    def pool_of(world: int) -> DistPool:
        if world not in pools:
            for old in pools.values():
                old.close()
            pools.clear()
            pools[world] = DistPool(world, timeout_s=3600)
        return pools[world]

    rows = []
    try:
        for world in args.stages:
            known = (args.reference_ms or {}).get(str(world))
            if known is None:
                base = _run(pool_of, args, 1, "1f1b", 1, world)
                rows.append(base)
                print(_line(base, base), flush=True)
            else:
                base = {"ms": known}
            for schedule in args.schedules:
                for m in args.micro:
                    if schedule == "interleaved" and 2 * world > GPT_SMALL_8["n_layer"]:
                        continue
                    row = _run(pool_of, args, world, schedule, m, world)
                    row["x_pp1"] = base["ms"] / row["ms"]
                    rows.append(row)
                    print(_line(row, base), flush=True)
    finally:
        for pool in pools.values():
            pool.close()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


def _line(row: dict, base: dict) -> str:
    mib = lambda n: f"{n / 2**20:,.1f}"  # noqa: E731
    if row["P"] == 1:
        return (f"| {row['world']} | pp=1 (dp={row['world']}) | - | {row['ms']:,.0f} | 1.00 | - | - | - | "
                f"{mib(row['act_peak_stage0'])} | - |")
    return (f"| {row['world']} | {row['schedule']}{' v=2' if row['v'] > 1 else ''} {row['split']} | {row['M']} | "
            f"{row['ms']:,.0f} | {base['ms'] / row['ms']:.2f} | {row['bubble']:.2f} | {row['planned']:.2f} | "
            f"{row['planned_for_costs']:.2f} | {mib(row['act_peak_stage0'])} | {mib(row['send_bytes_stage0'])} |")


if __name__ == "__main__":
    print("| world | schedule [blocks per stage] | M | ms/step | x pp=1 | bubble measured | planned (stage FLOPs) | "
          "planned for the stages' costs | stage-0 activation peak MiB | p2p MiB/step (stage 0) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    sys.exit(main())
