"""`tpctl plan`: what each way of splitting N ranks costs, before renting them.

For every valid layout (mode, size, depth, pp, dp) of a world of N ranks, computed
from the model's shapes (built on the meta device, nothing materialised) and
each mode's algorithm as the code in `tpctl/parallel/` runs it:

  * every ZeRO stage of the layouts with data-parallel replicas (zero=1..3,
    parallel/data_parallel/zero.py): what it shards, and the gathers and reduce-scatters
    it adds;
  * per-rank memory: parameters, gradients, AdamW state, activations
    (estimate), and under ZeRO-3 the parameters gathered at once;
  * per-rank FLOPs of one optimizer step;
  * per-step communication: payload bytes (what `comm.CommStats` counts),
    ring wire bytes and calls, per collective kind and per mesh group.

The communication counts are exact: `tests/test_plan.py` runs a whole GPT
through a train step in every mode and asserts the counted bytes and calls
equal these. With a hardware profile (`configs/hardware_profiles/*.yaml`) it predicts
step time as compute / (peak x efficiency) plus, per collective, latency x
ring steps + wire bytes / bandwidth of the slowest link its group spans (NVLink
inside a node, the network across nodes), with no overlap assumed, and says
which splits fit in its memory per rank (`memory=GIB` plans for less: a
shared device, room kept for other work) -- and which fit only with ZeRO.

    tpctl plan model=gpt-small world=64 hardware=h100 [memory=GIB] [train.batch_size=...] [--json]
    tpctl plan --calibrate [hardware=cpu]     # fit the CPU profile from a short probe
    tpctl plan --auto world=64 hardware=h100  # every runnable choice, the five fastest that fit
                                              # (tpctl/cost/auto.py; `tpctl train layout=auto world=N` runs the first)
"""

from __future__ import annotations

import dataclasses
import json
from typing import Optional

from tpctl.commands.options import integer, parse_options, text
from tpctl.cost.planner import KIND_ABBREV, Hardware, SplitPlan, load_hardware, plan_world
from tpctl.errors import ConfigError, fail


def _parse(args: list[str]):
    ranks = "expected a positive number of ranks"
    return parse_options(args, {"world": (None, integer(1, ranks)), "hardware": (None, text), "memory": (None, gib)},
                         flags=("--json", "--calibrate", "--auto"))


