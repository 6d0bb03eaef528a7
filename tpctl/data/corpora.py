"""The token stream of a run's ``cfg.data``: found or built, then checked
against the config (``prepare_data``).

Token sources (``cfg.data``):

* ``name=text``, ``path=None``: the default corpus, the Python standard
  library's own ``*.py`` sources -- text every machine has, so nothing is
  downloaded. Tokenised once into ``<cache_dir>/stdlib-<hash>.bin``.
* ``name=text``, ``path=foo.txt``: a UTF-8 text file, tokenised and cached
  the same way (``<cache_dir>/foo-<hash>.bin``).
* ``name=text``, ``path=foo.bin``: pre-tokenised ids (nanoGPT layout: flat
  little-endian uint16), memory-mapped in place, never copied.
* ``name=text``, ``path=DIR``: a corpus written by ``tpctl prepare-data``
  (tpctl/data/prepare.py): its train and val shards (uint16 or uint32),
  memory-mapped end to end as one stream; the split is the prepared one.
* ``name=synthetic``: ``data.synthetic_tokens`` seeded random ids in
  ``[0, data.vocab_size)``, generated in memory (cheap, identical on every rank).

With ``data.tokenizer``, the token files are uint16 up to 65,536 ids and
uint32 above (``tokenizer.token_dtype``).

``prepare_data`` runs in the launcher before workers start (it builds caches
and finds config errors) and again in every worker, where it is a cache hit.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import sysconfig
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np

from tpctl.atomic import write_file
from tpctl.errors import ConfigError

from . import DataError
from .shards import INDEX, check_shards, read_index
from .token_ids import check_ids_once, check_vocab, model_vocab
from .tokenizer import Tokenizer, files_stamp, identity_hash, whole_lines

log = logging.getLogger(__name__)

BIN_DTYPE = np.dtype("<u2")  # nanoGPT .bin layout and byte-level ids: little-endian uint16
_CHUNK = 1 << 24  # bytes / tokens per streamed chunk (16 Mi)


@dataclass(frozen=True)
class DataInfo:
    path: Optional[str]  # token file or prepared directory; None for synthetic data
    n_tokens: int
    vocab_size: int  # max token id + 1 (a prepared directory: its tokenizer's size)
    description: str  # one human line for the log
    dtype: str = "<u2"  # of the token file(s)
    n_val: Optional[int] = None  # a prepared directory's val tokens (its split); None: by val_fraction
    sources: tuple = ()  # data.mix: each entry's DataInfo, in order (this one then describes the whole)


def cache_dir(cfg) -> Path:
    """``data.cache_dir``, else ``$TPCTL_CACHE_DIR`` (tests isolate with it),
    else ``~/.cache/tpctl``."""
    d = cfg.data.cache_dir or os.environ.get("TPCTL_CACHE_DIR") or "~/.cache/tpctl"
    return Path(d).expanduser()


def prepare_data(cfg, scan_ids: bool = True) -> DataInfo:
    """Build (or find) the token stream of ``cfg.data`` and validate it.

    Raises ConfigError for anything that would otherwise fail inside a worker:
    a missing file, ids the model's vocabulary cannot embed, splits too short
    for one window of ``train.seq_len + 1`` tokens. ``scan_ids``: read every
    id of a prepared corpus (the launcher does, once per process and corpus
    state; the workers check each batch they read instead, TokenData.batch).
    """
    d = cfg.data
    if d.name == "synthetic":
        info = _synthetic_info(cfg)
    elif d.name == "text":
        if not 0.0 < d.val_fraction < 1.0:
            raise ConfigError("data.val_fraction", d.val_fraction, "must be in (0, 1)")
        from .mix import check_data_keys, mix_entries

        check_data_keys(cfg)
        entries = mix_entries(d)
        if entries:
            return _mix(cfg, entries, scan_ids)
        if d.path is None:
            info = _stdlib_corpus(cfg)
        else:
            info = _corpus(cfg, d.path, scan_ids, "data.path")
        check_vocab(cfg, info.vocab_size, info.n_val is not None, info.description)
    else:
        raise ConfigError("data.name", d.name, "one of: text, synthetic")
    _check_splits(cfg, info)
    return info


def _corpus(cfg, path: str, scan_ids: bool, key: str) -> DataInfo:
    if Path(path).expanduser().is_dir():
        return _prepared_dir(cfg, path, scan_ids, key)
    return _user_file(cfg, path, key)


def _mix(cfg, entries, scan_ids: bool) -> DataInfo:
    """data.mix: each entry's corpus found or built and checked as
    data.path's would be (the key named: data.mix[i].path)."""
    parts = []
    for i, e in enumerate(entries):
        key = f"data.mix[{i}].path"
        info = _corpus(cfg, e.path, scan_ids, key)
        check_vocab(cfg, info.vocab_size, info.n_val is not None, info.description, f"{key}={e.path!r}")
        _check_splits(cfg, info, (key, e.path))
        parts.append(info)
    desc = "mix of " + ", ".join(f"{p.description} (weight {e.written})" for p, e in zip(parts, entries))
    return DataInfo(None, sum(p.n_tokens for p in parts), max(p.vocab_size for p in parts), desc,
                    sources=tuple(parts))


