"""tpctl's error vocabulary: the exit statuses of every command, the one
line an error is printed as, and the base of tpctl's exception classes.

A bad config exits 2 with one line naming the key, the value and what would
be valid, before any worker starts (see docs/DESIGN.md, section 3). Commands
print through `error`/`warning` here, so the prefix a user (or a script)
greps for is written in one place."""

from __future__ import annotations

import sys
from contextlib import contextmanager

# Exit statuses (README, "Exit status").
EXIT_OK = 0
# The work failed: a rank, a checkpoint, a recipe's goal.
EXIT_FAILED = 1
# Refused before anything ran: a config value, an argument, a rewrite that
# does not prove itself, data the model cannot read.
EXIT_USAGE = 2
# The exit status of a command stopped by Ctrl-C (128 + SIGINT), and of each
# rank it stopped.
EXIT_INTERRUPTED = 130
# The launcher's pid, exported to its workers: a worker whose parent is
# another process (the launcher died before the worker could ask to die
# with it) does not start (launch/worker.py, `die_with_parent`).
LAUNCHER_PID_ENV = "TPCTL_LAUNCHER_PID"


def error(message: str) -> None:
    """Print `message` as tpctl's one-line error on stderr."""
    print(f"tpctl: error: {message}", file=sys.stderr, flush=True)


def warning(message: str) -> None:
    """Print `message` as tpctl's one-line warning on stderr."""
    print(f"tpctl: warning: {message}", file=sys.stderr, flush=True)


def fail(message: str, code: int = EXIT_USAGE) -> int:
    """Print the error and return the exit status: `return fail(...)`."""
    error(message)
    return code


def one_line(exc: BaseException) -> str:
    """`<ExceptionType>: <first line of its message>`."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


class TpctlError(Exception):
    """Base of tpctl's own errors: the message is one line a user can act
    on; `exit_code` is the status the command ends with."""

    exit_code = EXIT_FAILED


class ConfigError(TpctlError, ValueError):
    """An invalid configuration value, found before any worker starts."""

    exit_code = EXIT_USAGE

    def __init__(self, key: str, value: object, valid: str):
        self.key, self.value, self.valid = key, value, valid
        super().__init__(str(self))

    def __str__(self) -> str:
        return f"invalid config: {self.key}={self.value!r}: {self.valid}"


class Interrupted(KeyboardInterrupt):
    """A termination signal (SIGTERM, SIGHUP) raised as Ctrl-C's
    KeyboardInterrupt is, so that the same cleanup runs (temporary files
    removed) and the command exits 128 + `signum` with one line."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signum)


def interrupt_on_termination() -> None:
    """From now on, SIGTERM and SIGHUP raise Interrupted in the main thread
    (by default they end the process at once: nothing is cleaned up)."""
    import signal

    def handler(signum, frame):
        raise Interrupted(signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


def interrupted_status(error: KeyboardInterrupt) -> tuple[str, int]:
    """(the signal's name, the exit status: 128 + its number) of an
    interruption: Ctrl-C's SIGINT, or the signal an Interrupted carries."""
    import signal

    signum = getattr(error, "signum", signal.SIGINT)
    return signal.Signals(signum).name, 128 + signum


def die_with_parent(sig: int) -> None:
    """Ask Linux to send this process `sig` when its parent dies, even by
    SIGKILL (nothing elsewhere)."""
    import sys

    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
        except OSError:
            pass


def quiet_interrupts() -> None:
    """Until the caller installs its own handling: SIGINT ends this process
    at once, quietly (128 + SIGINT). For a worker while it starts: the
    launcher forwards Ctrl-C to it, and a KeyboardInterrupt raised in the
    middle of its imports would print a traceback."""
    import os
    import signal

    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(128 + signum))


def stop_signals() -> tuple:
    """What a terminal or a scheduler sends to stop a job's processes."""
    import signal

    return signal.SIGINT, signal.SIGTERM, signal.SIGHUP


@contextmanager
def signals_held():
    """Hold back Ctrl-C and the other stop signals until the block is done;
    one that came meanwhile is raised right after it. For what must not be
    cut in two: `import torch` (a KeyboardInterrupt inside it is sometimes
    swallowed, or crosses C++ and aborts the process), creating a temporary
    directory that the surrounding code must know to remove, starting
    worker processes."""
    import signal

    held = signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals())
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def import_torch() -> None:
    """`import torch`, with the stop signals held (`signals_held`)."""
    with signals_held():
        import torch  # noqa: F401
