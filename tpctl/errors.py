"""Errors with a contract: a bad config exits 2 with one line naming the key,
the value and what would be valid (see docs/DESIGN.md, section 3)."""

from __future__ import annotations

from contextlib import contextmanager

# The exit status of a command stopped by Ctrl-C (128 + SIGINT), and of each
# rank it stopped.
EXIT_INTERRUPTED = 130
# The launcher's pid, exported to its workers: a worker whose parent is
# another process (the launcher died before the worker could ask to die
# with it) does not start (launch/worker.py, `die_with_parent`).
LAUNCHER_PID_ENV = "TPCTL_LAUNCHER_PID"


class ConfigError(ValueError):
    """An invalid configuration value, found before any worker starts."""

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
