"""What `tpctl prepare-data SRC...` reads: the sources its arguments name, in
a fixed order, cut into tasks, and the documents of each task.

Determinism: the sources are listed in a fixed order and cut into tasks
that do not depend on the number of workers. A document goes to val when
the hash of its text falls below ``val_fraction``: the split depends on the
document alone (not on its position or the worker count), and duplicated
documents land on the same side.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

from . import DataError
from .tokenizer import whole_lines

SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".parquet")
NEWLINE = b"\n"
_TASK_BYTES = 1 << 22  # raw text per task (4 MiB): small enough to balance, large enough to amortise
_ARROW_ROWS = 4096  # rows per task from a `datasets` directory


@dataclass(frozen=True)
class Source:
    path: str  # absolute
    kind: str  # txt | jsonl | jsonl.gz | parquet | datasets
    size: int  # bytes (all files of a datasets directory)
    mtime_ns: int  # the newest file's

    def record(self) -> dict:
        return {"path": self.path, "kind": self.kind, "size": self.size, "mtime_ns": self.mtime_ns}


def _kind(path: Path) -> Optional[str]:
    name = path.name.lower()
    for suffix in (".jsonl.gz", ".jsonl", ".txt", ".parquet"):
        if name.endswith(suffix):
            return suffix[1:]
    return None


def _is_datasets_dir(path: Path) -> bool:
    return (path / "dataset_info.json").is_file() and (path / "state.json").is_file() or \
        (path / "dataset_dict.json").is_file()


def _source(path: Path, kind: str) -> Source:
    if kind == "datasets":
        files = [p for p in path.rglob("*") if p.is_file()]
        size, mtime = sum(p.stat().st_size for p in files), max((p.stat().st_mtime_ns for p in files), default=0)
    else:
        st = path.stat()
        size, mtime = st.st_size, st.st_mtime_ns
    return Source(str(path.resolve()), kind, size, mtime)


def find_sources(args: Sequence[str]) -> list[Source]:
    """The sources named by files, directories (walked in sorted order; a
    saved `datasets` directory is one source) and globs, in argument order,
    each once."""
    found: list[Source] = []
    for arg in args:
        p = Path(arg).expanduser()
        if p.exists():
            matches = [p]
        else:
            matches = [Path(m) for m in sorted(glob.glob(os.path.expanduser(arg), recursive=True))]
            if not matches:
                raise DataError(f"{arg}: no such file, directory or glob match")
        for m in matches:
            if m.is_dir():
                found += _walk(m)
            elif _kind(m):
                found.append(_source(m, _kind(m)))
            elif m == p:  # named explicitly: say so; a glob's or a walk's other files are skipped
                raise DataError(f"{m}: not a supported source; expected {', '.join(SUFFIXES)} files, "
                                "directories of them, or a `datasets` save_to_disk directory")
    seen, unique = set(), []
    for s in found:
        if s.path not in seen:
            seen.add(s.path)
            unique.append(s)
    if not unique:
        raise DataError(f"no {', '.join(SUFFIXES)} files or `datasets` directories in {' '.join(args)}")
    return unique


def _walk(root: Path) -> list[Source]:
    if _is_datasets_dir(root):
        return [_source(root, "datasets")]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        keep = []
        for d in sorted(dirnames):
            if d.startswith("."):
                continue
            if _is_datasets_dir(here / d):
                out.append((str(here / d), _source(here / d, "datasets")))
            else:
                keep.append(d)
        dirnames[:] = keep
        for f in filenames:
            if not f.startswith(".") and _kind(here / f):
                out.append((str(here / f), _source(here / f, _kind(here / f))))
    return [s for _, s in sorted(out, key=lambda x: x[0])]


# Tasks: each source cut into pieces a worker tokenises. Cut the same way
# whatever the worker count.


@dataclass
class Task:
    source: int  # index into the source list
    kind: str  # lines | text | parquet | arrow
    path: str
    payload: object = None  # lines: bytes; text: (bytes, is_last, val); parquet: row group; arrow: (start, stop)
    first: int = 0  # the first line / row of the piece (1-based lines, 0-based rows)
    nbytes: int = 0  # share of the source's size, for the progress bar


def _utf8(data: bytes, errors: str, where: Callable[[int], str]) -> str:
    """`data` as text; undecodable (with errors=strict): a DataError naming
    where (`where` of the bad byte's offset) and the byte."""
    try:
        return data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as e:
        raise DataError(f"{where(e.start)}: not valid UTF-8 (byte 0x{data[e.start]:02x}); "
                        "pass errors=replace to substitute U+FFFD") from None


def decode_text(data: bytes, errors: str, where: str, first_line: int) -> str:
    """A block of a .txt source whose first line is `first_line`, as text."""
    return _utf8(data, errors, lambda at: f"{where} line {first_line + data.count(NEWLINE, 0, at)}")


def tasks(sources: list[Source], opts: dict) -> Iterator[Task]:
    for i, s in enumerate(sources):
        n = 0
        for task in _source_tasks(i, s, opts):
            n += 1
            yield task
        if n == 0:
            raise DataError(f"{s.path}: empty source (no documents)")


def _read_blocks(f, size: int) -> Iterator[bytes]:
    """Blocks of whole lines of the open file `f`, read `size` bytes at a time."""
    return whole_lines(iter(lambda: f.read(size), b""))


def _source_tasks(i: int, s: Source, opts: dict) -> Iterator[Task]:
    if s.kind in ("jsonl", "jsonl.gz"):
        line = 1
        opener = gzip.open if s.kind == "jsonl.gz" else open
        try:
            with opener(s.path, "rb") as f:
                raw = getattr(f, "fileobj", f)  # progress counts the bytes of the file, compressed or not
                done = 0
                for block in _read_blocks(f, _TASK_BYTES):
                    now = raw.tell()
                    if block.strip():
                        yield Task(i, "lines", s.path, block, line, now - done)
                    done = now
                    line += block.count(b"\n")
        except (OSError, EOFError, zlib.error) as e:
            raise DataError(f"{s.path}: cannot be read near line {line} ({e})") from None
    elif s.kind == "txt":
        data = Path(s.path).read_bytes()
        if not data:
            return
        # One file, one document: its split follows the whole file's hash.
        val = in_val(data, opts["val_fraction"])
        blocks = list(_read_blocks(_BytesReader(data), _TASK_BYTES))
        line = 1
        for k, block in enumerate(blocks):
            yield Task(i, "text", s.path, (block, k == len(blocks) - 1, val), line, len(block))
            line += block.count(b"\n")
    elif s.kind == "parquet":
        import pyarrow.parquet as pq

        try:
            meta = pq.ParquetFile(s.path).metadata
        except Exception as e:
            raise DataError(f"{s.path}: not a readable parquet file ({type(e).__name__}: {e})") from None
        row = 0
        for g in range(meta.num_row_groups):
            rows = meta.row_group(g).num_rows
            if rows:
                yield Task(i, "parquet", s.path, g, row, s.size * rows // max(meta.num_rows, 1))
            row += rows
    elif s.kind == "datasets":
        n = len(_load_datasets(s.path, opts["text_column"]))
        for a in range(0, n, _ARROW_ROWS):
            b = min(a + _ARROW_ROWS, n)
            yield Task(i, "arrow", s.path, (a, b), a, s.size * (b - a) // n)


class _BytesReader:
    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def read(self, n: int) -> bytes:
        out = self.data[self.pos:self.pos + n]
        self.pos += len(out)
        return out


_DATASETS: dict = {}


def _load_datasets(path: str, column: str):
    """A saved `datasets.Dataset` (memory-mapped), once per process."""
    if path not in _DATASETS:
        try:
            import datasets
        except ImportError:
            raise DataError(f"{path}: a `datasets` directory needs the datasets package: "
                            "pip install 'tpctl[data]'") from None
        try:
            ds = datasets.load_from_disk(path)
        except Exception as e:
            raise DataError(f"{path}: not a loadable `datasets` directory ({type(e).__name__}: {e})") from None
        if isinstance(ds, datasets.DatasetDict):
            raise DataError(f"{path}: a DatasetDict (splits: {', '.join(ds)}): pass one split's directory, "
                            f"e.g. {Path(path) / next(iter(ds))}")
        if column not in ds.column_names:
            raise DataError(f"{path}: no column {column!r} (columns: {', '.join(ds.column_names)}); "
                            "set text_column=NAME")
        _DATASETS[path] = ds
    return _DATASETS[path]


def in_val(text: bytes, val_fraction: float) -> bool:
    """Whether a document goes to val: by the hash of its text alone."""
    if val_fraction <= 0:
        return False
    h = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")
    return h < val_fraction * 2.0 ** 64


def documents(task: Task, opts: dict) -> list[str]:
    """The documents of a line/row task, as str; DataError names the line/row."""
    if task.kind == "lines":
        docs, field_name = [], opts["text_field"]
        for k, raw in enumerate(task.payload.split(b"\n")):
            if not raw.strip():
                continue
            where = f"{task.path} line {task.first + k}"
            line = _utf8(raw, opts["errors"], lambda at: where)
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise DataError(f"{where}: not valid JSON ({e})") from None
            if not isinstance(obj, dict) or field_name not in obj:
                keys = ", ".join(obj) if isinstance(obj, dict) else type(obj).__name__
                raise DataError(f"{where}: no {field_name!r} field (has: {keys}); set text_field=NAME")
            text = obj[field_name]
            if not isinstance(text, str):
                raise DataError(f"{where}: field {field_name!r} is {type(text).__name__}, expected a string")
            docs.append(text)
        return docs
    column = opts["text_column"]
    if task.kind == "parquet":
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(task.path)
            if column not in pf.schema_arrow.names:
                raise DataError(f"{task.path}: no column {column!r} (columns: {', '.join(pf.schema_arrow.names)}); "
                                "set text_column=NAME")
            values = pf.read_row_group(task.payload, columns=[column]).column(0).to_pylist()
        except DataError:
            raise
        except Exception as e:
            raise DataError(f"{task.path}: row group {task.payload} (rows from {task.first}) cannot be read "
                            f"({type(e).__name__}: {e})") from None
    else:
        a, b = task.payload
        values = _load_datasets(task.path, column)[a:b][column]
    docs = []
    for k, v in enumerate(values):
        if isinstance(v, bytes):
            v = _utf8(v, opts["errors"], lambda at: f"{task.path} row {task.first + k}")
        if not isinstance(v, str):
            raise DataError(f"{task.path} row {task.first + k}: column {column!r} is "
                            f"{'null' if v is None else type(v).__name__}, expected a string")
        docs.append(v)
    return docs
