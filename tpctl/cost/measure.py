"""The measuring engine behind `tpctl bench` (tpctl/commands/bench.py):
one pool of gloo ranks runs every mode on the same model and batch, rounds
alternating the modes so that every mode sees the same load. `setup`,
`loss_and_step` and friends run on the ranks (state kept per process: the
pool's processes live through the run); `bench` drives them.
"""

from __future__ import annotations

import statistics
import time
from typing import Optional

from tpctl.errors import ConfigError

BASELINE = "dtensor"
# The mode whose layout PyTorch's own tensor parallelism (BASELINE) reproduces.
BASELINE_MODE = "1d"
# The same model trained by a plain PyTorch loop: no tpctl layer, F.cross_entropy,
# torch.nn.utils.clip_grad_norm_ (the loop tpctl must be as fast as).
PLAIN = "plain"
# tpctl in one process: the reference every mode must match.
REFERENCE = "none"
DEFAULT_MODES = [REFERENCE, PLAIN, "1d", BASELINE, "2d"]
# `<mode>-blocking`: the same run with train.overlap=false (every collective
# waited for at once), a row beside the overlapped one.
BLOCKING = "-blocking"


def overlapped(name: str) -> tuple[str, bool]:
    """A bench mode name without its `-blocking` suffix, and whether it
    overlaps communication (True unless the suffix was there). `1d+sp`,
    the spelling bench took before it read layout names, is `1d-sp`."""
    name, overlaps = (name[:-len(BLOCKING)], False) if name.endswith(BLOCKING) else (name, True)
    return (f"{name[:-3]}-sp" if name.endswith("+sp") else name), overlaps


def mode_names() -> list[str]:
    """What `modes=[...]` takes besides layout names: the registered modes
    (`none` among them), `<mode>-sp` for those with sequence parallelism,
    `plain` and `dtensor`."""
    from tpctl.parallel.registry import mode_classes

    names = [REFERENCE, PLAIN]
    for cls in mode_classes():
        names += ([cls.name] if cls.name != REFERENCE else []) + ([f"{cls.name}-sp"] if cls.sequence_parallel else [])
        names += [BASELINE] if cls.name == BASELINE_MODE else []  # beside the mode it reproduces
    return names


def layout_of(name: str, size: int, depth: Optional[int], pp: int = 1):
    """The layout a bench mode name measures. Every name is a layout's
    short name (Layout.parse) but `plain` (one rank) and `dtensor` (a 1d
    group of `size`). One that names a mode alone (`1d`, `1d-sp`, `2.5d`:
    no size, no other axis) is that mode on one group of `size` ranks,
    with `pp` pipeline stages of it (pp x size ranks; a mode using depth,
    as 2.5d: the smallest depth > 1 its geometry takes, unless given);
    `none` is one rank. Any other (`none-dp4-z2`, `2d-4-dp2-z3`) is the
    layout it names, of `size` ranks in all."""
    from tpctl.parallel.layout import Layout

    name = overlapped(name)[0]
    if name == PLAIN:
        return Layout()
    if name == BASELINE:
        return Layout(BASELINE_MODE, size)
    layout = Layout.parse(name)
    if is_layout_name(name) or layout.mode == REFERENCE:
        return layout
    if not layout.mode_class.uses_depth:
        return layout.replace(size=size, pp=pp)
    if depth is None:
        depth = next((v["depth"] for v in layout.mode_class.variants(size) if _fits(Layout(layout.mode, size, v["depth"]))), 1)
    return layout.replace(size=size, depth=depth, pp=pp)


def _fits(layout) -> bool:
    try:
        layout.geo
    except ConfigError:
        return False
    return True


def is_layout_name(name: str) -> bool:
    """Whether a bench mode name names a whole layout (`2d-4-dp2-z1`:
    anything besides a mode and `sp`), rather than a mode on the bench's
    group; a name Layout.parse refuses is one where it has a '-' (`check`
    says what is wrong with it)."""
    from tpctl.parallel.layout import Layout

    name = overlapped(name)[0]
    try:
        layout = Layout.parse(name)
    except ValueError:
        return "-" in name
    return layout.replace(seq_parallel=False) != Layout(layout.mode)


def one_rank(name: str) -> bool:
    """Whether bench mode `name` runs on one rank (the others idle)."""
    return name in (REFERENCE, PLAIN)


