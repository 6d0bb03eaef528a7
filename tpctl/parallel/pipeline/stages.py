"""The arithmetic of a pipeline (pp > 1): how many stages and chunks, which
blocks each chunk holds, how many micro-batches a step is cut into, and the
bubble the schedule leaves. No process group and no tensor: the config
check (config/pipeline.py), the planner, `inspect` and the running pipeline
(schedule.py) all read the same `PipelineSpec`.

A pipeline of P stages cuts the model's repeated blocks into C = P * v
contiguous chunks (v = 1, or `pipeline.virtual_stages` with the interleaved
schedule); chunk c runs on pipeline rank c mod P, so with v > 1 a rank holds
every P-th chunk (Megatron's interleaved assignment, which is also what
torch.distributed.pipelining's looped schedules expect). What runs before the
first block (embeddings) belongs to chunk 0, what runs after the last (the
final norm and the LM head) to chunk C - 1.

Bubble (the idle fraction of a stage when every micro-batch costs the same
on every stage and point-to-point sends are free): GPipe and 1F1B wait
P - 1 slots of the M + P - 1 a step takes; interleaving splits each slot in
v, so (P - 1) / (v * M + P - 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from tpctl.schema import DEFAULT_SCHEDULE

SCHEDULES = ("gpipe", "1f1b", "interleaved")
# The default number of micro-batches keeps the planned bubble at or below this.
TARGET_BUBBLE = 0.25


@dataclass(frozen=True)
class PipelineSpec:
    """A run's pipeline: `stages` ranks along the pp axis, `virtual` chunks
    on each, `microbatches` per step, and optionally the blocks of each
    chunk (`split`, first chunk first)."""

    stages: int = 1
    schedule: str = DEFAULT_SCHEDULE
    virtual: int = 1
    microbatches: int = 1
    split: Optional[tuple[int, ...]] = None
    seq_len: int = 0  # tokens per sequence: the stages' attention cost (0: not counted)

    @classmethod
    def plain(cls, pp: int) -> "PipelineSpec":
        """`pp` stages on the default schedule with one micro-batch per stage
        (what the planner and a pipeline built without a config assume)."""
        return cls(pp, DEFAULT_SCHEDULE, 1, pp)

    @property
    def chunks(self) -> int:
        return self.stages * self.virtual

    def rank_of(self, chunk: int) -> int:
        """The pipeline rank that runs chunk `chunk`."""
        return chunk % self.stages

    def chunks_of(self, pp_rank: int) -> list[int]:
        """The chunks pipeline rank `pp_rank` runs, in order."""
        return list(range(pp_rank, self.chunks, self.stages))

    def bubble(self) -> float:
        """The planned idle fraction of a stage (stages of equal cost)."""
        p = self.stages
        return (p - 1) / (self.virtual * self.microbatches + p - 1)

    def bubble_for(self, costs: Sequence[float]) -> float:
        """The idle fraction of the stages (mean over them) when each costs
        `costs[r]` per micro-batch (or per step: only the ratios matter):
        the slowest paces the steady state, so a step lasts
        (m - 1 + (v-1)/v) * max + sum / v; equal costs give bubble()."""
        m, v = self.microbatches, self.virtual
        wall = (m - 1 + (v - 1) / v) * max(costs) + sum(costs) / v
        return 1 - m * (sum(costs) / len(costs)) / wall if wall else 0.0

    def in_flight(self, rank: int = 0) -> float:
        """Micro-batches whose activations pipeline rank `rank` holds at
        once at most: all M in GPipe, P - rank in 1F1B (its warm-up);
        interleaved, the chunk forwards of torch's warm-up ((v - 1) rounds
        of P, plus 2 per hop to the last rank) and the first steady one,
        each 1/v of the rank's blocks."""
        m, p, v = self.microbatches, self.stages, self.virtual
        if self.schedule == "gpipe":
            return m
        if self.schedule == "1f1b":
            return min(m, p - rank)
        per_round = m // max(1, m // p)
        return min(m * v, (v - 1) * per_round + 2 * (p - 1 - rank) + 1) / v

    def dropout_note(self, dropout: float) -> str | None:
        """What this pipeline trains with dropout on, said at start-up and by
        `tpctl inspect` (docs/DESIGN.md, "Dropout"); None where nothing differs.
        Masks are drawn per (step, micro-batch, block): how the batch is cut
        into micro-batches changes them, as `train.grad_accum` does."""
        if not dropout or self.microbatches <= 1:
            return None
        return (f"dropout={dropout} with M={self.microbatches} micro-batches: masks are drawn per micro-batch, so this run "
                f"equals pp=1 train.grad_accum={self.microbatches} (fp32 round-off), not pp=1 on one unsplit batch")

    def label(self) -> str:
        v = f" v={self.virtual}" if self.schedule == "interleaved" else ""
        return f"pp={self.stages} {self.schedule}{v} M={self.microbatches}"

    # ---- which blocks each chunk holds ----------------------------------------
    def cut(self, weights: Sequence[int], first: int = 0, last: int = 0) -> list[range]:
        """The blocks of each chunk, as ranges of block indices: `split` if
        given, else contiguous runs balanced by parameters: the largest
        chunk's weight (its blocks', plus `first` for chunk 0 -- what runs
        before the blocks -- and `last` for the last chunk) as small as it
        can be."""
        n, c = len(weights), self.chunks
        if c > n:
            raise ValueError(f"{self.describe_chunks()} but the model has {n} blocks")
        if self.split is not None:
            sizes = list(self.split)
            if len(sizes) != c or sum(sizes) != n or min(sizes) < 1:
                raise ValueError(f"pipeline.split={list(sizes)}: expected {c} positive numbers of blocks summing to {n}")
        else:
            sizes = _balanced(list(weights), c, first, last)
        out, start = [], 0
        for size in sizes:
            out.append(range(start, start + size))
            start += size
        return out

    def describe_chunks(self) -> str:
        if self.virtual > 1:
            return f"pp={self.stages} x pipeline.virtual_stages={self.virtual} makes {self.chunks} stages"
        return f"pp={self.stages} makes {self.chunks} stages"

    def label_without_m(self) -> str:
        return f"pp={self.stages} {self.schedule}" + (f" v={self.virtual}" if self.virtual > 1 else "")


