"""tpctl prepare-data and data.path=DIR: corpora of txt / jsonl(.gz) / parquet /
`datasets` directories into token shards (uint16 or uint32 by vocabulary),
byte-identical whatever the worker count, trained on as one memory-mapped
stream in every mode; every bad input is one line and exit 2."""

from __future__ import annotations

import filecmp
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cli_support import scaled
from conftest import build_trainer, layouts
from tpctl.commands import prepare_data as command
from tpctl.data import DataError, sources
from tpctl.data.prepare import prepare
from tpctl.data.shards import ShardedTokens, read_index, shard_paths
from tpctl.data.tokenizer import BYTES_EOS

pytestmark = pytest.mark.timeout(300)

WORDS = 70_000  # word-level vocabulary: w0 .. w69999, then [UNK] and <eos>: 70,002 ids > 65,536


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory) -> str:
    """A Hugging Face tokenizer with more ids than uint16 holds, made here."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(WORDS)}
    vocab.update({"[UNK]": WORDS, "<eos>": WORDS + 1})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    d = tmp_path_factory.mktemp("word_tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="[UNK]").save_pretrained(d)
    return str(d)


def _word_docs(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    # Ids from the whole range, the top (> 65,535) included in every document.
    return [" ".join(f"w{i}" for i in np.append(rng.integers(0, WORDS, 30), WORDS - 1 - k % 100)) for k in range(n)]


@pytest.fixture(scope="module")
def word_corpus(tmp_path_factory, word_tokenizer) -> str:
    src = tmp_path_factory.mktemp("word_src")
    (src / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in _word_docs(400)))
    out = tmp_path_factory.mktemp("word_out") / "corpus"
    prepare([str(src)], out, word_tokenizer, workers=2)
    return str(out)


def _text_docs(n: int, tag: str) -> list[str]:
    return [f"{tag} document {k}: " + "héllo wörld ✓ " * (k % 9 + 1) for k in range(n)]


@pytest.fixture(scope="module")
def mixed_sources(tmp_path_factory) -> tuple[str, list[str]]:
    """txt + jsonl.gz + parquet + a saved `datasets` directory, and all their documents."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    src = tmp_path_factory.mktemp("mixed")
    docs = []
    for k in range(3):
        text = "\n".join(_text_docs(40, f"txt{k}"))
        (src / f"a{k}.txt").write_text(text, encoding="utf-8")
        docs.append(text)
    gz = _text_docs(300, "gz")
    with gzip.open(src / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(gz))
    pqt = _text_docs(250, "parquet")
    pq.write_table(pa.table({"text": pqt}), src / "c.parquet", row_group_size=64)
    arrow = _text_docs(300, "arrow")
    datasets.Dataset.from_dict({"text": arrow}).save_to_disk(str(src / "d_saved"))
    return str(src), docs + gz + pqt + arrow


def _documents(out: Path, eos: int) -> list[bytes]:
    """The documents of a prepared byte-level corpus, train then val."""
    index = read_index(out)
    docs = []
    for split in ("train", "val"):
        ids = np.concatenate([np.zeros(0, index["dtype"])] +
                             [np.fromfile(p, index["dtype"]) for p in shard_paths(out, index, split)])
        assert ids.size == 0 or ids[-1] == eos
        docs += [bytes(d[:-1].astype(np.uint8)) for d in np.split(ids, np.flatnonzero(ids == eos) + 1)[:-1]]
    return docs


