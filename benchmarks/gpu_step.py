"""tpctl against a plain PyTorch loop on one GPU, eager and compiled: the
numbers of issue 29 in one run (under 5 minutes on one H100/H200).

    PYTHONPATH=. python benchmarks/gpu_step.py [--steps 5] [--rounds 3] [--warmup 5] [--skip-llama]
        [--skip-gpt] [--set optim.fused=false]

Rows: gpt-small (124M, tpctl's GPT class; batch 16 x 1024, bf16 autocast,
AdamW, clip 1.0, random tokens) eager and compiled, and a ~1B Llama
(Hugging Face's LlamaForCausalLM, random init, nothing downloaded: hidden
2048, 16 layers, MLP 5632, vocab 32000 untied; batch 4 x 2048) compiled.
"plain" is the 15-line loop below on the same model object class, with
torch's default AdamW (foreach on a GPU); "tpctl" is `tpctl train
mode=none`'s step (its AdamW fused on a GPU: optim.fused=auto; `--set
optim.fused=false` measures it without) (training/build.py's build_run, the
trainer's TrainStep; train.compile compiles it as the trainer does).
gpt-small alternates plain and tpctl round by round (both resident); the
Llama runs plain, then tpctl (one at a time: 1B with AdamW twice is ~35 GB).
Each time is the median step after `warmup` steps (synchronised). MFU:
model FLOPs per token (cost/measure.py) x tokens/s / the bf16 peak of the
device's profile (configs/hardware_profiles/, by the GPU's name).

Without a GPU it runs tiny shapes on the CPU, compiling through dynamo only
(backend eager): a smoke run that checks the script, not a measurement.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

import torch
import torch.nn.functional as F

GPT_SMALL = {"model.arch": "gpt", "model.vocab_size": 50257, "model.n_layer": 12, "model.n_head": 12,
             "model.n_embd": 768, "model.block_size": 1024, "model.bias": True, "model.tie_embeddings": True,
             "train.batch_size": 16, "train.seq_len": 1024}
LLAMA_1B = {"model.arch": "llama", "model.vocab_size": 32000, "model.n_layer": 16, "model.n_head": 16,
            "model.n_kv_head": 16, "model.n_embd": 2048, "model.intermediate_size": 5632, "model.block_size": 2048,
            "model.bias": False, "model.tie_embeddings": False, "train.batch_size": 4, "train.seq_len": 2048}
TINY = {"gpt": {"model.n_layer": 1, "model.n_head": 2, "model.n_embd": 32, "model.vocab_size": 256,
                "model.block_size": 16, "train.batch_size": 2, "train.seq_len": 16},
        "llama": {"model.n_layer": 1, "model.n_head": 2, "model.n_kv_head": 2, "model.n_embd": 32,
                  "model.intermediate_size": 64, "model.vocab_size": 256, "model.block_size": 16,
                  "train.batch_size": 2, "train.seq_len": 16}}


def config(sizes: dict, tiny: bool, extra: dict | None = None):
    from omegaconf import OmegaConf

    from tpctl.config import default_config

    hf = sizes["model.arch"] != "gpt"
    cfg = default_config()
    values = {**sizes, **(TINY["llama" if hf else "gpt"] if tiny else {}), "precision": "bf16", "optim.grad_clip": 1.0,
              "model.dropout": 0.0, "train.label_smoothing": 0.0, **(extra or {})}
    for key, value in values.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


class Plain:
    """The 15-line loop: the model as written, F.cross_entropy, clip_grad_norm_, AdamW."""

    def __init__(self, cfg, device, compiled: bool):
        from tpctl.models import build_model
        from tpctl.parallel.roles.plan import logits_of
        from tpctl.training.compile import backend

        self.model = build_model(cfg.model, cfg.seed).to(device)
        if compiled:
            self.model.compile(backend=backend())
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
        self.logits_of, self.device = logits_of, device

    def __call__(self, x, y, step):
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            logits = self.logits_of(self.model(x))
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


class Tpctl:
    """`tpctl train mode=none`'s step on this device."""

    def __init__(self, cfg, device, compiled: bool):
        from tpctl.parallel.layout import Layout
        from tpctl.training.build import build_run
        from tpctl.training.compile import compile_model

        self.run = build_run(cfg, layout=Layout(), device=device, groups=False)
        if compiled:
            compile_model(self.run.model, "true", device.type, say=print)

    def __call__(self, x, y, step):
        return self.run.step([(x, y)], step)["loss"]


def timed(fn, batch, device, steps: int, first: int) -> list[float]:
    """Seconds of each of `steps` steps, synchronised."""
    out = []
    for i in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn(*batch, first + i)
        if device.type == "cuda":
            torch.cuda.synchronize()
        out.append(time.perf_counter() - start)
    return out


