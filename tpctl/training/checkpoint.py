"""Sharded checkpoints that load in any layout: save, verify, resume.

Format: torch.distributed.checkpoint (DCP), one directory per checkpoint,
`<run dir>/checkpoints/step_<N>/`, plus `manifest.json` (step, layout, model
config, config hash, size and sha256 of every file).

Why it reshards: every parameter carries a ShardSpec, the per-dim ranges of
the full tensor that this rank holds. The cartesian product of those ranges,
clipped at full_shape (past it lies zero padding, never saved), is a set of
boxes of the global tensor, each with its global offsets. Saving, each box is
one DCP chunk; loading, each local box asks DCP for its region, and DCP's
overlap search reads it from whichever saved chunks cover it. So nothing
here knows about modes: 2d size 4 loads into 3d size 8 or `none` alike.

What each checkpoint holds (all tensors: nothing is pickled but DCP's own
metadata, which is read with an allow-list unpickler):
  model.<name>                 parameters (tied parameters once)
  optim.<name>.exp_avg|exp_avg_sq  AdamW moments, boxed like their parameter
  optim.<name>.step            AdamW's step count
  train.step, train.first_loss the loop position (the LR schedule and the
                               data are functions of the step)
  rng.shared.dp<d>, rng.local.rank<r>, rng.torch.rank<r>[, rng.cuda.rank<r>]
                               dropout and global generators
Only one rank writes each box: the first of its replicas (ShardSpec
.replica_ranks[0], or for rows with replicas of their own .row_replicas) in
data-parallel replica 0; under ZeRO each replica writes the chunk it owns
(a sub-box of the shard), so every byte is written once, by whichever
replica holds it (DataParallel.held).

Atomic: written to `checkpoints/.tmp_step_<N>`, renamed to `step_<N>` once
every file and the manifest are on disk; a crash mid-write leaves only a
temp dir, which is never read and is removed by the next save.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import pickle
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from tpctl.parallel import comm
from tpctl.parallel.layout import Layout
from tpctl.parallel.shard import ShardSpec
from tpctl.errors import TpctlError

log = logging.getLogger("tpctl.checkpoint")

FORMAT = "tpctl-checkpoint/1"
MANIFEST = "manifest.json"
CHECKPOINTS = "checkpoints"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(TpctlError):
    """A checkpoint that cannot be used; the message is one line."""


# --------------------------------------------------------------------------
# Boxes: a shard as regions of the global tensor
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Box:
    offsets: tuple[int, ...]  # in the global tensor
    sizes: tuple[int, ...]
    local: tuple[int, ...]  # where the box starts in this rank's shard


def shard_boxes(spec: Optional[ShardSpec], local_shape: tuple[int, ...]) -> list[Box]:
    """The boxes of the global tensor a shard holds (padding clipped away),
    as its record says (ShardSpec.boxes). No spec: the tensor is whole."""
    if spec is None:
        return [Box((0,) * len(local_shape), tuple(local_shape), (0,) * len(local_shape))]
    return [Box(*box) for box in spec.boxes(local_shape)]


@dataclass
class Entry:
    """One named global tensor as this rank sees it: its local storage, the
    boxes of the global tensor that storage holds, and whether this rank is
    the one that writes them."""

    tensor: torch.Tensor
    full_shape: tuple[int, ...]
    boxes: list[Box]
    write: bool
    # Boxes (positions in `boxes`) another replica writes: rows of a fused
    # projection that hold a key/value head several ranks share.
    skip: frozenset = frozenset()

    def written(self) -> list[Box]:
        return [b for i, b in enumerate(self.boxes) if i not in self.skip] if self.write else []

    def view(self, box: Box) -> torch.Tensor:
        out = self.tensor
        for dim, (start, size) in enumerate(zip(box.local, box.sizes)):
            out = out.narrow(dim, start, size)
        return out

    def box_at(self, offsets) -> Box:
        offsets = tuple(offsets)
        for box in self.boxes:
            if box.offsets == offsets:
                return box
        raise KeyError(offsets)


def whole(tensor: torch.Tensor, write: bool) -> Entry:
    return Entry(tensor, tuple(tensor.shape), shard_boxes(None, tuple(tensor.shape)), write)


# --------------------------------------------------------------------------
# DCP planners over entries
# --------------------------------------------------------------------------


def _planners():
    """Imported late: `tpctl train`'s config checks never pay for DCP."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties, TensorStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class SavePlanner(DefaultSavePlanner):
        """Each entry this rank writes becomes one DCP chunk per box."""

        def __init__(self):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def create_local_plan(self) -> SavePlan:
            items = []
            for fqn, entry in self.state_dict.items():
                props = TensorProperties(dtype=entry.tensor.dtype)
                for box in entry.written():
                    offsets = torch.Size(box.offsets)
                    items.append(WriteItem(
                        index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(ChunkStorageMetadata(offsets, torch.Size(box.sizes)),
                                                    props, torch.Size(entry.full_shape))))
            self.plan = SavePlan(items)
            return self.plan

        def lookup_object(self, index):
            entry = self.state_dict[index.fqn]
            return entry.view(entry.box_at(index.offset)).detach().cpu().contiguous()

    class LoadPlanner(DefaultLoadPlanner):
        """Each local box asks for its region; DCP finds the saved chunks that
        overlap it. `missing` keys (e.g. generators of another layout) are
        skipped, every other key must exist with the same global shape."""

        def __init__(self, optional: Callable[[str], bool]):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self.optional = optional

        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            self.state_dict, self.metadata, self.is_coordinator = state_dict, metadata, is_coordinator
            self.original_state_dict = state_dict

        def create_local_plan(self) -> LoadPlan:
            saved = self.metadata.state_dict_metadata
            items = []
            for fqn, entry in self.state_dict.items():
                md = saved.get(fqn)
                if md is None:
                    if self.optional(fqn):
                        continue
                    raise CheckpointError(f"the checkpoint has no {fqn!r}")
                if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != tuple(entry.full_shape):
                    have = tuple(md.size) if isinstance(md, TensorStorageMetadata) else type(md).__name__
                    raise CheckpointError(f"{fqn}: shape {have} in the checkpoint, {tuple(entry.full_shape)} here")
                chunks = [ChunkStorageMetadata(torch.Size(b.offsets), torch.Size(b.sizes)) for b in entry.boxes]
                items += create_read_items_for_chunk_list(fqn, md, chunks)
            return LoadPlan(items)

        def load_bytes(self, read_item, value):
            raise CheckpointError(f"{read_item.dest_index.fqn}: a pickled object; tpctl checkpoints hold tensors only")

        def resolve_tensor(self, read_item):
            entry = self.state_dict[read_item.dest_index.fqn]
            out = entry.view(entry.boxes[read_item.dest_index.index])
            for dim, (start, size) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
                out = out.narrow(dim, start, size)
            return out

    return SavePlanner, LoadPlanner


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


