"""tpctl.data: tokenizer, caches, config errors and the batch contract
(every rank computes the same global batch and reads only its rows)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tpctl.data import corpora as data
from tpctl.data.batches import TokenData
from tpctl.data.corpora import DataInfo, prepare_data
from tpctl.data.tokenizer import Tokenizer
from tpctl.errors import ConfigError
from tpctl.config import default_config

pytestmark = pytest.mark.timeout(60)

BYTES = Tokenizer()


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Every test gets its own empty cache dir."""
    d = tmp_path / "cache"
    monkeypatch.setenv("TPCTL_CACHE_DIR", str(d))
    return d


def make_cfg(**data_kw):
    cfg = default_config()
    cfg.data.max_bytes = 200_000
    cfg.train.batch_size = 8
    cfg.train.seq_len = 16
    for k, v in data_kw.items():
        setattr(cfg.data, k, v)
    return cfg


def test_tokenizer_round_trip():
    text = "def f(x):\n    return x  # héllo ✓ 🐍\n"
    ids = BYTES.encode_array(text)
    assert ids.dtype == np.uint16 and ids.max() < 256
    assert list(ids) == list(text.encode("utf-8"))
    assert BYTES.decode(ids) == text
    assert BYTES.decode(torch.as_tensor(ids.astype(np.int64))) == text
    assert BYTES.decode(list(ids)) == text
    # A window cut mid-character decodes with a replacement char, no error.
    assert BYTES.decode(BYTES.encode_array("é")[:1]) == "\ufffd"


def test_the_byte_tokenizer_is_one_thing_everywhere():
    """Sampling, caches and prepare-data see the same ids, identity and separator."""
    text = "héllo ✓\n"
    assert BYTES.encode(text) == BYTES.encode_array(text).tolist() == list(text.encode("utf-8"))
    assert [a.tolist() for a in BYTES.encode_batch([text, "x"])] == [BYTES.encode(text), [ord("x")]]
    assert BYTES.encode_array(text.encode("utf-8")).tolist() == BYTES.encode(text)
    assert (BYTES.name, BYTES.hash, BYTES.vocab_size, BYTES.dtype) == ("bytes", "bytes-v1", 256, np.dtype("<u2"))
    assert BYTES.eos_id is None and BYTES.separator == 0  # generation never stops at NUL; documents are joined by it