def batch_of(cfg, device):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1), generator=g).to(device)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def measure(cfg, device, compiled: bool, args, together: bool) -> dict[str, float]:
    """Median step seconds of plain and tpctl: alternating rounds with both
    resident (`together`), else one after the other."""
    batch = batch_of(cfg, device)
    times: dict[str, list[float]] = {"plain": [], "tpctl": []}
    kinds = {"plain": Plain, "tpctl": Tpctl}
    if together:
        runs = {name: kind(cfg, device, compiled) for name, kind in kinds.items()}
        for name, run in runs.items():
            timed(run, batch, device, args.warmup, 0)
        for r in range(args.rounds):
            for name, run in runs.items():
                times[name] += timed(run, batch, device, args.steps, args.warmup + r * args.steps)
        del runs
    else:
        for name, kind in kinds.items():
            run = kind(cfg, device, compiled)
            timed(run, batch, device, args.warmup, 0)
            times[name] = timed(run, batch, device, args.steps * args.rounds, args.warmup)
            del run
            free(device)
    free(device)
    return {name: statistics.median(t) for name, t in times.items()}


def free(device) -> None:
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def mfu_of(cfg, seconds: float):
    from tpctl.cost.measure import ImpossibleMFU, hardware_for, mfu
    from tpctl.cost.planner import load_hardware
    from tpctl.errors import ConfigError

    if cfg.device != "cuda":
        return None
    try:
        return mfu(cfg, load_hardware(hardware_for("auto", "cuda")), seconds, 1)
    except (ConfigError, ImpossibleMFU) as e:
        print(f"MFU not given: {e}")
        return None


def profile(cfg, device, out_dir: str) -> None:
    """Where the eager step's time goes: torch.profiler's tables (self CUDA
    time, self CPU time) of 3 steps of plain and of tpctl, one file each."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    os.makedirs(out_dir, exist_ok=True)
    batch = batch_of(cfg, device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for name, kind in (("plain", Plain), ("tpctl", Tpctl)):
        run = kind(cfg, device, False)
        timed(run, batch, device, 3, 0)
        with profiler(activities=activities) as prof:
            timed(run, batch, device, 3, 3)
        events = prof.key_averages()
        by = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        with open(os.path.join(out_dir, f"profile_{name}.txt"), "w") as f:
            f.write(events.table(sort_by=by, row_limit=40) + "\n")
            f.write(events.table(sort_by="self_cpu_time_total", row_limit=40) + "\n")
        print(f"profile of {name}: {out_dir}/profile_{name}.txt", flush=True)
        del run
        free(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round (default 5)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3: 15 timed steps)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (compiling happens here)")
    parser.add_argument("--skip-llama", action="store_true", help="gpt-small only")
    parser.add_argument("--skip-gpt", action="store_true", help="the Llama only")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a tpctl config override for every row, e.g. optim.fused=false (repeatable)")
    parser.add_argument("--cpu", action="store_true", help="the tiny CPU smoke run even where a GPU is")
    parser.add_argument("--profile", metavar="DIR", help="also write torch.profiler tables of gpt-small's eager step there")
    args = parser.parse_args()
    gpu = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    if gpu:
        print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    else:
        from tpctl.training.compile import BACKEND_ENV

        os.environ.setdefault(BACKEND_ENV, "eager")
        args.steps, args.rounds, args.warmup = 1, 1, 1
        print("no CUDA device: tiny shapes on the CPU, compiled through dynamo only (backend eager); "
              "a smoke run, not a measurement")
    extra = dict(item.split("=", 1) for item in args.set)
    if extra:
        print(f"tpctl overrides: {extra}")
    rows = []
    plans = [] if args.skip_gpt else [("gpt-small bf16, eager", GPT_SMALL, False, True),
                                      ("gpt-small bf16, compiled", GPT_SMALL, True, True)]
    if not args.skip_llama:
        plans.append(("Llama ~1B bf16, compiled", LLAMA_1B, True, False))
    for label, sizes, compiled, together in plans:
        cfg = config(sizes, tiny=not gpu, extra=extra)
        cfg.device = device.type
        medians = measure(cfg, device, compiled, args, together)
        tokens = cfg.train.batch_size * cfg.train.seq_len
        rows.append((label, tokens, medians, {k: mfu_of(cfg, v) for k, v in medians.items()}))
        print(f"done: {label}", flush=True)
    print("\n| run | plain ms/step | tpctl ms/step | plain tokens/s | tpctl tokens/s | plain MFU | tpctl MFU | tpctl / plain |")
    print("|---|---|---|---|---|---|---|---|")
    for label, tokens, m, u in rows:
        mfus = [f"{u[k]:.3f}" if u[k] is not None else "-" for k in ("plain", "tpctl")]
        print(f"| {label} | {m['plain'] * 1e3:,.1f} | {m['tpctl'] * 1e3:,.1f} | {tokens / m['plain']:,.0f} | "
              f"{tokens / m['tpctl']:,.0f} | {mfus[0]} | {mfus[1]} | {m['tpctl'] / m['plain']:.2f} |")
    print("tpctl / plain: step time ratio (<= 1.00: tpctl as fast as the plain loop or faster)")
    if args.profile:
        cfg = config(GPT_SMALL, tiny=not gpu)
        cfg.device = device.type
        profile(cfg, device, args.profile)


if __name__ == "__main__":
    main()
