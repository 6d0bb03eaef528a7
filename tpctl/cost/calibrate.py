"""`tpctl plan --calibrate`: fit the CPU hardware profile from a short probe.

Four measurements on this machine, with the ranks tpctl would run (gloo,
one thread per rank):
  * compute: the best of 10 steps of `mode=none` on one rank for the
    configured model (the machine's speed when the load it shares lets it
    run; `tpctl bench` shows the best step beside the median), at its batch
    and at an eighth of it; a line through (FLOPs, time)
    gives peak_flops (the slope: everything that scales with the work --
    norms, softmax, AdamW -- folded into one effective rate) and the fixed
    cost of a block's operators per micro-batch (block_overhead_s, the
    intercept over the blocks: most of a small model's CPU step);
  * communication: all-reduces of 4 B .. 4 MiB over `world` ranks (default 4),
    BURST of them back to back (the median of the repetitions: the rate a
    step's collectives see, not the best single one); a least-squares line
    through (wire bytes, time) gives the bandwidth (slope) and the latency
    per ring step (intercept / ring steps);
  * the other kinds: a reduce-scatter's and an all-gather's time against
    what the all-reduce's fit gives them (`<kind>_factor`: the planner
    stretches every one of that kind by it), each set against the
    all-reduce of its size timed beside it, at every size of KIND_SIZES,
    and the median taken: the machine's mood moves both alike;
  * the process: the peak resident set of a rank that trained a
    near-empty model (base_bytes, the floor of layout=auto's predicted peak
    on CPU).
The fitted numbers are written to configs/hardware_profiles/<hardware>.yaml.
"""

from __future__ import annotations

import datetime
import os
import statistics
import time


def _probe(cfg_dict: dict, sizes: list[int], reps: int) -> dict:
    import torch
    import torch.distributed as dist

    from tpctl.parallel import comm

    world = dist.get_world_size()
    out = {}
    # The floor first, on the last rank: the probes below leave gloo's
    # buffers for 4 MiB messages in the peak, which a run of small messages
    # never has.
    out["base_bytes"] = _floor(cfg_dict) if dist.get_rank() == world - 1 else None
    if dist.get_rank() == 0:  # one rank alone, as a mode=none run: the configured batch, then a small one
        out["none_s"] = _best_step(cfg_dict, reps)
        out["small_s"] = _best_step(_small(cfg_dict), reps)
    comm.barrier()
    out["all_reduce"] = []
    for n in sizes:
        buf = torch.ones(n)
        times = []
        for _ in range(reps + 2):
            comm.barrier()
            t0 = time.perf_counter()
            for _ in range(BURST):
                comm.all_reduce(buf, dist.group.WORLD)
            times.append((time.perf_counter() - t0) / BURST)
        times = times[2:]
        out["all_reduce"].append((n * 4, statistics.median(times), world))
    out["kinds"] = {kind: {n: _burst(kind, n, reps) for n in KIND_SIZES} for kind in FACTOR_KINDS}
    return out


# All-reduces timed back to back, as a step issues them: one all-reduce right
# after a barrier, with every rank waiting and nothing else running, is the
# best case, about half of what the same message costs inside a step when
# more ranks than cores share the machine (measured: 16 floats over 8 gloo
# ranks on 2 cores, 9 ms after a barrier, ~20 ms back to back).
BURST = 5
# The other collectives a step waits for (1d's sequence parallelism, 3d,
# ZeRO-3's gathers), each timed at one activation-sized message against the
# all-reduce's fit: gloo's reduce-scatter costs about an all-reduce, not the
# p - 1 ring steps the planner counts for it (NCCL's).
FACTOR_KINDS = ("reduce_scatter", "all_gather")
# Floats per probe: the activation-sized messages (64 KiB .. 4 MiB), each
# also one of the all-reduce's sizes.
KIND_SIZES = (16384, 262144, 1048576)


