"""Token ids outside the vocabulary never reach a model: refused at start-up
against what the data holds (every source), and checked in each batch read
(a file damaged after start-up), in every mode: the 1d embedding would give
such an id a zero vector and train on, silently."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cli_support import scaled
from conftest import tiny_config
from tpctl.config import largest_grids
from conftest import build_trainer, layouts, tiny_config
from tpctl.errors import ConfigError
from tpctl.data.shards import read_index, shard_paths
from tpctl.data.batches import TokenData
from tpctl.data.corpora import prepare_data
from tpctl.data.prepare import prepare
from tpctl.data.token_ids import TokenOutOfRange

REPO = Path(__file__).resolve().parents[1]
BAD_ID = 300  # the byte tokenizer has 256 ids; uint16 shards hold it


def _prepared(tmp_path: Path) -> Path:
    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {k}: " + "some text " * 30}) + "\n" for k in range(60)))
    return prepare([str(src)], tmp_path / "corpus", "bytes", shard_tokens=4000).out


def _damage(shard: Path, at: int, token: int = BAD_ID) -> None:
    """Overwrite token `at` of `shard` in place (size and index untouched)."""
    with open(shard, "r+b") as f:
        f.seek(at * 2)
        f.write(np.asarray([token], "<u2").tobytes())


def test_a_shard_changed_after_prepare_data_is_refused_naming_the_shard_the_id_and_the_vocabulary(tmp_path):
    out = _prepared(tmp_path)
    index = read_index(out)
    shard = shard_paths(out, index, "val")[0]
    _damage(shard, 17)
    cfg = tiny_config(1, **{"data.path": str(out)})
    with pytest.raises(ConfigError) as e:
        prepare_data(cfg)
    assert e.value.key == "data.path"
    assert f"{shard}: token id {BAD_ID} at token 17 is outside the vocabulary of 256 ids" in str(e.value)
    assert f"max_id {index['max_id']} when written" in str(e.value)
    prepare_data(cfg, scan_ids=False)  # the workers' call: they check what they read instead


def test_every_source_is_refused_by_what_it_holds(tmp_path):
    raw = tmp_path / "raw.bin"  # nanoGPT layout: uint16 ids, no index
    np.asarray([1, 2, BAD_ID, 3] * 64, "<u2").tofile(raw)
    with pytest.raises(ConfigError, match=rf"model.vocab_size=256: must be > {BAD_ID}, the largest token id in "
                                          rf"data.path='{raw}'"):
        prepare_data(tiny_config(1, **{"data.path": str(raw)}))
    with pytest.raises(ConfigError, match=r"data.vocab_size=300: must be in 1..model.vocab_size=256"):
        prepare_data(tiny_config(1, **{"data.name": "synthetic", "data.vocab_size": BAD_ID}))


def test_a_batch_holding_an_id_outside_the_vocabulary_names_the_step_the_id_and_where_it_lies(tmp_path):
    out = _prepared(tmp_path)
    cfg = tiny_config(1, **{"data.path": str(out)})
    data = TokenData(cfg, prepare_data(cfg))
    x, y = data.batch("train", 4, range(8), vocab_size=256)  # clean
    start = int(data.offsets("train", 4)[5])  # row 5 of step 5 (0-based 4)
    index = read_index(out)
    shards = shard_paths(out, index, "train")
    sizes = [s["tokens"] for s in index["shards"]["train"]]
    k = int(np.searchsorted(np.cumsum(sizes), start + 3, side="right"))
    _damage(shards[k], start + 3 - sum(sizes[:k]))
    with pytest.raises(TokenOutOfRange) as e:
        data.batch("train", 4, range(8), vocab_size=256)
    assert str(e.value).startswith(f"step 5: token id {BAD_ID} (token {start + 3 - sum(sizes[:k])} of {shards[k]}) "
                                   "is outside the model's vocabulary of 256 ids")
    data.batch("train", 4, [0, 1, 2, 3, 4, 6, 7], vocab_size=256)  # the other rows are clean


def _train_on_damaged(layout, out: str) -> str:
    """Build a run on a clean corpus, damage every shard once the data is
    open (as a file changed mid-run), train: the error each rank raises."""
    import torch.distributed as dist


    cfg = layout.write_to(tiny_config(2, **{"data.path": out}))
    trainer = build_trainer(cfg, layout, pooled=False, lazy=False, scan_ids=False)
    dist.barrier()
    if dist.get_rank() == 0:
        index = read_index(out)
        for shard in shard_paths(out, index, "train") + shard_paths(out, index, "val"):
            np.full(shard.stat().st_size // 2, BAD_ID, "<u2").tofile(shard)
    dist.barrier()
    try:
        trainer.fit()
    except TokenOutOfRange as e:
        return str(e)
    return "trained on"


@pytest.mark.parametrize("layout", largest_grids(tiny_config(2), 8).values(), ids=list(largest_grids(tiny_config(2), 8)))
def test_every_mode_stops_at_the_first_batch_that_holds_such_an_id(pool, tmp_path, layout):
    out = _prepared(tmp_path)
    errors = pool.run(_train_on_damaged, layout, str(out))
    for error in errors:  # every rank reads some rows of the damaged stream
        assert error.startswith(f"step 1: token id {BAD_ID} (token ") and "is outside the model's vocabulary of 256" in error


def test_the_cli_refuses_a_damaged_corpus_before_any_worker_starts(tmp_path):
    out = _prepared(tmp_path)
    shard = shard_paths(out, read_index(out), "train")[1]
    _damage(shard, 5)
    run = subprocess.run([sys.executable, "-m", "tpctl.cli", "train", f"data.path={out}", "mode=1d", "size=2",
                          "train.steps=2", f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=scaled(180))
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"tpctl: error: invalid config: data.path='{out}': {shard}: "
                                                   f"token id {BAD_ID} at token 5 is outside the vocabulary of 256 ids")
    assert not (tmp_path / "run").exists()