def test_stdlib_cache_built_once_and_matches_bytes(cache):
    cfg = make_cfg()
    info = prepare_data(cfg)
    files = list(cache.glob("stdlib-*.bin"))
    assert [str(f) for f in files] == [info.path]
    assert info.n_tokens == 200_000 and info.vocab_size <= 256
    assert "stdlib corpus" in info.description

    # Content: the byte encoding of the concatenated stdlib sources.
    expected = b"".join(data.stdlib_corpus_bytes(data.stdlib_files(200_000), 200_000))
    tokens = np.fromfile(info.path, dtype="<u2")
    assert np.array_equal(tokens, np.frombuffer(expected, np.uint8).astype(np.uint16))
    assert info.vocab_size == int(tokens.max()) + 1

    # Second call (what every worker does): a cache hit, the file is untouched.
    st = files[0].stat()
    assert prepare_data(cfg) == info
    st2 = files[0].stat()
    assert (st2.st_ino, st2.st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
    assert not list(cache.glob(".*.tmp"))  # no temp files left behind

    # A different max_bytes is different content: a new cache file.
    cfg.data.max_bytes = 100_000
    assert prepare_data(cfg).path != info.path


def test_explicit_cache_dir_wins(tmp_path):
    cfg = make_cfg(cache_dir=str(tmp_path / "mine"))
    assert prepare_data(cfg).path.startswith(str(tmp_path / "mine"))


def test_user_text_file(tmp_path, cache):
    text = "hello wörld\n" * 2000
    p = tmp_path / "corpus.txt"
    p.write_text(text, encoding="utf-8")
    info = prepare_data(make_cfg(path=str(p)))
    assert info.path.startswith(str(cache)) and "corpus" in info.path
    assert np.array_equal(np.fromfile(info.path, "<u2"), BYTES.encode_array(text))
    assert info.n_tokens == len(text.encode())
    # Editing the file changes its key: the stale cache is not reused.
    p.write_text(text + "more\n", encoding="utf-8")
    info2 = prepare_data(make_cfg(path=str(p)))
    assert info2.path != info.path and info2.n_tokens == info.n_tokens + 5


def test_bin_file_used_in_place(tmp_path, cache):
    ids = (np.arange(5000) * 7919 % 1000).astype("<u2")
    p = tmp_path / "train.bin"
    ids.tofile(p)
    cfg = make_cfg(path=str(p))
    cfg.model.vocab_size = 1000
    info = prepare_data(cfg)
    assert info.path == str(p) and info.n_tokens == 5000 and info.vocab_size == 1000
    assert not list(cache.glob("*.bin"))  # not copied
    td = TokenData(cfg, info)
    x, y = td.batch("train", 0, range(8))
    assert x.max() < 1000 and x.dtype == torch.int64


def test_missing_path(tmp_path):
    with pytest.raises(ConfigError) as e:
        prepare_data(make_cfg(path=str(tmp_path / "nope.txt")))
    assert e.value.key == "data.path" and "no such file" in str(e.value)


def test_token_id_beyond_vocab(tmp_path):
    p = tmp_path / "gpt2.bin"
    np.array([1, 2, 50256, 3] * 100, dtype="<u2").tofile(p)
    cfg = make_cfg(path=str(p))  # model.vocab_size = 256
    with pytest.raises(ConfigError) as e:
        prepare_data(cfg)
    assert e.value.key == "model.vocab_size" and "50256" in str(e.value) and "data.path" in str(e.value)

    # Text: non-ASCII bytes do not fit a 128-token vocabulary.
    t = tmp_path / "u.txt"
    t.write_text("é" * 1000, encoding="utf-8")
    cfg = make_cfg(path=str(t))
    cfg.model.vocab_size = 128
    with pytest.raises(ConfigError, match="model.vocab_size"):
        prepare_data(cfg)


def test_splits_too_short(tmp_path):
    p = tmp_path / "tiny.txt"
    p.write_text("x" * 100)
    with pytest.raises(ConfigError) as e:
        prepare_data(make_cfg(path=str(p)))  # val split: 10 tokens < seq_len + 2
    assert e.value.key == "data.path" and "train.seq_len" in str(e.value)
    cfg = make_cfg(max_bytes=1000)
    cfg.train.seq_len = 200
    with pytest.raises(ConfigError) as e:
        prepare_data(cfg)
    assert e.value.key == "train.seq_len"


def test_bad_names():
    with pytest.raises(ConfigError, match="data.name"):
        prepare_data(make_cfg(name="wiki"))
    with pytest.raises(ConfigError, match="data.vocab_size"):
        prepare_data(make_cfg(name="synthetic", vocab_size=1000))  # model.vocab_size = 256


@pytest.fixture(params=["stdlib", "synthetic"])
def td(request) -> TokenData:
    cfg = make_cfg(name="text" if request.param == "stdlib" else "synthetic",
                   synthetic_tokens=50_000)
    return TokenData(cfg, prepare_data(cfg))


def test_batch_shapes_and_shift(td):
    x, y = td.batch("train", 3, range(8))
    assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one token
    # ...and each row really is a window of the stream.
    base = td.bounds["train"][0]
    for o, row in zip(td.offsets("train", 3).tolist(), x):
        assert np.array_equal(np.asarray(td.tokens[base + o: base + o + 16], np.int64), row.numpy())


def test_batch_deterministic(td):
    rows = range(8)
    x0, y0 = td.batch("train", 0, rows)
    x0b, y0b = td.batch("train", 0, rows)
    assert torch.equal(x0, x0b) and torch.equal(y0, y0b)
    assert not torch.equal(x0, td.batch("train", 1, rows)[0])
    assert not torch.equal(x0, td.batch("val", 0, rows)[0])
    # A fresh TokenData (another rank, another process) agrees.
    again = TokenData(make_cfg(name="synthetic", synthetic_tokens=50_000) if td.info.path is None
                      else make_cfg(), td.info)
    assert torch.equal(again.batch("train", 0, rows)[0], x0)


@pytest.mark.parametrize("parts", [[8], [4, 4], [2, 2, 2, 2], [1] * 8, [3, 5], [1, 6, 1]])
@pytest.mark.parametrize("split", ["train", "val"])
def test_row_subsets_are_the_global_batch(td, split, parts):
    """The key property: any partition of the rows into contiguous ranges
    (one per rank / micro-batch) concatenates to the global batch."""
    for step in (0, 7):
        gx, gy = td.batch(split, step, range(8))
        xs, ys, a = [], [], 0
        for n in parts:
            x, y = td.batch(split, step, range(a, a + n))
            xs.append(x), ys.append(y)
            a += n
        assert torch.equal(torch.cat(xs), gx) and torch.equal(torch.cat(ys), gy)
    # Non-contiguous rows too (e.g. a strided dp layout).
    assert torch.equal(td.batch(split, 2, [1, 5, 6])[0], td.batch(split, 2, range(8))[0][[1, 5, 6]])


def test_rows_out_of_range(td):
    with pytest.raises(IndexError):
        td.batch("train", 0, range(6, 9))
    with pytest.raises(ValueError):
        td.batch("test", 0, range(2))


def test_val_windows_stay_in_val(td):
    start, stop = td.bounds["val"]
    for step in range(20):
        o = td.offsets("val", step)
        assert o.min() >= 0 and (start + o.max() + td.seq_len + 1) <= stop


def test_synthetic_seeded_and_in_range():
    def tokens(seed, vocab=50):
        cfg = make_cfg(name="synthetic", synthetic_tokens=20_000, vocab_size=vocab)
        cfg.seed = seed
        info = prepare_data(cfg)
        assert info.path is None and info.n_tokens == 20_000 and info.vocab_size == vocab
        return np.asarray(TokenData(cfg, info).tokens, np.int64)

    a = tokens(0)
    assert np.array_equal(a, tokens(0))
    assert not np.array_equal(a, tokens(1))
    assert a.min() >= 0 and a.max() < 50 and len(np.unique(a)) == 50


def test_datainfo_is_plain():
    # The launcher may pass it along; it must stay a simple value.
    info = DataInfo(None, 10, 256, "x")
    assert info == DataInfo(None, 10, 256, "x")