def _burst(kind: str, numel: int, reps: int) -> float:
    """The median time of a `kind` of `numel` floats (the full tensor) over
    the world, BURST back to back, as the all-reduces are timed."""
    import torch
    import torch.distributed as dist

    from tpctl.parallel import comm

    group = dist.group.WORLD
    full = torch.ones(numel)
    block = full[: numel // dist.get_world_size()].contiguous()
    call = {"reduce_scatter": lambda: comm.reduce_scatter(full, group, 0),
            "all_gather": lambda: comm.all_gather(block, group, 0)}[kind]
    times = []
    for _ in range(reps + 2):
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(BURST):
            call()
        times.append((time.perf_counter() - t0) / BURST)
    return statistics.median(times[2:])


def _kind_factor(kind: str, times: dict, all_reduce: list, world: int, latency: float, bw: float) -> float:
    """How much longer `kind` takes than the fit gives it: at each size, its
    time over the all-reduce's of that size, times the fit's all-reduce over
    the fit's `kind` (1 where gloo ran it as the fit says); the median."""
    from .planner import LATENCY_STEPS, WIRE_FACTOR

    def fit(k: str, numel: int) -> float:
        return LATENCY_STEPS.get(k, lambda p: p - 1)(world) * latency + WIRE_FACTOR[k](world) * numel * 4 / bw

    reduced = {b // 4: t for b, t, _ in all_reduce}
    return statistics.median(t / reduced[n] * fit("all_reduce", n) / fit(kind, n) for n, t in times.items())


def _small(cfg_dict: dict) -> dict:
    """The config with an eighth of its batch: the same blocks, few FLOPs."""
    import copy

    small = copy.deepcopy(cfg_dict)
    small["train"]["batch_size"] = max(1, cfg_dict["train"]["batch_size"] // 8)
    return small


def _best_step(cfg_dict: dict, reps: int) -> float:
    from . import measure

    measure.setup(measure.REFERENCE, cfg_dict, 1, None)
    st = measure.rank_state[measure.REFERENCE]
    times = []
    for k in range(reps + 2):
        t0 = time.perf_counter()
        measure.loss_and_step(st, measure.REFERENCE)
        if k >= 2:
            times.append(time.perf_counter() - t0)
    measure.rank_state.pop(measure.REFERENCE)
    return min(times)


# A model of next to no bytes: what a rank holds training it is the process itself.
FLOOR_MODEL = {"n_layer": 1, "n_embd": 16, "n_head": 2, "block_size": 16}


def _floor(cfg_dict: dict) -> int:
    """The peak resident set of a rank that trained a near-empty model
    (the interpreter, torch, gloo and everything a training step imports)."""
    import torch
    from omegaconf import OmegaConf

    from tpctl.parallel.layout import Layout
    from tpctl.training.build import build_run
    from tpctl.training.loop import peak_rss_bytes

    cfg = OmegaConf.create(cfg_dict)
    cfg.model.update(FLOOR_MODEL)
    cfg.train.batch_size, cfg.train.seq_len = 2, 16
    run = build_run(cfg, layout=Layout(), groups=False, schedule=False)
    ids = torch.zeros(2, 17, dtype=torch.long)
    run.step([(ids[:, :-1], ids[:, 1:])], 0)
    return peak_rss_bytes()


# Near-empty models, a tpctl one and a Hugging Face one: the peak of a rank
# training one is its process's (train_floors).
TRAIN_FLOORS = {
    "train_base_bytes": ["model=gpt-tiny", "model.n_layer=1", "model.n_embd=16", "model.n_head=2", "model.block_size=16"],
    "train_base_bytes_hf": ["recipe=llama-tiny-none", "model.n_layer=1"],
}


def train_floors() -> dict[str, float]:
    """The floor of a `tpctl train` worker (the profile's train_base_bytes,
    and train_base_bytes_hf for a Hugging Face model): one rank trains a
    near-empty model 2 steps as any run does (forked from the warm server),
    on the default data (data=text: its corpus is resident in every run of
    it); its peak RSS less what the planner counts above the process."""
    import json
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from tpctl.cost.memory_check import predict
    from tpctl.config import compose_jobs, validate

    short = ["train.batch_size=2", "train.seq_len=16", "train.steps=2", "train.eval_every=0",
             "checkpoint.every=0", "checkpoint.at_end=false", "train.progress=false", "train.sample_every=0"]
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for key, overrides in TRAIN_FLOORS.items():
            cfg = compose_jobs([*overrides, *short])[0]
            validate(cfg)
            above = predict(cfg, machine=False).worst.peak  # (the profile being written is not read)
            run_dir = Path(tmp) / key
            proc = subprocess.run([sys.executable, "-m", "tpctl.cli", "train", *overrides, *short,
                                   f"hydra.run.dir={run_dir}"], capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{key}: the near-empty run failed: {proc.stderr.strip().splitlines()[-1:]}")
            peak = json.loads((run_dir / "summary.json").read_text())["peak_rss_bytes_max_rank"]
            out[key] = float(peak - above)
    return out


def calibrate(hardware: str, world: int, overrides: list[str]) -> int:
    """Probe `world` gloo ranks with the config of `overrides`; write the profile."""
    import yaml

    from tpctl.config import compose_jobs
    from tpctl.parallel.layout import Layout
    from .hardware import HARDWARE_DIR
    from .planner import WIRE_FACTOR, model_shape, plan_split
    from tpctl.launch.pool import DistPool

    from omegaconf import OmegaConf

    cfg = compose_jobs(overrides)[0]
    sizes = [1, 1024, 16384, 262144, 1048576]
    pool = DistPool(world, timeout_s=300)
    try:
        results = pool.run(_probe, OmegaConf.to_container(cfg, resolve=True), sizes, 10)
        result = dict(results[0], base_bytes=results[-1]["base_bytes"])
    finally:
        pool.close()
    floors = train_floors()
    shape = model_shape(cfg.model, cfg.seed)
    flops = plan_split(shape, Layout(), cfg.train.batch_size, cfg.train.seq_len).flops  # one process
    small = plan_split(shape, Layout(), _small({"train": dict(cfg.train)})["train"]["batch_size"], cfg.train.seq_len).flops
    # step = blocks x overhead + FLOPs / peak, through the two batches: a
    # CPU step of a small model is mostly the fixed cost of its operators.
    slope = (result["none_s"] - result["small_s"]) / (flops - small)
    peak = 1 / slope if slope > 0 else flops / result["none_s"]
    overhead = max(0.0, result["none_s"] - flops / peak) / max(1, shape.attention_layers)
    xs = [WIRE_FACTOR["all_reduce"](p) * b for b, _, p in result["all_reduce"]]
    ys = [t for _, t, _ in result["all_reduce"]]
    # A least-squares line through (wire bytes, time): gloo on loopback is
    # not one latency plus one bandwidth (small messages switch algorithms),
    # so the line fits the KB..MB messages a model sends, not the 4 B one.
    steps = 2 * (world - 1)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    intercept = max(my - slope * mx, ys[0])
    latency, bw = intercept / steps, 1.0 / slope
    fit = [intercept + x * slope for x in xs]
    # each other kind's time over what the all-reduce's fit gives it, as a
    # ratio to the all-reduce of its size measured in the same probe
    factors = {kind: _kind_factor(kind, times, result["all_reduce"], world, latency, bw)
               for kind, times in result["kinds"].items()}
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    m = cfg.model
    profile = {
        "peak_flops": float(f"{peak:.4g}"), "efficiency": 1.0, "ranks_per_node": 1024,
        "cores": os.cpu_count() or 1, "comm_world": world, "base_bytes": float(result["base_bytes"]), **floors,
        "block_overhead_s": float(f"{overhead:.4g}"),
        "intra_bw": float(f"{bw:.4g}"), "intra_latency": float(f"{latency:.4g}"),
        "inter_bw": float(f"{bw:.4g}"), "inter_latency": float(f"{latency:.4g}"),
        **{f"{kind}_factor": float(f"{f:.3g}") for kind, f in factors.items()},
        "note": (f"calibrated {when} by tpctl plan --calibrate: mode=none step of {m.arch} {m.n_layer}x{m.n_embd} "
                 f"batch {cfg.train.batch_size}x{cfg.train.seq_len} took {result['none_s'] * 1e3:.1f} ms; "
                 f"gloo all-reduce over {world} ranks, {sizes[0] * 4} B..{sizes[-1] * 4 // 2**20} MiB"),
    }
    path = HARDWARE_DIR / f"{hardware}.yaml"
    header = ("# This machine: CPU ranks over gloo (TCP on loopback), one thread per rank, one node.\n"
              "# Written by `tpctl plan --calibrate` (see its note); compute slows by world/cores when\n"
              "# more ranks than cores share the machine.\n")
    path.write_text(header + yaml.safe_dump(profile, sort_keys=False))
    print(f"compute: {flops / 1e9:.3f} GFLOP per mode=none step in {result['none_s'] * 1e3:.1f} ms, {small / 1e9:.3f} in "
          f"{result['small_s'] * 1e3:.1f} ms -> {peak / 1e9:.2f} GFLOP/s per rank and {overhead * 1e3:.2f} ms per block "
          "(forward and backward) beside the FLOPs")
    for (b, t, p), f in zip(result["all_reduce"], fit):
        print(f"all_reduce {b:>9,} B over {p} ranks: {t * 1e6:9.1f} us  (fit: {f * 1e6:9.1f} us)")
    for kind, f in factors.items():
        times = ", ".join(f"{n * 4:,} B {t * 1e6:.1f} us" for n, t in result["kinds"][kind].items())
        print(f"{kind} over {world} ranks: {times}: {f:.2f} x what the all-reduce's fit gives it "
              f"(median over the sizes; {kind}_factor)")
    print(f"process: {result['base_bytes'] / 2**20:.1f} MiB resident per rank training a near-empty model (base_bytes); "
          f"a tpctl train worker's: {floors['train_base_bytes'] / 2**20:.1f} MiB, with a Hugging Face model "
          f"{floors['train_base_bytes_hf'] / 2**20:.1f} MiB (train_base_bytes, train_base_bytes_hf)")
    print(f"fit: bandwidth {bw / 1e9:.3f} GB/s per rank, latency {latency * 1e6:.1f} us per ring step")
    print(f"wrote {path}")
    return 0