def pipeline_of(layout: Any, cfg: Any) -> Optional[PipelineSpec]:
    """The pipeline a run config asks for in `layout` (a Layout); None
    without stages. It reads and refuses nothing: the config was accepted
    before any worker started (tpctl.config.pipeline.check_pipeline), so a
    value it cannot use is a ValueError."""
    pp = layout.pp
    if pp == 1:
        return None
    schedule = pipeline_key(cfg, "schedule")
    virtual = pipeline_key(cfg, "virtual_stages") if schedule == "interleaved" else 1
    t, row_split = cfg.train, layout.dp * layout.geo.batch_split
    m = pipeline_key(cfg, "microbatches") or default_microbatches(schedule, pp, virtual, t.batch_size, row_split)
    if m is None:
        raise ValueError(f"no default number of micro-batches for {schedule} over pp={pp} divides "
                         f"train.batch_size={t.batch_size} into {row_split}-row blocks")
    split = pipeline_key(cfg, "split")
    return PipelineSpec(pp, schedule, virtual, m, None if split is None else tuple(split), t.seq_len)


# What a config that leaves out a pipeline key means (the schema's defaults).
KEY_DEFAULTS = {"schedule": DEFAULT_SCHEDULE, "virtual_stages": 2, "microbatches": None, "split": None}


def pipeline_key(cfg: Any, key: str) -> Any:
    """The run config's `pipeline.<key>` as written (KEY_DEFAULTS' where
    absent): what the stages read and config/pipeline.py checks."""
    p = cfg.get("pipeline") or {}
    return p.get(key, KEY_DEFAULTS[key]) if hasattr(p, "get") else getattr(p, key, KEY_DEFAULTS[key])


def default_microbatches(schedule: str, pp: int, virtual: int, batch_size: int, row_split: int) -> Optional[int]:
    """The fewest micro-batches that keep the planned bubble at or below
    TARGET_BUBBLE, that the schedule takes, and that divide `batch_size`
    into `row_split`-row blocks; None where none does."""
    per_row = batch_size // row_split if batch_size % row_split == 0 else 0
    least = least_microbatches(schedule, pp, virtual)
    return next((k for k in range(least, per_row + 1) if per_row % k == 0 and schedule_takes(schedule, pp, k)), None)


def least_microbatches(schedule: str, pp: int, virtual: int) -> int:
    """The fewest micro-batches whose planned bubble is <= TARGET_BUBBLE
    (and that the schedule accepts)."""
    least = math.ceil((pp - 1) * (1 - TARGET_BUBBLE) / (TARGET_BUBBLE * virtual))
    return max(least, pp if schedule == "1f1b" else 1, 1)


def schedule_takes(schedule: str, pp: int, m: int) -> bool:
    """torch's interleaved 1F1B runs max(1, m // pp) rounds of equal size."""
    if schedule != "interleaved":
        return True
    rounds = max(1, m // pp)
    return m % rounds == 0


def _balanced(weights: list[int], chunks: int, first: int, last: int) -> list[int]:
    """Sizes of `chunks` contiguous runs of `weights` (each at least one)
    minimising the heaviest run, `first` added to the first run's weight
    and `last` to the last's. Ties: the earliest runs the longest (a later
    stage also holds the LM head's activations)."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: the heaviest run when the first i blocks make k runs.
    best = [[inf] * (n + 1) for _ in range(chunks + 1)]
    cut = [[0] * (n + 1) for _ in range(chunks + 1)]
    best[0][0] = 0
    for k in range(1, chunks + 1):
        for i in range(k, n - (chunks - k) + 1):
            for j in range(k - 1, i):
                w = prefix[i] - prefix[j] + (first if k == 1 else 0) + (last if k == chunks else 0)
                cost = max(best[k - 1][j], w)
                if cost <= best[k][i]:  # the later cut wins a tie
                    best[k][i], cut[k][i] = cost, j
    sizes, i = [], n
    for k in range(chunks, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]
