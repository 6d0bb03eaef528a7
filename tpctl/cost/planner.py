"""The planner's engine: what each way of splitting N ranks costs (see
`tpctl plan --help`, tpctl/commands/plan.py, for what it computes).

For every valid (mode, size, depth, dp) split of a world of N ranks, computed
from the model's shapes (built on the meta device, nothing materialised) and
each mode's algorithm as the code in `tpctl/parallel/` runs it: per-rank
memory, per-rank FLOPs of one optimizer step, per-step communication (exact:
`tests/test_plan.py` checks them against comm's counts), and with a hardware
profile the predicted step time.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Optional

from tpctl.errors import ConfigError
from tpctl.parallel.geometry import WIRE_FACTOR, Geometry, padded_vocab, validate_parallel

from tpctl.config import CONFIG_DIR

HARDWARE_DIR = CONFIG_DIR / "hardware"
F32 = 4  # bytes of an fp32 element: parameters, activations, gradients
F64 = 8  # the gradient norm and the global loss mean are reduced in float64

# Latency steps of a ring (or pipelined chain) collective over p ranks.
LATENCY_STEPS = {"all_reduce": lambda p: 2 * (p - 1)}
KIND_ABBREV = {"all_reduce": "ar", "all_gather": "ag", "reduce_scatter": "rs", "broadcast": "bc", "reduce": "re"}
LINEAR_ROLES = ("qkv", "attn_in", "attn_out", "mlp_in", "mlp_out", "lm_head")


# --------------------------------------------------------------------------
# The model, as shapes


@dataclass
class Param:
    name: str
    role: Optional[str]  # the role of the module owning it (None: no role)
    kind: str  # weight / bias / table
    shape: tuple[int, ...]


@dataclass
class ModelShape:
    """What the planner needs of a model: its parameters by role, its
    linears (out, in) in call order, and attention's width."""

    params: list[Param]
    linears: list[tuple[str, str, int, int, bool]]  # (name, role, out, in, bias)
    roles: dict[str, str]
    embeddings: dict[str, tuple[int, int]]  # name -> (rows, dim) for embedding / pos_embedding roles
    norms: list[str]
    vocab_size: int
    n_embd: int
    n_head: int
    attention_layers: int


def model_shape(model_cfg, seed: int = 0) -> ModelShape:
    """Build the model on the meta device and read its shapes and roles."""
    from tpctl.models import build_model
    from tpctl.parallel.base import module_roles

    model = build_model(model_cfg, seed, lazy=True)
    roles = module_roles(model)
    owner = {}
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            owner.setdefault(id(p), (mname, pname))
    params, linears, embeddings, norms = [], [], {}, []
    for name, role in roles.items():
        module = model.get_submodule(name)
        if role in LINEAR_ROLES:
            out_f, in_f = _linear_dims(module)
            linears.append((name, role, out_f, in_f, getattr(module, "bias", None) is not None))
        elif role in ("embedding", "pos_embedding"):
            embeddings[name] = tuple(module.weight.shape)
        elif role == "norm":
            norms.append(name)
    for pname, p in model.named_parameters():  # tied parameters once
        mname, leaf = owner[id(p)]
        role = roles.get(mname)
        kind = "table" if role in ("embedding", "pos_embedding") else ("bias" if leaf == "bias" else "weight")
        params.append(Param(pname, role, kind, tuple(p.shape)))
    attention = [lin for lin in linears if lin[1] == "attn_out"]  # one per attention layer
    return ModelShape(params, linears, roles, embeddings, norms, model_cfg.vocab_size, model_cfg.n_embd,
                      model_cfg.n_head, len(attention))


def _linear_dims(module) -> tuple[int, int]:
    if hasattr(module, "out_features"):
        return module.out_features, module.in_features
    out_f, in_f = module.weight.shape  # nn.Linear's (out, in) layout
    return out_f, in_f


# --------------------------------------------------------------------------
# One split


@dataclass(frozen=True)
class Split:
    mode: str
    size: int
    depth: int = 1
    dp: int = 1
    seq_parallel: bool = False

    @property
    def world(self) -> int:
        return self.size * self.dp

    @property
    def label(self) -> str:
        name = self.mode + ("+sp" if self.seq_parallel else "")
        extra = f" d={self.depth}" if self.mode == "2.5d" else ""
        return f"{name} size={self.size}{extra} dp={self.dp}"


