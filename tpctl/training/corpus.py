"""Prepared corpora: many documents in, token shards + an index out
(`tpctl prepare-data`), and the reading side that training memory-maps.

The layout of a prepared directory::

    index.json           what was prepared from what (see ``prepare``)
    train-000000.bin     token ids, little-endian uint16 or uint32 (by the
    train-000001.bin     vocabulary), documents joined by the EOS id, cut
    val-000000.bin       into shards of ``shard_tokens`` ids

Determinism: the sources are listed in a fixed order, cut into tasks that do
not depend on the number of workers, and the workers' results are written in
task order, so 1 and N workers write the same bytes. A document goes to val
when the hash of its text falls below ``val_fraction``: the split depends on
the document alone (not on its position or the worker count), and duplicated
documents land on the same side.

Nothing here imports torch: a prepare run forks its workers from a light
process.
"""

from __future__ import annotations

import fcntl
import glob
import gzip
import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import time
import zlib
from bisect import bisect_right
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np

from tpctl.errors import EXIT_USAGE, TpctlError, die_with_parent, signals_held, stop_signals

FORMAT = "tpctl-corpus"
# Part of the no-op key: bump it when the bytes written for the same input change.
VERSION = 1
INDEX = "index.json"
SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".parquet")
BYTES_EOS = 0  # the byte tokenizer's document separator: NUL, which text does not hold
_TASK_BYTES = 1 << 22  # raw text per task (4 MiB): small enough to balance, large enough to amortise
_ARROW_ROWS = 4096  # rows per task from a `datasets` directory


class DataError(TpctlError, ValueError):
    """Bad input (a file, a line, a row): one line for the user, exit 2."""

    exit_code = EXIT_USAGE


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest little-endian unsigned dtype that holds every id below
    ``vocab_size``: uint16 up to 65,536 ids, uint32 above."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


# --------------------------------------------------------------------------
# Tokenizers: bytes, or a local Hugging Face tokenizer directory.


@dataclass(frozen=True)
class TokenizerInfo:
    name: str  # "bytes" or the directory
    vocab_size: int
    eos_id: int
    hash: str  # of the tokenizer's files (or "bytes-v1"): part of the no-op key


