"""Memory before launch: each rank's predicted peak beside the memory it
has, and the refusal of a run that will not fit (`tpctl train --check`
prints it; `tpctl train` refuses with the same line before any worker).

The prediction is layout=auto's (cost/auto.py `peak_parts`) for the one
choice the config makes: the planner's dry run on the meta device
(parameters, gradients, AdamW state per rank, activations as the schedule
holds them), the step's largest temporary (the loss's chunk, or a Linear's
blocks in flight), the data-parallel bucket, ZeRO-3's gathered block, and
the process itself (the hardware profile's `train_base_bytes`, or
`train_base_bytes_hf` for a Hugging Face model: on CPU, a `tpctl train`
worker's interpreter and libraries as `tpctl plan --calibrate` measured
them). Ranks of one pipeline stage hold alike; each stage is a row.

The memory a rank has, first found of: `train.memory_limit_gib`; the
`hardware=` profile's memory per rank; on CUDA the smallest visible
device's memory (shared by the ranks placed on it); on CPU this machine's
RAM (MemTotal: what is free at the moment would make the verdict depend on
what else runs, e.g. a test suite's pools) split by the ranks it starts. A Slurm launch
runs elsewhere: unchecked unless one of the first two is set.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from tpctl.errors import ConfigError
from tpctl.parallel.layout import Layout

GIB = 2**30
# The parts of a peak as printed (cost/auto.py peak_parts' keys); the rest
# (the data-parallel bucket, ZeRO-3's gathered block, the allocator's slack,
# the process) as "other".
COLUMNS = (("params", "params"), ("grads", "grads"), ("optimizer", "optimizer"), ("activations", "activations"),
           ("temporary", "temporary"))


@dataclass
class StagePeak:
    """The predicted peak of the ranks of one pipeline stage (all ranks at pp=1)."""

    ranks: list[int]
    stage: Optional[int]
    parts: dict[str, int]

    @property
    def peak(self) -> int:
        return sum(self.parts.values())


@dataclass
class MemoryCheck:
    layout: Layout
    stages: list[StagePeak]
    limit_bytes: Optional[float]  # per rank; None: not known here
    limit_source: str  # where the limit came from, in words
    notes: list[str] = field(default_factory=list)

    @property
    def worst(self) -> StagePeak:
        return max(self.stages, key=lambda s: s.peak)

    @property
    def fits(self) -> bool:
        return self.limit_bytes is None or not self.stages or self.worst.peak <= self.limit_bytes

    def refusal(self, cfg: Any) -> Optional[ConfigError]:
        """The one line for a run that will not fit (None: it fits, or nothing to check against)."""
        if self.fits:
            return None
        w = self.worst
        where = f"rank {w.ranks[0]}" + (f" (pipeline stage {w.stage})" if w.stage is not None else "")
        return ConfigError("memory", f"{w.peak / GIB:.2f}GiB",
                           f"{self.layout.label()}: {where} is predicted to peak at {w.peak / GIB:.2f} GiB "
                           f"({_largest(w.parts)}), more than the {self.limit_bytes / GIB:.2f} GiB per rank of "
                           f"{self.limit_source}; to fit, {knobs(self.layout, w.parts, cfg)}")


def _largest(parts: dict[str, int]) -> str:
    """The peak by what it is for: the three groups knobs() chooses between."""
    state = parts["params"] + parts["grads"] + parts["optimizer"] + parts.get("zero_gathered", 0)
    act = parts["activations"] + parts["temporary"] + parts.get("comm_buffer", 0) + parts.get("heap", 0)
    return (f"weights, gradients and AdamW state {state / GIB:.2f} GiB, activations {act / GIB:.2f} GiB, "
            f"the process {parts.get('process', 0) / GIB:.2f} GiB")


def knobs(layout: Layout, parts: dict[str, int], cfg: Any) -> str:
    """The settings that shrink the part that dominates the peak."""
    state = parts["params"] + parts["grads"] + parts["optimizer"] + parts.get("zero_gathered", 0)
    act = parts["activations"] + parts["temporary"] + parts.get("heap", 0)
    if parts.get("process", 0) > state + act:
        return "run fewer ranks on this machine or give each more memory (the process itself is most of it)"
    t = cfg.train
    ckpt = "" if t.activation_checkpointing else ", or set train.activation_checkpointing=true"
    smaller_batch = f"lower train.batch_size (now {t.batch_size}) or raise train.grad_accum (now {t.grad_accum}){ckpt}"
    if state >= act:
        zero = (f"zero={layout.zero + 1} (dp={layout.dp} replicas share the state)" if layout.dp > 1 and layout.zero < 3
                else "dp > 1 with zero=1..3")
        return f"raise size (now {layout.size}), pp (now {layout.pp}) or use {zero}; else {smaller_batch}"
    return f"{smaller_batch}; or raise size (now {layout.size}) or pp (now {layout.pp})"


def predict(cfg: Any, machine: bool = True, built: Optional[tuple] = None) -> MemoryCheck:
    """Each stage's predicted peak and the memory per rank, for a validated
    run config. machine=False: without the hardware profile's terms (the
    process, the allocator's slack; what calibrate.train_floors measures).
    `built`: what validating the config returned, (its model on the meta
    device, the role plan), read instead of building and tracing it again."""
    layout = Layout.from_config(cfg)
    limit, source = memory_per_rank(cfg, layout)
    try:
        stages = _stage_peaks(cfg, layout, _profile(cfg) if machine else None, built)
    except Exception as e:  # a model or mode the planner cannot cost (a plugin mode without cost hooks)
        return MemoryCheck(layout, [], limit, source, [f"not predicted: the planner cannot cost this run ({e})"])
    return MemoryCheck(layout, stages, limit, source)


_SHAPES: dict[tuple, Any] = {}  # (model config, seed) -> the planner's ModelShape


def _stage_peaks(cfg: Any, layout: Layout, hw, built: Optional[tuple]) -> list[StagePeak]:
    from omegaconf import OmegaConf

    from tpctl.cost.auto import Choice, peak_parts
    from tpctl.cost.planner import model_shape, plan_split
    from tpctl.parallel.pipeline.stages import pipeline_of

    t = cfg.train
    pipe = pipeline_of(layout, cfg)
    if pipe is not None:
        choice = Choice(layout, pipe.microbatches, pipe.schedule, pipe.virtual, bool(t.activation_checkpointing))
    else:
        choice = Choice(layout, t.grad_accum, checkpointing=bool(t.activation_checkpointing))
    key = (json.dumps(OmegaConf.to_container(cfg.model, resolve=True), sort_keys=True, default=str), cfg.seed)
    if key not in _SHAPES:  # the jobs of a sweep over layouts read the model once
        # The config check has built and traced this model (on the meta
        # device): its shapes are read from that model, and the dry run
        # rewrites a copy of it (dry_run._original), not a third build.
        _SHAPES[key] = (model_shape(cfg.model, cfg.seed, built), built[0] if built else None)
    shape, model = _SHAPES[key]
    plan = plan_split(shape, layout, t.batch_size, t.seq_len, 1 if pipe else t.grad_accum, pipeline=pipe,
                      cache={"model": model} if model is not None else None, context=cfg.context.impl)
    if layout.pp == 1:
        stages = [StagePeak(list(range(layout.world)), None, peak_parts(plan, shape, choice, cfg, hw))]
    else:
        stages = []
        for s, stage_plan in enumerate(plan.stages):
            # peak_parts finds a stage's place by its memory among the stages
            # (auto.py _worst_stage): the stage's plan, with the list of all.
            own = dataclasses.replace(stage_plan, stages=plan.stages)
            ranks = [r for r in range(layout.world) if layout.coords(r)["pp"] == s]
            stages.append(StagePeak(ranks, s, peak_parts(own, shape, choice, cfg, hw)))
    return stages


def _profile(cfg: Any):
    """The hardware profile whose `base_bytes` is the process's share of a
    peak: `hardware=` when given, else the CPU's on device=cpu (a GPU's
    allocator counts no process floor)."""
    from tpctl.cost.hardware import load_hardware

    name = cfg.get("hardware") or ("cpu" if cfg.device == "cpu" else None)
    return load_hardware(name) if name else None


def memory_per_rank(cfg: Any, layout: Layout) -> tuple[Optional[float], str]:
    """(bytes per rank, where that number comes from); (None, why) when unknown here."""
    limit = cfg.train.get("memory_limit_gib")
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not 0 < limit < math.inf:
            raise ConfigError("train.memory_limit_gib", limit, "expected a positive number of GiB per rank, or null")
        return float(limit) * GIB, f"train.memory_limit_gib={limit}"
    name = cfg.get("hardware")
    if name:
        hw = _profile(cfg)
        if hw.memory_bytes:
            return hw.memory_bytes, f"hardware={name}"
    if cfg.launcher.name == "slurm":
        return None, "launcher=slurm: the nodes' memory is not known here (set train.memory_limit_gib or hardware=)"
    here = max(1, layout.world // max(1, int(cfg.launcher.nnodes)))  # ranks this node starts
    if cfg.device == "cuda":
        return _cuda_per_rank(here)
    total = _mem_total()
    if total is None:
        return None, "this machine's memory could not be read"
    return total / here, f"this machine's RAM ({total / GIB:.1f} GiB) / {here} rank(s)"


def _cuda_per_rank(ranks: int) -> tuple[Optional[float], str]:
    """The smallest visible device's memory over the ranks placed on it
    (launch/local.py places rank r on device r % count). This process may
    touch the driver: CUDA workers are fresh interpreters, never forked."""
    import torch

    try:
        count = torch.cuda.device_count()
        if count == 0:
            return None, "no CUDA device is visible here"
        smallest = min(torch.cuda.get_device_properties(i).total_memory for i in range(min(count, ranks)))
    except RuntimeError as e:  # a driver that cannot be read: the run itself will say why
        return None, f"the CUDA devices' memory could not be read ({e})"
    sharing = math.ceil(ranks / count)
    return smallest / sharing, (f"the smallest CUDA device ({smallest / GIB:.1f} GiB)"
                                + (f" / {sharing} ranks sharing it" if sharing > 1 else ""))


def _mem_total() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import os

        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def _ranks(ranks: list[int]) -> str:
    """0-3,8-11: runs of consecutive ranks."""
    runs, start = [], ranks[0]
    for prev, cur in zip(ranks, ranks[1:] + [None]):
        if cur != prev + 1:
            runs.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = cur
    return ",".join(runs)


def render(found: MemoryCheck, cfg: Any) -> str:
    """The per-rank table `tpctl train --check` prints."""
    m = cfg.model
    what = m.get("_target_") or m.get("arch")
    head = ["ranks", *(c for _, c in COLUMNS), "other", "peak", "has", ""]
    rows = []
    for s in found.stages:
        p = s.parts
        other = p["comm_buffer"] + p["zero_gathered"] + p["heap"] + p["process"]
        has = _mib(found.limit_bytes) if found.limit_bytes is not None else "?"
        verdict = "" if found.limit_bytes is None else ("fits" if s.peak <= found.limit_bytes else "OVER")
        label = _ranks(s.ranks) + (f" (stage {s.stage})" if s.stage is not None else "")
        rows.append([label, *(_mib(p[k]) for k, _ in COLUMNS), _mib(other), _mib(s.peak), has, verdict])
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    line = lambda r: "  ".join(str(v).ljust(w) if i == 0 else str(v).rjust(w) for i, (v, w) in enumerate(zip(r, widths)))  # noqa: E731
    t = cfg.train
    out = [f"tpctl: memory check: {found.layout.label()} ({found.layout.world} ranks), {what}, "
           f"batch {t.batch_size} x seq {t.seq_len}, grad_accum {t.grad_accum}, device {cfg.device}",
           "predicted peak per rank, MiB (other: data-parallel bucket, ZeRO-3 gathered block, the allocator's slack, "
           "the process itself):",
           *([line(head), *(line(r) for r in rows)] if rows else found.notes),
           f"memory per rank: {_mib(found.limit_bytes) + ' MiB, ' if found.limit_bytes is not None else ''}{found.limit_source}"]
    return "\n".join(out)
