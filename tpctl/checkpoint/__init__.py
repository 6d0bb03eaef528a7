"""Sharded checkpoints that load in any layout: save, verify, resume.

Format: torch.distributed.checkpoint (DCP), one directory per checkpoint,
`<run dir>/checkpoints/step_<N>/`, plus `manifest.json`. The package by
purpose: `state` (what each rank holds and writes, and the write rules),
`dcp` (save and load through DCP, resharding between layouts), `store` (the
directory of checkpoints: atomic commit, rotation, resume) and `manifest`
(the manifest, hashes, validation against a config). The names below are
the package's public ones.
"""

from .dcp import MANIFEST_ALLOWANCE, bytes_to_write, load, read_full, root_cause, save
from .manifest import (FORMAT, MANIFEST, CheckpointError, config_changes, config_hash, manifest_layout, model_config,
                       model_difference, verify)
from .state import Box, Entry, shard_boxes, state_entries, whole
from .store import CHECKPOINTS, Checkpointer, newest_valid, resolve_resume, rotate, step_dirs

__all__ = [
    "MANIFEST_ALLOWANCE", "bytes_to_write", "load", "read_full", "root_cause", "save",
    "FORMAT", "MANIFEST", "CheckpointError", "config_changes", "config_hash", "manifest_layout", "model_config",
    "model_difference", "verify",
    "Box", "Entry", "shard_boxes", "state_entries", "whole",
    "CHECKPOINTS", "Checkpointer", "newest_valid", "resolve_resume", "rotate", "step_dirs",
]
