"""Start `size × dp` workers on this node through torchrun's Python API, wait,
and report which rank failed and why (docs/DESIGN.md, section 2).

Each worker runs `tpctl.launch.worker <run dir>/config.yaml` as its main module, forked
from a warm server (launch/warm.py) or as `python -u -m` (launcher.start_method): it reads the
resolved config (`tpctl.config.load_worker_config`) and never runs Hydra; its
run dir is the folder holding that file. torchrun's environment (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...) tells it who it is.

Test hook: the environment variable TPCTL_WORKER_MODULE (or launch's
`worker_module` argument) names another module to run instead of tpctl.launch.worker,
e.g. `tests.fake_worker`, so the launcher can be tested on its own.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from tpctl.errors import EXIT_FAILED, LAUNCHER_PID_ENV, error, fail, warning
from tpctl.parallel.layout import Layout

from . import warm

WORKER_MODULE = "tpctl.launch.worker"
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
        return fail(f"worker module {module!r} not found (check {WORKER_MODULE_ENV})", EXIT_FAILED)
    lc = cfg.launcher
    nproc = Layout.from_config(cfg).world // lc.nnodes
    endpoint, run_id = _rendezvous(lc)
    if lc.nnodes > 1:
        print(f"tpctl: {node_layout(cfg)}", file=sys.stderr, flush=True)
    if lc.node_rank > 0:
        problem = wait_for_rendezvous_host(endpoint, lc.rdzv_timeout_s)
        if problem:
            return fail(f"node {lc.node_rank} of {lc.nnodes}: {problem}", EXIT_FAILED)
    if cfg.device == "cuda" and lc.get("backend", "auto") == "gloo":
        print(f"tpctl: launcher.backend=gloo with device=cuda: {nproc} ranks share this machine's GPU(s); "
              "for testing every mode on few GPUs, not for speed", file=sys.stderr, flush=True)

    _prepare_agent(cfg, nproc)
    agent_dir = tempfile.mkdtemp(prefix="tpctl-agent-")
    method = start_method(cfg)
    config = launch_config(LaunchConfig, DefaultLogsSpecs, cfg, agent_dir, nproc, endpoint, run_id, method)
    # torch installs its own SIGINT/SIGTERM handlers while workers run
    # (they raise SignalException and stop the workers); put ours back after.
    saved_handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    # The workers check that this process is their parent (worker.die_with_parent;
    # with warm starts, the fork server checks it, and they the server).
    saved_pid = os.environ.get(LAUNCHER_PID_ENV)
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    try:
        if method == "forkserver":
            with warm.server():
                quiet_agent()
                elastic_launch(config, warm.run_module)(module, str(run_dir / "config.yaml"))
        else:
            quiet_agent()
            elastic_launch(config, sys.executable)("-u", "-m", module, str(run_dir / "config.yaml"))
        return 0
    except ChildFailedError as e:
        failures = all_failures(e.failures)
        refusal = refused(failures)
        if refusal is not None:  # the workers refused to train (e.g. an unproven rewrite): as a bad config
            return fail(refusal)
        finished = finished_ranks(failures, agent_dir)
        if finished == set(failures):
            # Every rank's work is complete and its files are written; what
            # ended a process after that (a signal in its teardown) took
            # nothing from the run, and is said, not hidden.
            for line in failure_lines(split_failures(failures)[0], finished):
                warning(f"{line}; the run is complete and its files are intact")
            return 0
        report_failures(failures, run_dir, finished)
        return 1
    except RendezvousError as e:
        # Another node never came (timeout) or the rendezvous host (node 0)
        # went away mid-run; the agent has stopped this node's workers.
        return fail(_rendezvous_failure(e, lc, endpoint, isinstance(e, RendezvousTimeoutError)), EXIT_FAILED)
    except SignalException as e:
        print(f"tpctl: interrupted by {signal.Signals(e.sigval).name}; workers stopped", file=sys.stderr)
        return 128 + int(e.sigval)
    except KeyboardInterrupt:  # before the workers started: nothing to stop; the command's one line (cli.main)
        raise
    except Exception as e:  # the agent itself failed (e.g. node 0 cannot listen at the endpoint): one line
        reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
        error(f"node {lc.node_rank} of {lc.nnodes}: starting the workers failed at {endpoint}: "
              f"{type(e).__name__}: {reason}")
        return 1
    finally:
        shutil.rmtree(agent_dir, ignore_errors=True)
        if saved_pid is None:
            os.environ.pop(LAUNCHER_PID_ENV, None)
        else:
            os.environ[LAUNCHER_PID_ENV] = saved_pid
        for sig, handler in saved_handlers.items():
            signal.signal(sig, handler)


def _rendezvous(lc) -> tuple[str, str]:
    """(endpoint, run id) of the workers' rendezvous."""
    if lc.nnodes > 1 or lc.rdzv_endpoint:
        endpoint = lc.rdzv_endpoint
        # Every node must name the same job; the endpoint is the same on all.
        return endpoint, lc.rdzv_id or f"tpctl-{endpoint.replace(':', '-')}"
    addr = lc.master_addr
    return f"{addr}:{lc.master_port or free_port(addr)}", lc.rdzv_id or f"tpctl-{uuid.uuid4().hex[:12]}"


