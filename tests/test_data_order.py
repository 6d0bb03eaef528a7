"""data.order=epoch and data.mix (tpctl/data/order.py, mix.py, batches.py):
every window once per epoch in a seeded order, the same rows in every
layout, a resume in another layout reading the same tokens (data_hash),
a mix's rows per corpus within one row of the weights, and bad values
refused in one line before any worker starts."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_support import tpctl  # noqa: F401  (fixture)
from omegaconf import OmegaConf

from tpctl.config import default_config
from tpctl.data.batches import TokenData
from tpctl.data.corpora import prepare_data
from tpctl.data.mix import check_data_keys, mix_entries
from tpctl.data.order import MixSchedule, _keys, epoch_windows, permute
from tpctl.errors import ConfigError

pytestmark = pytest.mark.timeout(120)

SEQ, BATCH = 16, 8


def make_cfg(seed: int = 0, batch: int = BATCH, **data):
    cfg = default_config()
    cfg.seed, cfg.train.batch_size, cfg.train.seq_len = seed, batch, SEQ
    for key, value in data.items():
        OmegaConf.update(cfg, f"data.{key}", value)
    return cfg


def corpus(tmp_path: Path, name: str, n_bytes: int, alphabet: bytes = b"abcdefghijklmnopqrstuvwxyz") -> str:
    """A text file of `n_bytes` bytes from `alphabet` (so a window tells which file it came from)."""
    rng = np.random.default_rng(len(name) + n_bytes)
    path = tmp_path / name
    path.write_bytes(bytes(rng.choice(list(alphabet), n_bytes).tolist()))
    return str(path)


def data_of(cfg) -> TokenData:
    return TokenData(cfg, prepare_data(cfg))


def epoch_reads(td: TokenData, steps: int, split: str = "train") -> list[int]:
    """The window index of every row of steps 0..steps-1, in global row order."""
    return [int(o) // SEQ for s in range(steps) for o in td.windows(split, s)[1]]


# ---- order=epoch: once per epoch, seeded ---------------------------------------


def test_every_window_of_the_split_is_read_once_per_epoch(tmp_path):
    # 1,900 bytes: a train split of 1,710 tokens, 106 windows -- not a
    # multiple of the batch, so epochs end inside a step.
    td = data_of(make_cfg(path=corpus(tmp_path, "a.txt", 1900)))
    n = (td.split_len("train") - 1) // SEQ
    assert n == 106
    reads = epoch_reads(td, steps=3 * n // BATCH + 1)
    for e in range(3):
        assert sorted(reads[e * n:(e + 1) * n]) == list(range(n)), f"epoch {e}"
    # Each row reads the window its offset names, seq_len apart, x and y shifted by one.
    x, y = td.batch("train", 13, range(BATCH))  # step 13 holds rows of epochs 0 and 1
    for o, row_x, row_y in zip(td.offsets("train", 13).tolist(), x, y):
        assert o % SEQ == 0
        assert row_x.tolist() == td.tokens[o:o + SEQ].tolist() and row_y.tolist() == td.tokens[o + 1:o + SEQ + 1].tolist()
    # The val split too: its windows once each over its epoch.
    m = (td.split_len("val") - 1) // SEQ
    val = epoch_reads(td, steps=m // BATCH + 1, split="val")
    assert sorted(val[:m]) == list(range(m))


def test_the_order_differs_by_epoch_and_by_seed_and_is_the_same_again(tmp_path):
    path = corpus(tmp_path, "a.txt", 1900)
    td = data_of(make_cfg(path=path))
    n = 106
    reads = epoch_reads(td, steps=2 * n // BATCH + 1)
    first, second = reads[:n], reads[n:2 * n]
    assert first != second and first != sorted(first)
    other_seed = epoch_reads(data_of(make_cfg(seed=1, path=path)), steps=n // BATCH + 1)[:n]
    assert other_seed != first
    assert epoch_reads(data_of(make_cfg(path=path)), steps=n // BATCH + 1)[:n] == first  # another process alike
    # The train and val orders are not the same permutation either.
    assert not np.array_equal(permute(n, _keys(0, "train", 0, 0), np.arange(n)), permute(n, _keys(0, "val", 0, 0), np.arange(n)))


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 100, 1023, 1024, 1025, 65_537])
def test_the_permutation_is_a_bijection_whatever_the_number_of_windows(n):
    out = permute(n, _keys(7, "train", 0, 3), np.arange(n))
    assert sorted(out.tolist()) == list(range(n))


def test_a_large_corpus_costs_only_the_rows_read():
    n = 10**9  # a billion windows: nothing of size n is made
    reads = np.arange(5 * n - 4, 5 * n + 4)  # rows across the end of epoch 4
    out = epoch_windows(0, "train", 0, n, reads)
    assert ((0 <= out) & (out < n)).all() and len(set(out.tolist())) == len(out)
    assert (out == epoch_windows(0, "train", 0, n, reads)).all()


@pytest.mark.parametrize("order", ["epoch", "random"])
def test_the_rows_are_the_same_in_every_share_of_the_batch(tmp_path, order):
    """What a layout does with the batch: dp replicas take row blocks,
    micro-batches smaller ones, tp ranks the same block; every share is the
    same rows of one global batch, in any world size."""
    cfg = make_cfg(batch=16, path=corpus(tmp_path, "a.txt", 1900), order=order)
    td = data_of(cfg)
    again = data_of(cfg)  # another rank's process
    for step in (0, 6, 7, 40):
        whole = td.batch("train", step, range(16))[0]
        for dp in (1, 2, 4, 8, 16):
            for micros in (1, 2):
                share = 16 // dp // micros
                if share == 0:
                    continue
                parts = [again.batch("train", step, range(a, a + share))[0] for a in range(0, 16, share)]
                assert torch.equal(torch.cat(parts), whole), (step, dp, micros)
        assert td.batch_hash("train", step) == again.batch_hash("train", step)
    assert td.batch_hash("train", 6) != td.batch_hash("train", 7)


def test_the_hash_changes_with_any_token_of_the_batch(tmp_path):
    td = data_of(make_cfg(path=corpus(tmp_path, "a.txt", 1900)))
    before = td.batch_hash("train", 2)
    o = int(td.offsets("train", 2)[BATCH - 1]) + SEQ  # the last token (y only) of the last row
    tokens = np.array(td.tokens)
    tokens[o] = (tokens[o] + 1) % 256
    td.tokens = td.streams[0].tokens = tokens
    assert td.batch_hash("train", 2) != before


def test_random_order_keeps_its_offsets(tmp_path):
    """order=random is what every run read before: offsets from (seed, split, step)."""
    from tpctl.data.batches import _step_seed

    td = data_of(make_cfg(path=corpus(tmp_path, "a.txt", 1900), order="random"))
    g = torch.Generator().manual_seed(_step_seed(0, "train", 5))
    assert torch.equal(td.offsets("train", 5), torch.randint(0, td.split_len("train") - SEQ, (BATCH,), generator=g))


def test_the_summary_says_the_epoch_and_the_share_of_it_read(tmp_path):
    td = data_of(make_cfg(path=corpus(tmp_path, "a.txt", 1900)))
    p = td.progress(20)  # 160 rows of 106 windows
    assert (p["data_epoch"], p["data_epoch_fraction"]) == (1, pytest.approx(54 / 106))
    assert p["data"] == "epoch 1, 50.9% of it read (106 windows an epoch, 160 read in all), order epoch"


# ---- data.mix ------------------------------------------------------------------


def _prefix_gap(schedule: MixSchedule, weights, rows: int) -> float:
    """The largest |C_j(n) - n w_j| over every prefix n <= rows and source j."""
    source, _ = schedule.assign(np.arange(rows))
    counts = np.cumsum(np.eye(len(weights))[source], axis=0)
    total = sum(Fraction(w) for w in weights)
    share = np.array([float(Fraction(w) / total) for w in weights])
    return float(np.abs(counts - np.arange(1, rows + 1)[:, None] * share).max())


@pytest.mark.parametrize("weights, batch", [
    (["0.7", "0.3"], 10), (["1", "2", "4"], 7), (["0.5", "0.25", "0.125", "0.125"], 8),
    (["0.13", "0.29", "0.58"], 8), (["3", "1", "1", "1", "1", "1"], 16), (["0.001", "0.999"], 8)])
def test_mix_counts_follow_the_weights_over_every_window_of_steps(weights, batch):
    schedule = MixSchedule([Fraction(w) for w in weights])
    steps = max(3 * schedule.period // batch, 40)
    assert _prefix_gap(schedule, weights, steps * batch) < 1  # every prefix within one row of its share
    source, reads = schedule.assign(np.arange(steps * batch))
    per_step = np.stack([np.bincount(source[s * batch:(s + 1) * batch], minlength=len(weights)) for s in range(steps)])
    share = np.array([float(Fraction(w) / sum(Fraction(x) for x in weights)) for w in weights])
    cum = np.vstack([np.zeros(len(weights)), np.cumsum(per_step, axis=0)])
    for a in range(steps):  # every window of steps [a, b)
        got = cum[a + 1:] - cum[a]
        want = np.arange(1, steps - a + 1)[:, None] * batch * share
        assert np.abs(got - want).max() < 2, a  # two prefixes, each within one row
        exact = np.isclose(batch * share, np.round(batch * share))
        assert (np.abs(got - want)[:, exact] < 1e-9).all(), a  # batch x weight whole: exactly that, every step
    # Each source's reads count its rows in order: 0, 1, 2, ...
    for j in range(len(weights)):
        assert (reads[source == j] == np.arange((source == j).sum())).all()
    # counts() (the summary's) agrees with the assignment.
    assert schedule.counts(steps * batch) == np.bincount(source, minlength=len(weights)).tolist()


def test_a_mix_reads_each_corpus_in_its_own_epoch_order_by_the_weights(tmp_path):
    letters = corpus(tmp_path, "letters.txt", 1900)  # 106 train windows
    digits = corpus(tmp_path, "digits.txt", 1000, b"0123456789")  # 56 train windows
    cfg = make_cfg(batch=10, mix=[f"{letters}:0.7", {"path": digits, "weight": 0.3}])
    td = data_of(cfg)
    assert "mix of" in td.info.description and len(td.streams) == 2
    seen = {0: [], 1: []}
    for step in range(40):
        source, offsets = td.windows("train", step)
        x, _ = td.batch("train", step, range(10))
        is_digit = (x < ord("a")).all(dim=1).numpy()
        assert (is_digit == (source == 1)).all()  # the tokens come from the corpus assigned
        assert np.bincount(source, minlength=2).tolist() == [7, 3]  # 10 x 0.7, 10 x 0.3: every step
        for s, o in zip(source.tolist(), offsets.tolist()):
            seen[s].append(o // SEQ)
    for s, n in ((0, 106), (1, 56)):
        assert sorted(seen[s][:n]) == list(range(n)) and sorted(seen[s][n:2 * n]) == list(range(n))
        assert seen[s][:n] != seen[s][n:2 * n]
    p = td.progress(40)["data_sources"]
    assert [(q["rows"], q["epoch"]) for q in p] == [(280, 2), (120, 2)]
    # Every share of the batch, as in a single corpus.
    again = data_of(cfg)
    assert torch.equal(torch.cat([again.batch("train", 9, range(a, a + 2))[0] for a in range(0, 10, 2)]),
                       td.batch("train", 9, range(10))[0])


# ---- bad values: one line, exit 2, before any worker ----------------------------


@pytest.mark.parametrize("data, key, says", [
    ({"order": "shuffle"}, "data.order", "expected one of epoch, random"),
    ({"mix": "a.txt:1"}, "data.mix", "expected a list"),
    ({"mix": ["a.txt:0"]}, "data.mix[0]", "positive number"),
    ({"mix": ["A:0.5", "a.txt:-1"]}, "data.mix[1]", "positive number"),
    ({"mix": ["a.txt:heavy"]}, "data.mix[0]", "not a number"),
    ({"mix": ["a.txt"]}, "data.mix[0]", "PATH:WEIGHT"),
    ({"mix": [{"weight": 1}]}, "data.mix[0]", "needs a path"),
    ({"mix": [{"path": "A"}]}, "data.mix[0]", "needs a weight"),
    ({"mix": [{"path": "A", "weight": 1, "shuffle": True}]}, "data.mix[0]", "unknown key 'shuffle'"),
    ({"mix": ["A:1"], "path": "A"}, "data.mix", "leave data.path unset"),
    ({"mix": ["A:1"], "name": "synthetic"}, "data.mix", "expected data.name=text"),
    ({"mix": ["A:1", "missing.txt:1"]}, "data.mix[1].path", "no such file"),
    ({"mix": ["A:0.1234567", "A:1"]}, "data.mix", "round the weights"),
])
def test_bad_data_values_are_refused_naming_the_key_the_value_and_what_is_valid(tmp_path, monkeypatch, data, key, says):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "A").write_text("x" * 1000)
    with pytest.raises(ConfigError) as e:
        check_data_keys(make_cfg(**data))
    assert e.value.key == key and says in e.value.valid, str(e.value)
    assert e.value.exit_code == 2 and "\n" not in str(e.value)


def test_the_command_line_forms_of_a_mix_compose(tmp_path):
    from tpctl.config.compose import compose_jobs

    for override in ("data.mix=[a.txt:0.7,data/b:0.3]", "data.mix=[{path:a.txt,weight:0.7},{path:data/b,weight:0.3}]"):
        cfg = compose_jobs(["model=gpt-tiny", override])[0]
        assert [(e.path, e.weight) for e in mix_entries(cfg.data)] == [("a.txt", Fraction(7, 10)), ("data/b", Fraction(3, 10))]
    # The weight is after the last colon: a path may hold one.
    assert mix_entries(OmegaConf.create({"mix": ["runs:v2/a.txt:2"]}))[0].path == "runs:v2/a.txt"


def test_a_bad_mix_on_the_command_line_exits_2_in_one_line(tpctl):  # noqa: F811
    (tpctl.cwd / "a.txt").write_text("x" * 1000)
    done = tpctl.run(["train", "model=gpt-tiny", "data.mix=[a.txt:0.7,a.txt:0]", f"hydra.run.dir={tpctl.cwd / 'run'}"])
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "data.mix[1]='a.txt:0'" in lines[0] and "positive number" in lines[0], done.stderr
    assert not (tpctl.cwd / "run" / "metrics.jsonl").exists()


# ---- a resume in other layouts reads the same tokens ----------------------------

# A corpus of 600 bytes: 33 train windows, so the epoch ends at step 5 (rows
# 32..39), after the checkpoint at step 3: the resumed steps cross it.
RUN = ["model=gpt-tiny", "model.n_layer=1", "optim.eps=1e-5", "data.max_bytes=600", f"train.batch_size={BATCH}",
       f"train.seq_len={SEQ}", "train.log_every=1", "train.eval_every=0", "train.progress=false", "seed=3",
       "train.steps=6"]


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_resume_in_other_layouts_reads_the_same_tokens_and_continues_the_loss(tpctl):  # noqa: F811
    first = tpctl.cwd / "first"
    done = tpctl.run(["train", *RUN, "mode=1d", "size=2", "checkpoint.every=3", f"hydra.run.dir={first}"], timeout=300)
    assert done.returncode == 0, done.stderr
    reference = _metrics(first)
    assert len({r["data_hash"] for r in reference}) == 6
    summary = json.loads((first / "summary.json").read_text())
    assert (summary["data_epoch"], summary["data_epoch_fraction"]) == (1, pytest.approx(15 / 33))
    for name, layout in (("fewer", ["mode=none"]), ("more", ["mode=1d", "size=2", "dp=2"])):
        run = tpctl.cwd / name
        done = tpctl.run(["train", *RUN, *layout, f"train.resume={first / 'checkpoints' / 'step_3'}",
                          f"hydra.run.dir={run}"], timeout=300)
        assert done.returncode == 0, done.stderr
        resumed = _metrics(run)
        assert [r["step"] for r in resumed] == [4, 5, 6]
        assert [r["data_hash"] for r in resumed] == [r["data_hash"] for r in reference[3:]], name
        for want, got in zip(reference[3:], resumed):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-6), (name, got["step"])
