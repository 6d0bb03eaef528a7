"""`tpctl plan --auto`: the search of layout=auto (tpctl/cost/auto.py) as a
table of the five fastest choices that fit, with what decided it."""

from __future__ import annotations

import dataclasses
import json
import time

from tpctl.errors import ConfigError, fail


def plan_auto(world: int, hardware: str, memory_gib, overrides: list[str], as_json: bool) -> int:
    import torch

    from tpctl.config import compose_jobs
    from tpctl.cost.auto import TOP, refusal, search
    from tpctl.cost.hardware import load_hardware

    start = time.perf_counter()
    try:
        cfg = compose_jobs(overrides)[0]
        hw = load_hardware(hardware)
        if memory_gib is not None:
            hw = dataclasses.replace(hw, memory_bytes=memory_gib * 2**30)
        torch.set_num_threads(1)  # the dry runs' tiny probes: one thread is faster than many sharing cores
        found = search(cfg, world, hw)
        error = refusal(found, world, hw)
    except ConfigError as e:
        return fail(e)
    if error is not None:
        return fail(error)
    elapsed = time.perf_counter() - start
    if as_json:
        print(json.dumps({"world": world, "hardware": hw.name, "memory_bytes": hw.memory_bytes, "seconds": elapsed,
                          "searched": len(found.ranked) + len(found.unfit), "splits": found.splits,
                          "pick": found.pick.to_json(), "top": [c.to_json() for c in found.ranked[:TOP]],
                          "unfit": len(found.unfit), "invalid": len(found.invalid)}, indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table

    m, t = cfg.model, cfg.train
    table = Table(title=f"tpctl plan --auto: {m.arch} {m.n_layer}x{m.n_embd} on {world} ranks, batch {t.batch_size} x seq "
                        f"{t.seq_len}, hardware {hw.name}" + (f", {hw.memory_bytes / 2**30:,.1f} GiB per rank" if hw.memory_bytes else ""))
    for col in ("", "choice", "step ms", "peak MiB/rank", "state MiB", "act MiB", "exposed comm ms", "bubble", "GFLOP/rank"):
        table.add_column(col, justify="left" if col in ("", "choice") else "right")
    for i, c in enumerate(found.ranked[:TOP]):
        p = c.parts
        table.add_row("★" if i == 0 else str(i + 1), c.choice.name, f"{c.step_time_s * 1e3:,.3f}", f"{c.peak_bytes / 2**20:,.1f}",
                      f"{(p['params'] + p['grads'] + p['optimizer']) / 2**20:,.1f}", f"{p['activations'] / 2**20:,.1f}",
                      f"{c.exposed_comm_s * 1e3:,.3f}", f"{c.plan.bubble:.0%}" if c.plan.bubble is not None else "-",
                      f"{c.flops / 1e9:,.1f}")
    console = Console(width=200)
    console.print(table)
    console.print(f"searched {len(found.ranked) + len(found.unfit)} choices ({found.splits} distinct splits costed; "
                  f"{len(found.unfit)} over memory, {len(found.invalid)} refused) in {elapsed:.1f} s. "
                  "peak: parameters, gradients, AdamW, activations as the schedule holds them, the largest temporary "
                  "(the loss's or a Linear's), a bucket being reduced, ZeRO-3's gathered block, the allocator's slack "
                  "(hardware heap_slack) and the process (hardware train_base_bytes[_hf], else base_bytes).")
    console.print("run the pick: tpctl train " + " ".join(found.pick.choice.overrides()))
    return 0
