"""tpctl's tensor-parallel layers against ColossalAI's legacy ones
(colossalai.legacy.nn: Linear1D_Col/Row, Linear2D, Linear2p5D, Linear3D) on
the same workload and the same gloo CPU ranks: a stack of residual MLP
blocks (H -> 4H, GELU, 4H -> H), fp32, forward + backward + SGD step, both
libraries built from the same full weights in each process and timed in
alternating rounds, so drift on a shared machine hits both. The first
step's loss of each is checked against the one-process loss.

    /work/cvenv/bin/python benchmarks/colossalai_compare.py             # 1d 4, 2d 4, 2.5d 8 (depth 2), 3d 8
    python benchmarks/colossalai_compare.py --modes 1d --hidden 64 --rounds 1 --steps 1

ColossalAI is optional (not a tpctl dependency); without it this prints how
to install it and exits 0. It pins torch<=2.5.1 and imports optimizer
packages its legacy layers never call; the recipe below installs it beside
torch 2.13 (docs/benchmarks.md: "Against ColossalAI")."""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

INSTALL = ("colossalai is not importable: python3 -m venv /work/cvenv && /work/cvenv/bin/pip install torch==2.13.0 "
           "&& BUILD_EXT=0 /work/cvenv/bin/pip install --no-deps colossalai==0.5.0 && /work/cvenv/bin/pip install "
           "psutil einops hydra-core omegaconf rich safetensors numpy, plus stubs for peft, galore_torch, bitsandbytes "
           "and its seed manager on the CPU generator (docs/benchmarks.md: 'Against ColossalAI'); then run this with "
           "/work/cvenv/bin/python and PYTHONPATH=<tpctl>")

LR = 0.1  # large enough that a wrong gradient shows in the second step's loss
CHECKED = 2  # steps whose loss is checked against one process
# mode -> (ranks, depth)
SIZES = {"1d": (4, 1), "2d": (4, 1), "2.5d": (8, 2), "3d": (8, 1)}


def full_weights(hidden: int, layers: int, batch: int, seq: int):
    """The reference model's weights (nn.Linear layout) and input, the same in every process."""
    import torch

    g = torch.Generator().manual_seed(0)
    blocks = [tuple(torch.randn(shape, generator=g) * scale for shape, scale in (
        ((4 * hidden, hidden), hidden ** -0.5), ((4 * hidden,), 0.1),
        ((hidden, 4 * hidden), (4 * hidden) ** -0.5), ((hidden,), 0.1))) for _ in range(layers)]
    return blocks, torch.randn(batch, seq, hidden, generator=g)


def block_class():
    import torch

    class Block(torch.nn.Module):
        def __init__(self, fc1, fc2):
            super().__init__()
            self.fc1, self.fc2 = fc1, fc2

        def forward(self, x):
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))

    return Block


def reference_losses(blocks, x, steps: int, lr: float) -> list[float]:
    """The losses of `steps` SGD steps of the whole model in one process."""
    import torch
    import torch.nn.functional as F

    params = [t.clone().requires_grad_() for block in blocks for t in block]
    losses = []
    for _ in range(steps):
        h = x
        for w1, b1, w2, b2 in zip(*[iter(params)] * 4):
            h = h + F.linear(F.gelu(F.linear(h, w1, b1)), w2, b2)
        loss = (h ** 2).mean()
        loss.backward()
        losses.append(float(loss))
        with torch.no_grad():
            for p in params:
                p -= lr * p.grad
                p.grad = None
    return losses


def build_tpctl(mode: str, size: int, depth: int, blocks, x):
    import torch

    import tpctl

    tp = tpctl.init_parallel(mode=mode, size=size, depth=depth)
    Block = block_class()
    hidden = x.shape[-1]
    model = torch.nn.Sequential(*[Block(torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden, hidden))
                                  for _ in blocks])
    with torch.no_grad():
        for block, (w1, b1, w2, b2) in zip(model, blocks):
            for p, v in ((block.fc1.weight, w1), (block.fc1.bias, b1), (block.fc2.weight, w2), (block.fc2.bias, b2)):
                p.copy_(v)
    plan = {f"{i}.{name}": role for i in range(len(blocks)) for name, role in (("fc1", "mlp_in"), ("fc2", "mlp_out"))}
    model = tpctl.parallelize(model, tp, plan)
    local = tp.mode.shard_hidden(x[tp.mode.read_rows(range(x.shape[0]))]).contiguous()
    return model, local, lambda: tp.sync_grads(model)