def _prepare_agent(cfg: Any, nproc: int) -> None:
    """The environment the elastic agent and its workers need."""
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


def quiet_agent() -> None:
    """The agent logs every step of its life, and each failure in its own
    format; tpctl reports failures itself, one line per rank (launch).
    torch sets a level on each of its loggers, so the parent's is not
    enough. After the fork server started: a server forked from this
    process (warm._fork_server) keeps the workers' levels torch's."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    # Its process context warns as it SIGTERMs the ranks left once one has
    # failed (before the one line naming that rank): timing decides whether
    # any are left, so the line came and went between runs.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.CRITICAL)


def _rendezvous_failure(e: Exception, lc, endpoint: str, timed_out: bool) -> str:
    """The one line of a rendezvous that never formed or was lost."""
    if timed_out:
        who = "the other nodes" if lc.node_rank == 0 else "node 0 is running, but not every node"
        what = (f"no job with all {lc.nnodes} nodes formed at {endpoint}: {who} joined within "
                f"launcher.rdzv_timeout_s={lc.rdzv_timeout_s} (start every node with the same launcher settings)")
    else:
        what = (f"lost the rendezvous at {endpoint}" + (" (did node 0 stop?)" if lc.node_rank > 0 else ""))
    reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"node {lc.node_rank} of {lc.nnodes}: {what}: {type(e).__name__}: {reason}"


def start_method(cfg: Any) -> str:
    """launcher.start_method, with auto resolved: "forkserver" (workers fork
    from one process that has imported torch: launch/warm.py) on CPU;
    "spawn" (a fresh interpreter per worker) on CUDA, where a process that
    forks must never have touched the driver, which torch's imports do not
    promise."""
    import multiprocessing

    method = cfg.launcher.get("start_method", "auto")
    if method == "auto":
        warm = cfg.device != "cuda" and "forkserver" in multiprocessing.get_all_start_methods()
        return "forkserver" if warm else "spawn"
    return method


def launch_config(LaunchConfig, DefaultLogsSpecs, cfg: Any, agent_dir: str, nproc: int, endpoint: str, run_id: str,
                  method: str = "spawn"):
    """torchrun's LaunchConfig for this node. Only keywords every supported
    torch has are passed as such; newer ones go through `accepted`."""
    lc = cfg.launcher
    # torch >= 2.12: how long stopped workers get before SIGKILL (older
    # agents have their own fixed grace period).
    optional = accepted(LaunchConfig, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    return LaunchConfig(
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
        # Used only by a function entrypoint (warm starts); a command's
        # workers are always fresh interpreters.
        start_method=method,
        # The agent's own files (error.json of a failed rank, which the
        # failure lines are read from) go to `agent_dir`, a temp dir the
        # launcher removes, not the run dir: its disk may be what is full.
        # Worker stdout/stderr are not redirected: rank 0 draws its progress
        # bar on this terminal.
        logs_specs=DefaultLogsSpecs(log_dir=agent_dir),
        **optional,
    )


def accepted(callable_: Any, **kwargs: Any) -> dict:
    """The keyword arguments `callable_` (a class or function) accepts: a
    keyword newer than the installed torch is left out, not an error."""
    import inspect

    params = inspect.signature(callable_).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(kwargs)
    return {k: v for k, v in kwargs.items() if k in params}


def node_layout(cfg: Any) -> str:
    """Where the tensor-parallel groups land. torchrun gives each node a run
    of consecutive global ranks, and the mesh puts a tensor-parallel group on
    consecutive ranks (rank = (dp_rank*pp + pp_rank)*size + tp_rank), so a
    group stays inside one node exactly when the node's worker count
    divides by size; pipeline stages and replicas are what cross nodes."""
    lc = cfg.launcher
    layout = Layout.from_config(cfg)
    per_node = layout.world // lc.nnodes
    between = "pipeline and data-parallel" if layout.pp > 1 else "data-parallel"
    head = f"node {lc.node_rank} of {lc.nnodes}: {per_node} workers"
    if per_node % cfg.size == 0:
        return f"{head}, {per_node // cfg.size} whole tensor-parallel group(s) of {cfg.size}; only {between} traffic crosses nodes"
    if cfg.size % per_node == 0:
        return (f"{head}: a tensor-parallel group (size={cfg.size}) spans {cfg.size // per_node} nodes, "
                "so its collectives cross the network; use fewer nodes or more workers per node where you can")
    return (f"{head}: {per_node} does not divide by size={cfg.size}, so some tensor-parallel groups span two nodes "
            "and their collectives cross the network")


def report_failures(failures: dict[int, Any], run_dir: Path | None = None, finished: set[int] = frozenset()) -> None:
    """One line per rank that failed on its own, `rank R: <Type>: <message>`
    (ranks that failed with the same message share it); one line for the
    ranks the agent then stopped with SIGTERM (torch lists those as failures
    too). The tracebacks stay in logs/rank<r>.log. `finished`: ranks whose
    work was complete before their process ended (said on their line)."""
    failed, stopped = split_failures(failures)
    lines = failure_lines(failed, finished)
    for line in lines:
        error(line)
    if stopped:
        print(f"tpctl: stopped the other ranks: {', '.join(map(str, stopped))}", file=sys.stderr)
    if any(lost in line for line in lines for lost in LOST_PEER_MESSAGES):
        print("tpctl: a rank lost its connection to a peer: another rank, or another node's tpctl, died first "
              "(see its logs)", file=sys.stderr)
    elif run_dir is not None:
        print(f"tpctl: the tracebacks are in {run_dir / 'logs'}/rank<r>.log", file=sys.stderr)


def split_failures(failures: dict[int, Any]) -> tuple[dict[int, Any], list[int]]:
    """(the ranks that failed on their own, the ranks the agent stopped
    with SIGTERM because of them); all are "failed" when all were stopped."""
    stopped = sorted(r for r, f in failures.items() if f.exitcode == -signal.SIGTERM)
    failed = {r: f for r, f in failures.items() if r not in stopped}
    return (failed, stopped) if failed else (failures, [])


def failure_lines(failures: dict[int, Any], finished: set[int] = frozenset()) -> list[str]:
    """`rank R: <why>` for each distinct reason (ranks with the same one
    share a line)."""
    by_reason: dict[str, list[int]] = {}
    for rank in sorted(failures):
        reason = failure_reason(failures[rank])
        if rank in finished:
            reason += " after its work was complete"
        by_reason.setdefault(reason, []).append(rank)
    return [f"rank {ranks[0]}: {reason}" + (f" (ranks {', '.join(map(str, ranks[1:]))} too)" if len(ranks) > 1 else "")
            for reason, ranks in by_reason.items()]


def all_failures(failures: dict[int, Any]) -> dict[int, Any]:
    """`failures` with the ranks of this node torch did not list. Its
    function-entrypoint context (warm starts) names only the first rank that
    failed; each rank's folder in the agent's dir says the rest: the exit
    status the rank recorded as it left (worker.record_exit), else an error
    file (an exception @record wrote: exit 1), else its work marked complete
    (not a failure), else nothing: the agent stopped it (SIGTERM)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from .worker import DONE_MARKER, EXIT_RECORD

    if not failures:
        return failures
    rank, first = next(iter(failures.items()))
    attempt = Path(first.error_file).parent.parent
    offset = rank - first.local_rank  # torch numbers a node's ranks consecutively
    complete = dict(failures)
    for folder in sorted(attempt.iterdir() if attempt.is_dir() else [], key=lambda p: p.name):
        if not folder.name.isdigit() or offset + int(folder.name) in complete:
            continue
        local, error_file = int(folder.name), str(folder / "error.json")
        try:
            _, pid, status = (folder / EXIT_RECORD).read_text().split()
            pid, status = int(pid), int(status)
        except (OSError, ValueError):
            pid, status = -1, (1 if os.path.exists(error_file) else None)
        if status is None and (folder / DONE_MARKER).exists():
            status = 0
        if status != 0:
            status = -signal.SIGTERM if status is None else status
            complete[offset + local] = ProcessFailure(local_rank=local, pid=pid, exitcode=status, error_file=error_file)
    return complete