def _synthetic_info(cfg) -> DataInfo:
    d = cfg.data
    if d.synthetic_tokens < 1:
        raise ConfigError("data.synthetic_tokens", d.synthetic_tokens, "must be >= 1")
    if not 1 <= d.vocab_size <= (model_vocab(cfg) or d.vocab_size):
        raise ConfigError("data.vocab_size", d.vocab_size,
                          f"must be in 1..model.vocab_size={cfg.model.vocab_size}")
    return DataInfo(None, d.synthetic_tokens, d.vocab_size,
                    f"synthetic, {d.synthetic_tokens} tokens, vocab {d.vocab_size}, seed {cfg.seed}")


def split_bounds(n_tokens: int, val_fraction: float, n_val: Optional[int] = None) -> dict:
    """``{split: (start, stop)}``: the last ``val_fraction`` of the stream is
    val, or its last ``n_val`` tokens (a prepared directory: train shards,
    then val shards)."""
    if n_val is None:
        n_val = int(n_tokens * val_fraction)
    return {"train": (0, n_tokens - n_val), "val": (n_tokens - n_val, n_tokens)}


def _check_splits(cfg, info: DataInfo, named: Optional[tuple] = None) -> None:
    # A window is seq_len + 1 tokens (x and y shifted by one); ask for at least
    # two distinct window offsets per split, so batches are not all alike.
    need = cfg.train.seq_len + 1
    bounds = split_bounds(info.n_tokens, cfg.data.val_fraction, info.n_val)
    shortest = min(stop - start for start, stop in bounds.values())
    if shortest <= need:
        key, value = named or (("data.path", cfg.data.path) if cfg.data.path else ("train.seq_len", cfg.train.seq_len))
        raise ConfigError(
            key, value,
            f"each split must hold more than train.seq_len+1={need} tokens, but the "
            f"shorter split of {info.description} ("
            + ("val_fraction of prepare-data" if info.n_val is not None else f"data.val_fraction={cfg.data.val_fraction}")
            + f") holds {shortest}")


# -- caches -----------------------------------------------------------------


