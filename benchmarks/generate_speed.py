"""Generation speed: tokens/s of greedy decoding in mode=none (one rank) and
mode=1d (size ranks), with the KV cache and without it (every step re-runs
the whole sequence).

    python benchmarks/generate_speed.py                       # a 4x256 GPT, 96 new tokens, 2 ranks
    python benchmarks/generate_speed.py --size 2 --new 128 --layers 6 --embd 384

One pool of `size` gloo ranks runs every case (training/generation.py's
`generate` on a rewritten model, as `tpctl generate`'s workers run it, minus
the launch); rounds alternate the cases so each sees the same load on a
shared machine, and the table gives the median. mode=none runs on rank 0
while the other ranks wait. The prompt's prefill is included in the time.
"""

from __future__ import annotations

import argparse
import statistics
import time

from rich.console import Console
from rich.table import Table

from tpctl.launch.pool import DistPool, parallelism_of
from tpctl.parallel.layout import Layout


def _model(mode_key: str, layers: int, embd: int, block: int):
    from tpctl.config import default_config
    from tpctl.models import build_model
    from tpctl.parallel.tensor.rewrite import rewrite_layers

    cfg = default_config(arch="gpt", vocab_size=256, n_layer=layers, n_head=embd // 64, n_embd=embd, block_size=block)
    mode = parallelism_of(Layout.parse(mode_key)).mode
    return rewrite_layers(build_model(cfg.model, 0, lazy=True), mode).model, mode


_cache: dict = {}


def _timed(mode_key: str, use_cache: bool, new: int, layers: int, embd: int, block: int):
    import torch

    from tpctl.training.generation import generate

    torch.set_num_threads(1)
    if mode_key not in _cache:
        _cache[mode_key] = _model(mode_key, layers, embd, block)
    model, mode = _cache[mode_key]
    if mode.geo.mode == "none" and mode.mesh.rank != 0:
        return None
    prompt = list(b"def main(argv):\n    ")
    started = time.perf_counter()
    out = generate(model, mode, prompt, new, use_cache=use_cache)
    return len(out) / (time.perf_counter() - started), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=2)
    parser.add_argument("--new", type=int, default=96)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    block = args.new + 32
    one_d = Layout("1d", args.size).name
    modes = {"none": Layout(dp=args.size).name, one_d: one_d}  # layout names (Layout.parse)
    cases = [(name, cache) for name in modes for cache in (True, False)]
    speeds: dict = {c: [] for c in cases}
    pool = DistPool(args.size, timeout_s=1800)
    try:
        for name, key in modes.items():  # build (and warm up) each model once
            pool.run(_timed, key, True, 4, args.layers, args.embd, block)
        for _ in range(args.rounds):
            for name, cache in cases:
                speed, _ = pool.run(_timed, modes[name], cache, args.new, args.layers, args.embd, block)[0]
                speeds[(name, cache)].append(speed)
    finally:
        pool.close()
    table = Table(title=f"greedy decoding: GPT {args.layers}x{args.embd}, {args.new} new tokens, "
                        f"median of {args.rounds} rounds")
    for col in ("mode", "KV cache", "tokens/s", "x none (cached)"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    ref = statistics.median(speeds[("none", True)])
    for (name, cache), values in speeds.items():
        median = statistics.median(values)
        table.add_row(name, "yes" if cache else "no", f"{median:,.1f}", f"{median / ref:.2f}")
    console = Console(width=120)
    console.print(table)


if __name__ == "__main__":
    main()
