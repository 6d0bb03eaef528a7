"""`tpctl train layout=auto world=N`: the layout picked in the launcher's
process, before Hydra or any worker starts, by rewriting the command
line: `layout=auto world=N` stays (recorded in config.yaml), the picked
layout's keys and the prediction (`auto=...`, for summary.json) are added.
A refusal is one line, exit 2, like any other config error."""

from __future__ import annotations

import sys

from tpctl.errors import ConfigError

# Keys layout=auto sets: given by hand as well, they would contradict the pick.
PICKED = ("mode", "size", "depth", "dp", "pp", "zero", "seq_parallel", "train.grad_accum", "pipeline.schedule",
          "pipeline.microbatches", "pipeline.virtual_stages", "train.activation_checkpointing")


def _key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def wants_auto(overrides: list[str]) -> bool:
    return any(_key(o) == "layout" and o.split("=", 1)[1:] == ["auto"] for o in overrides)


def resolve_overrides(overrides: list[str], multirun: bool, config_name: str, config_dir) -> list[str]:
    """`overrides` with the pick of layout=auto added; ConfigError where
    nothing can be picked (naming the smallest footprint and the knob)."""
    import torch

    from tpctl.config import compose_jobs
    from tpctl.cost.auto import resolve
    from tpctl.cost.hardware import load_hardware

    if multirun:
        raise ConfigError("layout", "auto", "picks one layout: expected a single run, not -m")
    given = [o for o in overrides if _key(o) in PICKED]
    if given:
        raise ConfigError(_key(given[0]), given[0].split("=", 1)[-1], "layout=auto picks it: drop it, or drop layout=auto")
    cfg = compose_jobs(overrides, False, config_name, config_dir)[0]
    world = cfg.get("world")
    if not isinstance(world, int) or world < 1:
        raise ConfigError("world", world, "layout=auto needs the number of ranks: expected world=N (N >= 1)")
    hw = load_hardware(cfg.get("hardware") or ("cpu" if cfg.device == "cpu" else "h100"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the dry runs' tiny probes: one thread is faster than many sharing cores
    try:
        pick = resolve(cfg, world, hw)
    finally:
        torch.set_num_threads(threads)
    record = {"layout": pick.choice.name, "predicted_ms": round(pick.step_time_s * 1e3, 4),
              "predicted_peak_bytes": int(pick.peak_bytes), "hardware": hw.name}
    print(f"tpctl: layout=auto picked {pick.choice.name} of {world} ranks on hardware={hw.name}: predicted "
          f"{pick.step_time_s * 1e3:,.2f} ms per step, {pick.peak_bytes / 2**20:,.1f} MiB per rank", file=sys.stderr)
    fields = [f"+auto.{k}='{v}'" if isinstance(v, str) else f"+auto.{k}={v}" for k, v in record.items()]
    return [*overrides, *pick.choice.overrides(), *fields]
