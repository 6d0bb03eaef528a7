"""One rank of a run; started by the launcher through torchrun as
`python -m tpctl.launch.worker <run dir>/config.yaml`. It reads the resolved config
and never runs Hydra. Each arrow of a run's flow is one call in `run`.

Every worker entry point (this one, `generate_worker`) runs through `serve`:
it ties the rank's life to the launcher's before anything heavy is
imported, maps what `run` raised to the exit status, and leaves with
`leave`, never through interpreter finalisation (see `leave` for why). So
nothing heavy is imported at module level here: torch comes after
`die_with_parent`.
"""

from __future__ import annotations

if __name__ == "__main__":  # first of all (see `serve`)
    from tpctl.errors import quiet_interrupts

    quiet_interrupts()

import functools
import json
import logging
import math
import os
import re
import sys
from pathlib import Path
from typing import Callable, NoReturn

from tpctl.errors import EXIT_INTERRUPTED, EXIT_USAGE, LAUNCHER_PID_ENV, import_torch

log = logging.getLogger("tpctl.worker")
# The exit status of a rank that refuses to train a rewrite that differs
# from the original (the launcher passes it on, as for a bad config).
# Written beside the rank's torchelastic error file (its pid) once its work
# is complete (its files written and closed): the launcher tells a rank
# that died after that from one that failed (launch/local.py, `finished_ranks`).
DONE_MARKER = "tpctl-done"
# Written there too as the rank leaves: "<rank> <pid> <exit status>" (the
# launcher reads the ranks torch does not report; launch/warm.py).
EXIT_RECORD = "tpctl-exit"


def init_distributed(device: str, timeout_s: float, backend: str = "auto"):
    """Join the process group torchrun set up: `backend` "auto" is nccl on
    CUDA and gloo on CPU; gloo with device=cuda lets ranks share GPUs (rank
    r on GPU LOCAL_RANK mod the GPU count). The timeout bounds every
    collective, so a dead rank fails the run, and joining the group: torch's
    store client ignores its timeout when the store's end accepts the
    connection and never answers, so an alarm ends the process then
    (SIGALRM, which the launcher names: `ALARM_REASON`)."""
    import datetime
    import signal

    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    backend = resolve_backend(backend, device)
    device_id = None
    if device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device_id = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device_id)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(max(1, math.ceil(timeout_s)) + 5)  # the store's own timeout first, where it keeps it
    try:
        if backend == "nccl":
            dist.init_process_group("nccl", timeout=timeout, device_id=device_id)
        else:
            if backend == "gloo":
                from .gloo import share_one_device

                share_one_device()  # one polling thread for all of the mesh's groups
            dist.init_process_group(backend, timeout=timeout)
    finally:
        signal.alarm(0)
    return device_id if device_id is not None else torch.device("cpu")


# How the launcher names a rank ended by init_distributed's alarm.
ALARM_REASON = ("did not join the process group within launcher.collective_timeout_s: its store (rank 0's, or "
                "the launcher's) accepted the connection and never answered")


def resolve_backend(backend: str, device: str) -> str:
    """launcher.backend: "auto" is nccl for device=cuda, gloo for cpu."""
    if backend == "auto":
        return "nccl" if device == "cuda" else "gloo"
    return backend


def die_with_parent() -> None:
    """Tie this rank's life to the launcher's: Linux SIGTERMs it when the
    launcher dies, even by SIGKILL, so no orphaned rank waits in a
    rendezvous or a collective. Called before anything heavy is imported,
    because a launcher killed while its ranks import torch must not leave
    them behind; and since the signal only covers a death after the call,
    a launcher already gone (this process has another parent than the pid
    the launcher exported) ends the rank here."""
    import signal

    from tpctl.errors import die_with_parent as signal_on_parent_death

    signal_on_parent_death(signal.SIGTERM)
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher and os.getppid() != int(launcher):
        print(f"tpctl: rank {os.environ.get('RANK', '?')}: the launcher (pid {launcher}) is gone; not starting",
              file=sys.stderr, flush=True)
        os._exit(128 + signal.SIGTERM)


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
    import torch
    import torch.distributed as dist

    from tpctl.config import load_worker_config
    from tpctl.parallel.layout import Layout
    from tpctl.seeding import derive_seed
    from tpctl.training.build import build_parallelism

    cfg = load_worker_config(config_path)
    device = init_distributed(cfg.device, cfg.launcher.collective_timeout_s, cfg.launcher.get("backend", "auto"))
    setup_logging(config_path.parent, dist.get_rank())
    from tpctl.training.step import set_tf32

    line = set_tf32(bool(cfg.train.get("tf32", False)), device, cfg.precision)
    if line and dist.get_rank() == 0:
        print(line, flush=True)
    layout = Layout.from_config(cfg)
    layout = adjust(layout) if adjust else layout
    par = build_parallelism(cfg, layout, device)
    # torch seeds its global generator at random in each process; from
    # (seed, rank) instead, so that two runs of one config write the same
    # checkpoints, byte for byte (tpctl's own draws use their own generators).
    torch.manual_seed(derive_seed(cfg.seed, "torch", dist.get_rank()))
    log.info("mesh: %s, rank %d at %s dp_rank=%d", par.layout.label(), par.mesh.rank, par.mesh.coords, par.mesh.dp_rank)
    return cfg, par


