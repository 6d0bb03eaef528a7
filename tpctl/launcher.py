"""Start `size × dp` workers on this node through torchrun's Python API, wait,
and report which rank failed and why (DESIGN.md, section 2: "launcher").

Each worker runs `python -u -m tpctl.worker <run dir>/config.yaml`: it reads the
resolved config (`tpctl.config.load_worker_config`) and never runs Hydra; its
run dir is the folder holding that file. torchrun's environment (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...) tells it who it is.

Test hook: the environment variable TPCTL_WORKER_MODULE (or launch's
`worker_module` argument) names another module to run instead of tpctl.worker,
e.g. `tests.fake_worker`, so the launcher can be tested on its own.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import socket
import sys
import uuid
from pathlib import Path
from typing import Any

LAUNCHERS = ("local", "slurm")
WORKER_MODULE = "tpctl.worker"
WORKER_MODULE_ENV = "TPCTL_WORKER_MODULE"
# Seconds the workers get to exit after SIGINT/SIGTERM before SIGKILL.
SHUTDOWN_TIMEOUT_S = 10


def launch(cfg: Any, run_dir: str | os.PathLike, worker_module: str | None = None) -> int:
    """Run the workers of one training run; return the exit status for tpctl:
    0 when every rank finished, 1 when a rank failed, 128+signal (130 for
    Ctrl-C) when the launcher was interrupted. Workers never outlive it."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousTimeoutError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    run_dir = Path(run_dir)
    module = worker_module or os.environ.get(WORKER_MODULE_ENV) or WORKER_MODULE
    if not _module_exists(module):  # else every rank would fail with the same ImportError
        print(f"tpctl: error: worker module {module!r} not found (check {WORKER_MODULE_ENV})", file=sys.stderr)
        return 1
    lc = cfg.launcher
    nproc = cfg.size * cfg.dp // lc.nnodes
    if lc.nnodes > 1 or lc.rdzv_endpoint:
        endpoint = lc.rdzv_endpoint
        # Every node must name the same job; the endpoint is the same on all.
        run_id = lc.rdzv_id or f"tpctl-{endpoint.replace(':', '-')}"
    else:
        addr = lc.master_addr
        endpoint = f"{addr}:{lc.master_port or free_port(addr)}"
        run_id = lc.rdzv_id or f"tpctl-{uuid.uuid4().hex[:12]}"
    if lc.nnodes > 1:
        print(f"tpctl: {node_layout(cfg)}", file=sys.stderr, flush=True)

    # torchrun's CLI sets this; its Python API does not. Without it every
    # worker starts one thread per core and they fight over the cores.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    if cfg.launcher.max_restarts > 0:
        # By default the agent's rendezvous store is shared with the workers
        # and outlives a restart, so a restarted rank can read the address
        # a dead rank of the previous attempt published and fail to connect
        # (gloo: "Connection refused"). Opting out gives each attempt a fresh
        # store hosted by its rank 0.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # The agent logs every step of its life, and each failure in its own
    # format; tpctl reports failures itself, one line per rank (below).
    # torch sets a level on each of its loggers, so the parent's is not enough.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)

    config = LaunchConfig(
        min_nodes=lc.nnodes,
        max_nodes=lc.nnodes,
        nproc_per_node=nproc,
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        # Node 0 hosts the rendezvous store; the others only connect (on one
        # machine, two "nodes" would otherwise both try to host it).
        rdzv_configs={"is_host": lc.node_rank == 0, "join_timeout": lc.rdzv_timeout_s},
        run_id=run_id,
        max_restarts=cfg.launcher.max_restarts,
        monitor_interval=cfg.launcher.monitor_interval_s,
        start_method="spawn",
        # The agent's own files (error.json of a failed rank) go to the run
        # dir rather than a temp dir nobody cleans. Worker stdout/stderr are
        # not redirected: rank 0 draws its progress bar on this terminal.
        # (One folder per node: on Slurm the nodes share the run dir.)
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir / "torchelastic" / (f"node{lc.node_rank}" if lc.nnodes > 1 else ""))),
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    )
    # torch installs its own SIGINT/SIGTERM handlers while workers run
    # (they raise SignalException and stop the workers); put ours back after.
    saved_handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        elastic_launch(config, sys.executable)("-u", "-m", module, str(run_dir / "config.yaml"))
        return 0
    except ChildFailedError as e:
        report_failures(e.failures)
        return 1
    except RendezvousError as e:
        # Another node never came (timeout) or the rendezvous host (node 0)
        # went away mid-run; the agent has stopped this node's workers.
        what = "no job with all nodes formed" if isinstance(e, RendezvousTimeoutError) else "lost the rendezvous"
        print(f"tpctl: error: node {lc.node_rank} of {lc.nnodes}: {what} at {endpoint} "
              f"(is node 0 running, and did every node start within launcher.rdzv_timeout_s={lc.rdzv_timeout_s}?): "
              f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", file=sys.stderr)
        return 1
    except SignalException as e:
        print(f"tpctl: interrupted by {signal.Signals(e.sigval).name}; workers stopped", file=sys.stderr)
        return 128 + int(e.sigval)
    except KeyboardInterrupt:  # before the workers started: nothing to stop
        print("tpctl: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    finally:
        for sig, handler in saved_handlers.items():
            signal.signal(sig, handler)


def validate_nodes(cfg: Any) -> None:
    """ConfigError for a multi-node setting that cannot work (no torch here:
    `tpctl train` checks this before starting anything)."""
    from .errors import ConfigError

    lc, world = cfg.launcher, cfg.size * cfg.dp
    if lc.name not in LAUNCHERS:
        raise ConfigError("launcher.name", lc.name, f"expected one of {', '.join(LAUNCHERS)} (launcher=local or launcher=slurm)")
    if lc.nnodes < 1:
        raise ConfigError("launcher.nnodes", lc.nnodes, "expected a positive number of nodes")
    if world % lc.nnodes:
        raise ConfigError("launcher.nnodes", lc.nnodes,
                          f"every node runs the same number of workers: size*dp={world} must divide by nnodes")
    if not 0 <= lc.node_rank < lc.nnodes:
        raise ConfigError("launcher.node_rank", lc.node_rank, f"expected 0 <= node_rank < launcher.nnodes={lc.nnodes}")
    if lc.name == "slurm":
        if cfg.device == "cuda" and lc.gpus_per_node != world // lc.nnodes:
            raise ConfigError("launcher.gpus_per_node", lc.gpus_per_node,
                              f"device=cuda runs one worker per GPU: expected size*dp/nnodes={world // lc.nnodes}")
        if lc.time_min < 1:
            raise ConfigError("launcher.time_min", lc.time_min, "expected a positive number of minutes")
        return  # Slurm tells each node its rank and the rendezvous host
    if lc.nnodes > 1 and not lc.rdzv_endpoint:
        raise ConfigError("launcher.rdzv_endpoint", lc.rdzv_endpoint,
                          "several nodes meet at node 0: expected HOST:PORT, reachable from every node")
    if lc.rdzv_endpoint:
        host, _, port = lc.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError("launcher.rdzv_endpoint", lc.rdzv_endpoint, "expected HOST:PORT, e.g. node0.cluster:29500")
    if lc.rdzv_timeout_s < 1:
        raise ConfigError("launcher.rdzv_timeout_s", lc.rdzv_timeout_s, "expected a value >= 1")


def node_layout(cfg: Any) -> str:
    """Where the tensor-parallel groups land. torchrun gives each node a run
    of consecutive global ranks, and the mesh puts a tensor-parallel group on
    consecutive ranks (rank = dp_rank*size + tp_rank), so a group stays
    inside one node exactly when the node's worker count divides by size."""
    lc = cfg.launcher
    per_node = cfg.size * cfg.dp // lc.nnodes
    head = f"node {lc.node_rank} of {lc.nnodes}: {per_node} workers"
    if per_node % cfg.size == 0:
        return f"{head}, {per_node // cfg.size} whole tensor-parallel group(s) of {cfg.size}; only data-parallel traffic crosses nodes"
    if cfg.size % per_node == 0:
        return (f"{head}: a tensor-parallel group (size={cfg.size}) spans {cfg.size // per_node} nodes, "
                "so its collectives cross the network; use fewer nodes or more workers per node where you can")
    return (f"{head}: {per_node} does not divide by size={cfg.size}, so some tensor-parallel groups span two nodes "
            "and their collectives cross the network")


def report_failures(failures: dict[int, Any]) -> None:
    """One line per rank that failed on its own; one line for the ranks the
    agent then stopped with SIGTERM (torch lists those as failures too)."""
    stopped = [r for r, f in failures.items() if f.exitcode == -signal.SIGTERM]
    failed = [r for r in failures if r not in stopped] or stopped
    for rank in sorted(failed):
        f = failures[rank]
        print(f"tpctl: error: rank {rank} failed with exit code {f.exitcode}: {failure_reason(f)}", file=sys.stderr)
    if stopped and failed != stopped:
        print(f"tpctl: stopped the other ranks: {', '.join(map(str, sorted(stopped)))}", file=sys.stderr)
    if any(_LOST_PEER in failure_reason(failures[r]) for r in failed for _LOST_PEER in LOST_PEER_MESSAGES):
        print("tpctl: a rank lost its connection to a peer: another rank, or another node's tpctl, died first "
              "(see its logs)", file=sys.stderr)


# What gloo says when the rank at the other end of a connection is gone.
LOST_PEER_MESSAGES = ("Connection closed by peer", "Connection reset by peer")


def failure_reason(failure: Any) -> str:
    """One line on why a rank died: the exception its @record'ed main raised,
    or the signal that killed it."""
    if failure.exitcode < 0:
        return f"killed by {failure.signal_name()}"
    message = failure.message
    if isinstance(message, dict):  # the error file of @record: {"message": "...", "extraInfo": {...}}
        message = message.get("message", "")
    if not message or message.startswith("To enable traceback"):
        return "no error recorded (see the rank's output; the worker's main needs @record)"
    # "<Type>: <message>"; keep the first line of a message that spans several.
    return str(message).strip().splitlines()[0]


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a parent package is missing
        return False


def free_port(addr: str) -> int:
    """A port that is free now on `addr` (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]