def _reader(path: Path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with open(Path(self.path) / ".metadata", "rb") as f:
                try:
                    metadata = _SafeUnpickler(f).load()
                except CheckpointError:
                    raise
                except Exception as e:
                    raise CheckpointError(f"unreadable DCP metadata: {e}") from None
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(path)


# --------------------------------------------------------------------------
# What a training run's state is, as entries
# --------------------------------------------------------------------------


def _skipped(spec: Optional[ShardSpec], boxes: list[Box], rank: int) -> frozenset:
    """The boxes of a shard whose rows another holder writes (the record's
    answer, ShardSpec.writes, box by box)."""
    if spec is None:
        return frozenset()
    return frozenset(i for i, b in enumerate(boxes) if not spec.writes(rank, b.local[0]))

def _adam_state(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> dict:
    """AdamW's state of `p`, created as AdamW would create it (zeros, step 0)
    when the parameter has not been stepped yet, so it can be loaded into."""
    state = optimizer.state[p]
    if not state:
        from torch.optim.optimizer import _get_scalar_dtype

        state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def _rng_keys(mesh) -> dict[str, Any]:
    """{key: generator or device name} of the generators this rank owns."""
    keys = {f"rng.local.rank{mesh.rank}": mesh.rng_local, f"rng.torch.rank{mesh.rank}": "cpu"}
    if mesh.device.type == "cuda":
        keys[f"rng.cuda.rank{mesh.rank}"] = "cuda"
    keys[f"rng.shared.dp{mesh.dp_rank}"] = mesh.rng_shared
    return keys


def _get_rng(gen) -> torch.Tensor:
    if gen == "cpu":
        return torch.get_rng_state()
    if gen == "cuda":
        return torch.cuda.get_rng_state()
    return gen.get_state()


def _set_rng(gen, state: torch.Tensor) -> None:
    if gen == "cpu":
        torch.set_rng_state(state)
    elif gen == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        gen.set_state(state)


def state_entries(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], par,
                  step: int, first_loss: float) -> dict[str, Entry]:
    """A run's state as entries: the model's parameters and AdamW's moments
    (boxes of the full tensors, as the data-parallel component says this
    rank holds and writes them), the step, and the generators."""
    mesh = par.mesh
    entries: dict[str, Entry] = {}
    for name, p, values, spec, write in par.dp.held(model):
        boxes = shard_boxes(spec, tuple(values.shape))
        full = tuple(spec.full_shape) if spec is not None else tuple(values.shape)
        skip = _skipped(spec, boxes, mesh.rank)
        entries[f"model.{name}"] = Entry(values, full, boxes, write, skip)
        if optimizer is None:
            continue
        state = _adam_state(optimizer, p)
        held = spec.local_shape() if spec is not None else tuple(values.shape)
        for moment in ("exp_avg", "exp_avg_sq"):
            # (under ZeRO a chunk's padding rows, past what its record holds, are never saved)
            entries[f"optim.{name}.{moment}"] = Entry(state[moment][:held[0]] if values.dim() else state[moment],
                                                      full, boxes, write, skip)
        # One writer among the shards: the one writing the global origin.
        origin = write if spec is None else spec.writes_origin(mesh.rank)
        entries[f"optim.{name}.step"] = whole(state["step"].detach().reshape(1).double().cpu(), origin)
    is_first = mesh.rank == 0
    entries["train.step"] = whole(torch.tensor([step], dtype=torch.int64), is_first)
    entries["train.first_loss"] = whole(torch.tensor([first_loss], dtype=torch.float64), is_first)
    for key, gen in _rng_keys(mesh).items():
        # The shared generator is the same on every rank of a tp group.
        writes = mesh.tp_rank == 0 if key.startswith("rng.shared") else True
        entries[key] = whole(_get_rng(gen).clone(), writes)
    return entries


# --------------------------------------------------------------------------
# Save
# --------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def config_hash(cfg) -> str:
    from omegaconf import OmegaConf

    text = json.dumps(OmegaConf.to_container(cfg, resolve=True), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _plain(cfg) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True)


# Settings a resumed run may change without changing what it computes
# (the layout, where and how often it saves, the launcher).
_LAYOUT_KEYS = ("mode", "size", "depth", "dp", "pp", "pipeline.", "device", "seq_parallel", "launcher.", "checkpoint.", "train.resume",
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


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every step_<N> dir under `root`, newest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found, reverse=True)


def save(root: Path, step: int, model, optimizer, par, cfg, first_loss: float = float("nan"),
         keep: int = 0) -> Path:
    """Write checkpoint `root/step_<step>` collectively (every rank calls
    this); returns its path. Keeps the newest `keep` valid ones (0: all).

    A save that fails on any rank (a full disk, no permission) raises the
    same CheckpointError on every rank, naming the root cause, after its
    temp dir is removed: the checkpoints written before are untouched."""
    from torch.distributed.checkpoint import save as dcp_save

    SavePlanner, _ = _planners()
    root = Path(root)
    final, tmp = root / f"step_{step}", root / f".tmp_step_{step}"
    started = time.perf_counter()
    mesh = par.mesh
    entries = state_entries(model, optimizer, par, step, first_loss)
    sizes = comm.all_gather_object(bytes_to_write(entries))

    def fail(why: str) -> CheckpointError:
        return CheckpointError(f"checkpoint step {step} not written to {root}: {why}; "
                               "the checkpoints written before are kept")

    def prepare() -> None:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp_*"):  # left by a crash mid-write
            shutil.rmtree(stale, ignore_errors=True)
        free = shutil.disk_usage(root).free
        # As large as the newest checkpoint (the same state: the same size,
        # whatever the layout), or the estimate when it is the first.
        need = max([sum(sizes) + MANIFEST_ALLOWANCE] + [_written_bytes(path) for _, path in step_dirs(root)[:1]])
        if need > free:
            raise CheckpointError(f"it needs about {need / 2**20:,.2f} MiB, the disk has "
                                  f"{free / 2**20:,.2f} MiB free (ENOSPC: No space left on device)")
        tmp.mkdir()

    _on_rank0(mesh, prepare, fail, tmp)
    error, files = None, {}
    writer = _recording_writer(tmp)
    try:
        dcp_save(entries, storage_writer=writer, planner=SavePlanner())
        # Each rank hashes the files it wrote (DCP names them __<rank>_<n>.distcp).
        files = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in sorted(tmp.glob(f"__{mesh.rank}_*"))}
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        error = root_cause(writer.failure or e)
    gathered = comm.all_gather_object((error, files))
    errors = [e for e, _ in gathered if e]
    if errors:
        if mesh.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        comm.barrier()
        raise fail(errors[0])

    def commit() -> None:
        files = {name: info for _, part in gathered for name, info in part.items()}
        meta = tmp / ".metadata"
        files[".metadata"] = {"bytes": meta.stat().st_size, "sha256": _sha256(meta)}
        manifest = {
            "format": FORMAT, "step": step, "layout": mesh.layout.to_dict(), "seed": int(cfg.seed), "model": model_config(cfg), "config_hash": config_hash(cfg),
            "data": {"name": cfg.data.name, "path": cfg.data.path, "next_batch": step},
            "config": _plain(cfg),
            "torch": torch.__version__, "files": files,
        }
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if final.exists():  # the same step saved again (e.g. after a restart)
            old = root / f".tmp_old_step_{step}"
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        _fsync_dir(root)

    _on_rank0(mesh, commit, fail, tmp)
    if mesh.rank == 0:
        rotate(root, keep)
    comm.barrier()
    log.info("checkpoint %s written in %.2fs", final, time.perf_counter() - started)
    return final


