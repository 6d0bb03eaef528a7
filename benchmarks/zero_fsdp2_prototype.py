"""The prototype behind docs/DESIGN.md's choice of ZeRO engine: PyTorch's
FSDP2 (`torch.distributed.fsdp.fully_shard`, ZeRO-3 over a mesh dimension)
against tpctl's own stage 3 (parallel/data_parallel/zero.py), on the same model, batch and
ranks (mode=none, dp=2, gloo on CPU).

    python benchmarks/zero_fsdp2_prototype.py [--model gpt-tiny] [--steps 5]

Prints, per engine: the loss curve's largest relative difference from
mode=none in one process, the median step time, the parameter bytes a rank
holds between steps, the collectives comm.py counted (what `tpctl plan` and
tests/test_plan.py can see), and whether the parameters the optimizer steps
still carry their ShardSpec (what checkpoints, the gradient norm and the
tensor-parallel replica sums read).
"""

from __future__ import annotations

import argparse
import statistics
import time


def _run(engine: str, model: str, steps: int) -> dict:
    import torch
    from omegaconf import OmegaConf

    from tpctl.config import compose_jobs
    from tpctl.launch.pool import pooled_run
    from tpctl.parallel import comm
    from tpctl.parallel.data_parallel.zero import storage_bytes
    from tpctl.parallel.layout import Layout
    from tpctl.parallel.shard import spec_of
    from tpctl.training.build import build_step
    from tpctl.training.step import build_optimizer

    layout = Layout.parse("none-dp2" + ("-z3" if engine == "tpctl zero=3" else ""))
    cfg = compose_jobs([f"model={model}", "train.batch_size=8", "train.seq_len=32"])[0]
    OmegaConf.update(cfg, "optim.grad_clip", 1.0)
    ids = torch.randint(0, cfg.model.vocab_size, (8, 33), generator=torch.Generator().manual_seed(0))
    run = pooled_run(cfg, layout, step=False)  # FSDP2 takes the model before any step does
    par, net = run.par, run.model
    rows = par.dp.share(8, 1, 0)
    x, y = ids[rows.start:rows.stop, :-1], ids[rows.start:rows.stop, 1:]
    if engine == "tpctl zero=3":
        step = build_step(cfg, par, net, schedule=False)

        def train(k):
            return float(step([(x, y)], k)["loss"])

        held = lambda: step.memory()["param_bytes"]  # noqa: E731
        params = [p for group in step.optimizer.param_groups for p in group["params"]]
    else:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(par.mesh.groups["dp"], "cpu")
        for block in net.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(net, mesh=mesh)
        opt = build_optimizer(list(net.parameters()), cfg.optim)

        def train(k):
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(net(x).flatten(0, 1), y.flatten(), reduction="sum")
            (loss / y.numel()).backward()  # FSDP2 averages over the replicas: each rank's mean is 1/dp of the sum
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            total = loss.detach().clone()
            torch.distributed.all_reduce(total, group=par.mesh.groups["dp"])
            return float(total) / (8 * 32)

        held = lambda: storage_bytes(p.to_local() for p in net.parameters())  # noqa: E731
        params = list(net.parameters())
    comm.STATS.reset()
    losses, times = [], []
    for k in range(steps):
        t0 = time.perf_counter()
        losses.append(train(k))
        times.append(time.perf_counter() - t0)
    return {"loss": losses, "step_s": statistics.median(times[1:]), "param_bytes": held(),
            "counted_calls": sum(comm.STATS.calls.values()),
            "tagged": sum(spec_of(p) is not None for p in params), "params": len(params),
            "kind": type(params[0]).__name__}


def _reference(model: str, steps: int) -> list[float]:
    import torch
    from omegaconf import OmegaConf

    from tpctl.config import compose_jobs
    from tpctl.parallel.layout import Layout
    from tpctl.training.build import build_run

    cfg = compose_jobs([f"model={model}", "train.batch_size=8", "train.seq_len=32"])[0]
    OmegaConf.update(cfg, "optim.grad_clip", 1.0)
    ids = torch.randint(0, cfg.model.vocab_size, (8, 33), generator=torch.Generator().manual_seed(0))
    step = build_run(cfg, layout=Layout(), groups=False, schedule=False).step
    return [float(step([(ids[:, :-1], ids[:, 1:])], k)["loss"]) for k in range(steps)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    from tpctl.launch.pool import DistPool

    want = _reference(args.model, args.steps)
    pool = DistPool(2, timeout_s=1800)
    try:
        for engine in ("tpctl zero=3", "FSDP2"):
            try:
                r = pool.run(_run, engine, args.model, args.steps)[0]
            except Exception as e:  # noqa: BLE001 - the prototype reports what breaks
                print(f"{engine}: failed: {str(e).splitlines()[0][:200]}")
                continue
            worst = max(abs(a - b) / abs(b) for a, b in zip(r["loss"], want))
            print(f"{engine}: loss vs none {worst:.1e}, step {r['step_s'] * 1e3:.0f} ms, params held "
                  f"{r['param_bytes'] / 2**20:.2f} MiB, collectives counted by comm.py {r['counted_calls']}, "
                  f"parameters with a ShardSpec {r['tagged']}/{r['params']} ({r['kind']})")
    finally:
        pool.close()


if __name__ == "__main__":
    main()