@dataclass
class Comm:
    """Collectives of one kind over one mesh group, per step, for one rank."""

    calls: int = 0
    bytes: int = 0  # payload, as comm.CommStats counts it
    wire_bytes: float = 0.0
    group_size: int = 1


@dataclass
class SplitPlan:
    split: Split
    param_bytes: int
    grad_bytes: int
    optim_bytes: int
    activation_bytes: int
    flops: float
    comm: dict[tuple[str, str], Comm]  # (kind, group) -> Comm
    step_time_s: Optional[float] = None
    compute_s: Optional[float] = None
    comm_s: Optional[float] = None
    fits: Optional[bool] = None  # memory_bytes within the hardware's memory per rank

    def by_kind(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = defaultdict(lambda: {"calls": 0, "bytes": 0, "wire_bytes": 0.0})
        for (kind, _), c in self.comm.items():
            out[kind]["calls"] += c.calls
            out[kind]["bytes"] += c.bytes
            out[kind]["wire_bytes"] += c.wire_bytes
        return dict(out)

    @property
    def comm_bytes(self) -> int:
        return sum(c.bytes for c in self.comm.values())

    @property
    def wire_bytes(self) -> float:
        return sum(c.wire_bytes for c in self.comm.values())

    @property
    def memory_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optim_bytes + self.activation_bytes

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self.split)
        d.update(label=self.split.label, param_bytes=self.param_bytes, grad_bytes=self.grad_bytes,
                 optim_bytes=self.optim_bytes, activation_bytes=self.activation_bytes,
                 memory_bytes=self.memory_bytes, flops=self.flops, comm_bytes=self.comm_bytes,
                 wire_bytes=self.wire_bytes, step_time_s=self.step_time_s, compute_s=self.compute_s,
                 comm_s=self.comm_s, fits=self.fits, by_kind=self.by_kind(),
                 comm=[{"kind": k, "group": g, **dataclasses.asdict(c)} for (k, g), c in sorted(self.comm.items())])
        return d


class _Counter:
    """Accumulates collectives; a group of one is free (as in comm.py)."""

    def __init__(self, group_sizes: dict[str, int]):
        self.sizes = group_sizes
        self.comm: dict[tuple[str, str], Comm] = {}

    def add(self, kind: str, group: str, numel: int, times: int = 1, elem: int = F32) -> None:
        p = self.sizes[group]
        if p <= 1 or times == 0:
            return
        c = self.comm.setdefault((kind, group), Comm(group_size=p))
        c.calls += times
        c.bytes += times * numel * elem
        c.wire_bytes += times * WIRE_FACTOR[kind](p) * numel * elem


def group_sizes(split: Split, geo: Geometry) -> dict[str, int]:
    q, d = geo.q, geo.depth
    sizes = {"tp": split.size, "dp": split.dp, "world": split.world}
    if split.mode in ("2d", "2.5d"):
        sizes.update(row=q, col=q, depth=d, hidden_replica=d * q)
    if split.mode == "3d":
        sizes.update(i=q, j=q, l=q, ij=q * q, il=q * q)
    return sizes