# The files a Hugging Face tokenizer is read from (one of them at least).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def hf_tokenizer(directory: str):
    """The Hugging Face tokenizer saved in `directory` (nothing is
    downloaded); DataError with one line saying why it cannot be loaded."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as e:  # the library's many failure types: one line
        if not any((Path(directory) / name).is_file() for name in TOKENIZER_FILES):
            # transformers then says "...from one of: " and lists nothing
            raise DataError(f"the directory holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}; "
                            "a tokenizer's save_pretrained writes them)") from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise DataError(f"cannot be loaded ({type(e).__name__}: {first})") from None


def tokenizer_hash(directory: str) -> str:
    """sha256 over the names and contents of the files of a tokenizer directory."""
    h = hashlib.sha256()
    for p in sorted(Path(directory).iterdir()):
        if p.is_file():
            h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def load_tokenizer(spec: str):
    """(the tokenizer object or None for bytes, its TokenizerInfo)."""
    if spec == "bytes":
        return None, TokenizerInfo("bytes", 256, BYTES_EOS, "bytes-v1")
    if not Path(spec).is_dir():
        raise DataError(f"tokenizer={spec}: expected `bytes` or a local Hugging Face tokenizer directory (save_pretrained)")
    try:
        tok = hf_tokenizer(spec)
    except DataError as e:
        raise DataError(f"tokenizer={spec}: {e}") from None
    if tok.eos_token_id is None:
        raise DataError(f"tokenizer={spec}: has no eos_token, which prepare-data puts between documents "
                        "(set tokenizer.eos_token and save_pretrained again)")
    return tok, TokenizerInfo(str(spec), len(tok), int(tok.eos_token_id), tokenizer_hash(spec))


# The worker's tokenizer: set in the parent before the pool forks (or by the
# pool initializer under spawn), so it is loaded once, not once per task.
_TOKENIZER = None
_DTYPE = np.dtype("<u2")


def _init_worker(spec: Optional[str], dtype: str) -> None:
    global _TOKENIZER, _DTYPE
    # Ctrl-C (or SIGTERM to the process group) reaches every process; only
    # the parent acts on it: it drops the tasks not started and lets the
    # running ones finish. A worker ended by the signal mid-task could
    # hold a queue's lock and hang the parent. If the parent dies, so do they.
    for sig in stop_signals():
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, stop_signals())  # held while the parent started this process
    die_with_parent(signal.SIGKILL)
    # One core per worker: workers=N means N cores, and the Rust tokenizer's
    # own thread pool would otherwise oversubscribe them.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if spec is not None and _TOKENIZER is None:
        _TOKENIZER = load_tokenizer(spec)[0]
    _DTYPE = np.dtype(dtype)


def _encode_many(texts: list[str]) -> list[np.ndarray]:
    if _TOKENIZER is None:
        return [np.frombuffer(t.encode("utf-8"), np.uint8).astype(_DTYPE) for t in texts]
    backend = getattr(_TOKENIZER, "backend_tokenizer", None)
    if backend is not None:  # a fast tokenizer: the same ids, without the BatchEncoding
        return [np.asarray(e.ids, dtype=_DTYPE) for e in backend.encode_batch(texts, add_special_tokens=False)]
    return [np.asarray(ids, dtype=_DTYPE) for ids in _TOKENIZER(texts, add_special_tokens=False)["input_ids"]]


# --------------------------------------------------------------------------
# Sources: what the SRC arguments name, in a fixed order.


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


# --------------------------------------------------------------------------
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


@dataclass
class Result:
    source: int
    train: np.ndarray
    val: np.ndarray
    docs: list = field(default_factory=lambda: [0, 0, 0])  # train, val, empty
    nbytes: int = 0


def _line_of(data: bytes, pos: int, first: int) -> int:
    return first + data.count(b"\n", 0, pos)


def _decode(data: bytes, errors: str, where: str, first_line: int) -> str:
    try:
        return data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as e:
        line = _line_of(data, e.start, first_line)
        raise DataError(f"{where} line {line}: not valid UTF-8 (byte 0x{data[e.start]:02x}); "
                        "pass errors=replace to substitute U+FFFD") from None


def _tasks(sources: list[Source], opts: dict) -> Iterator[Task]:
    for i, s in enumerate(sources):
        n = 0
        for task in _source_tasks(i, s, opts):
            n += 1
            yield task
        if n == 0:
            raise DataError(f"{s.path}: empty source (no documents)")


def whole_lines(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """Re-cut chunks at line ends, so a subword tokenizer never sees a word
    (or a UTF-8 character) cut in two; the last piece may lack its newline."""
    rest = b""
    for chunk in chunks:
        data = rest + chunk
        cut = data.rfind(b"\n") + 1
        if cut == 0:
            rest = data
            continue
        rest = data[cut:]
        yield data[:cut]
    if rest:
        yield rest


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
        val = _in_val(data, opts["val_fraction"])
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


# --------------------------------------------------------------------------
# The worker: one task in, its documents' tokens out.


def _in_val(text: bytes, val_fraction: float) -> bool:
    if val_fraction <= 0:
        return False
    h = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")
    return h < val_fraction * 2.0 ** 64


def _documents(task: Task, opts: dict) -> list[str]:
    """The documents of a line/row task, as str; DataError names the line/row."""
    if task.kind == "lines":
        docs, field_name = [], opts["text_field"]
        for k, raw in enumerate(task.payload.split(b"\n")):
            if not raw.strip():
                continue
            where = f"{task.path} line {task.first + k}"
            try:
                line = raw.decode("utf-8", errors=opts["errors"])
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not valid UTF-8 (byte 0x{raw[e.start]:02x}); "
                                "pass errors=replace to substitute U+FFFD") from None
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
            try:
                v = v.decode("utf-8", errors=opts["errors"])
            except UnicodeDecodeError as e:
                raise DataError(f"{task.path} row {task.first + k}: not valid UTF-8 (byte 0x{v[e.start]:02x}); "
                                "pass errors=replace to substitute U+FFFD") from None
        if not isinstance(v, str):
            raise DataError(f"{task.path} row {task.first + k}: column {column!r} is "
                            f"{'null' if v is None else type(v).__name__}, expected a string")
        docs.append(v)
    return docs


def _encode_checked(texts: list[str], task: Task) -> list[np.ndarray]:
    try:
        return _encode_many(texts)
    except Exception as e:  # e.g. a lone surrogate from a JSON escape: not encodable text
        what = f"line {task.first}" if task.kind in ("lines", "text") else f"row {task.first}"
        raise DataError(f"{task.path}: the documents from {what} on cannot be tokenised "
                        f"({type(e).__name__}: {e})") from None


def tokenize_task(task: Task, opts: dict, eos: int) -> Result:
    empty = np.zeros(0, _DTYPE)
    if task.kind == "text":
        block, last, val = task.payload
        text = _decode(block, opts["errors"], task.path, task.first)
        ids = _encode_checked([text], task)[0]
        if last:
            ids = np.append(ids, np.asarray(eos, _DTYPE))
        docs = [0, int(last), 0] if val else [int(last), 0, 0]
        return Result(task.source, empty if val else ids, ids if val else empty, docs, task.nbytes)
    texts = _documents(task, opts)
    kept = [t for t in texts if t]
    ids = _encode_checked(kept, task)
    eos_arr = np.asarray([eos], _DTYPE)
    train, val = [], []
    for t, a in zip(kept, ids):
        side = val if _in_val(t.encode("utf-8", errors="surrogatepass"), opts["val_fraction"]) else train
        side += [a, eos_arr]
    join = lambda parts: np.concatenate(parts) if parts else empty  # noqa: E731
    return Result(task.source, join(train), join(val), [len(train) // 2, len(val) // 2, len(texts) - len(kept)], task.nbytes)


def _work(args) -> Result:
    return tokenize_task(*args)


def _in_order(pool: ProcessPoolExecutor, fn, items: Iterator, ahead: int) -> Iterator:
    """fn(item) for each item, computed by `pool`, yielded in the items'
    order, with at most `ahead` submitted and not yet yielded (the tasks
    hold the text: never the whole corpus in memory)."""
    pending: deque = deque()
    for item in items:
        # A submit may start the worker processes: a signal to the group
        # then must wait until they ignore it (_init_worker), and reach
        # the parent after the fork, not in its at-fork hooks (which swallow it).
        with signals_held():
            pending.append(pool.submit(fn, item))
        if len(pending) >= ahead:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


# --------------------------------------------------------------------------
# The writer: results in task order -> shards of shard_tokens ids.


class ShardWriter:
    def __init__(self, directory: Path, split: str, shard_tokens: int, dtype: np.dtype):
        self.directory, self.split, self.shard_tokens, self.dtype = directory, split, shard_tokens, dtype
        self.shards: list[dict] = []
        self.file = None
        self.in_shard = 0
        self.max_id = -1

    def write(self, ids: np.ndarray) -> None:
        if ids.size:
            self.max_id = max(self.max_id, int(ids.max()))
        while ids.size:
            if self.file is None:
                name = f"{self.split}-{len(self.shards):06d}.bin"
                self.file = open(self.directory / name, "wb")
                self.shards.append({"file": name, "tokens": 0})
            take = min(ids.size, self.shard_tokens - self.in_shard)
            self.file.write(ids[:take].astype(self.dtype, copy=False).tobytes())
            self.in_shard += take
            self.shards[-1]["tokens"] += take
            ids = ids[take:]
            if self.in_shard == self.shard_tokens:
                self._close()

    def _close(self) -> None:
        if self.file is not None:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            self.file, self.in_shard = None, 0

    def close(self) -> list[dict]:
        self._close()
        return self.shards


# --------------------------------------------------------------------------
# prepare: the whole run.


@dataclass
class Prepared:
    out: Path
    index: dict
    up_to_date: bool  # nothing was done: the index already described these sources
    seconds: float = 0.0


def _key(sources: list[Source], tok: TokenizerInfo, opts: dict) -> str:
    blob = json.dumps({"version": VERSION, "tokenizer": tok.hash, "options": opts,
                       "sources": [s.record() for s in sources]}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def read_index(directory: str | Path) -> dict:
    path = Path(directory) / INDEX
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{directory}: no readable {INDEX} ({e}); prepare it with "
                        f"`tpctl prepare-data SRC... out={directory} tokenizer=...`") from None
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise DataError(f"{path}: not a tpctl-corpus version {VERSION} index: prepare it again")
    return index


def prepare(srcs: Sequence[str], out: str | Path, tokenizer: str, workers: int = 1,
            text_field: str = "text", text_column: str = "text", val_fraction: float = 0.1,
            shard_tokens: int = 100_000_000, errors: str = "strict", progress: bool = False) -> Prepared:
    """Tokenise the sources into ``out``; see the module docstring. Raises
    DataError for bad input, naming the file and line/row."""
    t0 = time.perf_counter()
    out = Path(out).expanduser()
    if errors not in ("strict", "replace"):
        raise DataError(f"errors={errors}: expected strict or replace")
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction={val_fraction}: expected a value in [0, 1)")
    if out.exists() and not (out / INDEX).is_file() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"out={out}: exists and is not a prepared corpus; choose another directory")
    sources = find_sources(srcs)
    if any(s.kind == "parquet" for s in sources):
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise DataError("parquet sources need the pyarrow package: pip install 'tpctl[data]'") from None
    tok, info = load_tokenizer(tokenizer)
    opts = {"text_field": text_field, "text_column": text_column, "val_fraction": val_fraction,
            "shard_tokens": shard_tokens, "errors": errors}
    key = _key(sources, info, opts)
    remove_stale_tmp(out)
    try:
        index = read_index(out)
        if index.get("key") == key:
            check_shards(out, index)  # a shard removed or cut short: prepare again
            return Prepared(out, index, True, time.perf_counter() - t0)
    except DataError:
        pass
    dtype = token_dtype(info.vocab_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = owner = None
    try:
        with signals_held():  # an interruption comes once `tmp` is known, inside the try that removes it
            tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
            owner = _own(tmp)
        index = _run(sources, tok, info, opts, dtype, tmp, workers, progress)
        index["key"] = key
        (tmp / INDEX).write_text(json.dumps(index, indent=1) + "\n")
        (tmp / _TMP_LOCK).unlink()
        respect_umask(tmp)  # mkdtemp made it 0700: others (other nodes' users) must read the corpus
        _replace_dir(tmp, out)
    except BaseException:  # an error, Ctrl-C, SIGTERM (commands/prepare_data.py makes it an exception)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if owner is not None:
            os.close(owner)
    return Prepared(out, index, False, time.perf_counter() - t0)


# Inside a temporary output dir: locked (flock) by the run writing it, so a
# later run can tell the dir of a live run from one a killed run left.
_TMP_LOCK = ".writing"


def _own(tmp: Path) -> int:
    """Lock `tmp` as this process's; the kernel drops the lock when the
    process dies, however it dies."""
    fd = os.open(tmp / _TMP_LOCK, os.O_WRONLY | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


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


def remove_stale_tmp(out: Path, grace_s: float = 60.0) -> list[Path]:
    """Remove the `.<out>.<random>.tmp` dirs that runs killed mid-write
    (SIGKILL, a power cut) left beside `out`: those whose lock no live
    process holds, and those without a lock older than `grace_s` (a run
    that has just made its dir and not yet locked it is left alone)."""
    removed = []
    for tmp in out.parent.glob(f".{glob.escape(out.name)}.*.tmp"):
        lock = tmp / _TMP_LOCK
        try:
            if lock.exists():
                fd = os.open(lock, os.O_RDONLY)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a live run writes it
                finally:
                    os.close(fd)
            elif time.time() - tmp.stat().st_mtime < grace_s:
                continue
        except OSError:
            continue
        shutil.rmtree(tmp, ignore_errors=True)
        removed.append(tmp)
    return removed


def _replace_dir(new: Path, dest: Path) -> None:
    """Put ``new`` at ``dest``: a rename, so a reader sees the old or the new
    corpus whole (an old one is moved aside first, then removed)."""
    old = None
    if dest.exists():
        if not (dest / INDEX).is_file() and any(dest.iterdir()):
            raise DataError(f"out={dest}: exists and is not a prepared corpus; choose another directory")
        old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
        os.rename(dest, old)
    os.rename(new, dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _run(sources, tok, info: TokenizerInfo, opts: dict, dtype: np.dtype, tmp: Path,
         workers: int, progress: bool) -> dict:
    global _TOKENIZER
    writers = {split: ShardWriter(tmp, split, opts["shard_tokens"], dtype) for split in ("train", "val")}
    per_source = [{"documents": 0, "tokens": 0} for _ in sources]
    docs = {"train": 0, "val": 0, "empty": 0}
    total_bytes = sum(s.size for s in sources)
    fork = "fork" in multiprocessing.get_all_start_methods()
    spec = None if tok is None else info.name
    if fork:
        _TOKENIZER = tok  # inherited by the forked workers: loaded once
    ctx = multiprocessing.get_context("fork" if fork else "spawn")
    args = ((t, opts, info.eos_id) for t in _tasks(sources, opts))
    n_tokens = 0
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=(spec, dtype.str))
    with _Progress(total_bytes, progress) as bar:
        try:
            # In task order: the output does not depend on `workers`.
            for r in _in_order(pool, _work, args, 2 * workers):
                writers["train"].write(r.train)
                writers["val"].write(r.val)
                n = r.train.size + r.val.size
                n_tokens += n
                per_source[r.source]["documents"] += r.docs[0] + r.docs[1]
                per_source[r.source]["tokens"] += n
                for k, split in enumerate(("train", "val", "empty")):
                    docs[split] += r.docs[k]
                bar.advance(r.nbytes, n_tokens)
        finally:
            _TOKENIZER = None
            # On an error or an interruption: the tasks not started are
            # dropped, the ones running finish (a few seconds at most).
            pool.shutdown(wait=True, cancel_futures=True)
    for s, counts in zip(sources, per_source):
        if counts["documents"] == 0:
            raise DataError(f"{s.path}: empty source (no non-empty documents)")
    max_id = max(w.max_id for w in writers.values())
    if max_id >= info.vocab_size:  # a tokenizer whose ids exceed its own size: the model could not embed them
        raise DataError(f"tokenizer={info.name}: produced id {max_id}, but has {info.vocab_size} ids")
    shards = {split: w.close() for split, w in writers.items()}
    tokens = {split: sum(s["tokens"] for s in shards[split]) for split in shards}
    return {
        "format": FORMAT, "version": VERSION,
        "dtype": dtype.name, "vocab_size": info.vocab_size, "eos_id": info.eos_id,
        "max_id": max_id,
        "tokenizer": {"name": info.name, "hash": info.hash},
        "options": opts,
        "documents": docs, "tokens": tokens,
        "sources": [{**s.record(), **c} for s, c in zip(sources, per_source)],
        "shards": shards,
    }


class _Progress:
    """A rich bar (bytes read, tokens, tokens/s) on a terminal; nothing otherwise."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled and sys.stderr.isatty()
        self.start = time.perf_counter()

    def __enter__(self):
        if self.enabled:
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("tokenising"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                                TextColumn("{task.fields[tokens]:,} tokens, {task.fields[rate]:,.0f} tokens/s"),
                                TimeRemainingColumn(), transient=True)
            self.bar.__enter__()
            self.task = self.bar.add_task("tokenising", total=max(self.total, 1), tokens=0, rate=0.0)
        return self

    def advance(self, nbytes: int, tokens: int) -> None:
        if self.enabled:
            rate = tokens / max(time.perf_counter() - self.start, 1e-9)
            self.bar.update(self.task, advance=nbytes, tokens=tokens, rate=rate)

    def __exit__(self, *exc):
        if self.enabled:
            self.bar.__exit__(*exc)
        return False


