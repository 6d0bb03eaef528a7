"""A fork server for the suite's `tpctl` commands (cli_support.Tpctl.run).

Why: a fresh `python -m tpctl.cli` spends about 2 CPU-s importing torch,
Hydra and tpctl before it reads its first argument, and the suite runs a few
hundred commands, most of which end in a second or two (a refusal, a
fake worker's launch). This process imports them once; each command is a
fork of it that runs `tpctl.cli.main` as `python -m tpctl.cli ARGS` would:
in the command's working directory, environment and umask, its stdout and stderr
in files the test reads, stdin empty, leading a session of its own (the
test kills the session on a timeout), its exit status the status main
leaves with (0, 1, 2, 130, or minus the signal that ended it, as
subprocess reports it).

What differs from a fresh interpreter, and why it does not matter here:
- modules imported here read the environment at import time, not the
  command's: torch (OMP_NUM_THREADS, which the suite sets the same for
  every command), Hydra, omegaconf, tpctl (whose settings are read when a
  command runs). A command whose PYTHONPATH differs from this process's
  (a test's plugins or shims) runs as a fresh interpreter instead
  (Tpctl.run), as does every command a test interrupts (Tpctl.start) or
  that the README shows (test_readme);
- /proc/PID/environ of the forked command is this server's, so the test's
  marker does not name it (cli_support.marked_pids): the workers it starts
  are fresh interpreters and carry the marker, and the command itself is
  waited for (or killed with its session) before Tpctl.run returns.

It runs benchmark scripts the same way (cli_support.run_script:
`python SCRIPT ARGS` as runpy runs it, `__main__` being the script).

Protocol, one JSON line each way on stdin/stdout: a request {argv, cwd,
env, umask, out, err, and script for a script}; the replies {"pid": P} once forked, then {"status": S}.
One command at a time (a test process runs its tests in turn). The server
dies with the process that started it (PDEATHSIG), and a command with the
server.
"""

from __future__ import annotations

import json
import os
import signal
import sys

# Imported once, before any command forks: what every `tpctl` command
# imports before it reads its arguments (tpctl.cli, the train command and
# torch), and Hydra's parser. `serve` adds what a launch's fork server
# imports for its workers (launch.warm.PRELOAD: dynamo, the training
# modules): that server is a fork of the command (warm._fork_server),
# so it then has them already instead of importing them for every `tpctl
# train` of the suite (~2 CPU-s a launch).
PRELOAD = ("torch", "omegaconf", "hydra", "tpctl.cli", "tpctl.commands.train", "tpctl.config")


def _command(request: dict, reply_fds: tuple[int, int]) -> None:
    """In the forked child: become the command and run it to its exit."""
    import importlib
    import io

    from tpctl.errors import die_with_parent

    die_with_parent(signal.SIGKILL)  # the server's death (its owner's) ends the command
    os.setsid()
    for fd in reply_fds:
        os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["out"]), (2, request["err"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                                  write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                                  write_through=True)
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    sys.path[0] = request["cwd"]  # as `python -m` puts its working directory first
    os.environ.clear()
    os.environ.update(request["env"])
    script = request.get("script")
    if script is None:
        cli = importlib.import_module("tpctl.cli")
        # As under `python -m tpctl.cli`: the launcher's spawned processes
        # (multiprocessing) import the main module by this name.
        sys.modules["__main__"] = cli
        sys.argv = [cli.__file__, *request["argv"]]
    else:  # `python SCRIPT ARGS`: the script's folder first on the path, run as __main__
        import runpy

        sys.path[0] = os.path.dirname(os.path.abspath(script))
        sys.argv = [script, *request["argv"]]
    status = 1
    try:
        if script is None:
            cli.main(request["argv"])
        else:
            runpy.run_path(script, run_name="__main__")
        status = 0
    except SystemExit as e:
        if e.code is None:
            status = 0
        elif isinstance(e.code, int):
            status = e.code
        else:
            print(e.code, file=sys.stderr)
    except BaseException:
        sys.excepthook(*sys.exc_info())
    # What the interpreter's exit does: wait for the non-daemon threads,
    # then the exit handlers.
    import atexit
    import threading

    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(status & 0xFF)


def serve() -> None:
    from tpctl.errors import die_with_parent

    die_with_parent(signal.SIGKILL)
    owner = int(sys.argv[1]) if len(sys.argv) > 1 else None
    if owner is not None and os.getppid() != owner:
        os._exit(1)  # the owner died before the line above
    import importlib

    from tpctl.launch.warm import PRELOAD as WARM

    # (not warm_server: its set-up is the fork server's own, run as its first import)
    for name in PRELOAD + tuple(name for name in WARM if name != "tpctl.launch.warm_server"):
        importlib.import_module(name)
    requests = os.fdopen(os.dup(0), "r")
    replies = os.fdopen(os.dup(1), "w")
    reply_fds = (requests.fileno(), replies.fileno())
    replies.write(json.dumps({"ready": True}) + "\n")
    replies.flush()
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            try:
                _command(request, reply_fds)
            except BaseException:  # before main ran (main's own errors end in _command): say why
                import traceback

                traceback.print_exc()
            finally:
                os._exit(1)  # (_command leaves by os._exit; never back into this loop)
        replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n")
        replies.flush()


if __name__ == "__main__":
    serve()
