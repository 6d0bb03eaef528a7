"""The directory of a run's checkpoints, `<run dir>/checkpoints/step_<N>/`:
making room for a new one, committing it, keeping the newest N, and
finding the one a run resumes from.

Atomic: a checkpoint is written to `checkpoints/.tmp_step_<N>` and swapped
in as `step_<N>` once every file and the manifest are on disk; a crash
mid-write leaves only a temp dir, which is never read and is removed by the
next save.
"""

from __future__ import annotations

import logging
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from tpctl.atomic import fsync_dir, swap_dir

from .manifest import CheckpointError, _written_bytes, model_config, model_difference, verify, write_manifest

log = logging.getLogger("tpctl.checkpoint")

CHECKPOINTS = "checkpoints"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every step_<N> dir under `root`, newest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found, reverse=True)


def prepare(root: Path, tmp: Path, estimate: int) -> None:
    """Make the temp dir `tmp` of a new checkpoint under `root`, after
    removing what crashed saves left; CheckpointError if the disk lacks
    room for it (`estimate`: the bytes it will take)."""
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp_*"):  # left by a crash mid-write
        shutil.rmtree(stale, ignore_errors=True)
    free = shutil.disk_usage(root).free
    # As large as the newest checkpoint (the same state: the same size,
    # whatever the layout), or the estimate when it is the first.
    need = max([estimate] + [_written_bytes(path) for _, path in step_dirs(root)[:1]])
    if need > free:
        raise CheckpointError(f"it needs about {need / 2**20:,.2f} MiB, the disk has "
                              f"{free / 2**20:,.2f} MiB free (ENOSPC: No space left on device)")
    tmp.mkdir()


def commit(tmp: Path, final: Path, manifest: dict) -> None:
    """Complete the written checkpoint `tmp` with its manifest and put it at
    `final`. The same step saved again (e.g. after a restart) replaces the
    old one, which is set aside under a `.tmp_` name so that a crash
    between the renames leaves nothing a resume would read."""
    write_manifest(tmp, manifest)
    fsync_dir(tmp)
    swap_dir(tmp, final, aside=final.parent / f".tmp_old_{final.name}")


def _warn(message: str) -> None:
    """To the terminal (rank 0's stderr reaches it) and to the rank's log."""
    print(message, file=sys.stderr, flush=True)
    log.warning(message)


def rotate(root: Path, keep: int, warn: Callable[[str], None] = _warn) -> list[Path]:
    """Delete what lies beyond the newest `keep` valid checkpoints (0: keep
    all); return what was deleted. Only checkpoints that verify count, so
    a corrupt newer one never pushes out the last good one; an invalid one
    older than every kept one is deleted too (it can never be resumed)."""
    if keep <= 0:
        return []
    valid, removed = 0, []
    for _, path in step_dirs(Path(root)):
        try:
            verify(path)
            valid += 1
            if valid <= keep:
                continue
        except CheckpointError as e:
            if valid < keep:  # newer than a kept one, or nothing kept yet: not ours to judge
                warn(f"tpctl: warning: invalid checkpoint {path} ({e}) does not count towards checkpoint.keep={keep}")
                continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def newest_valid(root: Path, warn: Callable[[str], None]) -> Optional[tuple[Path, dict]]:
    """The newest checkpoint under `root` that verifies; each invalid one
    passed over is named through `warn`."""
    for _, path in step_dirs(Path(root)):
        try:
            return path, verify(path)
        except CheckpointError as e:
            warn(f"tpctl: warning: skipping invalid checkpoint {path}: {e}")
    return None


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def resolve_resume(cfg, run_dir: Path, restarted: bool = False, warn: Callable[[str], None] = _stderr
                   ) -> Optional[tuple[Path, dict]]:
    """The checkpoint a run starts from, with its manifest, or None (fresh).

    train.resume: null (fresh), auto (the newest valid checkpoint of the run
    dir; none: fresh) or a checkpoint path (must be valid). After a restart
    the newest valid checkpoint of the run dir wins whatever the setting.
    Raises CheckpointError (one line, the reason) for an invalid PATH or
    another model; callers name the key.
    """
    resume = cfg.train.resume
    found = None
    if restarted or resume == "auto":
        found = newest_valid(Path(run_dir) / CHECKPOINTS, warn)
    if found is None and resume not in (None, "auto"):
        try:
            found = Path(resume), verify(Path(resume))
        except CheckpointError as e:
            raise CheckpointError(f"not a valid checkpoint: {e}") from None
    if found is not None:
        diff = model_difference(found[1]["model"], model_config(cfg))
        if diff:
            raise CheckpointError(f"{found[0]} is a checkpoint of another model: {diff}")
    return found


@dataclass
class Checkpointer:
    """Where the loop saves and at which steps."""

    root: Path
    every: int
    keep: int
    at_end: bool = True

    def due(self, done: int, total: int) -> bool:
        return (self.every > 0 and done % self.every == 0) or (self.at_end and done == total)