# --------------------------------------------------------------------------
# Reading: the shards of a prepared directory as one stream.


class ShardedTokens:
    """Shards memory-mapped end to end as one read-only sequence; a slice
    that crosses a shard boundary is joined (a window's worth), nothing else
    is read into memory."""

    def __init__(self, paths: Sequence[str | Path], dtype):
        self.paths = [Path(p) for p in paths if Path(p).stat().st_size]
        self.parts = [np.memmap(p, dtype=dtype, mode="r") for p in self.paths]
        self.starts = np.cumsum([0] + [len(p) for p in self.parts]).tolist()
        self.dtype = np.dtype(dtype)

    def where(self, i: int) -> str:
        """Where token `i` of the stream lies: `token <k> of <shard>`."""
        k = bisect_right(self.starts, i) - 1
        return f"token {i - self.starts[k]} of {self.paths[k]}"

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, key):
        if not isinstance(key, slice):
            i = int(key) + (len(self) if int(key) < 0 else 0)
            if not 0 <= i < len(self):
                raise IndexError(key)
            k = bisect_right(self.starts, i) - 1
            return self.parts[k][i - self.starts[k]]
        start, stop, step = key.indices(len(self))
        if step != 1:
            raise ValueError("ShardedTokens slices must be contiguous")
        pieces = []
        k = bisect_right(self.starts, start) - 1
        while start < stop:
            part = self.parts[k]
            a = start - self.starts[k]
            b = min(stop - self.starts[k], len(part))
            pieces.append(part[a:b])
            start += b - a
            k += 1
        if not pieces:
            return np.zeros(0, self.dtype)
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


