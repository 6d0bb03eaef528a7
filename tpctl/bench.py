"""`tpctl bench`: modes side by side on one model, batch and world.

    tpctl bench model=gpt-tiny size=4 modes=[none,1d,dtensor,2d] [steps=5] [rounds=3] [train.batch_size=16 ...]

One pool of `size` gloo ranks runs every mode (and `dtensor`: PyTorch's own
tensor parallelism, torch.distributed.tensor.parallel's ColwiseParallel /
RowwiseParallel with loss_parallel on the same GPT, the same batch). Rounds
alternate the modes, `steps` timed steps each, so that every mode sees the
same load on a shared machine; the table gives the median step. `none` runs
on rank 0 alone (the single-process reference the ratios are taken to).

A step is a whole optimizer step: forward, parallel loss, backward, gradient
sync, clipping, AdamW. Per rank: parameter + gradient + AdamW bytes measured
from the tensors, communication bytes per step from comm.STATS, and the
step time `tpctl plan` predicts with the `cpu` hardware profile beside the
measured one.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any, Optional

from .errors import ConfigError

BASELINE = "dtensor"
DEFAULT_MODES = ["none", "1d", BASELINE, "2d"]


def _parse(args: list[str]):
    opts: dict[str, Any] = {"size": None, "modes": None, "steps": 5, "rounds": 3, "warmup": 2, "depth": None,
                            "hardware": "cpu", "json": False}
    overrides = []
    for a in args:
        if a == "--json":
            opts["json"] = True
            continue
        key, eq, value = a.partition("=")
        if eq and key in ("size", "steps", "rounds", "warmup", "depth"):
            try:
                opts[key] = int(value)
            except ValueError:
                raise ConfigError(key, value, "expected a positive integer") from None
            if opts[key] < (0 if key == "warmup" else 1):
                raise ConfigError(key, value, "expected a positive integer")
        elif eq and key == "modes":
            opts["modes"] = [m.strip() for m in value.strip("[]").split(",") if m.strip()]
        elif eq and key == "hardware":
            opts["hardware"] = value
        elif eq and key in ("mode", "dp"):
            raise ConfigError(key, value, "tpctl bench takes modes=[...] and size=N (one tensor-parallel group, dp=1)")
        else:
            overrides.append(a)
    if opts["size"] is None:
        raise ConfigError("size", "(missing)", "expected size=N, the number of ranks every mode runs on")
    return opts, overrides


def _split_for(mode: str, size: int, depth: Optional[int]):
    """(tpctl mode, size, depth, seq_parallel) of a bench mode name."""
    from .geometry import exact_root

    if mode == "none":
        return "none", 1, 1, False
    if mode in ("1d", BASELINE):
        return "1d", size, 1, False
    if mode in ("1d+sp", "1d-sp"):
        return "1d", size, 1, True
    if mode == "2.5d":
        if depth is None:  # the smallest depth > 1 that leaves a square
            depth = next((d for d in range(2, size) if size % d == 0 and exact_root(size // d, 2)), 1)
        return "2.5d", size, depth, False
    return mode, size, 1, False


def check(cfg, modes: list[str], size: int, depth: Optional[int]) -> None:
    from omegaconf import OmegaConf

    from .geometry import validate_parallel

    valid = ["none", "1d", "1d+sp", BASELINE, "2d", "2.5d", "3d"]
    for m in modes:
        if m not in valid:
            raise ConfigError("modes", m, f"expected a list of {', '.join(valid)}")
        mode, msize, mdepth, sp = _split_for(m, size, depth)
        probe = OmegaConf.to_container(cfg, resolve=True)
        probe.update(mode=mode, size=msize, depth=mdepth, dp=1, seq_parallel=sp)
        validate_parallel(OmegaConf.create(probe))
    if cfg.model.arch != "gpt" and BASELINE in modes:
        raise ConfigError("modes", BASELINE, f"the DTensor baseline is written for model.arch=gpt, not {cfg.model.arch}")


# --------------------------------------------------------------------------
# On the ranks (state kept per process: the pool's processes live through the run)

_state: dict[str, dict] = {}


def _none_mesh():
    """A one-rank mesh for mode=none on rank 0 of a bigger world."""
    import torch

    from .geometry import geometry
    from .mesh import Mesh

    mesh = Mesh(geo=geometry("none", 1), rank=0, world_size=1, dp_size=1, dp_rank=0, tp_rank=0,
                coords={"p": 0}, device=torch.device("cpu"))
    mesh.groups, mesh.group_ranks = {"tp": None, "dp": None}, {"tp": [0], "dp": [0]}
    mesh.rng_shared = torch.Generator().manual_seed(0)
    mesh.rng_local = torch.Generator().manual_seed(1)
    return mesh


def _setup(name: str, cfg_dict: dict, size: int, depth: Optional[int]) -> dict:
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from .models import build_model
    from .train import build_optimizer

    cfg = OmegaConf.create(cfg_dict)
    mode, msize, mdepth, sp = _split_for(name, size, depth)
    rank = dist.get_rank()
    if name == BASELINE:
        st = _setup_dtensor(cfg, size)
    elif name == "none":
        if rank != 0:
            _state[name] = {"idle": True}
            return {}
        from .parallel.none import NoParallel
        from .parallel.base import parallelize

        tp = NoParallel(_none_mesh())
        st = {"tp": tp, "model": parallelize(build_model(cfg.model, cfg.seed, lazy=True), tp)}
    else:
        from . import init_parallel, parallelize

        tp = init_parallel(mode=mode, size=msize, depth=mdepth, dp=1, seed=cfg.seed, seq_parallel=sp)
        st = {"tp": tp, "model": parallelize(build_model(cfg.model, cfg.seed, lazy=True), tp)}
    st["opt"] = build_optimizer(st["model"], cfg.optim)
    st["cfg"] = cfg
    g = torch.Generator().manual_seed(cfg.seed)
    st["ids"] = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1), generator=g)
    st["times"], st["comm"] = [], []
    _state[name] = st
    return {"param_bytes": sum(p.numel() * p.element_size() for p in st["model"].parameters())}


def _setup_dtensor(cfg, size: int) -> dict:
    """PyTorch's TP on the same GPT: qkv and fc column-parallel, the
    projections row-parallel, the embedding vocab-parallel (Rowwise on
    nn.Embedding), the LM head column-parallel with sharded logits for
    loss_parallel. The fused qkv rows are reordered first (as tpctl's
    fused_block does), so each rank's contiguous block is [q_p | k_p | v_p]:
    whole heads, the same math as the model."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from .models import build_model
    from .parallel.shard import fused_block

    model = build_model(cfg.model, cfg.seed)
    mesh = init_device_mesh("cpu", (size,))
    n = 3 * cfg.model.n_embd
    order = torch.cat([torch.arange(a, b) for p in range(size) for a, b in fused_block(n, 3, size, size, p)])
    plan = {"wte": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i, block in enumerate(model.blocks):
        with torch.no_grad():
            block.attn.qkv.weight.copy_(block.attn.qkv.weight[order])
            if block.attn.qkv.bias is not None:
                block.attn.qkv.bias.copy_(block.attn.qkv.bias[order])
        plan.update({f"blocks.{i}.attn.qkv": ColwiseParallel(), f"blocks.{i}.attn.proj": RowwiseParallel(),
                     f"blocks.{i}.mlp.fc": ColwiseParallel(), f"blocks.{i}.mlp.proj": RowwiseParallel()})
    tied = cfg.model.tie_embeddings
    parallelize_module(model, mesh, plan)
    if tied:  # parallelize_module made two parameters of the tied one
        model.lm_head.weight = model.wte.weight
    return {"model": model, "mesh": mesh}


def _loss_and_step(st: dict, name: str) -> None:
    import torch
    import torch.nn.functional as F

    cfg, model, opt = st["cfg"], st["model"], st["opt"]
    x, y = st["ids"][:, :-1], st["ids"][:, 1:]
    opt.zero_grad(set_to_none=True)
    if name == BASELINE:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.parallel import loss_parallel

        logits = model(x)
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
        st["loss"] = loss.full_tensor().item()
        # the global norm: each shard once, replicated tensors once
        sharded = torch.zeros((), dtype=torch.float64)
        replicated = torch.zeros((), dtype=torch.float64)
        for p in model.parameters():
            if isinstance(p.grad, DTensor):
                sharded += p.grad.to_local().double().pow(2).sum()
            elif p.grad is not None:
                replicated += p.grad.double().pow(2).sum()
        torch.distributed.all_reduce(sharded, group=st["mesh"].get_group())
        norm = (sharded + replicated).sqrt().item()
        coef = cfg.optim.grad_clip / (norm + 1e-6)
        if cfg.optim.grad_clip > 0 and coef < 1:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)
    else:
        tp = st["tp"]
        logits = model(tp.shard_batch(x))
        loss_sum = tp.cross_entropy(logits, tp.shard_targets(y), cfg.model.vocab_size).sum()
        (loss_sum / y.numel()).backward()
        tp.sync_grads(model)
        tp.clip_grad_norm_(model, cfg.optim.grad_clip)
        # the number a trainer logs (a one-rank none run has no world to reduce over)
        st["loss"] = (loss_sum.item() / y.numel() if name == "none" else tp.global_mean(loss_sum, y.numel()))
    opt.step()


def _run(name: str, steps: int, record: bool) -> None:
    import torch.distributed as dist

    from . import comm

    st = _state[name]
    for _ in range(steps):
        dist.barrier()  # every mode's step starts with all ranks ready
        comm.STATS.reset()
        t0 = time.perf_counter()
        if not st.get("idle"):
            _loss_and_step(st, name)
        elapsed = time.perf_counter() - t0
        if not st.get("idle"):
            st.setdefault("first_loss", st["loss"])
        if record and not st.get("idle"):
            st["times"].append(elapsed)
            st["comm"].append(comm.STATS.total_bytes())
    dist.barrier()


def _collect(name: str) -> dict:
    import torch

    st = _state.pop(name)
    if st.get("idle"):
        return {}
    model, opt = st["model"], st["opt"]

    def nbytes(t):
        if hasattr(t, "to_local"):
            t = t.to_local()
        return t.numel() * t.element_size()

    params = sum(nbytes(p) for p in model.parameters())
    state = sum(nbytes(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    return {"times": st["times"], "first_loss": st.get("first_loss"), "comm_bytes": st["comm"][-1] if st["comm"] else 0,
            "param_bytes": params, "grad_bytes": params, "optim_bytes": state}


# --------------------------------------------------------------------------
# The command


def bench(cfg, modes: list[str], size: int, steps: int, rounds: int, warmup: int,
          depth: Optional[int] = None, timeout_s: float = 600) -> dict[str, dict]:
    from omegaconf import OmegaConf

    from .testing import DistPool

    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    pool = DistPool(size, timeout_s=timeout_s)
    try:
        for m in modes:
            pool.run(_setup, m, cfg_dict, size, depth)
            pool.run(_run, m, warmup, False)
        for _ in range(rounds):  # alternate: every mode sees the same load
            for m in modes:
                pool.run(_run, m, steps, True)
        results = {}
        for m in modes:
            per_rank = pool.run(_collect, m)
            r = per_rank[0]
            # a step ends when its slowest rank is done: the max over ranks
            times = [max(rr["times"][k] for rr in per_rank if rr) for k in range(len(r["times"]))]
            r["times"] = times
            r["median_s"] = statistics.median(times)
            r["best_s"] = min(times)
            results[m] = r
        return results
    finally:
        pool.close()


def predicted_ms(cfg, modes, size, depth, hardware: str) -> dict[str, Optional[float]]:
    """`tpctl plan`'s predicted step time of each mode on `hardware`."""
    from .geometry import geometry
    from .plan import Split, load_hardware, model_shape, plan_split, predict

    hw = load_hardware(hardware)
    shape = model_shape(cfg.model, cfg.seed)
    out = {}
    for m in modes:
        mode, msize, mdepth, sp = _split_for(m, size, depth)
        geo = geometry(mode, msize, mdepth)
        p = plan_split(shape, Split(mode, msize, mdepth, 1, sp), geo, cfg.train.batch_size, cfg.train.seq_len)
        out[m] = predict(p, geo, hw).step_time_s * 1e3
    return out


def main(args: list[str]) -> int:
    if any(a in ("-h", "--help") for a in args):
        print(__doc__, end="")
        return 0
    try:
        opts, overrides = _parse(args)
        from .config import compose_jobs

        cfg = compose_jobs(overrides)[0]
        modes = opts["modes"] or DEFAULT_MODES
        check(cfg, modes, opts["size"], opts["depth"])
        from .plan import load_hardware

        load_hardware(opts["hardware"])
    except ConfigError as e:
        print(f"tpctl: error: {e}", file=sys.stderr)
        return 2
    size = opts["size"]
    results = bench(cfg, modes, size, opts["steps"], opts["rounds"], opts["warmup"], opts["depth"])
    predicted = predicted_ms(cfg, [m for m in modes], size, opts["depth"], opts["hardware"])
    tokens = cfg.train.batch_size * cfg.train.seq_len
    if opts["json"]:
        import json

        print(json.dumps({m: {**r, "predicted_ms": predicted.get(m), "tokens_per_s": tokens / r["median_s"]}
                          for m, r in results.items()}, indent=1))
        return 0
    print_table(results, predicted, cfg, size, opts)
    return 0


def print_table(results: dict, predicted: dict, cfg, size: int, opts: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    m, t = cfg.model, cfg.train
    tokens = t.batch_size * t.seq_len
    ref = results.get("none")
    title = (f"tpctl bench: {m.arch} {m.n_layer}x{m.n_embd} (vocab {m.vocab_size}), batch {t.batch_size} x seq {t.seq_len}, "
             f"{size} ranks, median of {opts['rounds']}x{opts['steps']} steps")
    table = Table(title=title)
    for c in ("mode", "ranks", "ms/step", "best ms", "tokens/s", "x none", "comm MiB/step", "params+grads+AdamW MiB/rank",
              "x none ", "step-1 loss", f"plan ms ({opts['hardware']})"):
        table.add_column(c, justify="left" if c == "mode" else "right")
    for name, r in results.items():
        mem = r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"]
        label = name + (" (torch TP)" if name == BASELINE else "")
        speed = f"{ref['median_s'] / r['median_s']:.2f}" if ref else "-"
        mem_ratio = f"{mem / (ref['param_bytes'] + ref['grad_bytes'] + ref['optim_bytes']):.2f}" if ref else "-"
        comm_mib = "not counted" if name == BASELINE else f"{r['comm_bytes'] / 2**20:,.2f}"
        table.add_row(label, "1" if name == "none" else str(size), f"{r['median_s'] * 1e3:,.1f}", f"{r['best_s'] * 1e3:,.1f}",
                      f"{tokens / r['median_s']:,.0f}", speed, comm_mib, f"{mem / 2**20:,.2f}", mem_ratio,
                      f"{r['first_loss']:.6f}", f"{predicted[name]:,.1f}" if predicted.get(name) is not None else "-")
    console = Console(width=200)
    console.print(table)
    console.print("x none: speed-up (tokens/s) and memory relative to mode=none on one rank; comm: payload bytes "
                  "handed to collectives by rank 0 (comm.py); plan ms: `tpctl plan`'s prediction.")
