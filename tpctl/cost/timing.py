"""The planner's predicted step time: a plan's FLOPs at a hardware
profile's rate, and each of its collectives at the speed of the slowest
link its groups span (cost/planner.py's plans; `predict` fills them in)."""

from __future__ import annotations

import functools

from tpctl.parallel.layout import Layout
from tpctl.parallel.tensor.cost_hooks import kv_replicas_size

from .hardware import Hardware

# Latency steps of a ring (or pipelined chain) collective over p ranks.
LATENCY_STEPS = {"all_reduce": lambda p: 2 * (p - 1), "send": lambda p: 1}
# What compute an asynchronous collective hides behind: a third of a step's (its weight-gradient products).
BESIDE_SHARE = 1 / 3


def predict(plan, hw: Hardware, overlap: bool = True):
    """Fill in step_time_s of `plan` (a planner.SplitPlan): compute + every
    collective at the speed of the slowest link its groups span, less
    (train.overlap) the asynchronous ones up to BESIDE_SHARE of the compute
    (hidden_s; comm_s: the exposed rest), on the rank of its stage that
    sends the most (SplitPlan.tp_comm: ranks summing other replica sets).
    A pipeline's step is its slowest stage's, whose compute is stretched
    by the bubble (busy for 1 - bubble of the step, on average)."""
    if plan.stages:
        for stage in plan.stages:
            predict(stage, hw, overlap)
        slowest = max(plan.stages, key=lambda p: p.step_time_s)
        plan.compute_s = sum(p.compute_s for p in plan.stages) / len(plan.stages) / (1 - plan.bubble)
        plan.comm_s = slowest.comm_s
        plan.step_time_s = plan.compute_s + plan.comm_s
        plan.fits = all(p.fits for p in plan.stages)
        return plan
    compute = plan.flops / (hw.peak_flops * hw.efficiency)
    if hw.cores and plan.layout.world > hw.cores:
        compute *= plan.layout.world / hw.cores  # oversubscribed CPU: ranks take turns
    plan.comm_s, plan.hidden_s = max((_comm_s(plan.layout, comm, hw, compute, overlap)
                                      for comm in (plan.comm, *plan.tp_comm.values())), key=lambda t: t[0])
    plan.compute_s = compute
    plan.step_time_s = compute + plan.comm_s
    plan.fits = not hw.memory_bytes or plan.memory_bytes <= hw.memory_bytes
    return plan


def _comm_s(layout: Layout, comm: dict, hw: Hardware, compute: float, overlap: bool) -> tuple[float, float]:
    """(exposed, hidden) seconds of one rank's collectives `comm` ({(kind,
    group): planner.Comm}) beside `compute` seconds."""
    comm_s = hideable = 0.0
    for (kind, group), c in comm.items():
        # every collective of a kind takes the time that kind was measured to
        # take (Hardware.kind_factor: gloo's reduce-scatter costs about an
        # all-reduce, however it is issued); issued beside other work, it
        # can hide behind that work, up to BESIDE_SHARE of the compute
        factor = hw.kind_factor(kind)
        comm_s += factor * sent_s(layout, kind, group, c.group_size, c.calls, c.wire_bytes, hw)
        hideable += factor * sent_s(layout, kind, group, c.group_size, c.hidden_calls, c.hidden_wire_bytes, hw)
    hidden = min(hideable, BESIDE_SHARE * compute) if overlap else 0.0
    return comm_s - hidden, hidden


def sent_s(layout: Layout, kind: str, group: str, group_size: int, calls: float, wire_bytes: float,
           hw: Hardware) -> float:
    """Seconds `calls` collectives of `kind` over one `group` of `layout`
    (`group_size` ranks) take to send `wire_bytes` in all, as counted: the
    latency of each ring step and the bytes at the bandwidth of the slowest
    link any such group spans (before Hardware.kind_factor)."""
    spans = _spans_nodes(layout, group, hw.ranks_per_node)
    bw, lat = (hw.inter_bw, hw.inter_latency) if spans else (hw.intra_bw, hw.intra_latency)
    return calls * LATENCY_STEPS.get(kind, lambda p: p - 1)(group_size) * lat + wire_bytes / bw


@functools.lru_cache(maxsize=4096)
def _spans_nodes(layout: Layout, group: str, ranks_per_node: int) -> bool:
    """Whether any group `group` of `layout` spans nodes (cached: the
    search of layout=auto asks for every split's groups at every schedule)."""
    size = kv_replicas_size(group)
    groups = layout.group_members(group if size is None else "tp")
    if size is not None:  # ranks sharing a key/value head: consecutive positions of a grid (fused.held_units)
        groups = [g[i:i + size] for g in groups for i in range(0, len(g), size)]
    return any(len({r // ranks_per_node for r in members}) > 1 for members in groups)


def mark_fits_by_zero(plans: list) -> None:
    """Mark each ZeRO split (planner.SplitPlan) that fits in memory where its layout with zero=0 does not."""
    without = {p.layout: p for p in plans if p.layout.zero == 0}
    for p in plans:
        base = without.get(p.layout.replace(zero=0))
        p.fits_by_zero = bool(p.layout.zero and p.fits and base is not None and base.fits is False)
