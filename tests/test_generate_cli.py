"""`tpctl generate` as a user runs it: bad input exits 2 with one line before
any worker starts; end to end (slow), a 3-step training run's checkpoint
decodes to the same tokens in mode=none and 2d, and to the sample the run
itself logged with train.sample_every."""

from __future__ import annotations

import json

import pytest

from cli_support import tpctl  # noqa: F401  (fixture)
from tpctl.commands import generate


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=256, n_embd=16, n_layer=1, n_head=2, n_positions=16,
                        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    directory = tmp_path_factory.mktemp("gpt2")
    GPT2LMHeadModel(config).save_pretrained(directory)
    return directory


def _fails(capsys, args: list[str], *expected: str) -> None:
    assert generate.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tpctl: error: "), err
    for part in expected:
        assert part in err, err


def test_missing_source(capsys, tmp_path):
    _fails(capsys, [str(tmp_path / "nope"), "prompt=hi"], "SOURCE", "no such directory")
    _fails(capsys, [str(tmp_path), "prompt=hi"], "neither a tpctl checkpoint")
    _fails(capsys, ["prompt=hi"], "takes SOURCE first")


def test_bad_settings(capsys, pretrained):
    src = str(pretrained)
    _fails(capsys, [src, "prompt=hi", "bogus=1"], "bogus")
    _fails(capsys, [src, "prompt=hi", "temperature=-1"], "temperature", ">= 0")
    _fails(capsys, [src, "prompt=hi", "top_k=x"], "top_k")
    _fails(capsys, [src, "prompt=hi", "max_new_tokens=15"], "max_new_tokens", "16 positions", "at most 14")
    _fails(capsys, [src], "prompt=")
    _fails(capsys, [src, "prompt="], "no tokens")
    _fails(capsys, [src, "prompt=hi", "mode=2d", "size=3"], "size", "square")
    _fails(capsys, [src, "prompt=hi", "model=gpt-tiny"], "the model comes from SOURCE")
    _fails(capsys, [src, "prompt=hi", "mode=1d", "size=2", "dp=2"], "dp")


@pytest.mark.parametrize("overrides, key", [
    (["train.sample_every=-1"], "train.sample_every"),
    (["train.sample_every=5", "train.sample_tokens=0"], "train.sample_tokens"),
    (["train.sample_every=5", "train.sample_tokens=64"], "train.sample_tokens"),  # gpt-tiny: 64 positions
])
def test_sample_settings_are_checked(overrides, key):
    from tpctl.config import compose_jobs, validate
    from tpctl.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        validate(compose_jobs(overrides)[0], model_check=False)
    assert e.value.key == key


@pytest.mark.slow
def test_checkpoint_generates_in_any_mode(tpctl):  # noqa: F811
    run = tpctl.cwd / "run"
    trained = tpctl.run(["train", "mode=1d", "size=2", "train.steps=3", "train.eval_every=0", "train.progress=false",
                         "optim.lr=0.01", "optim.eps=1e-5", "optim.warmup_steps=0", "train.sample_every=3", "train.sample_tokens=8",
                         "train.sample_prompt=def", f"hydra.run.dir={run}"], timeout=600)
    assert trained.returncode == 0, trained.stderr
    last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["step"] == 3 and isinstance(last["sample"], str)
    outs = {}
    for layout in (["mode=none"], ["mode=2d", "size=4"]):
        done = tpctl.run(["generate", str(run / "checkpoints" / "step_3"), "prompt=def", "temperature=0",
                          "max_new_tokens=8", "--json", *layout], timeout=600)
        assert done.returncode == 0, done.stderr
        outs[layout[0]] = json.loads(done.stdout.strip().splitlines()[-1])
    none, two_d = outs["mode=none"], outs["mode=2d"]
    assert none["tokens"] == 8 and none["ids"] == two_d["ids"]
    # The run's own sample (1d, in the loop) is the final model's greedy text.
    assert none["text"] == last["sample"]
