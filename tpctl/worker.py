"""One rank of a run; started by the launcher through torchrun as
`python -m tpctl.worker <run dir>/config.yaml`. It reads the resolved config
and never runs Hydra. Each arrow of a run's flow is one call in `main`."""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

log = logging.getLogger("tpctl.worker")


def init_distributed(device: str, timeout_s: float) -> torch.device:
    """Join the process group torchrun set up (gloo on CPU, nccl on GPU).
    The timeout bounds every collective, so a dead rank fails the run."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", local_rank))
        return torch.device("cuda", local_rank)
    dist.init_process_group("gloo", timeout=timeout)
    return torch.device("cpu")


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this worker if the launcher dies, even by
    SIGKILL, so no orphaned rank keeps waiting in a collective."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        PR_SET_PDEATHSIG = 1
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        except OSError:
            pass


def setup_logging(run_dir: Path, rank: int) -> None:
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(log_dir / f"rank{rank}.log")
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank{rank} %(name)s %(levelname)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)


def print_summary(summary: dict, run_dir: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="tpctl run summary", caption=f"run dir: {run_dir}", show_header=False)
    for key, value in summary.items():
        if value is None:
            continue
        if "bytes" in key:
            value = f"{value / 2**20:,.1f} MiB"
        elif isinstance(value, float):
            value = f"{value:,.4f}" if abs(value) < 1000 else f"{value:,.0f}"
        table.add_row(key, str(value))
    Console().print(table)


@record
def run(argv: list[str] | None = None) -> None:
    from . import init_parallel, parallelize
    from .config import load_worker_config
    from .data import TokenData, prepare_data
    from .models import build_model
    from .train import Trainer

    config_path = Path((argv if argv is not None else sys.argv[1:])[0])
    run_dir = config_path.parent
    cfg = load_worker_config(config_path)
    device = init_distributed(cfg.device, cfg.launcher.collective_timeout_s)
    setup_logging(run_dir, dist.get_rank())
    mode = init_parallel(cfg.mode, cfg.size, cfg.depth, cfg.dp, cfg.seed, cfg.seq_parallel, device)
    mesh = mode.mesh
    log.info("mesh: mode=%s coords=%s dp_rank=%d", mesh.mode, mesh.coords, mesh.dp_rank)
    # Lazy: each rank makes one parameter whole at a time, to slice its shard.
    model = parallelize(build_model(cfg.model, cfg.seed, lazy=True), mode, cfg.model.get("plan")).to(device)
    data = TokenData(cfg, prepare_data(cfg))
    log.info("data: %s", data.describe())
    if mesh.rank == 0:
        whole = sum(math.prod(p.tpctl_spec.full_shape) for p in model.parameters())
        print(f"tpctl: mode={cfg.mode} size={cfg.size} dp={cfg.dp} ({mesh.world_size} ranks), "
              f"{cfg.model.get('_target_') or cfg.model.arch} with {whole / 1e6:.2f}M parameters, {data.describe()}", flush=True)
    trainer = Trainer(cfg, model, mode, data, run_dir)
    found = find_resume(cfg, run_dir, mesh.rank)
    if found is not None:
        trainer.resume(*found)
        if mesh.rank == 0:
            m = found[1]
            restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
            after = f" after restart {restart} of {cfg.launcher.max_restarts}" if restart else ""
            print(f"tpctl: resumed from {found[0]}{after} (step {m['step']}, written in mode={m['mode']} "
                  f"size={m['size']} dp={m['dp']})", flush=True)
    if trainer.start_step >= cfg.train.steps:
        if mesh.rank == 0:
            print(f"tpctl: nothing to train: the checkpoint is at step {trainer.start_step}, train.steps={cfg.train.steps}")
        dist.destroy_process_group()
        return
    records = trainer.fit()
    summary = trainer.summary(records)
    log.info("summary: %s", summary)
    if mesh.rank == 0:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        print_summary(summary, run_dir)
    dist.destroy_process_group()


def find_resume(cfg, run_dir: Path, rank: int):
    """(checkpoint path, manifest) to resume from, or None. Rank 0 picks and
    verifies it (after a restart by torchrun: the newest valid one of the run
    dir) and tells the others, so a bad checkpoint fails every rank alike."""
    from .checkpoint import CheckpointError, resolve_resume

    choice: list = [None]
    if rank == 0:
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        try:
            # The launcher has warned about invalid checkpoints already,
            # unless torchrun restarted the workers.
            warn = (lambda m: print(m, file=sys.stderr, flush=True)) if restarted else log.warning
            found = resolve_resume(cfg, run_dir, restarted, warn)
            choice = [(str(found[0]), found[1]) if found else None]
        except Exception as e:  # the other ranks wait in the broadcast: always tell them
            choice = [f"train.resume={cfg.train.resume!r}: {e}"]
    dist.broadcast_object_list(choice, src=0)
    if isinstance(choice[0], str):
        raise CheckpointError(choice[0])
    return None if choice[0] is None else (Path(choice[0][0]), choice[0][1])


def main(argv: list[str] | None = None) -> None:
    die_with_parent()
    try:
        run(argv)
    except KeyboardInterrupt:
        # Ctrl-C reaches every rank; the launcher reports it once.
        sys.exit(130)
    except RuntimeError as e:
        # Another rank died (and the launcher names it): one line here, not
        # a traceback per surviving rank. @record has kept the error.
        lost = re.search(r"Connection (closed|reset) by peer[^.]*", str(e))
        if lost:
            print(f"tpctl: rank {os.environ.get('RANK', '?')}: a peer rank is gone ({lost.group(0).strip()})",
                  file=sys.stderr, flush=True)
            sys.exit(1)
        raise


if __name__ == "__main__":
    main()
