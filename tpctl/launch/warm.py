"""Warm starts: the workers of a launch fork from one process that has
already imported torch and tpctl (launcher.start_method=forkserver).

Why: a fresh `python -m tpctl.launch.worker` spends about 2.5 s of CPU
importing torch, and torch._dynamo (torch's optimizers import it the first
time they are built), before it does any work. Eight ranks on a small
machine spend most of a short run there. Python's forkserver imports once
(`PRELOAD`) and forks every worker of the launch from that process.

What stays as with a fresh interpreter:
- the worker runs its module as `__main__` with argv [module, *args]
  (runpy), stdout and stderr unbuffered (`python -u`);
- sys.path and the working directory are the launcher's (multiprocessing
  sends them with each start); the environment is the launcher's when the
  server started, which `server` does at the launch, after the launcher
  has set what the workers read;
- a rank dies with the process it hangs from: here the fork server, which
  itself dies with the launcher (warm_server: PDEATHSIG, since the pipe
  multiprocessing watches stays open while any worker holds it). The
  worker checks its parent against LAUNCHER_PID_ENV, which `run_module`
  sets to the server's pid.

What differs, and is handled by the launcher: torch's function-entrypoint
context reports only the first rank that failed, and waits for a return
value from every rank that exits 0. A worker therefore ends with
SystemExit(0) (never os._exit(0)) when it succeeds, and writes its exit
status beside its error file when it fails (worker.leave); the launcher
reads the others from there (local.all_failures).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import Iterator, Optional

from tpctl.errors import LAUNCHER_PID_ENV

# Imported once, in the server, before any worker forks from it.
# Not the worker modules themselves: runpy runs those as __main__, and warns
# when one is imported already. Not DCP either: once dynamo is loaded its
# import costs a rank ~0.06 CPU-s, while preloaded it would add ~18 MiB to
# the resident set of every worker, of a run that never saves too (which
# the memory check's process floor is measured without).
PRELOAD = ["tpctl.launch.warm_server", "torch", "torch._dynamo", "torch.distributed", "tpctl.launch.warm",
           "tpctl.training.build", "tpctl.training.loop", "tpctl.data.corpora"]
# Set in the server when it imports this module (PRELOAD): every worker's
# parent.
SERVER_PID = os.getpid()
# True in a worker forked from the server (set by run_module).
FORKED = False
# The threads this process ran when it allowed the server to fork from it
# (allow_fork_start); None: it did not.
_FORK_SAFE_THREADS: Optional[frozenset] = None


def allow_fork_start() -> None:
    """Let this launch's fork server be a fork of this process (see
    _fork_server) rather than a fresh interpreter. Call right after
    importing torch, before any tensor op: torch's ops here run on one
    thread from now on (a launcher validates on the meta device and probes
    tiny tensors), so torch never starts its OpenMP threads in this process
    — a fork of a process whose OpenMP threads ran hangs at the child's
    first parallel op (GNU libgomp). The threads running now (OpenBLAS's,
    started by importing numpy, which it restarts after a fork) are those a
    fork may leave behind. The workers set their own thread count
    (run_module)."""
    global _FORK_SAFE_THREADS
    import torch

    torch.set_num_threads(1)
    _FORK_SAFE_THREADS = _threads()


def _threads() -> Optional[frozenset]:
    """The ids of this process's threads, native ones included; None where
    there is no /proc to tell (then the server is never forked)."""
    try:
        return frozenset(os.listdir("/proc/self/task"))
    except OSError:
        return None


@contextlib.contextmanager
def server() -> Iterator[None]:
    """Start the fork server now (it imports PRELOAD while the launcher goes
    on with the rendezvous), and stop it when the launch ends, so that the
    next launch in this process starts from its own environment."""
    import multiprocessing
    from multiprocessing import forkserver

    multiprocessing.set_forkserver_preload(PRELOAD)
    if not _fork_server(forkserver._forkserver):
        forkserver.ensure_running()
    try:
        yield
    finally:
        # Killed, not asked: a worker that outlived the launch (none should)
        # would keep it waiting; with the server gone, such a worker ends too.
        running = forkserver._forkserver
        pid = getattr(running, "_forkserver_pid", None)
        if pid is not None:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        stop = getattr(running, "_stop", None)  # Python >= 3.8: forget it, so the next launch starts its own
        if stop is not None:
            stop()


def run_module(module: str, *argv: str) -> None:
    """A worker's entry point in the forked process: run `module` as
    `python -u -m module *argv` would."""
    import io
    import runpy

    global FORKED
    FORKED = True
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # as a fresh interpreter reads it (a forked server's is the launcher's 1)
        import torch

        torch.set_num_threads(int(threads))
    # Imported here, not in the server (its preload failed): the parent is still the server.
    os.environ[LAUNCHER_PID_ENV] = str(SERVER_PID if SERVER_PID != os.getpid() else os.getppid())
    for fd, name in ((1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        stream = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=getattr(old, "encoding", None) or "utf-8",
                                  errors="backslashreplace", write_through=True)
        setattr(sys, name, stream)
    sys.argv = [module, *argv]
    # A server forked from the launcher may hold the module imported (tpctl
    # generate imports its worker's helpers): run it afresh as __main__, as
    # `python -m` does (runpy warns of a module imported before it runs).
    sys.modules.pop(module, None)
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    # Returning is how torch's context learns that the rank succeeded.


def _fork_server(server) -> bool:
    """Start multiprocessing's fork server `server` as a fork of this
    process instead of a fresh interpreter, where that is safe: the
    launcher allowed it and runs no thread it did not run then
    (allow_fork_start); True if started (False: nothing done, the caller
    starts it as multiprocessing does). The launcher has imported torch
    already (it validated the config), so the server's imports of PRELOAD
    cost only what is not loaded yet (dynamo and tpctl's training modules):
    a fresh server imports torch again first (measured: a 4-rank 2-step
    gpt-tiny run, 6.9 CPU-s forked against 8.6 fresh). What the workers
    inherit is what a fresh server gives them: the launcher's environment,
    working directory and sys.path at this moment, the listening socket and
    the pipe that tells the server its clients are gone (every other
    descriptor is let go), no logging handlers, default handling of the stop
    signals, and warm_server's set-up, run in the server as its first
    import."""
    import socket
    from multiprocessing import connection, forkserver, resource_tracker, util

    running = _threads()
    if (_FORK_SAFE_THREADS is None or running is None or not running <= _FORK_SAFE_THREADS
            or server._forkserver_pid is not None or not hasattr(forkserver, "main")):
        return False
    resource_tracker.ensure_running()
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the server: never returns
            _serve_forked(server, listener.fileno(), alive_r)
        os.close(alive_r)
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
    return True


def _serve_forked(server, listener_fd: int, alive_r: int) -> None:
    """The forked fork server's life (_fork_server)."""
    global SERVER_PID
    code = 0
    try:
        # Every other descriptor of the launcher (the run dir's lock, the
        # log file, the pipes of whoever started it) is let go: made a copy
        # of /dev/null rather than closed, so that a Python object owning
        # one, finalised later, closes its own number and never one reused.
        null = os.open(os.devnull, os.O_RDWR)
        for fd in map(int, os.listdir("/proc/self/fd")):
            if fd not in (0, 1, 2, listener_fd, alive_r, null):
                with contextlib.suppress(OSError):
                    os.dup2(null, fd)
        for sig in (signal.SIGTERM, signal.SIGHUP):  # the launcher's handlers are not the server's
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        import logging

        # The launcher's root handlers (Hydra's, on descriptors let go
        # above) are not a worker's, which sets up its own
        # (worker.setup_logging); the agent's loggers are quietened after
        # this fork (local.quiet_agent).
        logging.root.handlers.clear()
        logging.root.setLevel(logging.WARNING)
        SERVER_PID = os.getpid()
        server._forkserver_pid = server._forkserver_alive_fd = None
        sys.modules.pop("tpctl.launch.warm_server", None)  # its set-up runs in the server, as its first import
        from multiprocessing import forkserver

        forkserver.main(listener_fd, alive_r, PRELOAD)
    except SystemExit:  # the launcher and every worker are gone
        pass
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)