def test_mixed_corpus_identical_with_1_and_2_workers(mixed_sources, tmp_path, monkeypatch):
    src, expected = mixed_sources
    # Small tasks: the 2 workers really split every source.
    monkeypatch.setattr(sources, "_TASK_BYTES", 2048)
    monkeypatch.setattr(sources, "_ARROW_ROWS", 64)
    one = prepare([src], tmp_path / "one", "bytes", workers=1, shard_tokens=10_000)
    two = prepare([src], tmp_path / "two", "bytes", workers=2, shard_tokens=10_000)
    files = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "two").iterdir())
    assert len(one.index["shards"]["train"]) > 1 and one.index["shards"]["val"]
    _, mismatch, errors = filecmp.cmpfiles(tmp_path / "one", tmp_path / "two", files, shallow=False)
    assert not mismatch and not errors
    assert [s["kind"] for s in one.index["sources"]] == ["txt"] * 3 + ["jsonl.gz", "parquet", "datasets"]
    # Every document once, whole, in source order within each split.
    got = _documents(tmp_path / "one", BYTES_EOS)
    assert sorted(got) == sorted(t.encode() for t in expected)
    assert one.index["documents"]["train"] + one.index["documents"]["val"] == len(expected)
    assert 0.03 < one.index["documents"]["val"] / len(expected) < 0.2  # val_fraction=0.1, by document
    assert two.index == one.index
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_rerun_is_a_noop_until_a_source_changes(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in _text_docs(50, "a")))
    args = [str(src), f"out={tmp_path / 'out'}", "tokenizer=bytes", "workers=1"]
    assert command.main(args) == 0
    assert "prepared 1 sources, 50 documents" in capsys.readouterr().out
    index = tmp_path / "out" / "index.json"
    before = index.stat()
    assert command.main(args) == 0
    assert "up to date" in capsys.readouterr().out
    assert (index.stat().st_ino, index.stat().st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    # A damaged corpus is prepared again, as is one with another option or an edited source.
    (tmp_path / "out" / "train-000000.bin").write_bytes(b"")
    assert command.main(args) == 0
    assert "prepared" in capsys.readouterr().out
    # Another option is other output; so is an edited source.
    assert command.main(args + ["val_fraction=0.2"]) == 0
    assert "prepared" in capsys.readouterr().out
    with open(src / "a.jsonl", "a") as f:
        f.write(json.dumps({"text": "one more"}) + "\n")
    assert command.main(args + ["val_fraction=0.2"]) == 0
    assert "prepared 1 sources, 51 documents" in capsys.readouterr().out


def _write_bad_inputs(d: Path) -> None:
    (d / "missing.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n{"body": "c"}\n')
    (d / "notjson.jsonl").write_text('{"text": "a"}\n{"text": \n')
    (d / "badutf8.jsonl").write_bytes(b'{"text": "a"}\n{"text": "caf\xe9"}\n')
    (d / "badutf8.txt").write_bytes(b"fine\nfine\nnot \xff fine\n")
    (d / "empty.txt").write_bytes(b"")
    (d / "blank.jsonl").write_text("\n\n")
    (d / "corrupt.parquet").write_bytes(b"PAR1 this is not parquet")
    (d / "notgz.jsonl.gz").write_bytes(b"plain, not gzip\n")
    (d / "notes.md").write_text("x")


# name -> (arguments, what the one line must say)
BAD_INPUTS = {
    "missing field": (["missing.jsonl"], ["missing.jsonl line 3", "'text'", "body"]),
    "no JSON": (["notjson.jsonl"], ["notjson.jsonl line 2", "JSON"]),
    "undecodable jsonl": (["badutf8.jsonl"], ["badutf8.jsonl line 2", "UTF-8", "errors=replace"]),
    "undecodable txt": (["badutf8.txt"], ["badutf8.txt line 3", "0xff"]),
    "empty txt": (["empty.txt"], ["empty.txt", "empty source"]),
    "blank jsonl": (["blank.jsonl"], ["blank.jsonl", "empty source"]),
    "corrupt parquet": (["corrupt.parquet"], ["corrupt.parquet", "parquet"]),
    "corrupt gzip": (["notgz.jsonl.gz"], ["notgz.jsonl.gz", "line 1"]),
    "unsupported file": (["notes.md"], ["notes.md", "not a supported source"]),
    "no such source": (["nope/*.jsonl"], ["nope/*.jsonl", "no such file"]),
    "unknown option": (["missing.jsonl", "worker=2"], ["worker", "expected one of"]),
    "bad option value": (["missing.jsonl", "errors=ignore"], ["errors", "strict, replace"]),
    "no tokenizer dir": (["missing.jsonl", "tokenizer=nodir"], ["tokenizer=nodir"]),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_exits_2_with_one_line(case, tmp_path, capsys, monkeypatch):
    if case == "corrupt parquet":
        pytest.importorskip("pyarrow")
    monkeypatch.chdir(tmp_path)
    _write_bad_inputs(tmp_path)
    args, says = BAD_INPUTS[case]
    if not any(a.startswith("tokenizer=") for a in args):
        args = args + ["tokenizer=bytes"]
    assert command.main(args + [f"out={tmp_path / 'out'}", "workers=2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tpctl: error: "), err
    for s in says:
        assert s in err, (s, err)
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]  # the temp dir is gone


def test_errors_replace_accepts_undecodable_bytes(tmp_path):
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "a"}\n{"text": "caf\xe9"}\n')
    p = prepare([str(tmp_path / "bad.jsonl")], tmp_path / "out", "bytes", errors="replace", val_fraction=0.0)
    assert _documents(tmp_path / "out", 0) == [b"a", "caf\ufffd".encode()]
    assert p.index["tokens"]["val"] == 0


def test_parquet_null_row_and_missing_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": ["a", "b", None, "d"]}), tmp_path / "n.parquet", row_group_size=2)
    with pytest.raises(DataError, match=r"n\.parquet row 2: column 'text' is null"):
        prepare([str(tmp_path / "n.parquet")], tmp_path / "out", "bytes")
    with pytest.raises(DataError, match=r"no column 'body' \(columns: text\)"):
        prepare([str(tmp_path / "n.parquet")], tmp_path / "out", "bytes", text_column="body")


def test_word_vocab_above_uint16(word_corpus, word_tokenizer):
    index = read_index(word_corpus)
    assert index["dtype"] == "uint32" and index["vocab_size"] == WORDS + 2 and index["eos_id"] == WORDS + 1
    assert index["max_id"] == WORDS + 1
    ids = np.concatenate([np.fromfile(p, "<u4") for p in shard_paths(word_corpus, index, "train")])
    assert (ids > 65_535).sum() > 400  # the ids that uint16 would have wrapped
    # The stream is the tokenizer's own ids, documents joined by <eos>.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(word_tokenizer)
    first = ids[:np.flatnonzero(ids == WORDS + 1)[0]]
    assert tok.decode(first.tolist()) in _word_docs(400)


def test_one_tokenizer_identity_and_ids(word_corpus, word_tokenizer):
    """The index records the tokenizer's one identity hash, and its three
    encoders (sampling, the text cache, prepare-data's workers) agree."""
    from tpctl.data.tokenizer import Tokenizer, identity_hash

    tok = Tokenizer(word_tokenizer)
    index = read_index(word_corpus)
    assert index["tokenizer"] == {"name": word_tokenizer, "hash": tok.hash} and tok.hash == identity_hash(word_tokenizer)
    assert (tok.vocab_size, tok.eos_id, tok.separator, tok.dtype) == (WORDS + 2, WORDS + 1, WORDS + 1, np.dtype("<u4"))
    docs = _word_docs(3)
    assert [a.tolist() for a in tok.encode_batch(docs)] == [tok.encode(d) for d in docs] == \
        [tok.encode_array(d.encode()).tolist() for d in docs]
    assert tok.decode(tok.encode(docs[0])) == docs[0]


def test_data_tokenizer_above_uint16(word_tokenizer, tmp_path, monkeypatch):
    """The data.tokenizer path (a text file tokenised at launch) writes uint32 too."""
    from tpctl.config import default_config
    from tpctl.data.batches import TokenData
    from tpctl.data.corpora import prepare_data

    monkeypatch.setenv("TPCTL_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "t.txt").write_text("\n".join(_word_docs(200)))
    cfg = default_config()
    cfg.data.path, cfg.data.tokenizer, cfg.model.vocab_size = str(tmp_path / "t.txt"), word_tokenizer, WORDS + 2
    cfg.train.seq_len, cfg.train.batch_size = 16, 8
    info = prepare_data(cfg)
    assert info.dtype == "<u4" and info.vocab_size == WORDS  # max id + 1: w69999 is in every document
    x, _ = TokenData(cfg, info).batch("train", 0, range(8))
    assert x.max() > 65_535


def test_sharded_stream_reads_across_boundaries(tmp_path):
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 70_000, n).astype("<u4") for n in (7, 1, 13, 0, 5)]
    paths = []
    for k, a in enumerate(parts):
        paths.append(tmp_path / f"s{k}.bin")
        a.tofile(paths[-1])
    whole = np.concatenate(parts)
    stream = ShardedTokens(paths, "<u4")
    assert len(stream) == len(whole)
    for a in range(len(whole)):
        assert stream[a] == whole[a]
        for b in range(a, len(whole) + 1):
            assert np.array_equal(stream[a:b], whole[a:b])


def test_vocab_above_the_model_is_refused(word_corpus):
    from tpctl.config import default_config
    from tpctl.errors import ConfigError
    from tpctl.data.corpora import prepare_data

    cfg = default_config()
    cfg.data.path = word_corpus  # model.vocab_size = 256
    with pytest.raises(ConfigError) as e:
        prepare_data(cfg)
    assert e.value.key == "model.vocab_size" and str(WORDS + 2) in str(e.value)


@pytest.mark.slow
def test_cli_refuses_the_vocab_before_workers_start(word_corpus, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    r = subprocess.run([sys.executable, "-m", "tpctl.cli", "train", f"data.path={word_corpus}", "mode=1d", "size=2",
                        "train.steps=2", f"hydra.run.dir={tmp_path / 'run'}"],
                       capture_output=True, text=True, env=env, timeout=scaled(120))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.vocab_size" in lines[0] and str(WORDS + 2) in lines[0]
    assert not list((tmp_path / "run").rglob("rank*.log"))  # no worker started


# -- training on prepared corpora, on the pools -----------------------------

TRAIN_LAYOUTS = layouts("none-dp4", "1d-2-dp2", "3d-8")


def _train(layout, data_path: str, vocab: int, val_fraction: float = 0.1) -> list[float]:
    from omegaconf import OmegaConf

    from tpctl.config import default_config

    cfg = layout.write_to(default_config())
    for key, value in {"model.n_embd": 16, "model.n_head": 4, "model.block_size": 16, "model.vocab_size": vocab,
                       "data.path": data_path, "data.val_fraction": val_fraction,
                       "train.batch_size": 8, "train.seq_len": 16, "train.eval_every": 2, "train.log_every": 1,
                       "train.progress": False, "optim.lr": 1e-2, "optim.eps": 1e-5, "optim.warmup_steps": 2, "train.steps": 4}.items():
        OmegaConf.update(cfg, key, value)
    records = build_trainer(cfg, layout, pooled=False, lazy=False).fit()
    return [r["loss"] for r in records] + [r["val_loss"] for r in records if r.get("val_loss") is not None]


def test_word_vocab_trains_equal_in_1d_and_3d(pool, word_corpus):
    curves = {key: pool.run(_train, layout, word_corpus, WORDS + 2)[0] for key, layout in TRAIN_LAYOUTS.items()}
    reference = curves.pop("none-dp4")
    assert len(reference) == 6 and reference[-1] < reference[0] + 0.5  # 4 train losses, 2 val losses
    for key, losses in curves.items():
        assert losses == pytest.approx(reference, rel=1e-5), key


def test_shards_train_like_one_bin(pool, tmp_path):
    """A corpus cut into many shards gives the loss curve of the same tokens in one .bin."""
    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in _text_docs(400, "s")))
    prepared = prepare([str(src)], tmp_path / "sharded", "bytes", workers=2, shard_tokens=1000)
    index = prepared.index
    assert len(index["shards"]["train"]) > 10
    one = tmp_path / "one.bin"
    with open(one, "wb") as f:
        for split in ("train", "val"):
            for p in shard_paths(tmp_path / "sharded", index, split):
                f.write(p.read_bytes())
    n, n_val = index["tokens"]["train"] + index["tokens"]["val"], index["tokens"]["val"]
    fraction = (n_val + 0.5) / n  # the .bin's split: its last int(n * fraction) = n_val tokens
    layout = TRAIN_LAYOUTS["1d-2-dp2"]
    sharded = pool.run(_train, layout, str(tmp_path / "sharded"), 256)[0]
    single = pool.run(_train, layout, str(one), 256, fraction)[0]
    assert sharded == single


def test_out_must_be_a_corpus_or_new(tmp_path):
    (tmp_path / "a.txt").write_text("some text\n")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "mine.txt").write_text("not a corpus")
    with pytest.raises(DataError, match="exists and is not a prepared corpus"):
        prepare([str(tmp_path / "a.txt")], tmp_path / "busy", "bytes", val_fraction=0.0)
    assert (tmp_path / "busy" / "mine.txt").read_text() == "not a corpus"


def test_lone_surrogate_is_one_line(tmp_path):
    (tmp_path / "s.jsonl").write_text('{"text": "ok"}\n{"text": "bad \\ud800 half"}\n')
    with pytest.raises(DataError, match=r"s\.jsonl: the documents from line 1 on cannot be tokenised"):
        prepare([str(tmp_path / "s.jsonl")], tmp_path / "out", "bytes")