def finished_ranks(failures: dict[int, Any], agent_dir: str | os.PathLike) -> set[int]:
    """The ranks among `failures` whose process had marked its work
    complete (worker.mark_done: its pid, beside its error file in the
    agent's dir) before it ended."""
    from .worker import DONE_MARKER

    done = set()
    for marker in Path(agent_dir).rglob(DONE_MARKER):
        try:
            done.add(int(marker.read_text()))
        except (OSError, ValueError):
            pass
    return {r for r, f in failures.items() if f.pid in done}


# What gloo says when the rank at the other end of a connection is gone.
LOST_PEER_MESSAGES = ("Connection closed by peer", "Connection reset by peer")


def refused(failures: dict[int, Any]) -> str | None:
    """The reason, when the workers refused to train (exit 2, e.g. a
    rewrite that is not the original model) and no rank failed otherwise
    (the agent stops the rest with SIGTERM): one line for all ranks."""
    from tpctl.errors import EXIT_USAGE as EXIT_REFUSED

    codes = {f.exitcode for f in failures.values()}
    if EXIT_REFUSED not in codes or not codes <= {EXIT_REFUSED, -signal.SIGTERM}:
        return None
    rank = min(r for r, f in failures.items() if f.exitcode == EXIT_REFUSED)
    return REFUSAL_TYPE.sub("", failure_reason(failures[rank]), count=1)


