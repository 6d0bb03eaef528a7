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
from typing import Iterator

from tpctl.errors import LAUNCHER_PID_ENV

# Imported once, in the server, before any worker forks from it.
# Not the worker modules themselves: runpy runs those as __main__, and warns
# when one is imported already.
PRELOAD = ["tpctl.launch.warm_server", "torch", "torch._dynamo", "torch.distributed", "tpctl.launch.warm",
           "tpctl.training.build", "tpctl.training.loop", "tpctl.data.corpora"]
# Set in the server when it imports this module (PRELOAD): every worker's
# parent.
SERVER_PID = os.getpid()
# True in a worker forked from the server (set by run_module).
FORKED = False


@contextlib.contextmanager
def server() -> Iterator[None]:
    """Start the fork server now (it imports PRELOAD while the launcher goes
    on with the rendezvous), and stop it when the launch ends, so that the
    next launch in this process starts from its own environment."""
    import multiprocessing
    from multiprocessing import forkserver

    multiprocessing.set_forkserver_preload(PRELOAD)
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
    # Imported here, not in the server (its preload failed): the parent is still the server.
    os.environ[LAUNCHER_PID_ENV] = str(SERVER_PID if SERVER_PID != os.getpid() else os.getppid())
    for fd, name in ((1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        stream = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=getattr(old, "encoding", None) or "utf-8",
                                  errors="backslashreplace", write_through=True)
        setattr(sys, name, stream)
    sys.argv = [module, *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    # Returning is how torch's context learns that the rank succeeded.