def plan_split(shape: ModelShape, split: Split, geo: Geometry, batch_size: int, seq_len: int,
               grad_accum: int = 1) -> SplitPlan:
    """Memory, FLOPs and communication of one optimizer step on one rank."""
    mode, q, d = split.mode, geo.q, geo.depth
    vp = padded_vocab(shape.vocab_size, geo.vocab_multiple)
    seqs = batch_size // (grad_accum * split.dp)  # sequences of one micro-batch per dp replica
    tokens = seqs * seq_len  # M: token rows of a micro-batch in one tensor-parallel group
    counter = _Counter(group_sizes(split, geo))
    add = counter.add
    P, sp = split.size, split.seq_parallel
    hidden = shape.n_embd

    # ---- parameters: this rank's shard of each, and the replica buckets
    # sync_grads all-reduces (one coalesced call per replica group).
    param_numel = 0
    buckets: dict[str, int] = defaultdict(int)
    lin_by_name = {lin[0]: lin for lin in shape.linears}
    for p in shape.params:
        numel, replicas = _shard(shape, p, split, geo, vp, lin_by_name)
        param_numel += numel
        if replicas is not None:
            buckets[replicas] += numel

    # ---- forward and backward of one micro-batch, role by role
    fwd_bwd = _Counter(counter.sizes)
    c = fwd_bwd.add
    flops = 0.0
    act = 0  # saved-for-backward elements (estimate)
    rows = {"none": tokens, "1d": tokens, "2d": tokens // q, "2.5d": tokens // (d * q), "3d": tokens // (q * q)}[mode]
    for name, (n_rows, dim) in shape.embeddings.items():
        role = shape.roles[name]
        if role != "embedding":
            continue
        if mode == "1d":
            if sp:
                c("reduce_scatter", "tp", tokens * dim)
                c("all_gather", "tp", tokens * dim)
            else:
                c("all_reduce", "tp", tokens * dim)
        elif mode in ("2d", "2.5d"):
            # gather the column's vocabulary blocks of this hidden block; backward reduce-scatter
            c("all_gather", "col", vp * (dim // q))
            c("reduce_scatter", "col", vp * (dim // q))
        elif mode == "3d":
            c("all_gather", "i", vp // q * (dim // q))
            c("reduce_scatter", "i", vp // q * (dim // q))
            c("reduce_scatter", "j", tokens // q * (dim // q))
            c("all_gather", "j", tokens // q * (dim // q))
    for name in shape.norms:
        if mode in ("2d", "2.5d"):
            c("all_reduce", "row", 2 * rows, times=2)  # moments forward, their gradient backward
        elif mode == "3d":
            c("all_reduce", "l", 2 * rows, times=2)
        h_local = hidden // {"none": 1, "1d": 1}.get(mode, q)
        norm_rows = tokens // P if (mode == "1d" and sp) else rows
        act += 2 * norm_rows * h_local
    for name, role, out_f, in_f, bias in shape.linears:
        n = vp if role == "lm_head" else out_f
        k = in_f
        if mode == "none":
            flops += 2 * tokens * n * k
            act += tokens * k
        elif mode == "1d":
            column = role in ("qkv", "attn_in", "mlp_in", "lm_head")
            flops += 2 * tokens * n * k / P
            act += tokens * (k if column else k // P)
            if column:
                if sp:
                    c("all_gather", "tp", tokens * k)
                    c("reduce_scatter", "tp", tokens * k)
                else:
                    c("all_reduce", "tp", tokens * k)  # backward of copy_to_group
            else:
                c("reduce_scatter" if sp else "all_reduce", "tp", tokens * n)
                if sp:
                    c("all_gather", "tp", tokens * n)
        elif mode in ("2d", "2.5d"):
            w, y = (n // q) * (k // q), rows * (n // q)
            flops += 2 * rows * n * k / q
            act += rows * (k // q)
            c("broadcast", "col", w, times=2 * q)  # W forward and backward
            c("broadcast", "row", y, times=q)  # dY backward
            c("reduce", "row", y, times=q)  # Y forward
            c("reduce", "col", w, times=q)  # dW backward
        elif mode == "3d":
            layout_rows, layout_hidden = ("j", "l") if role in ("qkv", "attn_in", "mlp_in", "lm_head") else ("l", "j")
            x, w, y = tokens // q * (k // q), (n // q) * (k // q), tokens // q * (n // q)
            flops += 2 * (tokens // q) * (n // q) * (k // q)
            act += x + w
            for group, numel in ((layout_rows, x), ("i", w)):
                c("all_gather", group, numel)
                c("reduce_scatter", group, numel)
            c("reduce_scatter", layout_hidden, y)
            c("all_gather", layout_hidden, y)
        if role == "lm_head":
            v_local = vp // {"none": 1, "1d": P}.get(mode, q)
            act += 2 * rows * v_local  # logits and the loss's saved probabilities
    # attention: scores and weighted sum over the rank's heads and rows
    head_split = {"none": 1, "1d": P}.get(mode, q)
    attn_rows = tokens if mode in ("none", "1d") else rows
    if mode == "3d":
        attn_rows = tokens // (q * q)  # fed layout B: rows (i, l)
    flops += shape.attention_layers * 2 * 2 * attn_rows * seq_len * (hidden // head_split)
    act += shape.attention_layers * 4 * attn_rows * (hidden // head_split)
    # the vocab-parallel cross entropy: row max, then (sum-exp, target, sum)
    loss_group = {"1d": "tp", "2d": "row", "2.5d": "row", "3d": "j"}.get(mode)
    if loss_group:
        c("all_reduce", loss_group, rows, times=1)
        c("all_reduce", loss_group, 3 * rows, times=1)

    for key, cm in fwd_bwd.comm.items():
        total = counter.comm.setdefault(key, Comm(group_size=cm.group_size))
        total.calls += grad_accum * cm.calls
        total.bytes += grad_accum * cm.bytes
        total.wire_bytes += grad_accum * cm.wire_bytes
    flops *= 3 * grad_accum  # backward = two products per forward product

    # ---- after backward: sync_grads, the global norm, the logged loss
    for group, numel in buckets.items():
        add("all_reduce", group, numel)
    add("all_reduce", "dp", param_numel)
    add("all_reduce", "tp", 1, elem=F64)  # grad_norm
    add("all_reduce", "world", 1, elem=F64)  # global_mean of the loss
    n_tensors = len(shape.params)
    return SplitPlan(split, param_numel * F32, param_numel * F32, 2 * param_numel * F32 + n_tensors * F32,
                     act * F32, flops, counter.comm)


def _shard(shape: ModelShape, p: Param, split: Split, geo: Geometry, vp: int, lin_by_name) -> tuple[int, Optional[str]]:
    """(elements this rank holds, the mesh group whose replicas' gradients
    sync_grads sums, or None)."""
    mode, q, P, sp = split.mode, geo.q, split.size, split.seq_parallel
    full = math.prod(p.shape)
    role = p.role
    if mode == "none":
        return full, None
    if mode == "1d":
        if role == "embedding":
            return vp // P * p.shape[1], None
        if role in ("qkv", "attn_in", "mlp_in", "lm_head"):
            n = vp if role == "lm_head" else p.shape[0]
            return n // P * (math.prod(p.shape[1:]) if p.kind == "weight" else 1), None
        if role in ("attn_out", "mlp_out") and p.kind == "weight":
            return full // P, None
        # replicated over the group: partial sums only with sequence parallelism
        return full, ("tp" if sp else None)
    if role is None:
        raise ValueError(f"parameter {p.name!r} has no role; mode {mode} cannot leave it whole")
    hidden_replica = {"2d": "col", "2.5d": "hidden_replica"}.get(mode)
    if mode in ("2d", "2.5d"):
        depth_replica = "depth" if geo.depth > 1 else None
        if role == "embedding":
            return vp // q * (p.shape[1] // q), depth_replica
        if role == "pos_embedding":
            return p.shape[0] * (p.shape[1] // q), hidden_replica
        if role == "norm":
            return full // q, hidden_replica
        n = vp if role == "lm_head" else p.shape[0]
        if p.kind == "weight":
            return n // q * (p.shape[1] // q), depth_replica
        return n // q, hidden_replica
    # 3d
    if role == "embedding":
        return vp // (q * q) * (p.shape[1] // q), None
    if role == "pos_embedding":
        return p.shape[0] * (p.shape[1] // q), "ij"
    if role == "norm":
        return full // q, "ij"
    n = vp if role == "lm_head" else p.shape[0]
    if p.kind == "weight":
        return n // (q * q) * (p.shape[1] // q), None
    # a bias lands in the flipped layout of its linear's input
    return n // q, ("il" if role in ("qkv", "attn_in", "mlp_in", "lm_head") else "ij")


# --------------------------------------------------------------------------
# Every split of a world


def splits_of(world: int, cfg) -> list[tuple[Split, Optional[Geometry], Optional[str]]]:
    """Every (mode, size, depth, dp, seq_parallel) with size*dp == world,
    with its geometry, or None and the reason it is invalid for `cfg`."""
    out = []
    for size in range(1, world + 1):
        if world % size:
            continue
        dp = world // size
        candidates = []
        if size == 1:
            candidates.append(Split("none", 1, 1, dp))
        else:
            candidates += [Split("1d", size, 1, dp), Split("1d", size, 1, dp, True), Split("2d", size, 1, dp),
                           Split("3d", size, 1, dp)]
            # depth 1 is 2d; depth = size (q = 1) is data parallelism with extra steps
            candidates += [Split("2.5d", size, depth, dp) for depth in range(2, size) if size % depth == 0]
        for s in candidates:
            probe = _with_split(cfg, s)
            try:
                out.append((s, validate_parallel(probe), None))
            except ConfigError as e:
                if s.mode in ("2d", "3d", "2.5d") and "needs" in str(e):
                    continue  # not a square / cube: not a split at all
                out.append((s, None, str(e).removeprefix("invalid config: ")))
    return out


def _with_split(cfg, s: Split):
    from omegaconf import OmegaConf

    probe = OmegaConf.to_container(cfg, resolve=True) if not isinstance(cfg, dict) else dict(cfg)
    probe.update(mode=s.mode, size=s.size, depth=s.depth, dp=s.dp, seq_parallel=s.seq_parallel)
    return OmegaConf.create(probe)


# --------------------------------------------------------------------------
# Hardware


@dataclass
class Hardware:
    name: str
    peak_flops: float  # per rank, fp32 (what tpctl computes in today)
    efficiency: float  # achieved fraction of peak on these matmuls
    ranks_per_node: int
    intra_bw: float  # bytes/s per rank, inside a node
    intra_latency: float  # seconds per ring step
    inter_bw: float  # bytes/s per rank, across nodes
    inter_latency: float
    memory_bytes: float = 0.0  # per rank (device memory); 0: not checked
    cores: int = 0  # CPU profiles: ranks beyond this many share cores (0: one device per rank)
    peak_flops_bf16: float = 0.0  # per rank, dense bf16 (tensor cores); 0: unknown (bench's MFU at bf16)
    note: str = ""


def load_hardware(name: str) -> Hardware:
    import yaml

    path = HARDWARE_DIR / f"{name}.yaml"
    if not path.exists():
        valid = ", ".join(sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml")))
        raise ConfigError("hardware", name, f"expected one of {valid}")
    raw = yaml.safe_load(path.read_text())
    fields = {f.name for f in dataclasses.fields(Hardware)}
    try:
        values = {k: (str(v) if k == "note" else int(v) if k in ("ranks_per_node", "cores") else float(v))
                  for k, v in raw.items() if k in fields and k != "name"}
        return Hardware(name=name, **values)
    except (TypeError, ValueError) as e:  # PyYAML reads 1.0e9 as text, hence float() above
        raise ConfigError("hardware", name, f"{path} needs numbers for {', '.join(sorted(fields - {'name', 'note'}))}: {e}") from None


def group_members(split: Split, geo: Geometry, group: str) -> list[list[int]]:
    """Global ranks of every group named `group` (the mesh's own layout)."""
    from tpctl.parallel.mesh import group_members as mesh_group_members  # imports torch

    return mesh_group_members(geo, split.dp, group)


def predict(plan: SplitPlan, geo: Geometry, hw: Hardware) -> SplitPlan:
    """Fill in step_time_s: compute + every collective at the speed of the
    slowest link its groups span (no overlap of compute and communication)."""
    compute = plan.flops / (hw.peak_flops * hw.efficiency)
    if hw.cores and plan.split.world > hw.cores:
        compute *= plan.split.world / hw.cores  # oversubscribed CPU: ranks take turns
    comm_s = 0.0
    for (kind, group), c in plan.comm.items():
        spans = any(len({r // hw.ranks_per_node for r in members}) > 1
                    for members in group_members(plan.split, geo, group))
        bw, lat = (hw.inter_bw, hw.inter_latency) if spans else (hw.intra_bw, hw.intra_latency)
        steps = LATENCY_STEPS.get(kind, lambda p: p - 1)(c.group_size)
        comm_s += c.calls * steps * lat + c.wire_bytes / bw
    plan.compute_s, plan.comm_s, plan.step_time_s = compute, comm_s, compute + comm_s
    plan.fits = not hw.memory_bytes or plan.memory_bytes <= hw.memory_bytes
    return plan


# --------------------------------------------------------------------------
# The command


def plan_world(cfg, world: int, hw: Optional[Hardware]) -> tuple[list[SplitPlan], list[tuple[Split, str]]]:
    shape = model_shape(cfg.model, cfg.seed)
    t = cfg.train
    plans, invalid = [], []
    for split, geo, why in splits_of(world, cfg):
        if geo is None:
            invalid.append((split, why))
            continue
        try:
            p = plan_split(shape, split, geo, t.batch_size, t.seq_len, t.grad_accum)
        except ValueError as e:
            invalid.append((split, str(e)))
            continue
        plans.append(predict(p, geo, hw) if hw else p)
    if hw:  # the fastest first, among those that fit in memory
        plans.sort(key=lambda p: (not p.fits, p.step_time_s))
    return plans, invalid