def run(argv: list[str]) -> None:
    import torch.distributed as dist

    from tpctl.data.batches import TokenData
    from tpctl.data.corpora import prepare_data
    from tpctl.training.build import build_run
    from tpctl.training.loop import Trainer

    config_path = Path(argv[0])
    run_dir = config_path.parent
    cfg, par = start_worker(config_path)
    mesh = par.mesh
    # Lazy: each rank makes one parameter whole at a time, to slice its shard.
    # The rewrite, proven equal to the original before step 1 unless
    # train.verify_rewrite=false (RewriteRefused: exit 2, see `failed`).
    run = build_run(cfg, par, verify=cfg.train.verify_rewrite)
    model, verified = run.model, run.verified
    if verified is not None:
        log.info("verify: %s", verified.line(par.mode))
        if mesh.rank == 0:
            print(f"tpctl: {verified.line(par.mode)}", flush=True)
    if run.cp_error is not None:
        line = (f"cp={par.cp.size} ({par.cp.impl}) proven at start-up: the logits on each rank's positions equal the "
                f"whole sequence's within {run.cp_error:.1e}")
        log.info("verify: %s", line)
        if mesh.rank == 0:
            print(f"tpctl: {line}", flush=True)
    # The launcher has scanned the data's ids; each batch read is checked (Trainer).
    data = TokenData(cfg, prepare_data(cfg, scan_ids=False))
    log.info("data: %s", data.describe())
    whole = whole_parameters(model, par)
    if mesh.rank == 0:
        stages = f", {par.pipeline.spec.label()}" if par.pipeline is not None else ""
        picked = f"layout=auto picked {cfg.auto.layout}: " if cfg.get("auto") else ""
        print(f"tpctl: {picked}{par.layout.label()} ({mesh.world_size} ranks{stages}), "
              f"{cfg.model.get('_target_') or cfg.model.arch} with {whole / 1e6:.2f}M parameters, {data.describe()}", flush=True)
        note = par.pipeline.spec.dropout_note(cfg.model.get("dropout") or 0) if par.pipeline is not None else None
        if note:
            print(f"tpctl: {note}", flush=True)
        if par.layout.zero and par.layout.dp * par.layout.cp == 1:  # (cp ranks are replicas ZeRO shards between)
            print(f"tpctl: zero={par.layout.zero} with dp=1: one replica has nothing to share, "
                  "so every rank keeps its whole state (as zero=0)", flush=True)
    trainer = Trainer(run, data, run_dir)
    found = find_resume(cfg, run_dir, mesh.rank)
    if found is not None:
        trainer.resume(*found)
        if mesh.rank == 0:
            from tpctl.checkpoint import manifest_layout

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
        from tpctl.training import trackers

        trackers.finish(summary)  # logger=mlflow|wandb: the summary, then their runs ended
    dist.destroy_process_group()


def whole_parameters(model, par) -> int:
    """The whole model's parameter count (with pp > 1: summed over the
    stages, each tied weight once)."""
    import torch

    from tpctl.parallel import comm

    mine = sum(math.prod(p.tpctl_spec.full_shape) for p in model.parameters()
               if p.tpctl_spec.first_on_stages(par.mesh.rank))
    if par.pipeline is None:
        return mine
    total = torch.tensor([float(mine)], dtype=torch.float64, device=par.mesh.device)
    comm.all_reduce(total, par.mesh.groups["pp"])
    return int(total.item())


def find_resume(cfg, run_dir: Path, rank: int):
    """(checkpoint path, manifest) to resume from, or None. Rank 0 picks and
    verifies it (after a restart by torchrun: the newest valid one of the run
    dir) and tells the others, so a bad checkpoint fails every rank alike."""

    from tpctl.checkpoint import CheckpointError, resolve_resume
    from tpctl.parallel import comm

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
    choice[0] = comm.broadcast_object(choice[0])
    if isinstance(choice[0], str):
        raise CheckpointError(choice[0])
    return None if choice[0] is None else (Path(choice[0][0]), choice[0][1])


