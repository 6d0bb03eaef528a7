"""A checkpoint's record of itself and whether it can be used: the
manifest (`manifest.json`: step, layout, model config, config hash, the
whole config, size and sha256 of every file), DCP's metadata read with an
allow-list unpickler (nothing in a checkpoint is pickled but that
metadata), and the comparisons of a checkpoint with a run's config.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from pathlib import Path
from typing import Optional

import torch

from tpctl.errors import TpctlError
from tpctl.parallel.layout import Layout

FORMAT = "tpctl-checkpoint/1"
MANIFEST = "manifest.json"


class CheckpointError(TpctlError):
    """A checkpoint that cannot be used; the message is one line."""


# DCP's .metadata is a pickle. Only these classes may appear in it, so a
# crafted file cannot run code (weights_only-style loading, as torch.load's).
_SAFE_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
    ("torch", "Size"), ("torch", "layout"), ("torch", "strided"), ("torch", "memory_format"),
    ("torch", "contiguous_format"), ("torch", "preserve_format"), ("torch", "channels_last"),
    # torch.load(weights_only=True) allows it too: it maps "torch.strided" to the layout.
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
}
_SAFE_DTYPES = {str(d).split(".")[-1] for d in (
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128)}


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _SAFE_GLOBALS or (module == "torch" and name in _SAFE_DTYPES):
            return super().find_class(module, name)
        raise CheckpointError(f"DCP metadata refers to {module}.{name}, which a tpctl checkpoint never holds")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def file_record(path: Path) -> dict:
    """A file's line in the manifest."""
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


def manifest_of(step: int, layout: Layout, cfg, files: dict) -> dict:
    """The manifest of the checkpoint of `step` written in `layout` by the
    run of `cfg`, whose files are `files` ({name: file_record})."""
    return {
        "format": FORMAT, "step": step, "layout": layout.to_dict(), "seed": int(cfg.seed), "model": model_config(cfg), "config_hash": config_hash(cfg),
        "data": {"name": cfg.data.name, "path": cfg.data.path, "next_batch": step},
        "config": _plain(cfg),
        "torch": torch.__version__, "files": files,
    }


def write_manifest(directory: Path, manifest: dict) -> None:
    """Written in place, fsynced: the directory it completes is swapped in
    whole afterwards, so no reader sees it half written."""
    with open(directory / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def config_hash(cfg) -> str:
    from omegaconf import OmegaConf

    text = json.dumps(OmegaConf.to_container(cfg, resolve=True), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _plain(cfg) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True)


# Settings a resumed run may change without changing what it computes
# (the layout, where and how often it saves, the launcher).
_LAYOUT_KEYS = ("mode", "size", "depth", "dp", "pp", "cp", "context.", "pipeline.", "device", "seq_parallel", "launcher.", "checkpoint.", "train.resume",
                "train.progress", "train.log_every", "train.eval_every", "train.eval_batches", "data.cache_dir",
                "train.on_nonfinite")


def config_changes(manifest: dict, cfg) -> list[str]:
    """'key: saved -> now' for each setting (model aside: that one is
    refused) that differs from the run that wrote the checkpoint and changes
    the curve (e.g. train.steps reshapes the LR schedule)."""
    def flat(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from flat(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}", v

    saved = dict(flat(manifest.get("config", {})))
    now = dict(flat(_plain(cfg)))
    return [f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(saved) | set(now))
            if saved.get(k) != now.get(k) and not k.startswith("model.")
            and not any(k == p or (p.endswith(".") and k.startswith(p)) for p in _LAYOUT_KEYS)]


def model_config(cfg) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg.model, resolve=True)


def _written_bytes(path: Path) -> int:
    """The bytes of a written checkpoint's files (its manifest's record;
    0 when it has none)."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        return sum(f["bytes"] for f in manifest["files"].values()) + (path / MANIFEST).stat().st_size
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return 0


# (path, manifest mtime and size) -> manifest: the launcher checks a
# checkpoint twice (config validation, then before the workers start);
# hashing gigabytes once is enough.
_verified: dict[tuple, dict] = {}


def verify(path: Path, checksums: bool = True) -> dict:
    """The manifest of a complete, intact checkpoint; CheckpointError (one
    line) otherwise."""
    path = Path(path)
    try:
        stat = (path / MANIFEST).stat()
        key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size, checksums)
    except OSError:
        key = None
    if key in _verified:
        return _verified[key]
    manifest = _verify(path, checksums)
    if key is not None:
        _verified[key] = manifest
    return manifest


def _verify(path: Path, checksums: bool) -> dict:
    if not path.is_dir():
        raise CheckpointError("not a directory" if path.exists() else "no such directory")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"no {MANIFEST} (not a tpctl checkpoint, or an unfinished one)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"unreadable {MANIFEST}: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{MANIFEST} is not of format {FORMAT}")
    for name, info in manifest.get("files", {}).items():
        file = path / name
        if "/" in name or not file.is_file():
            raise CheckpointError(f"missing file {name}")
        size = file.stat().st_size
        if size != info["bytes"]:
            raise CheckpointError(f"{name} has {size} bytes, the manifest says {info['bytes']} (truncated?)")
        if checksums and _sha256(file) != info["sha256"]:
            raise CheckpointError(f"{name} does not match its sha256 in the manifest (corrupted)")
    if ".metadata" not in manifest.get("files", {}):
        raise CheckpointError("the manifest lists no .metadata")
    _check_metadata(path)
    return manifest


def _check_metadata(path: Path) -> None:
    """DCP's .metadata unpickles (allow-listed classes only) into DCP
    Metadata: found here, not by every rank mid-load."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        with open(path / ".metadata", "rb") as f:
            metadata = _SafeUnpickler(f).load()
    except CheckpointError as e:
        raise CheckpointError(f"unreadable DCP .metadata: {e}") from None
    except Exception as e:
        raise CheckpointError(f"unreadable DCP .metadata: {type(e).__name__}: {e}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"DCP .metadata holds a {type(metadata).__name__}, not DCP Metadata")


def model_difference(saved: dict, cfg_model: dict) -> Optional[str]:
    """None when the same model; else 'model.k=saved in the checkpoint, here now; ...'.
    A key a checkpoint predates (written before tpctl had it) is its default."""
    from tpctl.schema import ModelConfig

    if saved.get("arch") != "custom":  # a custom model's keys are its builder's
        defaults = vars(ModelConfig())
        saved = {**{k: defaults[k] for k in cfg_model if k in defaults and k not in saved}, **saved}
    diffs = [f"model.{k}={saved.get(k)!r} in the checkpoint, {cfg_model.get(k)!r} here"
             for k in sorted(set(saved) | set(cfg_model)) if saved.get(k) != cfg_model.get(k)]
    return "; ".join(diffs) or None


def manifest_layout(manifest: dict) -> Layout:
    """The layout a checkpoint was written in (manifests before the
    `layout` block held its keys at the top level)."""
    return Layout.from_config(manifest.get("layout", manifest))