def check(cfg, modes: list[str], size: int, depth: Optional[int], pp: int = 1) -> None:
    from tpctl.config import check_layout
    from tpctl.parallel.layout import Layout

    valid = mode_names()
    for m in modes:
        if not overlapped(m)[1] and overlapped(m)[0] in (PLAIN, BASELINE, REFERENCE):
            raise ConfigError("modes", m, f"{overlapped(m)[0]} has no collectives of tpctl's to overlap: "
                                          "-blocking follows a tensor-parallel mode (1d-blocking) or a layout name")
        if is_layout_name(m):
            try:
                layout = layout_of(m, size, depth)
            except ValueError as e:
                raise ConfigError("modes", m, str(e)) from None
            check_layout(cfg, layout)
            if layout.world != size:
                raise ConfigError("modes", m, f"{layout.label()} runs on {layout.world} ranks: expected {size} (size={size})")
            continue
        if overlapped(m)[0] not in valid:
            example = Layout(dp=size, zero=1).name
            raise ConfigError("modes", m, f"expected a list of {', '.join(valid)}, or layout names such as {example}")
        if m == BASELINE and pp > 1:
            raise ConfigError("modes", m, f"the DTensor baseline has no pipeline stages: leave it out with pp={pp}")
        check_layout(cfg, layout_of(m, size, depth, pp))
    if cfg.model.arch != "gpt" and BASELINE in modes:
        raise ConfigError("modes", BASELINE, f"the DTensor baseline is written for model.arch=gpt, not {cfg.model.arch}")


# --------------------------------------------------------------------------
# On the ranks (state kept per process: the pool's processes live through the run)

rank_state: dict[str, dict] = {}


def _device(cfg):
    """This rank's device: the CPU, or with device=cuda a GPU (ranks share
    the machine's GPUs over gloo, as launcher.backend=gloo does)."""
    import torch
    import torch.distributed as dist

    if cfg.device != "cuda":
        return torch.device("cpu")
    gpu = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
    torch.cuda.set_device(gpu)
    return gpu


def setup(name: str, cfg_dict: dict, size: int, depth: Optional[int], compile: bool = False, pp: int = 1) -> dict:
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from tpctl.models import build_model
    from tpctl.parallel.registry import import_mode_module
    from tpctl.training.build import build_run
    from tpctl.training.step import build_optimizer

    cfg = OmegaConf.create(cfg_dict)
    cfg.train.overlap = overlapped(name)[1]
    import_mode_module(cfg.get("mode_module"))  # a pool rank finds a mode defined outside tpctl by name
    layout = layout_of(name, size, depth, pp)
    rank = dist.get_rank()
    device = _device(cfg)
    from tpctl.training.step import set_tf32

    set_tf32(bool(cfg.train.get("tf32", False)), device, cfg.precision)  # every row, the plain one too
    if name == BASELINE:
        st = _setup_dtensor(cfg, size)
    elif one_rank(name) and rank != 0:
        rank_state[name] = {"idle": True}
        return {}
    elif name == PLAIN:  # the model as written: no rewrite, no tpctl layer
        st = {"model": build_model(cfg.model, cfg.seed).to(device)}
    else:
        # One rank of a bigger pool measures mode=none: its mesh has no process group.
        # tpctl's own step, as the trainer runs it (a constant learning rate).
        run = build_run(cfg, layout=layout, device=device, groups=layout.world > 1, schedule=False)
        st = {"par": run.par, "model": run.model, "step": run.step, "opt": run.step.optimizer}
    if "step" not in st:
        st["opt"] = build_optimizer(st["model"].parameters(), cfg.optim)
    if compile:
        from tpctl.training.compile import compile_model

        compile_model(st["model"], "true", device.type, say=print, per_block="par" in st and st["par"].pipeline is not None)
    st["cfg"], st["device"] = cfg, device
    g = torch.Generator().manual_seed(cfg.seed)
    st["ids"] = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1), generator=g).to(device)
    st["times"], st["comm"], st["exposed"] = [], [], []
    rank_state[name] = st
    return {"param_bytes": _memory(st)["param_bytes"]}


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

    from tpctl.models import build_model
    from tpctl.parallel.shard import fused_block

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


