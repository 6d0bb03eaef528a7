"""Activation memory per rank of one forward + backward with context
parallelism (cp ranks splitting each sequence), against cp=1, on a long
sequence of a gpt-tiny-shaped model.

    python benchmarks/cp_memory.py                     # batch 1 x 4096 tokens, cp 1, 2, 4, ring and ulysses
    python benchmarks/cp_memory.py --seq 8192 --cps 1 4 --impls ring

Three numbers per rank (the largest rank's reported): the peak resident set
size increase during the step (activation_memory.py's method: VmHWM reset
before the step, every large tensor its own mapping, so transient buffers
count too), the peak of the bytes torch held allocated beyond those before
the step (the profiler's allocation events: no allocator's rounding), and
the bytes autograd keeps for the backward (distinct storages saved by the
forward, through saved-tensor hooks); beside them the planner's activation
estimate (`tpctl plan`'s act column) and its ratio to each peak.
"""

from __future__ import annotations

import argparse
import os

from activation_memory import _step_peak_bytes

from tpctl.cost.measure import peak_allocated_bytes


def measure(cp: int, impl: str, batch: int, seq: int) -> dict:
    import torch

    from tpctl.config import compose_jobs
    from tpctl.parallel.layout import Layout
    from tpctl.training.build import build_run

    cfg = compose_jobs(["model=gpt-tiny", f"model.block_size={seq}", f"cp={cp}", f"context.impl={impl}",
                        f"train.seq_len={seq}", f"train.batch_size={batch}"])[0]
    run = build_run(cfg, layout=Layout(cp=cp), step=False)
    par, net = run.par, run.model
    ids = torch.randint(0, cfg.model.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    x, y = par.shard_batch(ids[:, :-1]), par.shard_targets(ids[:, 1:])
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    def step():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = par.cross_entropy(net(x), y, cfg.model.vocab_size).sum() / (batch * seq)
        loss.backward()

    step()  # warm-up: gradients allocated, thread pools started
    net.zero_grad(set_to_none=False)
    saved.clear()
    peak = _step_peak_bytes(step)
    params = {p.untyped_storage().data_ptr() for p in net.parameters()}
    kept = sum(n for ptr, n in saved.items() if ptr not in params)
    net.zero_grad(set_to_none=False)
    return {"peak": peak, "saved": kept, "allocated": peak_allocated_bytes(step)}


def planned(cp: int, impl: str, batch: int, seq: int) -> int:
    from tpctl.config import compose_jobs
    from tpctl.cost.planner import model_shape, plan_split
    from tpctl.parallel.layout import Layout

    cfg = compose_jobs(["model=gpt-tiny", f"model.block_size={seq}"])[0]
    return plan_split(model_shape(cfg.model), Layout(cp=cp), batch, seq, context=impl).activation_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--cps", nargs="*", type=int, default=[1, 2, 4])
    parser.add_argument("--impls", nargs="*", default=["ring", "ulysses"], choices=["ring", "ulysses"])
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # (see activation_memory.py)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from rich.console import Console
    from rich.table import Table

    from tpctl.launch.pool import DistPool

    table = Table(title=f"activation memory per rank, one forward+backward of gpt-tiny, batch {args.batch} x "
                        f"{args.seq} tokens (largest rank)")
    for col in ("cp", "impl", "peak RSS increase", "vs cp=1", "peak allocated", "saved for backward", "vs cp=1",
                "planned act", "planned / peak RSS", "planned / peak allocated"):
        table.add_column(col, justify="right")
    base = None
    for cp in args.cps:
        for impl in args.impls if cp > 1 else ["ring"]:
            Console(stderr=True).print(f"measuring cp={cp} {impl} ...")
            pool = DistPool(cp, timeout_s=1200)
            try:
                results = pool.run(measure, cp, impl, args.batch, args.seq)
            finally:
                pool.close()
            peak, saved, allocated = (max(r[key] for r in results) for key in ("peak", "saved", "allocated"))
            base = base or (peak, saved)
            plan = planned(cp, impl, args.batch, args.seq)
            table.add_row(str(cp), impl if cp > 1 else "-", f"{peak / 2**20:,.1f} MiB", f"{peak / base[0]:.2f}",
                          f"{allocated / 2**20:,.1f} MiB", f"{saved / 2**20:,.1f} MiB", f"{saved / base[1]:.2f}",
                          f"{plan / 2**20:,.1f} MiB", f"{plan / peak:.3f}", f"{plan / allocated:.3f}")
    Console(width=220).print(table)


if __name__ == "__main__":
    main()
