"""Any model through the command line: `model=custom model._target_=...`,
`model=hf`, `tpctl inspect`, refusals (exit 2 naming the module) before any
worker starts, a Hugging Face tokenizer for text data, and two whole runs
whose loss curves equal mode=none's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cli_support import tpctl  # noqa: F401  (fixture)

pytest.importorskip("transformers")

CUSTOM = ["model=custom", "model._target_=tests.custom_model.build", "+model.width=16", "+model.max_len=16",
          "+model.vocab_size=256", "train.seq_len=16"]
LLAMA = ["model=hf", "model.arch=llama", "model.n_head=8", "model.n_kv_head=4", "model.n_embd=32",
         "model.intermediate_size=48", "model.tie_embeddings=false", "model.block_size=16", "train.seq_len=16"]


def _one_error_line(result) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("tpctl: error: invalid config: "), lines[0]
    return lines[0]


@pytest.mark.timeout(120)
def test_a_model_the_mode_cannot_shard_is_refused_naming_the_module(tpctl):
    result = tpctl.run(["train", *CUSTOM, "+model.n_heads=3", "++model.width=24", "mode=2d", "size=4"])
    line = _one_error_line(result)
    assert "cannot shard module stack.0.mixer: 3 query heads do not split 2 ways" in line, line
    assert not (tpctl.cwd / "outputs").exists(), "nothing may start before the config is valid"


@pytest.mark.timeout(120)
def test_custom_model_errors_name_the_key(tpctl):
    assert "model._target_" in _one_error_line(tpctl.run(["train", "model=custom"]))
    line = _one_error_line(tpctl.run(["train", "model=custom", "model._target_=no_such_pkg.build"]))
    assert "model._target_='no_such_pkg.build': cannot import" in line, line
    line = _one_error_line(tpctl.run(["train", *CUSTOM, "+model.no_such_argument=1"]))
    assert "no_such_argument" in line, line


@pytest.mark.timeout(120)
def test_inspect_shows_roles_layers_and_shards(tpctl):
    # The verified column (8 ranks on 2 cores) is test_verify's.
    result = tpctl.run(["inspect", *LLAMA, "mode=3d", "size=8", "train.verify_rewrite=false"])
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for text in ("roles from traced forward", "model.layers.0.self_attn.k_proj", "attn_in", "Linear3D",
                 "SplitNorm", "mlp.gate_proj", "lm_head"):
        assert text in out, text
    # k_proj: 4 kv heads x 4 = 16 out features over q*q=4 blocks, 32 in over q=2.
    assert "weight (4, 16)" in out
    refused = tpctl.run(["inspect", *CUSTOM, "+model.n_heads=3", "++model.width=24", "mode=2d", "size=4"])
    assert refused.returncode == 2
    assert "stack.0.mixer" in refused.stdout and "3 query heads" in refused.stderr


def test_text_data_with_a_hugging_face_tokenizer(tmp_path, monkeypatch):
    """A tokenizer trained here (no download), saved, and used for text data:
    the cached token stream is exactly the tokenizer's ids of the text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tpctl.config import default_config
    from tpctl.data.corpora import prepare_data

    text = "".join(f"line {i}: the quick brown fox jumps over the lazy dog {i % 7}\n" for i in range(400))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text)
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train([str(corpus)], trainers.BpeTrainer(vocab_size=200, special_tokens=["[UNK]"]))
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(tmp_path / "tok")

    monkeypatch.setenv("TPCTL_CACHE_DIR", str(tmp_path / "cache"))
    cfg = default_config()
    cfg.data.path, cfg.data.tokenizer = str(corpus), str(tmp_path / "tok")
    cfg.train.seq_len = 16
    info = prepare_data(cfg)
    ids = np.fromfile(info.path, dtype="<u2")
    want = PreTrainedTokenizerFast.from_pretrained(tmp_path / "tok")(text, add_special_tokens=False)["input_ids"]
    assert ids.tolist() == want
    assert info.vocab_size <= 200 and len(ids) < len(text) / 2  # subwords, not bytes


def _curve(tpctl, args: list[str], name: str) -> list[float]:
    run_dir = tpctl.cwd / name
    result = tpctl.run(["train", *args, "train.steps=10", "train.log_every=1", "train.eval_every=0",
                        "optim.lr=1e-2", "optim.eps=1e-5", "optim.warmup_steps=2", "data.max_bytes=200000", "train.batch_size=8",
                        f"hydra.run.dir={run_dir}"], timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [json.loads(line)["loss"] for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(900)
# A Hugging Face Llama's whole run through the CLI is a recipe (llama-tiny
# 2d and 3d equal to none in `tpctl check-recipes`).
@pytest.mark.parametrize("model,mode", [
    (CUSTOM, ["mode=1d", "size=2", "seq_parallel=true"]),
], ids=["custom-1d-sp"])
def test_whole_run_equals_mode_none(tpctl, model, mode):
    reference = _curve(tpctl, [*model, "mode=none"], "none")
    got = _curve(tpctl, [*model, *mode], "parallel")
    assert reference[-1] < reference[0]
    assert got == pytest.approx(reference, rel=1e-4)
