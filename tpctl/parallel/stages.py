"""The arithmetic of a pipeline (pp > 1): how many stages and chunks, which
blocks each chunk holds, how many micro-batches a step is cut into, and the
bubble the schedule leaves. No process group and no tensor: the config
check, the planner, `inspect` and the running pipeline (`pipeline.py`) all
read the same `PipelineSpec`.

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

from tpctl.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved")
# The default number of micro-batches keeps the planned bubble at or below this.
TARGET_BUBBLE = 0.25


@dataclass(frozen=True)
class PipelineSpec:
    """A run's pipeline: `stages` ranks along the pp axis, `virtual` chunks
    on each, `microbatches` per step, and optionally the blocks of each
    chunk (`split`, first chunk first)."""

    stages: int = 1
    schedule: str = "1f1b"
    virtual: int = 1
    microbatches: int = 1
    split: Optional[tuple[int, ...]] = None
    seq_len: int = 0  # tokens per sequence: the stages' attention cost (0: not counted)

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

    # ---- from a config ----------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: Any, pp: int, row_split: int) -> "PipelineSpec":
        """The pipeline of a run config with `pp` stages whose every
        micro-batch is split into `row_split` row blocks (dp x the mode's
        batch split); ConfigError names the first bad key."""
        p = cfg.get("pipeline") or {}
        get = p.get if hasattr(p, "get") else (lambda k, d=None: getattr(p, k, d))
        schedule = get("schedule", "1f1b")
        if schedule not in SCHEDULES:
            raise ConfigError("pipeline.schedule", schedule, f"expected one of {', '.join(SCHEDULES)}")
        # The counts are checked as written whatever pp is: a bad value is
        # refused even where this run does not use it.
        virtual, m = get("virtual_stages", 2), get("microbatches", None)
        if type(virtual) is not int or virtual < 2:
            raise ConfigError("pipeline.virtual_stages", virtual, "the interleaved schedule runs several chunks per rank: expected 2 or more")
        if m is not None and (type(m) is not int or m < 1):
            raise ConfigError("pipeline.microbatches", m, "expected a positive number of micro-batches (or null)")
        if pp == 1:  # one stage: nothing below applies
            return cls()
        virtual = virtual if schedule == "interleaved" else 1
        split = get("split", None)
        if split is not None:
            split = tuple(split)
            if len(split) != pp * virtual or any(type(s) is not int or s < 1 for s in split):
                where = f"pp={pp}" + (f" x virtual_stages={virtual}" if virtual > 1 else "")
                raise ConfigError("pipeline.split", list(split), f"expected {pp * virtual} positive numbers of blocks ({where}), first stage first")
        t = cfg.train
        if t.grad_accum != 1:
            raise ConfigError("train.grad_accum", t.grad_accum, "with pp > 1 the pipeline's micro-batches split the batch: "
                              "expected train.grad_accum=1 (set pipeline.microbatches)")
        least = _least_microbatches(schedule, pp, virtual)
        spec = cls(pp, schedule, virtual, 1, split)
        if m is None:
            per_row = t.batch_size // row_split if t.batch_size % row_split == 0 else 0
            m = next((k for k in range(least, per_row + 1) if per_row % k == 0 and _schedule_takes(schedule, pp, k)), None)
            if m is None:
                raise ConfigError("pipeline.microbatches", None,
                                  f"by default the fewest micro-batches that keep the bubble of {spec.label_without_m()} at or below "
                                  f"{TARGET_BUBBLE:.0%} (at least {least}) and divide train.batch_size={t.batch_size} into "
                                  f"{row_split}-row blocks (dp x the mode's batch split): none does; set pipeline.microbatches "
                                  f"or train.batch_size (a multiple of {least * row_split})")
        else:
            if schedule == "1f1b" and m < pp:
                raise ConfigError("pipeline.microbatches", m, f"1f1b keeps one micro-batch per stage in flight: expected at least pp={pp}")
            if not _schedule_takes(schedule, pp, m):
                rounds = max(1, m // pp)
                raise ConfigError("pipeline.microbatches", m, f"the interleaved schedule runs micro-batches in rounds of pp={pp}: "
                                  f"expected a multiple of {rounds} rounds (e.g. {rounds * pp})")
        if t.batch_size % (m * row_split):
            raise ConfigError("train.batch_size", t.batch_size,
                              f"the global batch is split into pipeline.microbatches({m}) x {row_split} row blocks "
                              f"(dp x the mode's batch split): expected a positive multiple of {m * row_split}")
        return cls(pp, schedule, virtual, m, split, t.seq_len)

    def label_without_m(self) -> str:
        return f"pp={self.stages} {self.schedule}" + (f" v={self.virtual}" if self.virtual > 1 else "")


def _least_microbatches(schedule: str, pp: int, virtual: int) -> int:
    """The fewest micro-batches whose planned bubble is <= TARGET_BUBBLE
    (and that the schedule accepts)."""
    least = math.ceil((pp - 1) * (1 - TARGET_BUBBLE) / (TARGET_BUBBLE * virtual))
    return max(least, pp if schedule == "1f1b" else 1, 1)


def _schedule_takes(schedule: str, pp: int, m: int) -> bool:
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