def serve(run: Callable[[list[str]], None], argv: list[str] | None = None) -> NoReturn:
    """Run one rank of a worker entry point, `run(argv)` (argv[0]: the run's
    config.yaml), and end the process with its exit status: 0 done (its
    work complete: `mark_done`), 130 interrupted, 2 refused (a rewrite
    that is not the model), 1 failed, with the full traceback in
    logs/rank<r>.log and nothing on the terminal: the launcher prints one
    line per failed rank from the error @record has written. Ctrl-C, which
    the launcher forwards to its ranks, ends a rank quietly while its
    module starts (errors.quiet_interrupts, the entry module's first
    statement), and as KeyboardInterrupt from here on."""
    import signal

    die_with_parent()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        # Ctrl-C (the launcher forwards it) from here on: KeyboardInterrupt,
        # so that what the rank has written is flushed (`leave`).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        import_torch()
        from torch.distributed.elastic.multiprocessing.errors import record

        record(status_first(run))(argv)
        mark_done()
        status = 0
    except KeyboardInterrupt:
        # Ctrl-C reaches every rank (and may come while torch is imported);
        # the launcher reports it once.
        status = EXIT_INTERRUPTED
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:
        status = failed(e, argv)
    leave(status)


def exit_status(error: BaseException) -> int:
    """2 for a refusal (a rewrite that is not the model, attention cp
    cannot split, a bad input found by the workers: a TpctlError whose
    exit_code is EXIT_USAGE), else 1."""
    from tpctl.errors import TpctlError

    return EXIT_USAGE if isinstance(error, TpctlError) and error.exit_code == EXIT_USAGE else 1


def status_first(run: Callable[[list[str]], None]) -> Callable[[list[str]], None]:
    """`run`, recording the exit status of an exception it raises before
    @record writes the error file: once another rank has left, the agent
    may stop this one at any moment, and the launcher must read the status
    this rank chose (a refusal every rank raised is one line, exit 2),
    never an error file without it."""
    @functools.wraps(run)
    def guarded(argv: list[str]) -> None:
        try:
            run(argv)
        except Exception as e:
            record_exit(exit_status(e))
            raise
    return guarded


def failed(error: BaseException, argv: list[str]) -> int:
    """The exit status of a rank that raised `error`, once it is recorded."""
    if exit_status(error) == EXIT_USAGE:
        # Every rank refuses alike; the launcher prints the one line
        # (@record has kept it) and exits 2 as for a bad config.
        return EXIT_USAGE
    if not isinstance(error, Exception):  # e.g. DCP's CheckpointException: @record only records Exceptions
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(error)
    rank = os.environ.get("RANK", "?")
    log_traceback(Path(argv[0]).parent, rank)
    # Another rank died (and the launcher names it): one line here, not
    # a traceback per surviving rank.
    lost = LOST_PEER.search(str(error))
    if lost:
        print(f"tpctl: rank {rank}: a peer rank is gone ({lost.group(0).strip()})", file=sys.stderr, flush=True)
    return 1


def mark_done() -> None:
    """Record that this rank's work is complete, beside its error file
    (outside the run dir, whose disk may be full): whatever happens to the
    process after this, its outputs are written and closed."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        try:
            (Path(error_file).parent / DONE_MARKER).write_text(str(os.getpid()))
        except OSError:
            pass


def record_exit(status: int) -> None:
    """Leave this rank's exit status beside its error file (EXIT_RECORD)."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        try:
            (Path(error_file).parent / EXIT_RECORD).write_text(f"{os.environ.get('RANK', '?')} {os.getpid()} {status}")
        except OSError:
            pass


def leave(status: int) -> NoReturn:
    """End this process now with `status`, after what a normal exit does
    before finalising the interpreter (the atexit handlers: logging's
    flush and close, torch's cache writes and pool shutdowns, the
    multiprocessing finalisers), but without finalising it.

    Why: gloo runs each collective on a worker thread that lets go of the
    collective's tensors only after the caller has returned from it, and
    those threads outlive `destroy_process_group` (gloo's shutdown does
    nothing; the group lives on while anything holds it: the mesh, the
    modules, torch.distributed.nn.functional's default arguments, which
    captured the world group when DCP imported it). Dropping the last
    reference to a tensor Python has seen needs the GIL. A rank that exits
    milliseconds after its last collective can reach finalisation first;
    a thread that asks for the GIL then is ended by Python with
    pthread_exit, whose unwinding crosses gloo's noexcept destructor:
    std::terminate, SIGABRT, a finished run reported as failed
    (tests/teardown_race.py reproduces it; `os._exit` leaves no such
    window: the kernel ends every thread at once).

    A rank forked by a warm start (launch/warm.py) that succeeded raises
    SystemExit(0) instead: torch's context waits for its return, and its
    process ends in os._exit as well, once the launcher has seen it."""
    import atexit

    from tpctl.launch import warm

    # Recorded first: the agent may SIGTERM this rank during the atexit
    # handlers (another rank has already left), and what the launcher
    # reports must be the status this rank chose, not "stopped".
    record_exit(status)
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe: nothing more can be said
                pass
        if status == 0 and warm.FORKED:
            raise SystemExit(0)
        os._exit(status)


def main(argv: list[str] | None = None) -> NoReturn:
    serve(run, argv)


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