def bytes_to_write(entries: dict) -> int:
    """What this rank's part of a checkpoint takes on disk: the tensors'
    bytes, plus per tensor written the frame torch.save puts around it (a
    zip archive of its own: about 1.5 KiB, measured here) and its record
    in DCP's metadata (measured: about 240 bytes with 40-character names;
    256 + the name's length allowed). The manifest is MANIFEST_ALLOWANCE."""
    import io

    one = io.BytesIO()
    torch.save(torch.zeros(1), one)
    frame = one.getbuffer().nbytes - 4 + 256
    return sum(e.view(b).numel() * e.tensor.element_size() + frame + len(key)
               for key, e in entries.items() for b in e.written())


# The manifest (the run's config, a record per file) and what else a
# checkpoint holds once: a few KiB.
MANIFEST_ALLOWANCE = 8 << 10


def _written_bytes(path: Path) -> int:
    """The bytes of a written checkpoint's files (its manifest's record;
    0 when it has none)."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        return sum(f["bytes"] for f in manifest["files"].values()) + (path / MANIFEST).stat().st_size
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return 0


def _recording_writer(path: Path):
    """DCP's file writer (one file per rank, fsynced) that keeps the first
    exception its own rank raised, whole. DCP hands each rank's failure to
    every rank pickled, which drops what it was raised from: torch.save's
    RuntimeError ("unexpected pos ...") loses the OSError under it that
    says ENOSPC."""
    from torch.distributed.checkpoint import FileSystemWriter

    class RecordingWriter(FileSystemWriter):
        failure: Optional[BaseException] = None

        def write_data(self, plan, planner):
            try:
                return super().write_data(plan, planner)
            except BaseException as e:
                self.failure = self.failure or e
                raise

        def finish(self, metadata, results):
            try:
                return super().finish(metadata, results)
            except BaseException as e:
                self.failure = self.failure or e
                raise

    return RecordingWriter(path, single_file_per_rank=True, sync_files=True)


def _on_rank0(mesh, action: Callable[[], None], fail: Callable[[str], CheckpointError], tmp: Path) -> None:
    """Run `action` on rank 0 and tell every rank how it went: a failure
    there raises `fail(reason)` everywhere (never a rank left waiting in a
    collective for a rank that gave up)."""
    outcome: list = [None]
    if mesh.rank == 0:
        try:
            action()
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            outcome = [str(e) if isinstance(e, CheckpointError) else root_cause(e)]
    outcome[0] = comm.broadcast_object(outcome[0])
    if outcome[0] is not None:
        raise fail(outcome[0])


def root_cause(error: BaseException) -> str:
    """One line on why a save failed: the OSError underneath, if any (DCP
    wraps each rank's failure in a CheckpointException), else the error."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno:
            import errno as errno_names

            name = errno_names.errorcode.get(e.errno, str(e.errno))
            where = f": {e.filename}" if e.filename else ""
            return f"{type(e).__name__} [{name}] {e.strerror}{where}"
        todo += [e.__cause__, e.__context__]
        for failure in (getattr(e, "failures", None) or {}).values():  # DCP's {rank: (exception, traceback)}
            todo.append(failure[0] if isinstance(failure, tuple) else failure)
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


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


# --------------------------------------------------------------------------
# Verify, find, compare
# --------------------------------------------------------------------------


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


# --------------------------------------------------------------------------
# Load
# --------------------------------------------------------------------------


def manifest_layout(manifest: dict) -> Layout:
    """The layout a checkpoint was written in (manifests before the
    `layout` block held its keys at the top level)."""
    return Layout.from_config(manifest.get("layout", manifest))


def load(path: Path, model, optimizer, par, manifest: dict, seed: int) -> tuple[int, float]:
    """Load checkpoint `path` into this rank's shards (collectively); return
    (step, first_loss). Generators come back exactly when the layout is the
    same; in another layout there is no "same" local generator, so they are
    re-seeded from (seed, step) — deterministic, but not the saved stream."""
    from torch.distributed.checkpoint import load as dcp_load

    started = time.perf_counter()
    _, LoadPlanner = _planners()
    mesh = par.mesh
    entries = state_entries(model, optimizer, par, 0, 0.0)
    saved = manifest_layout(manifest)
    # Generators are per rank: the same ones exist only in the same layout
    # (sequence parallelism and ZeRO change no generator).
    same_layout = saved.replace(seq_parallel=False, zero=0) == mesh.layout.replace(seq_parallel=False, zero=0)
    same_shared = saved.dp == mesh.layout.dp
    rng = {k: v for k, v in _rng_keys(mesh).items()}
    for key in list(rng):
        if not (same_layout or (key.startswith("rng.shared") and same_shared)):
            del entries[key]
    dcp_load(entries, storage_reader=_reader(Path(path)), planner=LoadPlanner(optional=lambda k: k.startswith("rng.")))
    step = int(entries["train.step"].tensor.item())
    if optimizer is not None:
        for name, p, *_ in par.dp.held(model):
            optimizer.state[p]["step"].fill_(entries[f"optim.{name}.step"].tensor.item())
    par.dp.after_load()
    from tpctl.seeding import derive_seed

    for key, gen in rng.items():
        if key in entries:
            _set_rng(gen, entries[key].tensor)
        elif not isinstance(gen, str):
            gen.manual_seed(derive_seed(seed, key.split(".")[1], mesh.rank, step))
        elif gen == "cpu":
            torch.manual_seed(derive_seed(seed, "torch", mesh.rank, step))
    log.info("checkpoint %s loaded in %.2fs", path, time.perf_counter() - started)
    return step, float(entries["train.first_loss"].tensor.item())


def read_full(path: Path, manifest: Optional[dict] = None, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """Every tensor under `prefix` as one whole tensor, in one process
    (no process group): {name without prefix: tensor}."""
    import warnings

    from torch.distributed.checkpoint import load as dcp_load

    _, LoadPlanner = _planners()
    reader = _reader(Path(path))
    metadata = reader.read_metadata()
    entries = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if fqn.startswith(prefix):
            entries[fqn] = whole(torch.zeros(tuple(md.size), dtype=md.properties.dtype), False)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore")
        dcp_load(entries, storage_reader=_reader(Path(path)), planner=LoadPlanner(optional=lambda k: False),
                 no_dist=True)
    return {fqn[len(prefix):]: e.tensor for fqn, e in entries.items()}


# --------------------------------------------------------------------------
# The training loop's side: when to save, the metrics file on resume
# --------------------------------------------------------------------------


@dataclass
class Checkpointer:
    root: Path
    every: int
    keep: int
    at_end: bool = True

    def due(self, done: int, total: int) -> bool:
        return (self.every > 0 and done % self.every == 0) or (self.at_end and done == total)
