"""`tpctl bench`: modes side by side on one model, batch and world.

    tpctl bench model=gpt-tiny size=4 modes=[none,plain,1d,dtensor,2d] [steps=5] [rounds=3] [compile=true]
                [pp=2 pipeline.schedule=1f1b ...] [device=cuda hardware=auto|h100|h200] [train.batch_size=16 ...]
    tpctl bench model=gpt-tiny size=4 modes=[none-dp4,none-dp4-z1,none-dp4-z3,1d-2-dp2-z2]
    tpctl bench model=gpt-small size=4 modes=[1d,1d-blocking,2d,2d-blocking]
    tpctl bench model=gpt-tiny size=4 modes=[none,none-cp2-dp2,none-cp4] train.batch_size=2 train.seq_len=4096 model.block_size=4096

A mode is a name (`1d`, `2d`: one tensor-parallel group of `size` ranks) or
a layout's short name of `size` ranks in all, with data parallelism and a
ZeRO stage (`2d-4-dp2-z3`: 2d on 4 ranks times 2 replicas, zero=3; the rows
show its label). `<mode>-blocking` (`1d-blocking`, `2d-4-dp2-blocking`) is
the same run with train.overlap=false: every collective waited for at once,
the row to compare the overlapped one with (the same bits). A layout
name with cp (`none-cp4`, `1d-2-cp2`) splits each sequence over cp ranks
(context.impl as set): the step peak per rank falls with cp.

One pool of `size` gloo ranks runs every mode (and `dtensor`: PyTorch's own
tensor parallelism, torch.distributed.tensor.parallel's ColwiseParallel /
RowwiseParallel with loss_parallel on the same GPT, the same batch). Rounds
alternate the modes, `steps` timed steps each, so that every mode sees the
same load on a shared machine; the table gives the median step. pp=P
gives tpctl's modes P pipeline stages (pp x size ranks; the pipeline.*
settings as in `tpctl train`). `none` runs
on rank 0 alone (the single-process reference the ratios are taken to), and
so does `plain`: the same model trained by a plain PyTorch loop (the model
as written, F.cross_entropy, torch.nn.utils.clip_grad_norm_, AdamW), what
tpctl's mode=none must be as fast as ("x plain").

device=cuda puts the ranks on the machine's GPUs (shared over gloo when
there are fewer GPUs than ranks) and adds an MFU column: model FLOPs per
token x tokens/s / the hardware profile's peak (bf16 peak at precision=bf16,
TF32's with train.tf32=true) over the ranks; an MFU above 1 (a profile
that is not the device's) is not printed. hardware=auto (the default)
prices on the device's profile: cpu, or the GPU's by its name (H100, H200,
A100, V100). train.tf32=true holds for every row, the plain one too.
compile=true compiles every mode's model (torch.compile).

A step is a whole optimizer step: forward, parallel loss, backward, gradient
sync, clipping, AdamW. Per rank: parameter + gradient + AdamW bytes measured
from the tensors, communication bytes per step from comm.STATS, and the
step time `tpctl plan` predicts with the hardware profile beside the
measured one.
"""

from __future__ import annotations


from tpctl.commands.options import integer, name_list, parse_options, refused, text
from tpctl.cost.measure import (BASELINE, DEFAULT_MODES, PLAIN, REFERENCE, ImpossibleMFU, bench, check, hardware_for,
                                is_layout_name, layout_of, mfu, one_rank, overlapped, predicted_ms)
from tpctl.errors import ConfigError, fail


def boolean(key: str, value: str) -> bool:
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ConfigError(key, value, "expected true or false")


