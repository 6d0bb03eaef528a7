"""One rank of a run; started by the launcher through torchrun as
`python -m tpctl.launch.worker <run dir>/config.yaml`. It reads the resolved config
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
# The exit status of a rank that refuses to train a rewrite that differs
# from the original (the launcher passes it on, as for a bad config).
EXIT_REFUSED = 2


def init_distributed(device: str, timeout_s: float, backend: str = "auto") -> torch.device:
    """Join the process group torchrun set up: `backend` "auto" is nccl on
    CUDA and gloo on CPU; gloo with device=cuda lets ranks share GPUs (rank
    r on GPU LOCAL_RANK mod the GPU count). The timeout bounds every
    collective, so a dead rank fails the run."""
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = resolve_backend(backend, device)
    if device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        gpu = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(gpu)
        if backend == "nccl":
            dist.init_process_group("nccl", timeout=timeout, device_id=gpu)
        else:
            dist.init_process_group(backend, timeout=timeout)
        return gpu
    dist.init_process_group(backend, timeout=timeout)
    return torch.device("cpu")


def resolve_backend(backend: str, device: str) -> str:
    """launcher.backend: "auto" is nccl for device=cuda, gloo for cpu."""
    if backend == "auto":
        return "nccl" if device == "cuda" else "gloo"
    return backend


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


def start_worker(config_path: Path, adjust=None):
    """What every worker does first, train and generate alike: read the
    resolved config, join the process group (launcher.backend), log to
    logs/rank<r>.log, seed torch's own generator from (seed, rank) and
    build this rank's parallel machinery. Returns (cfg, Parallelism);
    `adjust` (Layout -> Layout) may change the config's layout."""
    from tpctl.config import load_worker_config
    from tpctl.parallel.layout import Layout
    from tpctl.parallel.parallelism import parallelism
    from tpctl.seeding import derive_seed

    cfg = load_worker_config(config_path)
    device = init_distributed(cfg.device, cfg.launcher.collective_timeout_s, cfg.launcher.get("backend", "auto"))
    setup_logging(config_path.parent, dist.get_rank())
    layout = Layout.from_config(cfg)
    par = parallelism(adjust(layout) if adjust else layout, cfg.seed, device)
    # torch seeds its global generator at random in each process; from
    # (seed, rank) instead, so that two runs of one config write the same
    # checkpoints, byte for byte (tpctl's own draws use their own generators).
    torch.manual_seed(derive_seed(cfg.seed, "torch", dist.get_rank()))
    log.info("mesh: %s, rank %d at %s dp_rank=%d", par.layout.label(), par.mesh.rank, par.mesh.coords, par.mesh.dp_rank)
    return cfg, par


