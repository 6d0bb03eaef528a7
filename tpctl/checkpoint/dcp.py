"""Saving and loading a run's state through torch.distributed.checkpoint
(DCP), collectively, between any two layouts: each box of an entry
(checkpoint/state.py) is one DCP chunk when saved; loading, each local box
asks DCP for its region, and DCP's overlap search reads it from whichever
saved chunks cover it. A failure on any rank is the same one-line
CheckpointError on every rank, naming its root cause.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from tpctl.parallel import comm

from .manifest import CheckpointError, _SafeUnpickler, file_record, manifest_layout, manifest_of
from .state import _rng_keys, _set_rng, state_entries, whole
from .store import commit, prepare, rotate

log = logging.getLogger("tpctl.checkpoint")


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


def _reader(path: Path):
    """DCP's file reader, reading the metadata through the allow-list
    unpickler (DCP's own would unpickle anything)."""
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

def save(root: Path, step: int, model, optimizer, par, cfg, first_loss: float = float("nan"),
         keep: int = 0) -> Path:
    """Write checkpoint `root/step_<step>` collectively (every rank calls
    this); returns its path. Keeps the newest `keep` valid ones (0: all).

    A save that fails on any rank (a full disk, no permission) raises the
    same CheckpointError on every rank, naming the root cause, after its
    temp dir is removed: the checkpoints written before are untouched."""
    root = Path(root)
    final, tmp = root / f"step_{step}", root / f".tmp_step_{step}"
    started = time.perf_counter()
    mesh = par.mesh
    entries = state_entries(model, optimizer, par, step, first_loss)
    sizes = comm.all_gather_object(bytes_to_write(entries))

    def fail(why: str) -> CheckpointError:
        return CheckpointError(f"checkpoint step {step} not written to {root}: {why}; "
                               "the checkpoints written before are kept")

    _on_rank0(mesh, lambda: prepare(root, tmp, sum(sizes) + MANIFEST_ALLOWANCE), fail, tmp)
    gathered = comm.all_gather_object(_write_shards(entries, tmp, mesh.rank))
    errors = [e for e, _ in gathered if e]
    if errors:
        if mesh.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        comm.barrier()
        raise fail(errors[0])

    def finish() -> None:
        files = {name: info for _, part in gathered for name, info in part.items()}
        files[".metadata"] = file_record(tmp / ".metadata")
        commit(tmp, final, manifest_of(step, mesh.layout, cfg, files))

    _on_rank0(mesh, finish, fail, tmp)
    if mesh.rank == 0:
        rotate(root, keep)
    comm.barrier()
    log.info("checkpoint %s written in %.2fs", final, time.perf_counter() - started)
    return final


def _write_shards(entries: dict, tmp: Path, rank: int) -> tuple[Optional[str], dict]:
    """Write this rank's boxes into `tmp` (collectively): (None, {file:
    record} of the files this rank wrote), or (the root cause, {})."""
    from torch.distributed.checkpoint import save as dcp_save

    SavePlanner, _ = _planners()
    error, files = None, {}
    writer = _recording_writer(tmp)
    try:
        dcp_save(entries, storage_writer=writer, planner=SavePlanner())
        # Each rank hashes the files it wrote (DCP names them __<rank>_<n>.distcp).
        files = {p.name: file_record(p) for p in sorted(tmp.glob(f"__{rank}_*"))}
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        error = root_cause(writer.failure or e)
    return error, files


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
            return self._recorded(super().write_data, plan, planner)

        def finish(self, metadata, results):
            return self._recorded(super().finish, metadata, results)

        def _recorded(self, call, *args):
            try:
                return call(*args)
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