def _parse(args: list[str]):
    positive = integer(1, "expected a positive integer")
    one_group = refused("tpctl bench takes modes=[...] and size=N: data parallelism and ZeRO by layout names in modes "
                        "(modes=[none-dp4,none-dp4-z2] with size=4)")
    opts, overrides = parse_options(args, {
        "size": (None, positive), "modes": (None, name_list), "steps": (5, positive), "rounds": (3, positive),
        "warmup": (2, integer(0, "expected a positive integer")), "depth": (None, positive), "hardware": ("auto", text),
        "mode": (None, one_group), "dp": (None, one_group), "compile": (False, boolean), "pp": (1, positive)},
        flags=("--json",))
    if opts["size"] is None:
        raise ConfigError("size", "(missing)", "expected size=N, the number of ranks every mode runs on")
    return opts, overrides


def check_stages(modes: list[str], pp: int) -> None:
    """pp=P pipelines tpctl's tensor-parallel modes only: with none of them
    listed nothing would run P stages (and `check` would never see P
    against the model) while the header said P x size ranks."""
    staged = [m for m in modes if not (one_rank(m) or m == BASELINE or is_layout_name(m))]
    if pp > 1 and not staged:
        raise ConfigError("pp", pp, f"pipeline stages are for tpctl's tensor-parallel modes, and modes=[{','.join(modes)}] "
                          "has none (none and plain run on one rank, dtensor and layout names without stages): expected "
                          "pp=1, or a mode such as 1d in modes")


def main(args: list[str]) -> int:
    if any(a in ("-h", "--help") for a in args):
        print(__doc__, end="")
        return 0
    try:
        opts, overrides = _parse(args)
        from tpctl.config import compose_jobs

        cfg = compose_jobs(overrides)[0]
        modes = opts["modes"] or ([m for m in DEFAULT_MODES if m != "dtensor"] if opts["pp"] > 1 else DEFAULT_MODES)
        check(cfg, modes, opts["size"], opts["depth"], opts["pp"])
        check_stages(modes, opts["pp"])
        from tpctl.config import check_backend

        check_backend(cfg)  # device=cuda needs a CUDA device (the ranks share it)
        from tpctl.cost.planner import load_hardware

        opts["hardware"] = hardware_for(opts["hardware"], cfg.device)  # auto: the device's own profile
        load_hardware(opts["hardware"])
        if opts["compile"]:
            from tpctl.training.compile import preflight

            problem = preflight("true", cfg.device)
            if problem:
                raise ConfigError("compile", "true", f"{problem}: run without compile=true")
    except ConfigError as e:
        return fail(e)
    size, pp = opts["size"], opts["pp"]
    results = bench(cfg, modes, size, opts["steps"], opts["rounds"], opts["warmup"], opts["depth"], compile=opts["compile"], pp=pp)
    predicted = predicted_ms(cfg, [m for m in modes], size, opts["depth"], opts["hardware"], pp)
    tokens = cfg.train.batch_size * cfg.train.seq_len
    if opts["json"]:
        import json

        from tpctl.cost.planner import load_hardware

        hw = load_hardware(opts["hardware"])
        print(json.dumps({m: {**r, "predicted_ms": predicted.get(m), "tokens_per_s": tokens / r["median_s"],
                              "mfu": _mfu(cfg, hw, r["median_s"], 1 if one_rank(m) else size * pp, m)}
                          for m, r in results.items()}, indent=1))
        return 0
    print_table(results, predicted, cfg, size, opts)
    return 0


def _mfu(cfg, hw, median_s: float, ranks: int, name: str):
    """The MFU of a row; above 1 never printed: one line on stderr, and no value."""
    try:
        return mfu(cfg, hw, median_s, ranks)
    except ImpossibleMFU as e:
        import sys

        print(f"tpctl: bench: {name}: MFU {e}", file=sys.stderr)
        return None