@record
def run(argv: list[str] | None = None) -> None:
    from tpctl.parallel.verify import parallelize_verified
    from tpctl.training.data import TokenData, prepare_data
    from tpctl.models import build_model
    from tpctl.training.loop import Trainer

    config_path = Path((argv if argv is not None else sys.argv[1:])[0])
    run_dir = config_path.parent
    cfg, par = start_worker(config_path)
    mesh = par.mesh
    # Lazy: each rank makes one parameter whole at a time, to slice its shard.
    # The rewrite, proven equal to the original before step 1 unless
    # train.verify_rewrite=false (RewriteRefused: exit 2, see main).
    model, verified = parallelize_verified(build_model(cfg.model, cfg.seed, lazy=True), par, cfg.model.get("plan"),
                                           cfg.train.verify_rewrite)
    if verified is not None:
        log.info("verify: %s", verified.line(par.mode))
        if mesh.rank == 0:
            print(f"tpctl: {verified.line(par.mode)}", flush=True)
    data = TokenData(cfg, prepare_data(cfg))
    log.info("data: %s", data.describe())
    if mesh.rank == 0:
        whole = sum(math.prod(p.tpctl_spec.full_shape) for p in model.parameters())
        print(f"tpctl: {par.layout.label()} ({mesh.world_size} ranks), "
              f"{cfg.model.get('_target_') or cfg.model.arch} with {whole / 1e6:.2f}M parameters, {data.describe()}", flush=True)
        if par.layout.zero and par.layout.dp == 1:
            print(f"tpctl: zero={par.layout.zero} with dp=1: one replica has nothing to share, "
                  "so every rank keeps its whole state (as zero=0)", flush=True)
    trainer = Trainer(cfg, model, par, data, run_dir)
    found = find_resume(cfg, run_dir, mesh.rank)
    if found is not None:
        trainer.resume(*found)
        if mesh.rank == 0:
            from tpctl.training.checkpoint import manifest_layout

            m, saved = found[1], manifest_layout(found[1])
            restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
            after = f" after restart {restart} of {cfg.launcher.max_restarts}" if restart else ""
            print(f"tpctl: resumed from {found[0]}{after} (step {m['step']}, written in {saved.label()})", flush=True)
    if trainer.start_step >= cfg.train.steps:
        if mesh.rank == 0:
            print(f"tpctl: nothing to train: the checkpoint is at step {trainer.start_step}, train.steps={cfg.train.steps}")
        dist.destroy_process_group()
        return
    records = trainer.fit()
    summary = trainer.summary(records)
    log.info("summary: %s", summary)
    if mesh.rank == 0:
        from tpctl.training.metrics import json_safe

        (run_dir / "summary.json").write_text(json.dumps(json_safe(summary), indent=1) + "\n")
        print_summary(summary, run_dir)
    dist.destroy_process_group()


def find_resume(cfg, run_dir: Path, rank: int):
    """(checkpoint path, manifest) to resume from, or None. Rank 0 picks and
    verifies it (after a restart by torchrun: the newest valid one of the run
    dir) and tells the others, so a bad checkpoint fails every rank alike."""
    from tpctl.training.checkpoint import CheckpointError, resolve_resume

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
    """Run this rank; on failure exit 1 with the full traceback in
    logs/rank<r>.log and nothing on the terminal: the launcher prints one
    line per failed rank from the error @record has written."""
    from tpctl.parallel.verify import RewriteRefused

    die_with_parent()
    try:
        run(argv)
    except KeyboardInterrupt:
        # Ctrl-C reaches every rank; the launcher reports it once.
        sys.exit(130)
    except RewriteRefused:
        # Every rank refuses alike; the launcher prints the one line
        # (@record has kept it) and exits 2 as for a bad config.
        sys.exit(EXIT_REFUSED)
    except SystemExit:
        raise
    except BaseException as e:
        if not isinstance(e, Exception):  # e.g. DCP's CheckpointException: @record only records Exceptions
            from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

            ErrorHandler().record_exception(e)
        config_path = Path((argv if argv is not None else sys.argv[1:])[0])
        log_traceback(config_path.parent, os.environ.get("RANK", "?"))
        # Another rank died (and the launcher names it): one line here, not
        # a traceback per surviving rank.
        lost = LOST_PEER.search(str(e))
        if lost:
            print(f"tpctl: rank {os.environ.get('RANK', '?')}: a peer rank is gone ({lost.group(0).strip()})",
                  file=sys.stderr, flush=True)
        sys.exit(1)


# gloo's words for a connection whose other end died, with the peer's
# address ("[127.0.0.1]:4242": the dots are part of it, not a sentence end).
LOST_PEER = re.compile(r"Connection (?:closed|reset) by peer(?: \[[^\]\s]*\](?::\d+)?)?")


def log_traceback(run_dir: Path, rank: str) -> None:
    """Append the exception being handled, whole, to logs/rank<r>.log. When
    even that cannot be written (a full disk), the launcher's one line
    (the error file lives outside the run dir) is what remains."""
    import traceback

    try:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        with open(run_dir / "logs" / f"rank{rank}.log", "a") as f:
            f.write(f"rank{rank} failed:\n{traceback.format_exc()}")
    except OSError:
        pass


if __name__ == "__main__":
    main()