def _key(tokenizer: Optional[str], **parts) -> str:
    """Short content key: everything that determines a cache file's bytes,
    the tokenizer's files included (tokenizer.files_stamp)."""
    blob = json.dumps({"tokenizer": files_stamp(tokenizer), **parts}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _stats(tokens: Path, meta: Path, dtype: np.dtype = BIN_DTYPE) -> dict:
    """``{"n_tokens", "max_id"}`` of a token file. Kept in a JSON sidecar so a
    worker's prepare_data does not rescan a large .bin; the sidecar's name
    carries the same key as the data it describes, so it cannot be stale."""
    try:
        return json.loads(meta.read_text())
    except (OSError, ValueError):
        pass
    mm = np.memmap(tokens, dtype=dtype, mode="r") if tokens.stat().st_size else np.zeros(0, dtype)
    max_id = max((int(mm[i:i + _CHUNK].max()) for i in range(0, len(mm), _CHUNK)), default=-1)
    stats = {"n_tokens": int(len(mm)), "max_id": max_id, "dtype": dtype.str}
    write_file(meta, [json.dumps(stats).encode()])
    return stats


def _info(tokens: Path, meta: Path, what: str, text: bool = True) -> DataInfo:
    s = _stats(tokens, meta)
    n = s["n_tokens"]
    # Byte-level: one token per byte of text, so the text size is n bytes.
    desc = f"{what}, {n / 1e6:.1f} MB, {n} tokens" if text else f"{what}, {n} tokens, max id {s['max_id']}"
    return DataInfo(str(tokens), n, s["max_id"] + 1, desc, s.get("dtype", BIN_DTYPE.str))


def _build(dest: Path, byte_chunks: Iterator[bytes], total: int, what: str, tokenizer_dir: Optional[str] = None) -> None:
    """Tokenise a stream of byte chunks into ``dest`` (uint16, or uint32 for
    a vocabulary above 65,536), byte-level or with a Hugging Face tokenizer,
    showing progress: building is a one-off, every later run is a cache hit.
    The dtype goes into the stats sidecar, written after the tokens."""
    log.info("building %s cache %s (%.1f MB of text)", what, dest, total / 1e6)
    t0 = time.perf_counter()
    tok = Tokenizer(tokenizer_dir)

    def tokens() -> Iterator[bytes]:
        with _progress(total, f"tokenising {what}") as advance:
            for chunk in whole_lines(byte_chunks) if tok.directory else byte_chunks:
                advance(len(chunk))
                yield tok.encode_array(chunk).tobytes()

    write_file(dest, tokens())
    dest.with_suffix(".json").unlink(missing_ok=True)
    _stats(dest, dest.with_suffix(".json"), tok.dtype)
    log.info("built %s in %.2fs", dest.name, time.perf_counter() - t0)


@contextmanager
def _progress(total: int, desc: str):
    """A rich progress bar on an interactive terminal; silent otherwise (the
    log lines around the build say what happened)."""
    if not sys.stderr.isatty() or total < 8 * _CHUNK:
        yield lambda n: None
        return
    from rich.progress import Progress  # only imported when a bar is drawn

    with Progress(transient=True) as bar:
        task = bar.add_task(desc, total=total)
        yield lambda n: bar.advance(task, n)


# -- the default corpus: the standard library's sources ----------------------

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


def stdlib_files(max_bytes: int) -> list[Path]:
    """The stdlib ``*.py`` files, in a deterministic (sorted) walk, up to the
    first one that brings the total to ``max_bytes``. Tests and third-party
    packages are skipped: the first are odd text, the second differ by machine."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(n for n in dirnames if n not in _SKIP_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = Path(dirpath, name)
                files.append(path)
                total += path.stat().st_size
                if total >= max_bytes:
                    return files
    return files


def stdlib_corpus_bytes(files: Sequence[Path], max_bytes: int) -> Iterator[bytes]:
    """The corpus text: the files' bytes concatenated, cut at ``max_bytes``."""
    left = max_bytes
    for path in files:
        if left <= 0:
            return
        data = path.read_bytes()[:left]
        left -= len(data)
        yield data


def _stdlib_corpus(cfg) -> DataInfo:
    max_bytes = cfg.data.max_bytes
    if max_bytes < 1:
        raise ConfigError("data.max_bytes", max_bytes, "must be >= 1")
    files = stdlib_files(max_bytes)
    if not files:
        raise ConfigError("data.path", None, f"no *.py files found in {sysconfig.get_paths()['stdlib']} "
                          "for the default corpus; pass data.path=<text file or .bin>")
    root = Path(sysconfig.get_paths()["stdlib"])
    # Key on each file's name, size and mtime: an upgraded Python or edited
    # file gives a new cache file instead of a stale one.
    key = _key(cfg.data.get("tokenizer"), kind="stdlib", max_bytes=max_bytes, root=root, files=[
        (str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in files])
    dest = cache_dir(cfg) / f"stdlib-{key}.bin"
    if not (dest.exists() and dest.with_suffix(".json").exists()):
        total = min(max_bytes, sum(p.stat().st_size for p in files))
        _build(dest, stdlib_corpus_bytes(files, max_bytes), total, "stdlib corpus", cfg.data.get("tokenizer"))
    return _info(dest, dest.with_suffix(".json"), "stdlib corpus", text=not cfg.data.get("tokenizer"))


# -- a user's file: text (tokenised + cached) or .bin (used in place) ---------


def _user_file(cfg, path_str: str, key: str = "data.path") -> DataInfo:
    path = Path(path_str).expanduser()
    if not path.is_file():
        raise ConfigError(key, path_str, "no such file")
    st = path.stat()
    key = _key(cfg.data.get("tokenizer"), path=str(path.resolve()), size=st.st_size, mtime_ns=st.st_mtime_ns)
    if path.suffix == ".bin":
        if (path.parent / INDEX).is_file():
            raise ConfigError(key, path_str, f"a shard of the prepared corpus {path.parent}: "
                              f"pass {key}={path.parent} (its dtype and split are in its index)")
        if st.st_size % BIN_DTYPE.itemsize:
            raise ConfigError(key, path_str,
                              f"a .bin holds uint16 token ids, so its size must be even (it is {st.st_size} bytes)")
        return _info(path, cache_dir(cfg) / f"{path.stem}-{key}.json", f"token file {path.name}", text=False)
    dest = cache_dir(cfg) / f"{path.stem}-{key}.bin"
    if not (dest.exists() and dest.with_suffix(".json").exists()):
        _build(dest, _read_chunks(path), st.st_size, f"text file {path.name}", cfg.data.get("tokenizer"))
    return _info(dest, dest.with_suffix(".json"), f"text file {path.name}", text=not cfg.data.get("tokenizer"))


def _prepared_dir(cfg, path_str: str, scan_ids: bool, key: str = "data.path") -> DataInfo:
    """A directory written by ``tpctl prepare-data``: checked (index, shard
    sizes, tokenizer; with ``scan_ids`` every id of every shard)."""
    path = Path(path_str).expanduser()
    try:
        index = read_index(path)
        check_shards(path, index)
        if scan_ids:
            check_ids_once(path, index)
    except DataError as e:
        raise ConfigError(key, path_str, str(e)) from None
    tokenizer = cfg.data.get("tokenizer")
    if tokenizer and Path(tokenizer).is_dir() and identity_hash(tokenizer) != index["tokenizer"]["hash"]:
        raise ConfigError("data.tokenizer", tokenizer, f"is not the tokenizer {key}={path_str} was prepared with "
                          f"({index['tokenizer']['name']}): leave data.tokenizer unset or pass that one")
    n_train, n_val = index["tokens"]["train"], index["tokens"]["val"]
    desc = (f"prepared corpus {path.name} ({len(index['sources'])} sources, tokenizer {index['tokenizer']['name']}, "
            f"vocabulary {index['vocab_size']}, {index['dtype']})")
    return DataInfo(str(path), n_train + n_val, int(index["vocab_size"]), desc,
                    np.dtype(index["dtype"]).newbyteorder("<").str, n_val)


def _read_chunks(path: Path) -> Iterator[bytes]:
    # Streamed: byte tokenisation needs no context, so a large file never has
    # to fit in memory.
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            yield chunk