# The exception's type before a refusal's message (worker.exit_status): the
# one line says what was refused, as a config refused by the launcher does.
REFUSAL_TYPE = re.compile(r"^[A-Za-z_]\w*: ")


def failure_reason(failure: Any) -> str:
    """One line on why a rank died: `<ExceptionType>: <message>` of what its
    @record'ed main raised, or the signal that killed it."""
    if failure.exitcode == -signal.SIGALRM:
        from .worker import ALARM_REASON

        return ALARM_REASON
    if failure.exitcode < 0:
        return f"killed by {failure.signal_name()}"
    message = failure.message
    if isinstance(message, dict):  # the error file of @record: {"message": "...", "extraInfo": {...}}
        message = message.get("message", "")
    if not message or message.startswith("To enable traceback"):
        # It exited without raising (sys.exit, or killed before Python could).
        return f"exited with code {failure.exitcode} before reporting an exception (see its log and output)"
    # "<Type>: <message>"; keep the first line of a message that spans several.
    return str(message).strip().splitlines()[0]


def wait_for_rendezvous_host(endpoint: str, timeout_s: float) -> str | None:
    """None once node 0's rendezvous store answers at `endpoint`, trying
    until `timeout_s` has passed; else one line on why not: the host does
    not resolve, is unreachable, refuses the port (node 0 not started), or
    accepts connections and never answers (something else listens there).
    torch's own client would retry for its store timeout and then fail
    with a C++ stack, or wait for ever on a silent endpoint."""
    host, _, port = endpoint.rpartition(":")
    deadline = time.monotonic() + timeout_s
    why = "nothing answered"
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                pass
            return store_answers(host, int(port), deadline, timeout_s)
        except socket.gaierror as e:
            return f"the rendezvous host {host!r} of launcher.rdzv_endpoint={endpoint} does not resolve ({e.strerror})"
        except ConnectionRefusedError:
            why = f"connection refused: is node 0 (launcher.node_rank=0) running with launcher.rdzv_endpoint={endpoint}?"
        except OSError as e:  # a timeout, or no route to the host
            why = f"{host} is unreachable ({e.strerror or 'timed out'}): check the address and the network"
        if time.monotonic() >= deadline:
            return f"cannot reach the rendezvous at {endpoint} within launcher.rdzv_timeout_s={timeout_s}: {why}"
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


