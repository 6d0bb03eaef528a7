"""The one tokenizer of tpctl: UTF-8 bytes (ids 0..255), or a local Hugging
Face tokenizer directory (`data.tokenizer=DIR`, `prepare-data tokenizer=DIR`).
Training caches, prepared corpora, sampling and `tpctl generate` all encode
and decode through it.

Its identity (`Tokenizer.hash`, `identity_hash`) is what a prepared
corpus's index.json records: a hash of the directory's files' contents, or
`bytes-v1`. The caches of tokenised text key on `files_stamp` instead (the
files' names, sizes and modification times): it is cheap enough to compute
in every worker, and the caches made before carry it in their names.
"""

from __future__ import annotations

import hashlib
from functools import cached_property
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

import numpy as np

from . import DataError

BYTES = "bytes"
BYTES_HASH = "bytes-v1"
BYTES_EOS = 0  # the byte tokenizer's document separator: NUL, which text does not hold

# The files a Hugging Face tokenizer is read from (one of them at least).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest little-endian unsigned dtype that holds every id below
    ``vocab_size``: uint16 up to 65,536 ids, uint32 above."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def identity_hash(directory: Optional[str]) -> str:
    """sha256 over the names and contents of the files of a tokenizer
    directory; `bytes-v1` for the byte tokenizer (None)."""
    if not directory:
        return BYTES_HASH
    h = hashlib.sha256()
    for p in sorted(Path(directory).iterdir()):
        if p.is_file():
            h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def files_stamp(directory: Optional[str]) -> Optional[list]:
    """The directory's resolved path and its files' names, sizes and
    modification times (None: the byte tokenizer): part of a cache key."""
    if not directory:
        return None
    root = Path(directory).resolve()
    return [str(root)] + sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in root.iterdir() if p.is_file())


def _from_pretrained(directory: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def hf_tokenizer(directory: str):
    """The Hugging Face tokenizer saved in `directory` (nothing is
    downloaded); DataError with one line saying why it cannot be loaded."""
    try:
        return _from_pretrained(directory)
    except Exception as e:  # the library's many failure types: one line
        if not any((Path(directory) / name).is_file() for name in TOKENIZER_FILES):
            # transformers then says "...from one of: " and lists nothing
            raise DataError(f"the directory holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}; "
                            "a tokenizer's save_pretrained writes them)") from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise DataError(f"cannot be loaded ({type(e).__name__}: {first})") from None


class Tokenizer:
    """Bytes (`directory` None or empty) or the tokenizer saved in `directory`.
    Loading errors are the library's own (the callers word them); prepare-data
    opens its tokenizer with `load_tokenizer`, which says them in one line."""

    def __init__(self, directory: Optional[str] = None, backend=None):
        self.directory = str(directory) if directory else None
        self._hf = None
        if self.directory:
            self._hf = backend if backend is not None else _from_pretrained(self.directory)
        self.vocab_size = len(self._hf) if self._hf is not None else 256
        self.dtype = token_dtype(self.vocab_size)  # of its ids in token files

    @property
    def name(self) -> str:
        """`bytes` or the directory, as given: what index.json records."""
        return self.directory or BYTES

    @property
    def eos_id(self) -> Optional[int]:
        """The tokenizer's own end of text (generation stops at it); bytes have none."""
        return self._hf.eos_token_id if self._hf is not None else None

    @property
    def separator(self) -> Optional[int]:
        """The id prepare-data puts between documents."""
        return self.eos_id if self._hf is not None else BYTES_EOS

    @cached_property
    def hash(self) -> str:
        return identity_hash(self.directory)

    def encode(self, text: str) -> list[int]:
        if self._hf is not None:
            return list(self._hf(text, add_special_tokens=False)["input_ids"])
        return list(text.encode("utf-8"))

    def encode_array(self, data: str | bytes) -> np.ndarray:
        """The ids of `data` as an array of `dtype`. Bytes are tokens as they
        are for the byte tokenizer; a subword tokenizer reads them as UTF-8,
        an undecodable byte replaced (U+FFFD)."""
        if self._hf is None:
            raw = data.encode("utf-8") if isinstance(data, str) else data
            return np.frombuffer(raw, dtype=np.uint8).astype(self.dtype)
        text = data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data
        return np.asarray(self._hf(text, add_special_tokens=False)["input_ids"], dtype=self.dtype)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """The ids of each text, as arrays of `dtype`: the batch path of
        prepare-data's workers. A text that is not encodable (a lone
        surrogate) raises."""
        if self._hf is None:
            return [np.frombuffer(t.encode("utf-8"), np.uint8).astype(self.dtype) for t in texts]
        backend = getattr(self._hf, "backend_tokenizer", None)
        if backend is not None:  # a fast tokenizer: the same ids, without the BatchEncoding
            return [np.asarray(e.ids, dtype=self.dtype) for e in backend.encode_batch(texts, add_special_tokens=False)]
        return [np.asarray(ids, dtype=self.dtype) for ids in self._hf(list(texts), add_special_tokens=False)["input_ids"]]

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`. Bytes: invalid UTF-8 (a window cut mid-character)
        is replaced rather than raised, so any slice of a token stream decodes."""
        if self._hf is not None:
            return self._hf.decode(list(ids))
        arr = np.asarray(ids if hasattr(ids, "__array__") else list(ids), dtype=np.int64)  # an array, a tensor, a list
        if arr.size and (arr.min() < 0 or arr.max() > 255):
            raise ValueError(f"byte-level ids must be in 0..255, got {arr.min()}..{arr.max()}")
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def load_tokenizer(spec: str) -> Tokenizer:
    """prepare-data's tokenizer (`bytes` or a directory), or a DataError in
    one line naming `tokenizer=spec`; a directory's tokenizer needs an EOS,
    which separates the documents."""
    if spec == BYTES:
        return Tokenizer()
    if not Path(spec).is_dir():
        raise DataError(f"tokenizer={spec}: expected `bytes` or a local Hugging Face tokenizer directory (save_pretrained)")
    try:
        tok = Tokenizer(spec, hf_tokenizer(spec))
    except DataError as e:
        raise DataError(f"tokenizer={spec}: {e}") from None
    if tok.eos_id is None:
        raise DataError(f"tokenizer={spec}: has no eos_token, which prepare-data puts between documents "
                        "(set tokenizer.eos_token and save_pretrained again)")
    return tok


def whole_lines(chunks: Iterable[bytes]) -> Iterator[bytes]:
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