def loss_and_step(st: dict, name: str) -> None:
    import torch
    import torch.nn.functional as F

    cfg, model, opt = st["cfg"], st["model"], st["opt"]
    x, y = st["ids"][:, :-1], st["ids"][:, 1:]
    if "step" in st:  # tpctl: training/step.py, as the trainer runs it
        par, micros = st["par"], st["step"].micro_count
        out = st["step"]([(par.shard_batch(x, k, micros), par.shard_targets(y, k, micros)) for k in range(micros)], 0)
        st["loss"] = float(out["loss"])  # the number a trainer logs: one sync, as below
        return
    opt.zero_grad(set_to_none=True)
    if name == PLAIN:
        with _autocast(cfg, st["device"]):
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        st["loss"] = loss.item()  # the number a plain loop logs: one sync, as below
    elif name == BASELINE:
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
    opt.step()


def _autocast(cfg, device):
    from tpctl.training.step import autocast

    return autocast(device, cfg.precision)


def _run(name: str, steps: int, record: bool) -> None:
    from tpctl.parallel import comm

    st = rank_state[name]
    for _ in range(steps):
        comm.barrier()  # every mode's step starts with all ranks ready
        comm.STATS.reset()
        t0 = time.perf_counter()
        if not st.get("idle"):
            loss_and_step(st, name)
            if st["device"].type == "cuda":
                import torch

                torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        if not st.get("idle"):
            st.setdefault("first_loss", st["loss"])
        if record and not st.get("idle"):
            st["times"].append(elapsed)
            st["comm"].append(comm.STATS.total_bytes())
            exposed = comm.STATS.exposed_s
            st["exposed"].append((sum(exposed.values()), sum(v for k, v in exposed.items() if k.endswith("_flat"))))
    comm.barrier()


def _peak(name: str) -> int:
    """The peak of live bytes one more step of `name` allocates on this rank
    (activations, gradients, transient buffers such as a ring's received
    blocks): what falls with cp, where parameters and AdamW do not."""
    st = rank_state[name]
    if st.get("idle"):
        return 0
    return peak_allocated_bytes(lambda: loss_and_step(st, name))


def _collect(name: str) -> dict:
    st = rank_state.pop(name)
    if st.get("idle"):
        return {}
    return {"times": st["times"], "first_loss": st.get("first_loss"), "comm_bytes": st["comm"][-1] if st["comm"] else 0,
            "exposed": st["exposed"], **_memory(st)}


def _memory(st: dict) -> dict:
    """Bytes of parameters, gradients and optimizer state a rank holds:
    tpctl's step counts its own (ZeRO's chunks); the others' as whole
    tensors (a DTensor's local shard)."""
    import torch

    if "step" in st:
        held = st["step"].memory()
        return {"param_bytes": held["param_bytes"], "grad_bytes": held["grad_bytes"],
                "optim_bytes": held["optimizer_bytes"]}

    def nbytes(t):
        if hasattr(t, "to_local"):
            t = t.to_local()
        return t.numel() * t.element_size()

    params = sum(nbytes(p) for p in st["model"].parameters())
    state = sum(nbytes(v) for s in st["opt"].state.values() for v in s.values() if isinstance(v, torch.Tensor))
    return {"param_bytes": params, "grad_bytes": params, "optim_bytes": state}


# --------------------------------------------------------------------------
# The measurement


def bench(cfg, modes: list[str], size: int, steps: int, rounds: int, warmup: int,
          depth: Optional[int] = None, timeout_s: float = 600, compile: bool = False, pp: int = 1,
          pool=None) -> dict[str, dict]:
    """{mode: its measurements}; on `pool` (a DistPool of size x pp ranks,
    left open: the tests') or on one of its own."""
    from omegaconf import OmegaConf

    from tpctl.launch.pool import DistPool

    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    own = pool is None
    pool = DistPool(size * pp, timeout_s=timeout_s) if own else pool
    try:
        for m in modes:
            pool.run(setup, m, cfg_dict, size, depth, compile, pp)
            pool.run(_run, m, warmup, False)
        for _ in range(rounds):  # alternate: every mode sees the same load
            for m in modes:
                pool.run(_run, m, steps, True)
        results = {}
        for m in modes:
            peak = max(pool.run(_peak, m))
            per_rank = pool.run(_collect, m)
            r = per_rank[0]
            r["peak_bytes"] = peak  # the largest rank's
            # a step ends when its slowest rank is done: the max over ranks
            times = [max(rr["times"][k] for rr in per_rank if rr) for k in range(len(r["times"]))]
            r["times"] = times
            r["median_s"] = statistics.median(times)
            # communication the ranks' threads waited for (comm.STATS.exposed_s), per step: the mean over ranks
            exposed = [[statistics.fmean(rr["exposed"][k][part] for rr in per_rank if rr) for k in range(len(times))]
                       for part in (0, 1)]
            r["exposed_comm_s"], r["exposed_dp_s"] = (statistics.median(e) if e else 0.0 for e in exposed)
            del r["exposed"]
            r["best_s"] = min(times)
            results[m] = r
        return results
    finally:
        if own:
            pool.close()