# Connects to a c10d store as a rendezvous client does, in a child process:
# torch's client ignores its timeout when the other end accepts and stays
# silent, and a call blocked in it cannot be interrupted. "1" once torch is
# imported (not counted in the rendezvous time), "2" once the store answered.
_STORE_PROBE = """import datetime, sys
from torch.distributed import TCPStore
print(1, flush=True)
TCPStore(sys.argv[1], int(sys.argv[2]), is_master=False, wait_for_workers=False,
         timeout=datetime.timedelta(seconds=float(sys.argv[3])))
print(2, flush=True)
"""


def store_answers(host: str, port: int, deadline: float, timeout_s: float) -> str | None:
    """None when a c10d store answers at host:port before `deadline` (at
    least a few seconds from now), else why not."""
    import subprocess

    endpoint = f"{host}:{port}"
    left = max(5.0, deadline - time.monotonic())
    probe = subprocess.Popen([sys.executable, "-c", _STORE_PROBE, host, str(port), str(left)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        imported = probe.stdout.readline()
        try:
            out, err = probe.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            out, err = "", ""
        if "2" in out:
            return None
        if not imported:
            reason = err.strip().splitlines()[-1] if err.strip() else f"exit status {probe.returncode}"
            return f"cannot check the rendezvous at {endpoint}: {reason}"
        return (f"the rendezvous endpoint {endpoint} accepts connections but does not answer as node 0's rendezvous "
                f"store would within launcher.rdzv_timeout_s={timeout_s}: is launcher.rdzv_endpoint node 0's address "
                "and port, with nothing else listening there?")
    finally:
        if probe.poll() is None:
            probe.kill()
            probe.wait()


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a parent package is missing
        return False


def free_port(addr: str) -> int:
    """A port that is free now on `addr`, below the kernel's ephemeral range
    (/proc/sys/net/ipv4/ip_local_port_range) where it can: a port the OS
    picked from that range is handed out again to the next socket bound to
    port 0 -- gloo opens one per pair of ranks in every process group --
    and between this call and the rendezvous binding it, another process
    may take it. (Two tpctl nodes on one host then both find the port
    taken and both wait on the stranger as clients, until the rendezvous
    times out.) Else the OS picks one."""
    import random

    low = _ephemeral_low()
    for _ in range(50):
        port = random.randint(max(1024, low // 2), low - 1)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((addr, port))
                return port
            except OSError:
                continue
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 where unknown)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