def gib(key: str, value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not number > 0 or number == float("inf"):
        raise ConfigError(key, value, "expected a positive number of GiB per rank")
    return number


USAGE = """\
usage: tpctl plan model=NAME world=N [hardware=cpu|a100|h100|v100 [memory=GIB]] [train.batch_size=B train.seq_len=T ...] [--json]
       tpctl plan --auto model=NAME world=N [hardware=cpu|a100|h100|v100] [memory=GIB] [--json]
       tpctl plan --calibrate [hardware=cpu]
"""


def main(args: list[str]) -> int:
    if any(a in ("-h", "--help") for a in args):
        print(USAGE + __doc__, end="")
        return 0
    try:
        opts, overrides = _parse(args)
        world, hardware, as_json = opts["world"], opts["hardware"], opts["json"]
        if opts["calibrate"]:
            from tpctl.cost.calibrate import calibrate as run_calibration

            probe_world = 4 if world is None else integer(2, "expected at least 2 ranks to probe the network")("world", str(world))
            return run_calibration(hardware or "cpu", probe_world, overrides)
        if world is None:
            raise ConfigError("world", "(missing)", "expected world=N, the number of ranks to plan for")
        if opts["auto"]:
            from .plan_auto import plan_auto

            return plan_auto(world, hardware or "cpu", opts["memory"], overrides, as_json)
        from tpctl.config import compose_jobs

        cfg = compose_jobs(overrides)[0]
        hw = load_hardware(hardware) if hardware else None
        if opts["memory"] is not None:
            if hw is None:
                raise ConfigError("memory", opts["memory"], "plans against a hardware profile's memory: add hardware=NAME")
            hw = dataclasses.replace(hw, memory_bytes=opts["memory"] * 2**30)
        plans, invalid = plan_world(cfg, world, hw)
    except ConfigError as e:
        return fail(e)
    if not plans:  # an empty table would read as "nothing to say"
        why = "; ".join(f"{s.label()}: {reason}" for s, reason in invalid) or "no mode has a size that divides it"
        return fail(f"invalid config: world={world}: no split of {world} ranks is valid for this model and batch: {why}")
    if as_json:
        print(json.dumps({"world": world, "hardware": dataclasses.asdict(hw) if hw else None,
                          "model": dict(cfg.model), "batch_size": cfg.train.batch_size,
                          "seq_len": cfg.train.seq_len, "recommended": plans[0].label if hw and plans and plans[0].fits else None,
                          "splits": [p.to_json() for p in plans],
                          "invalid": [{"label": s.label(), "reason": why} for s, why in invalid]}, indent=1))
        return 0
    print_table(plans, invalid, cfg, world, hw)
    return 0


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def print_table(plans: list[SplitPlan], invalid, cfg, world: int, hw: Optional[Hardware]) -> None:
    from rich.console import Console
    from rich.table import Table

    m, t = cfg.model, cfg.train
    title = (f"tpctl plan: {m.arch} {m.n_layer}x{m.n_embd} (vocab {m.vocab_size}) on {world} ranks, "
             f"batch {t.batch_size} x seq {t.seq_len}" + (f", hardware {hw.name}" if hw else ""))
    table = Table(title=title, show_lines=False)
    cols = ["", "split", "params MiB", "grads MiB", "AdamW MiB", "act MiB*", "total GiB", "GFLOP", "comm MiB", "wire MiB",
            "calls", "by kind (MiB / calls)"]
    if hw:
        cols += ["compute ms", "comm ms", "step ms"]
    for c in cols:
        table.add_column(c, justify="left" if c in ("split", "by kind (MiB / calls)", "") else "right")
    for rank, p in enumerate(plans):
        kinds = "  ".join(f"{KIND_ABBREV[k]}:{_mib(v['bytes'])}/{v['calls']}"
                          for k, v in sorted(p.by_kind().items()))
        mark = "★" if hw and rank == 0 and p.fits else ("over" if hw and p.fits is False else ("z" if p.fits_by_zero else ""))
        row = [mark, p.label, _mib(p.param_bytes), _mib(p.grad_bytes),
               _mib(p.optim_bytes), _mib(p.activation_bytes), f"{p.memory_bytes / 2**30:,.1f}", f"{p.flops / 1e9:,.1f}", _mib(p.comm_bytes),
               _mib(p.wire_bytes), str(sum(c.calls for c in p.comm.values())), kinds]
        if hw:
            row += [f"{p.compute_s * 1e3:,.2f}", f"{p.comm_s * 1e3:,.2f}", f"{p.step_time_s * 1e3:,.2f}"]
        table.add_row(*row)
    console = Console(width=300)
    console.print(table)
    console.print("per rank, per optimizer step; comm = payload bytes handed to collectives (as comm.py counts them), "
                  "wire = what ring algorithms send; kinds: ar=all_reduce ag=all_gather rs=reduce_scatter bc=broadcast re=reduce "
                  "p2p=point-to-point sends between pipeline stages (pp: the stage holding the most memory; its step "
                  "time stretched by the schedule's bubble). * activations: saved-for-backward estimate of one "
                  "micro-batch (pp: of the micro-batches a stage holds in flight)." +
                  (f" ★ recommended: the fastest predicted step that fits in {hw.memory_bytes / 2**30:,.1f} GiB per rank; "
                   "over: does not fit (raise train.grad_accum or the world); z: fits only with its ZeRO stage." if hw else ""))
    by_zero = [p for p in plans if p.fits_by_zero]
    if by_zero:
        console.print(f"ZeRO makes {len(by_zero)} split(s) fit in {hw.memory_bytes / 2**30:,.1f} GiB per rank that do not "
                      "with zero=0: " + ", ".join(f"{p.label} ({p.memory_bytes / 2**30:,.2f} GiB)" for p in by_zero))
    if hw and plans and not plans[0].fits:
        console.print("no split fits in memory: raise train.grad_accum (smaller micro-batches) or the world size")
    for s, why in invalid:
        console.print(f"  not valid: {s.label()}: {why}")
