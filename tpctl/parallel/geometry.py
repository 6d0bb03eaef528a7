"""Static geometry of each tensor-parallel mode: how `size` ranks are arranged,
how the batch and the hidden dimension are split, and which configs are
therefore valid. Pure arithmetic, no torch.distributed, so the launcher can
validate a config before starting any worker."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tpctl.errors import ConfigError
from tpctl.schema import MODES, TrainConfig


def exact_root(n: int, k: int) -> int | None:
    """The integer r with r**k == n, or None."""
    r = round(n ** (1.0 / k))
    for cand in (r - 1, r, r + 1):
        if cand >= 1 and cand**k == n:
            return cand
    return None


@dataclass(frozen=True)
class Geometry:
    mode: str
    size: int
    depth: int
    # q: the side of the 2d/2.5d square or the 3d cube (1 for none/1d).
    q: int
    # The global batch is split into this many row blocks inside one
    # tensor-parallel group (1 for none/1d: every rank sees every row).
    batch_split: int
    # Every matrix dimension of a linear must divide by this, and the
    # number of attention heads by `head_split`.
    hidden_split: int
    head_split: int
    # The vocabulary is padded up to a multiple of this.
    vocab_multiple: int


def geometry(mode: str, size: int, depth: int = 1) -> Geometry:
    """Geometry for a mode, or ConfigError naming the offending key."""
    if mode not in MODES:
        raise ConfigError("mode", mode, f"expected one of {', '.join(MODES)}")
    if size < 1:
        raise ConfigError("size", size, "expected a positive number of tensor-parallel ranks")
    if mode == "none":
        if size != 1:
            raise ConfigError("size", size, "mode=none runs one tensor-parallel rank: expected size=1 (use dp for replicas)")
        return Geometry(mode, 1, 1, 1, 1, 1, 1, 1)
    if mode == "1d":
        return Geometry(mode, size, 1, 1, 1, size, size, size)
    if mode == "2d":
        q = exact_root(size, 2)
        if q is None:
            raise ConfigError("size", size, "mode=2d needs a square number of ranks (1, 4, 9, 16, ...)")
        return Geometry(mode, size, 1, q, q, q, q, q)
    if mode == "2.5d":
        if depth < 1:
            raise ConfigError("depth", depth, "expected depth >= 1")
        q = exact_root(size // depth, 2) if size % depth == 0 else None
        if q is None:
            valid = ", ".join(str(depth * r * r) for r in range(1, 5))
            raise ConfigError("size", size, f"mode=2.5d needs size = depth*q*q; with depth={depth}: {valid}, ...")
        return Geometry(mode, size, depth, q, depth * q, q, q, q)
    q = exact_root(size, 3)
    if q is None:
        raise ConfigError("size", size, "mode=3d needs a cube number of ranks (1, 8, 27, ...)")
    # 3d stores a weight's output dim in q*q blocks, so linears need q*q.
    return Geometry(mode, size, 1, q, q * q, q * q, q, q * q)


def validate_parallel(cfg: TrainConfig) -> Geometry:
    """Check everything that depends on the parallel layout."""
    geo = geometry(cfg.mode, cfg.size, cfg.depth)
    if cfg.mode != "2.5d" and cfg.depth != 1:
        raise ConfigError("depth", cfg.depth, f"depth is only used by mode=2.5d; expected depth=1 with mode={cfg.mode}")
    if cfg.dp < 1:
        raise ConfigError("dp", cfg.dp, "expected a positive number of data-parallel replicas")
    m = cfg.model
    if m.arch != "custom" and not m.get("pretrained"):
        # Sizes known from the config: name the key. (Any model is checked
        # module by module too, once built: models.check_model.)
        for key, heads in (("model.n_head", m.n_head), ("model.n_kv_head", m.get("n_kv_head"))):
            if heads is not None and heads % geo.head_split:
                raise ConfigError(key, heads, f"mode={cfg.mode} size={cfg.size} splits heads {geo.head_split} ways: expected a multiple of {geo.head_split}")
        if m.n_embd % m.n_head:
            raise ConfigError("model.n_embd", m.n_embd, f"expected a multiple of model.n_head={m.n_head}")
        inner = ("model.intermediate_size", m.intermediate_size) if m.get("intermediate_size") else ("model.mlp_ratio", m.n_embd * m.mlp_ratio)
        for key, dim in (("model.n_embd", m.n_embd), inner):
            if dim % geo.hidden_split:
                raise ConfigError(key, m[key.split(".")[1]], f"mode={cfg.mode} size={cfg.size} splits the hidden dim {geo.hidden_split} ways: hidden size {dim} does not divide")
    if cfg.seq_parallel:
        if cfg.mode != "1d":
            raise ConfigError("seq_parallel", True, f"sequence parallelism is for mode=1d; expected seq_parallel=false with mode={cfg.mode}")
        if cfg.train.seq_len % cfg.size:
            raise ConfigError("train.seq_len", cfg.train.seq_len, f"seq_parallel splits the sequence {cfg.size} ways: expected a multiple of {cfg.size}")
    t = cfg.train
    if t.grad_accum < 1:
        raise ConfigError("train.grad_accum", t.grad_accum, "expected a positive number of micro-batches")
    split = t.grad_accum * cfg.dp * geo.batch_split
    if t.batch_size < 1 or t.batch_size % split:
        raise ConfigError(
            "train.batch_size", t.batch_size,
            f"the global batch is split into grad_accum({t.grad_accum}) x dp({cfg.dp}) x {geo.batch_split} row blocks "
            f"(mode={cfg.mode}): expected a positive multiple of {split}",
        )
    return geo


def padded_vocab(vocab_size: int, multiple: int) -> int:
    return math.ceil(vocab_size / multiple) * multiple


# Bytes one rank sends, on average, for each byte of the full (gathered or
# reduced) tensor, with the bandwidth-optimal ring / pipelined algorithms of
# a group of p ranks: an all-reduce is a reduce-scatter plus an all-gather.
# comm.py counts with it, the planner predicts with it.
WIRE_FACTOR = {
    "all_reduce": lambda p: 2 * (p - 1) / p,
    "all_gather": lambda p: (p - 1) / p,
    "reduce_scatter": lambda p: (p - 1) / p,
    "broadcast": lambda p: (p - 1) / p,
    "reduce": lambda p: (p - 1) / p,
}
