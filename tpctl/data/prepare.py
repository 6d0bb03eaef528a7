"""The engine of `tpctl prepare-data`: many documents in (`sources`), token
shards and an index out (`shards` reads them), tokenised by a pool of
worker processes.

Determinism: the workers' results are written in task order, so 1 and N
workers write the same bytes. Nothing here imports torch: a prepare run
forks its workers from a light process.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np

from tpctl.atomic import respect_umask, swap_dir
from tpctl.errors import die_with_parent, signals_held, stop_signals

from . import DataError
from .shards import FORMAT, INDEX, SPLITS, VERSION, check_shards, read_index
from .sources import Source, Task, decode_text, documents, find_sources, in_val, tasks
from .tokenizer import Tokenizer, load_tokenizer

# The worker's tokenizer: set in the parent before the pool forks (or by the
# pool initializer under spawn), so it is loaded once, not once per task.
_TOKENIZER: Optional[Tokenizer] = None


def _init_worker(spec: str) -> None:
    global _TOKENIZER
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
    if _TOKENIZER is None:
        _TOKENIZER = load_tokenizer(spec)


@dataclass
class Result:
    source: int
    train: np.ndarray
    val: np.ndarray
    docs: list = field(default_factory=lambda: [0, 0, 0])  # train, val, empty
    nbytes: int = 0


def _encode_checked(texts: list[str], task: Task) -> list[np.ndarray]:
    try:
        return _TOKENIZER.encode_batch(texts)
    except Exception as e:  # e.g. a lone surrogate from a JSON escape: not encodable text
        what = f"line {task.first}" if task.kind in ("lines", "text") else f"row {task.first}"
        raise DataError(f"{task.path}: the documents from {what} on cannot be tokenised "
                        f"({type(e).__name__}: {e})") from None


def tokenize_task(task: Task, opts: dict, eos: int) -> Result:
    """A task's documents as ids, each followed by `eos`, on the side
    (train or val) each document's hash puts it."""
    dtype = _TOKENIZER.dtype
    empty = np.zeros(0, dtype)
    if task.kind == "text":
        block, last, val = task.payload
        text = decode_text(block, opts["errors"], task.path, task.first)
        ids = _encode_checked([text], task)[0]
        if last:
            ids = np.append(ids, np.asarray(eos, dtype))
        docs = [0, int(last), 0] if val else [int(last), 0, 0]
        return Result(task.source, empty if val else ids, ids if val else empty, docs, task.nbytes)
    texts = documents(task, opts)
    kept = [t for t in texts if t]
    ids = _encode_checked(kept, task)
    eos_arr = np.asarray([eos], dtype)
    train, val = [], []
    for t, a in zip(kept, ids):
        side = val if in_val(t.encode("utf-8", errors="surrogatepass"), opts["val_fraction"]) else train
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


def _key(sources: list[Source], tok: Tokenizer, opts: dict) -> str:
    """What the corpus is made from: the same key, the same bytes (a rerun is a no-op)."""
    blob = json.dumps({"version": VERSION, "tokenizer": tok.hash, "options": opts,
                       "sources": [s.record() for s in sources]}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def prepare(srcs: Sequence[str], out: str | Path, tokenizer: str, workers: int = 1,
            text_field: str = "text", text_column: str = "text", val_fraction: float = 0.1,
            shard_tokens: int = 100_000_000, errors: str = "strict", progress: bool = False) -> Prepared:
    """Tokenise the sources into ``out`` (its layout: shards.py). Raises
    DataError for bad input, naming the file and line/row."""
    t0 = time.perf_counter()
    out = Path(out).expanduser()
    if errors not in ("strict", "replace"):
        raise DataError(f"errors={errors}: expected strict or replace")
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction={val_fraction}: expected a value in [0, 1)")
    _refuse_foreign(out)
    sources = find_sources(srcs)
    if any(s.kind == "parquet" for s in sources):
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise DataError("parquet sources need the pyarrow package: pip install 'tpctl[data]'") from None
    tok = load_tokenizer(tokenizer)
    opts = {"text_field": text_field, "text_column": text_column, "val_fraction": val_fraction,
            "shard_tokens": shard_tokens, "errors": errors}
    key = _key(sources, tok, opts)
    remove_stale_tmp(out)
    try:
        index = read_index(out)
        if index.get("key") == key:
            check_shards(out, index)  # a shard removed or cut short: prepare again
            return Prepared(out, index, True, time.perf_counter() - t0)
    except DataError:
        pass
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = owner = None
    try:
        with signals_held():  # an interruption comes once `tmp` is known, inside the try that removes it
            tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
            owner = _own(tmp)
        index = _run(sources, tok, opts, tmp, workers, progress)
        index["key"] = key
        (tmp / INDEX).write_text(json.dumps(index, indent=1) + "\n")
        (tmp / _TMP_LOCK).unlink()
        respect_umask(tmp)  # mkdtemp made it 0700: others (other nodes' users) must read the corpus
        _place(tmp, out)
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


def _refuse_foreign(out: Path) -> None:
    """A DataError unless `out` is new, empty or a prepared corpus: the swap
    that puts the corpus there removes what was there."""
    if out.exists() and not (out / INDEX).is_file() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"out={out}: exists and is not a prepared corpus; choose another directory")


def _place(new: Path, dest: Path) -> None:
    """Swap the finished corpus `new` in at `dest`, so a reader sees the old
    or the new corpus whole. Checked again just before: something may have
    appeared at `dest` while the corpus was written."""
    _refuse_foreign(dest)
    swap_dir(new, dest)


def _run(sources: list[Source], tok: Tokenizer, opts: dict, tmp: Path, workers: int, progress: bool) -> dict:
    """Tokenise every task in `workers` processes and write the shards into
    `tmp`; the index, less its key."""
    global _TOKENIZER
    dtype = tok.dtype
    writers = {split: ShardWriter(tmp, split, opts["shard_tokens"], dtype) for split in SPLITS}
    per_source = [{"documents": 0, "tokens": 0} for _ in sources]
    docs = {"train": 0, "val": 0, "empty": 0}
    total_bytes = sum(s.size for s in sources)
    fork = "fork" in multiprocessing.get_all_start_methods()
    if fork:
        _TOKENIZER = tok  # inherited by the forked workers: loaded once
    ctx = multiprocessing.get_context("fork" if fork else "spawn")
    args = ((t, opts, int(tok.separator)) for t in tasks(sources, opts))
    n_tokens = 0
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=(tok.name,))
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
    if max_id >= tok.vocab_size:  # a tokenizer whose ids exceed its own size: the model could not embed them
        raise DataError(f"tokenizer={tok.name}: produced id {max_id}, but has {tok.vocab_size} ids")
    shards = {split: w.close() for split, w in writers.items()}
    tokens = {split: sum(s["tokens"] for s in shards[split]) for split in shards}
    return {
        "format": FORMAT, "version": VERSION,
        "dtype": dtype.name, "vocab_size": tok.vocab_size, "eos_id": int(tok.separator),
        "max_id": max_id,
        "tokenizer": {"name": tok.name, "hash": tok.hash},
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