def flops_per_token(cfg) -> float:
    """Model FLOPs per trained token (forward and backward): 6 per weight
    of the matmuls (every parameter but the position table), plus attention's
    scores and mix, 12 * layers * width * sequence (as PaLM's MFU counts)."""
    import math

    from .planner import model_shape

    shape = model_shape(cfg.model, cfg.seed)
    weights = sum(math.prod(p.shape) for p in shape.params if p.role != "pos_embedding")
    return 6.0 * weights + 12.0 * shape.attention_layers * shape.n_embd * cfg.train.seq_len


class ImpossibleMFU(ValueError):
    """A measured speed above the profile's peak: the profile is not this
    device's (an MFU above 1 is never printed)."""


def mfu(cfg, hw, median_s: float, ranks: int) -> Optional[float]:
    """Model FLOPs utilisation of `ranks` devices of profile `hw` at the
    measured step time: against the bf16 peak at precision=bf16, the TF32
    peak at fp32 with train.tf32=true, where known; ImpossibleMFU above 1."""
    peak = hw.peak_flops
    if cfg.precision == "bf16" and hw.peak_flops_bf16:
        peak = hw.peak_flops_bf16
    elif cfg.device == "cuda" and cfg.train.get("tf32", False) and hw.peak_flops_tf32:
        peak = hw.peak_flops_tf32
    if not peak:
        return None
    tokens = cfg.train.batch_size * cfg.train.seq_len
    value = flops_per_token(cfg) * tokens / median_s / (peak * ranks)
    if value > 1:
        raise ImpossibleMFU(f"{value:.2f} on hardware={hw.name} (peak {peak / 1e12:,.1f} TFLOP/s per rank): "
                            "faster than the profile's peak, so it is not this device's; name it with hardware=")
    return value


# A GPU's profile by its name (torch.cuda.get_device_name), first match.
DEVICE_PROFILES = (("H200", "h200"), ("H100", "h100"), ("A100", "a100"), ("V100", "v100"))


def hardware_for(setting: str, device: str) -> str:
    """bench's hardware=: a profile's name, or auto: the CPU's on device=cpu,
    on device=cuda the profile of GPU 0 by its name (ConfigError without one)."""
    if setting != "auto":
        return setting
    if device != "cuda":
        return "cpu"
    import torch

    name = torch.cuda.get_device_name(0)
    for part, profile in DEVICE_PROFILES:
        if part in name.upper():
            return profile
    known = ", ".join(p for _, p in DEVICE_PROFILES)
    raise ConfigError("hardware", "auto", f"no profile matches {name!r}: name one with hardware= ({known}, "
                      "or a file of configs/hardware_profiles/)")


def predicted_ms(cfg, modes, size, depth, hardware: str, pp: int = 1) -> dict[str, Optional[float]]:
    """`tpctl plan`'s predicted step time of each mode on `hardware`."""
    from tpctl.config.pipeline import check_pipeline

    from .planner import load_hardware, model_shape, plan_split, predict

    hw = load_hardware(hardware)
    shape = model_shape(cfg.model, cfg.seed)
    out = {}
    for m in modes:
        layout = layout_of(m, size, depth, pp)
        spec = check_pipeline(layout, cfg)
        plan = plan_split(shape, layout, cfg.train.batch_size, cfg.train.seq_len, pipeline=spec,
                          context=cfg.get("context", {}).get("impl", "ring"))
        out[m] = predict(plan, hw, overlap=overlapped(m)[1]).step_time_s * 1e3
    return out


def peak_allocated_bytes(fn) -> int:
    """Peak of live bytes torch allocated (and had not yet freed) while `fn`
    ran, from the profiler's allocation events (CPU and CUDA alike, which
    RSS cannot tell)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = top = 0
    for _, nbytes in events:
        live += nbytes
        top = max(top, live)
    return top
