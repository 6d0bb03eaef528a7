"""Writes that a reader never sees half done: a file is written beside its
destination and renamed into place, a directory is built beside its
destination and swapped in. A killed writer leaves the old file or
directory (or none), never a torn one: the cache of tokenised corpora, the
prepared corpora, checkpoints and exports all rely on it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (a no-op where directories
    cannot be opened, as on Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(dest: Path, chunks: Iterable[bytes]) -> None:
    """`dest` holds `chunks` whole, or is as it was: a temporary file in the
    same directory, fsynced, then `os.replace`d onto `dest`."""
    with replacing(dest) as tmp, open(tmp, "wb") as f:
        for chunk in chunks:
            f.write(chunk)


@contextmanager
def replacing(dest: Path) -> Iterator[Path]:
    """A temporary path beside `dest` for a writer that wants a path (a
    library's save): when the block ends, the file there is fsynced and
    `os.replace`d onto `dest`; if the block raises, it is removed and `dest`
    is as it was. The file is created 0600 (tempfile's mode), as
    safetensors' own files are."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def swap_dir(new: Path, dest: Path, aside: Path | None = None) -> None:
    """Put the finished directory `new` at `dest`: two renames, so a reader
    sees the old or the new directory whole. An existing `dest` is first
    renamed to `aside` (default: a hidden name beside it) and removed after.
    Both renames stay on one file system: `new` must lie beside `dest`."""
    new, dest = Path(new), Path(dest)
    old = None
    if dest.exists():
        old = Path(aside) if aside is not None else dest.with_name(f".{dest.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(dest, old)
    os.rename(new, dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    fsync_dir(dest.parent)


def respect_umask(path: Path) -> None:
    """Give `path` (and what a directory holds) the modes a plain open()
    or mkdir() would have given it under the process's umask: files that
    tempfile or safetensors create are 0600 (0700 for a directory), which
    other users and the other nodes' jobs of a shared file system cannot read."""
    umask = current_umask()
    for p in [path, *(path.rglob("*") if path.is_dir() else [])]:
        p.chmod((0o777 if p.is_dir() else 0o666) & ~umask)


def current_umask() -> int:
    try:  # Linux >= 4.7: read, not set (setting it races with other threads)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask
