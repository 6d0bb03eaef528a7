"""Text out (tpctl/training/generation.py): greedy decoding gives mode=none's
tokens in every mode, transformers' own `generate` tokens for Hugging Face
GPT-2 and Llama (random weights saved with save_pretrained here, nothing
downloaded), and the KV-cache path equals re-running the whole sequence.
The session's pools (4 ranks, 8 for 2.5d and 3d) serve every case; the CLI runs once (slow)."""

from __future__ import annotations

import pytest
import torch
from conftest import layouts

from tpctl.launch.pool import parallelism_of

MESHES = layouts("none-dp4", "1d-2-dp2", "1d-4", "2d-4", "2.5d-8-d2", "3d-8")
PROMPT = [10, 200, 33, 7, 99]
NEW = 12
# Seconds a pool call may take: the first one waits for the ranks to start and
# every one builds meshes and models, on CI machines other jobs also load.
CALL_TIMEOUT_S = 600


def _run(pool, fn, *args, **kwargs) -> list:
    return pool.run(fn, *args, timeout_s=CALL_TIMEOUT_S, **kwargs)


def _gpt_cfg():
    from tpctl.config import default_config

    cfg = default_config(arch="gpt", vocab_size=256, n_layer=2, n_head=4, n_embd=64, block_size=32)
    return cfg.model


def _build(model_cfg, key: str, seed: int = 0):
    from tpctl.models import build_model
    from tpctl.parallel.tensor.rewrite import rewrite_layers

    # Deliberately the layers alone (no run, no step, no data): what decoding reads.
    mode = parallelism_of(MESHES[key]).mode
    return rewrite_layers(build_model(model_cfg, seed, lazy=True), mode, training=False).model, mode  # (decoded only)


def _scale_up(model) -> None:
    """Random init gives nearly flat logits; make them decisive, so that
    greedy ties cannot hide behind fp32 round-off (the same factor on every
    rank's shard is the same factor on the whole model)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("wte.weight") or name.endswith("wpe.weight"):
                p.mul_(20)


def _greedy(key: str, use_cache: bool = True) -> list[int]:
    from tpctl.training.generation import generate

    model, mode = _build(_gpt_cfg(), key)
    _scale_up(model)
    return generate(model, mode, PROMPT, NEW, use_cache=use_cache)


@pytest.fixture(scope="module")
def reference(pool) -> list[int]:
    out = _run(pool, _greedy, "none-dp4")
    assert all(o == out[0] for o in out)
    assert len(out[0]) == NEW
    return out[0]


@pytest.mark.parametrize("key", ["1d-4", "2d-4", "2.5d-8-d2", "3d-8"])
def test_greedy_equals_none(pool, reference, key):
    out = _run(pool, _greedy, key)
    assert all(o == reference for o in out), (key, out[0], reference)


def _cache_vs_full(key: str) -> float:
    """Largest difference between the cached path's last-position logits
    (prefill, then one token at a time) and a forward of the whole sequence."""
    from tpctl.training.generation import Stepper, config_vocab, last_logits, local_input

    model, mode = _build(_gpt_cfg(), key)
    model.eval()
    vocab = config_vocab(model)
    seq = PROMPT + [5, 6, 7, 8]
    worst = 0.0
    with torch.no_grad():
        cached = Stepper(model, use_cache=True)
        got = last_logits(mode, cached(local_input(mode, PROMPT, "cpu")), vocab)
        for n in range(len(PROMPT), len(seq) + 1):
            want = last_logits(mode, Stepper(model, use_cache=False)(local_input(mode, seq[:n], "cpu")), vocab)
            worst = max(worst, (got - want).abs().max().item())
            if n < len(seq):
                got = last_logits(mode, cached(local_input(mode, [seq[n]], "cpu")), vocab)
    return worst


@pytest.mark.parametrize("key", ["none-dp4", "2d-4", "3d-8"])
def test_kv_cache_equals_full_forward(pool, key):
    worst = max(_run(pool, _cache_vs_full, key))
    assert worst < 1e-5, worst


def test_no_cache_path_same_tokens(pool, reference):
    out = _run(pool, _greedy, "1d-2-dp2", use_cache=False)
    assert out[0] == reference


def _greedy_recomputed(key: str) -> list[int]:
    """Under activation checkpointing (train.sample_every in such a run)."""
    from tpctl.training.generation import generate
    from tpctl.training.recompute import apply_activation_checkpointing

    model, mode = _build(_gpt_cfg(), key)
    _scale_up(model)
    assert apply_activation_checkpointing(model) > 0
    return generate(model, mode, PROMPT, NEW)


def test_activation_checkpointed_model_same_tokens(pool, reference):
    assert _run(pool, _greedy_recomputed, "2d-4")[0] == reference


# ---- Hugging Face ------------------------------------------------------------

HF_VOCAB = 61


def _hf_config(arch: str):
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(vocab_size=HF_VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=32,
                           tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    from transformers import GPT2Config

    return GPT2Config(vocab_size=HF_VOCAB, n_embd=16, n_layer=2, n_head=4, n_positions=32, n_inner=64,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def hf_saved(request, tmp_path_factory):
    """(arch, save_pretrained dir, transformers' greedy tokens)."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    arch = request.param
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(_hf_config(arch)).eval()
    with torch.no_grad():  # decisive logits (see _scale_up)
        model.get_input_embeddings().weight.mul_(20 if arch == "gpt2" else 1)
    directory = tmp_path_factory.mktemp(arch)
    model.save_pretrained(directory)
    prompt = torch.tensor([[p % HF_VOCAB for p in PROMPT]])
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW)
    return arch, str(directory), out[0, prompt.shape[1]:].tolist()


def _hf_greedy(arch: str, directory: str, key: str) -> list[int]:
    from omegaconf import OmegaConf

    from tpctl.config import typed_model
    from tpctl.training.generation import generate

    model, mode = _build(typed_model(OmegaConf.create({"arch": arch, "pretrained": directory})), key)
    return generate(model, mode, [p % HF_VOCAB for p in PROMPT], NEW)


@pytest.mark.parametrize("key", ["none-dp4", "1d-2-dp2", "2d-4", "3d-8"])
def test_hf_greedy_equals_transformers_generate(pool, hf_saved, key):
    arch, directory, want = hf_saved
    out = _run(pool, _hf_greedy, arch, directory, key)
    assert len(want) == NEW
    assert all(o == want for o in out), (arch, key, out[0], want)
