"""One owner per run dir: an advisory `fcntl.flock` on `<run dir>/.lock`.

Two `tpctl train` commands writing into one run dir would mix configs,
metrics and checkpoints of two runs, and both could exit 0. The launcher
takes this lock before anything is written into the dir and holds it until
it exits; the kernel releases it when the process dies, however it dies,
so there is no stale lock to clean up. The holder writes its pid into the
file, so a second command can say who owns the dir.

Each node of a multi-node run locks its own file (`.lock` on node 0,
`.lock.node<K>` on node K): on a shared file system (Slurm) the nodes of
one job share the run dir, while two jobs still exclude each other there.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from pathlib import Path
from tpctl.errors import TpctlError

LOCK_NAME = ".lock"


class RunDirBusy(TpctlError):
    """The run dir is locked by another live process; the message is one line."""


def lock_path(run_dir: str | os.PathLike, node_rank: int = 0) -> Path:
    return Path(run_dir) / (LOCK_NAME if node_rank == 0 else f"{LOCK_NAME}.node{node_rank}")


def holder(path: Path) -> str:
    """The pid written into a lock file, as text ('?' if unreadable)."""
    try:
        return path.read_text().strip() or "?"
    except OSError:
        return "?"


def _busy(path: Path) -> RunDirBusy:
    return RunDirBusy(f"run dir {path.parent} is in use by another tpctl run (pid {holder(path)} holds {path.name}); "
                      "wait for it to finish, or choose another hydra.run.dir")


def probe(run_dir: str | os.PathLike, node_rank: int = 0) -> None:
    """Raise RunDirBusy if another process holds the lock now. Creates
    nothing: a run dir or lock file that does not exist is free. (Cheap, so
    a second run is refused at once, before its config is checked.)"""
    path = lock_path(run_dir, node_rank)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise _busy(path) from None
        raise
    finally:
        os.close(fd)  # closing drops the shared lock taken to test


class RunDirLock:
    """The exclusive lock of one run dir, held while the object lives (or
    until `release`). Creates the run dir if needed."""

    def __init__(self, run_dir: str | os.PathLike, node_rank: int = 0, wait_s: float = 0.0):
        """wait_s: how long to wait for another holder to let go (a Slurm
        node waits for the tpctl that submitted it to exit)."""
        self.path = lock_path(run_dir, node_rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # No O_TRUNC: the file holds the owner's pid, which must survive
        # another process opening it to test the lock.
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN) and time.monotonic() < deadline:
                    time.sleep(0.2)
                    continue
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise _busy(self.path) from None
                raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd: int | None = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> "RunDirLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