def _colossal_context(mode: str, size: int, depth: int) -> None:
    """ColossalAI's legacy global context on the process group the pool already
    made (colossalai.legacy.launch would make its own): what launch does
    after init_process_group."""
    import torch.distributed as dist
    from colossalai.context import Config
    from colossalai.legacy.context import ParallelMode
    from colossalai.legacy.core import global_context as gpc

    tensor = dict(mode=mode, size=size, **({"depth": depth} if mode == "2.5d" else {}))
    gpc.load_config(Config(dict(parallel=dict(tensor=tensor))))
    rank, world = dist.get_rank(), dist.get_world_size()
    gpc._register_dist(rank, world, dist.GroupMember.WORLD, None, list(range(world)), ParallelMode.GLOBAL)
    gpc.add_global_rank(ParallelMode.GLOBAL, rank)
    gpc.init_parallel_groups()
    gpc.set_seed(1024)


def _colossal_pieces(mode: str, size: int, depth: int, hidden: int):
    """Per mode: the two Linears of a block, each Linear's slice of a full
    nn.Linear (weight, bias), and this rank's piece of an activation; the
    slicing is that of ColossalAI's own legacy layer tests."""
    from colossalai.legacy import nn as cnn
    from colossalai.legacy.context import ParallelMode as PM
    from colossalai.legacy.core import global_context as gpc

    local = gpc.get_local_rank
    if mode == "1d":
        r, p = local(PM.PARALLEL_1D), size
        layers = (lambda: cnn.Linear1D_Col(hidden, 4 * hidden), lambda: cnn.Linear1D_Row(4 * hidden, hidden))

        def cut(layer, w, b):
            if isinstance(layer, cnn.Linear1D_Col):
                return w.chunk(p, 0)[r], b.chunk(p)[r]
            return w.chunk(p, 1)[r], b
        return layers, cut, lambda a: a
    if mode in ("2d", "2.5d"):
        col, row, q = ((PM.PARALLEL_2D_COL, PM.PARALLEL_2D_ROW, int(round(size ** 0.5))) if mode == "2d" else
                       (PM.PARALLEL_2P5D_COL, PM.PARALLEL_2P5D_ROW, int(round((size // depth) ** 0.5))))
        i, j = local(col), local(row)
        h = local(PM.PARALLEL_2P5D_DEP) if mode == "2.5d" else 0
        cls = cnn.Linear2D if mode == "2d" else cnn.Linear2p5D
        layers = (lambda: cls(hidden, 4 * hidden), lambda: cls(4 * hidden, hidden))

        def cut(layer, w, b):
            bias = b.chunk(q)[j]
            return w.t().chunk(q, 0)[i].chunk(q, -1)[j], bias.chunk(q)[i] if mode == "2d" else bias
        return layers, cut, lambda a: a.chunk(depth * q, 0)[h * q + i].chunk(q, -1)[j]
    q = int(round(size ** (1 / 3)))
    layers = (lambda: cnn.Linear3D(hidden, 4 * hidden), lambda: cnn.Linear3D(4 * hidden, hidden))

    def cut(layer, w, b):
        j, i, k = (local(m) for m in (layer.input_parallel_mode, layer.weight_parallel_mode,
                                     layer.output_parallel_mode))
        return w.t().chunk(q, 0)[k].chunk(q, -1)[j].chunk(q, 0)[i], b.chunk(q)[j]

    def split(a):
        from colossalai.legacy.constants import INPUT_GROUP_3D, OUTPUT_GROUP_3D, WEIGHT_GROUP_3D
        from colossalai.legacy.nn.layer.parallel_3d._utils import get_parallel_mode_from_env

        j, i, k = (local(get_parallel_mode_from_env(g)) for g in (INPUT_GROUP_3D, WEIGHT_GROUP_3D, OUTPUT_GROUP_3D))
        return a.chunk(q, 0)[i].chunk(q, -1)[k].chunk(q, 0)[j]
    return layers, cut, split


def build_colossal(mode: str, size: int, depth: int, blocks, x):
    import torch
    import torch.distributed as dist

    _colossal_context(mode, size, depth)
    hidden = x.shape[-1]
    (make1, make2), cut, split = _colossal_pieces(mode, size, depth, hidden)
    local = split(x).contiguous()  # (3d: the input's layout read before the layers swap its groups)
    Block = block_class()
    model = torch.nn.Sequential(*[Block(make1(), make2()) for _ in blocks])
    with torch.no_grad():
        for block, (w1, b1, w2, b2) in zip(model, blocks):
            for layer, w, b in ((block.fc1, w1, b1), (block.fc2, w2, b2)):
                ws, bs = cut(layer, w, b)
                layer.weight.copy_(ws)
                layer.bias.copy_(bs)
    finish = lambda: None  # noqa: E731
    if mode == "2.5d":
        # The legacy layers leave the sum of the depth replicas' gradients to
        # the caller (its engine's handlers); tpctl's sync_grads does it.
        from colossalai.legacy.context import ParallelMode as PM
        from colossalai.legacy.core import global_context as gpc

        group = gpc.get_group(PM.PARALLEL_2P5D_DEP)

        def finish():
            for p in model.parameters():
                dist.all_reduce(p.grad, group=group)
    return model, local, finish


def compare(mode: str, size: int, depth: int, hidden: int, layers: int, batch: int, seq: int, steps: int,
            rounds: int, threads: int) -> dict:
    import time
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(threads)
    blocks, x = full_weights(hidden, layers, batch, seq)
    count = x.numel()
    runs = {}
    for name, build in (("colossalai", build_colossal), ("tpctl", build_tpctl)):
        model, local, finish = build(mode, size, depth, blocks, x)
        runs[name] = (model, local, finish, torch.optim.SGD(model.parameters(), lr=LR))

    def step(name: str) -> torch.Tensor:
        model, local, finish, opt = runs[name]
        out = model(local)
        loss = (out ** 2).sum() / count  # this rank's share (1d: every rank holds all of it)
        loss.backward()
        finish()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    first = {name: [] for name in runs}  # the first steps' losses: the same weights, data and updates as one process
    for _ in range(CHECKED):
        for name in runs:
            loss = step(name)
            held = dist.get_world_size() * runs[name][1].numel() / count  # copies of each element
            dist.all_reduce(loss)
            first[name].append(float(loss) / held)
    times = {name: [] for name in runs}
    for _ in range(rounds):
        for name in runs:  # alternating: drift on a shared machine hits both
            for _ in range(steps):
                dist.barrier()
                start = time.perf_counter()
                step(name)
                dist.barrier()
                times[name].append(time.perf_counter() - start)
    return {"times": times, "first": first, "reference": reference_losses(blocks, x, CHECKED, LR)}


def _rounds(times: list, steps: int) -> list[list]:
    return [times[i:i + steps] for i in range(0, len(times), steps)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2, help="MLP blocks")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per library per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args()
    if importlib.util.find_spec("colossalai") is None:
        print(INSTALL)
        return 0

    from rich.console import Console
    from rich.table import Table

    from tpctl.launch.pool import DistPool

    table = Table(title=f"{args.layers} MLP blocks {args.hidden}->{4 * args.hidden}->{args.hidden}, "
                        f"batch {args.batch}x{args.seq}, fp32, fwd+bwd+SGD, median of {args.rounds} alternating "
                        f"rounds x {args.steps} steps")
    for col in ("mode", "ranks", "colossalai ms", "tpctl ms", "tpctl / colossalai", "per round", "loss (one process)",
                f"colossalai: max rel. err, {CHECKED} steps", "tpctl"):
        table.add_column(col, justify="right")
    for mode in args.modes:
        size, depth = SIZES[mode]
        # A pool per mode: ColossalAI's global context is set up once per process.
        pool = DistPool(size, timeout_s=900)
        try:
            result = pool.run(compare, mode, size, depth, args.hidden, args.layers, args.batch, args.seq,
                              args.steps, args.rounds, args.threads)[0]  # barriers: every rank's times agree
        finally:
            pool.close()
        cai, tp = (statistics.median(result["times"][k]) * 1000 for k in ("colossalai", "tpctl"))
        # Each round's ratio of medians: the spread a shared machine gives.
        per_round = [statistics.median(t) / statistics.median(c) for c, t in
                     zip(*(_rounds(result["times"][k], args.steps) for k in ("colossalai", "tpctl")))]
        ref = result["reference"]
        errors = [max(abs(a - b) / abs(b) for a, b in zip(result["first"][k], ref)) for k in ("colossalai", "tpctl")]
        table.add_row(mode, str(size), f"{cai:.1f}", f"{tp:.1f}", f"{tp / cai:.3f}",
                      " ".join(f"{r:.2f}" for r in per_round), " ".join(f"{v:.6g}" for v in ref),
                      *(f"{e:.1e}" for e in errors))
        print(f"{mode}: colossalai {cai:.1f} ms, tpctl {tp:.1f} ms, ratio {tp / cai:.3f}, loss rel. err "
              f"{errors[0]:.1e} / {errors[1]:.1e}", file=sys.stderr, flush=True)  # the table comes at the end
    Console(width=200).print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
