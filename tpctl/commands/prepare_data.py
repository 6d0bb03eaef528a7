"""`tpctl prepare-data SRC... out=DIR tokenizer=DIR|bytes [options]`: tokenise
a corpus into token shards + an index that `tpctl train data.path=DIR` reads.
The engine is tpctl/data/prepare.py; this parses, calls and prints."""

from __future__ import annotations

import os
import sys

from tpctl.errors import ConfigError, EXIT_OK, fail, interrupt_on_termination, interrupted_status
from .options import parse_options


USAGE = """\
usage: tpctl prepare-data SRC... out=DIR tokenizer=DIR|bytes [options]

SRC: .txt (one document per file), .jsonl / .jsonl.gz (one JSON object per line),
.parquet files, directories of them, globs ('data/*.jsonl.gz'), or a directory
written by datasets' save_to_disk. Documents are joined by the tokenizer's EOS.

options:
  workers=N         tokenising processes (default: the cores, here {cores})
  text_field=text   the field of a .jsonl line that holds the text
  text_column=text  the column of a .parquet file or datasets directory
  val_fraction=0.1  share of documents (by a hash of their text) put in val
  shard_tokens=N    tokens per shard file (default 100000000)
  errors=strict     strict: undecodable bytes are an error; replace: U+FFFD

then: tpctl train data.path=DIR model.vocab_size=<the vocabulary printed>
"""


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _positive_int(key: str, text: str) -> int:
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(key, text, "expected a positive integer")
    return value


def _fraction(key: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1.0:
        raise ConfigError(key, text, "expected a number in [0, 1)")
    return value


def _choice(*valid: str):
    def parse(key: str, text: str) -> str:
        if text not in valid:
            raise ConfigError(key, text, f"expected one of: {', '.join(valid)}")
        return text
    return parse


OPTIONS = {
    "out": (None, lambda k, v: v),
    "tokenizer": (None, lambda k, v: v),
    "workers": (None, _positive_int),
    "text_field": ("text", lambda k, v: v),
    "text_column": ("text", lambda k, v: v),
    "val_fraction": (0.1, _fraction),
    "shard_tokens": (100_000_000, _positive_int),
    "errors": ("strict", _choice("strict", "replace")),
}


def parse(args: list[str]) -> tuple[list[str], dict]:
    """(the sources, the options); ConfigError for a bad or missing option.
    An argument `key=value` is an option unless it names an existing file."""
    values, rest = parse_options([a for a in args if not os.path.exists(a)], OPTIONS)
    for arg in rest:
        key, eq, text = arg.partition("=")
        if eq:
            raise ConfigError(key, text, f"not an option of prepare-data; expected one of: {', '.join(OPTIONS)}")
    sources = [a for a in args if os.path.exists(a) or a in rest]
    if not sources:
        raise ConfigError("SRC", None, "give at least one source file, directory or glob")
    for key in ("out", "tokenizer"):
        if not values[key]:
            raise ConfigError(key, values[key], "required (tokenizer=bytes or a Hugging Face tokenizer directory)"
                              if key == "tokenizer" else "required: the directory to write")
    values["workers"] = values["workers"] or _cores()
    return sources, values


def main(args: list[str]) -> int:
    if any(a in ("-h", "--help") for a in args):
        print(USAGE.format(cores=_cores()), end="")
        return EXIT_OK
    interrupt_on_termination()
    opts: dict = {}
    try:
        from tpctl.data import DataError
        from tpctl.data.prepare import prepare

        sources, opts = parse(args)
        result = prepare(sources, progress=True, **opts)
    except (ConfigError, DataError, OSError) as e:  # OSError: a path it cannot read or write
        return fail(e)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM/SIGHUP: prepare has removed its temporary files
        name, status = interrupted_status(e)
        out = f"; out={opts['out']} is as it was" if opts.get("out") else ""
        print(f"tpctl: prepare-data interrupted by {name}{out}", file=sys.stderr)
        return status
    index = result.index
    n_sources, tokens, docs = len(index["sources"]), index["tokens"], index["documents"]
    total = tokens["train"] + tokens["val"]
    if result.up_to_date:
        print(f"tpctl: {result.out} is up to date ({n_sources} sources unchanged, same tokenizer and options): "
              f"nothing to do")
    else:
        print(f"tpctl: prepared {n_sources} sources, {docs['train'] + docs['val']:,} documents, {total:,} tokens "
              f"in {result.seconds:.1f}s ({total / max(result.seconds, 1e-9):,.0f} tokens/s, "
              f"{opts['workers']} workers) into {result.out}")
    print(f"tpctl: train {tokens['train']:,} tokens ({docs['train']:,} documents, {len(index['shards']['train'])} shards), "
          f"val {tokens['val']:,} tokens ({docs['val']:,} documents); {index['dtype']}, vocabulary {index['vocab_size']:,}")
    print(f"tpctl: train on it with: tpctl train data.path={result.out} model.vocab_size={index['vocab_size']}")
    return EXIT_OK