def shard_paths(directory: str | Path, index: dict, split: str) -> list[Path]:
    return [Path(directory) / s["file"] for s in index["shards"][split]]


_SCAN_CHUNK = 1 << 24  # ids per vectorised pass of a scan


def first_outside(tokens: np.ndarray, vocab_size: int) -> Optional[int]:
    """The position of the first id of `tokens` (a memory map, read in
    chunks) outside [0, vocab_size), or None: one vectorised pass, about
    0.15 s per 100M uint16 tokens in the page cache."""
    for start in range(0, len(tokens), _SCAN_CHUNK):
        chunk = tokens[start:start + _SCAN_CHUNK]
        if chunk.size and (int(chunk.max()) >= vocab_size or int(chunk.min()) < 0):
            return start + int(np.argmax((chunk >= vocab_size) | (chunk < 0)))
    return None


def check_ids(directory: str | Path, index: dict) -> None:
    """Every id of every shard inside the vocabulary the corpus was prepared
    with: the index's max_id says what prepare-data wrote, the shards what
    is there now (one edited or damaged since would otherwise reach the
    model: the 1d embedding gives an id past its vocabulary a zero vector)."""
    vocab = int(index["vocab_size"])
    dtype = np.dtype(index["dtype"]).newbyteorder("<")
    for split in ("train", "val"):
        for path in shard_paths(directory, index, split):
            if not path.stat().st_size:
                continue
            tokens = np.memmap(path, dtype=dtype, mode="r")
            at = first_outside(tokens, vocab)
            if at is not None:
                raise DataError(f"{path}: token id {int(tokens[at])} at token {at} is outside the vocabulary of "
                                f"{vocab} ids it was prepared with (tokenizer {index['tokenizer']['name']}, max_id "
                                f"{index['max_id']} when written): the shard changed since; prepare the corpus again")


def check_shards(directory: str | Path, index: dict) -> None:
    """Every shard present with the size the index gives it (a cheap stat)."""
    itemsize = np.dtype(index["dtype"]).itemsize
    for split in ("train", "val"):
        for s in index["shards"][split]:
            p = Path(directory) / s["file"]
            want = s["tokens"] * itemsize
            have = p.stat().st_size if p.is_file() else None
            if have != want:
                raise DataError(f"{p}: {'missing' if have is None else f'{have} bytes'}, the index says "
                                f"{want}: prepare the corpus again")