def print_table(results: dict, predicted: dict, cfg, size: int, opts: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from tpctl.cost.planner import load_hardware

    m, t = cfg.model, cfg.train
    tokens = t.batch_size * t.seq_len
    ref, plain = results.get(REFERENCE), results.get(PLAIN)
    cuda = cfg.device == "cuda"
    hw = load_hardware(opts["hardware"])
    stages = f" (pp={opts['pp']})" if opts["pp"] > 1 else ""
    title = (f"tpctl bench: {m.arch} {m.n_layer}x{m.n_embd} (vocab {m.vocab_size}), batch {t.batch_size} x seq {t.seq_len}, "
             f"{size * opts['pp']} ranks on {cfg.device}{stages}, "
             f"{cfg.precision}{', compiled' if opts['compile'] else ''}, "
             f"median of {opts['rounds']}x{opts['steps']} steps")
    table = Table(title=title)
    columns = ["mode", "ranks", "ms/step", "best ms", "tokens/s", "x none", "x plain", "comm MiB/step", "exposed comm ms",
               "params+grads+AdamW MiB/rank", "x none ", "step peak MiB/rank", "x none  ", "step-1 loss",
               f"plan ms ({opts['hardware']})"]
    if cuda:
        columns.append(f"MFU ({opts['hardware']})")
    for c in columns:
        table.add_column(c, justify="left" if c == "mode" else "right")
    for name, r in results.items():
        mem = r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"]
        label = layout_of(name, size, opts["depth"]).label() + ("" if overlapped(name)[1] else " blocking") \
            if is_layout_name(name) else name
        label += " (torch TP)" if name == BASELINE else ""
        speed = f"{ref['median_s'] / r['median_s']:.2f}" if ref else "-"
        vs_plain = f"{plain['median_s'] / r['median_s']:.2f}" if plain else "-"
        mem_ratio = f"{mem / (ref['param_bytes'] + ref['grad_bytes'] + ref['optim_bytes']):.2f}" if ref else "-"
        comm_mib = "not counted" if name == BASELINE else f"{r['comm_bytes'] / 2**20:,.2f}"
        ranks = 1 if one_rank(name) else size * opts["pp"]
        peak_ratio = f"{r['peak_bytes'] / ref['peak_bytes']:.2f}" if ref and ref["peak_bytes"] else "-"
        row = [label, str(ranks), f"{r['median_s'] * 1e3:,.1f}", f"{r['best_s'] * 1e3:,.1f}",
               f"{tokens / r['median_s']:,.0f}", speed, vs_plain, comm_mib, _exposed(r, name), f"{mem / 2**20:,.2f}", mem_ratio,
               f"{r['peak_bytes'] / 2**20:,.2f}", peak_ratio, f"{r['first_loss']:.6f}", f"{predicted[name]:,.1f}" if predicted.get(name) is not None else "-"]
        if cuda:
            value = _mfu(cfg, hw, r["median_s"], ranks, name)
            row.append(f"{value:.3f}" if value is not None else "-")
        table.add_row(*row)
    console = Console(width=240)
    console.print(table)
    console.print("x none / x plain: speed-up (tokens/s) relative to mode=none on one rank and to a plain PyTorch loop "
                  "(F.cross_entropy, clip_grad_norm_) on one rank; memory relative to none; step peak: the most bytes "
                  "torch held allocated during one more step beyond what it held before (activations, gradients, "
                  "buffers; the largest rank's): what falls with cp=C; comm: payload bytes "
                  "handed to collectives by rank 0 (comm.py); exposed comm: the time a rank's thread spent issuing or "
                  "waiting for collectives (mean over ranks; dp: data parallelism's bucket reductions, not hidden behind "
                  "the backward); plan ms: `tpctl plan`'s prediction"
                  + ("; MFU: model FLOPs per token x tokens/s / (peak x ranks)." if cuda else "."))


def _exposed(r: dict, name: str) -> str:
    if name == BASELINE or "exposed_comm_s" not in r:
        return "not counted"
    dp = f" (dp {r['exposed_dp_s'] * 1e3:,.1f})" if r["exposed_dp_s"] else ""
    return f"{r['exposed_comm_s'] * 1e3:,.1f}{dp}"
