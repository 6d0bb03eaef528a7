"""Hugging Face models in and out, as a user brings them: tiny
`save_pretrained` directories of several families, built here by
`transformers` itself with the families' default settings (key/value cache
on, the default attention implementation; random weights, nothing
downloaded), their tensors under the names each family stores.

For each directory, on the session's 4-rank pool: `model.pretrained=DIR`
read slice by slice (through transformers' own renames and conversions)
gives `from_pretrained`'s logits; greedy decoding gives `transformers`'
own `generate` tokens in mode=none and 2d; a few training steps in 1d and
2d equal mode=none's within 1e-4; the trained model exported as a
save_pretrained directory (tpctl export) loads with `from_pretrained` to
the trained model's logits (1e-5), and the directories written by the 2d and
the none runs give the same logits.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from cli_support import tpctl, scaled  # noqa: F401  (fixture)
from conftest import build, layouts, trainer_of

pytest.importorskip("transformers")

MESHES = layouts("none-dp4", "1d-2-dp2", "2d-4")
STEPS, BATCH, SEQ = 5, 8, 8
PROMPT, NEW = [10, 200, 33, 7, 99], 8
TOL = dict(rtol=1e-5, atol=1e-5)
SIZES = dict(vocab_size=256, n_layer=2, n_head=4, n_embd=32, mlp_ratio=2, block_size=64)  # MLPs 64 wide
# family -> tpctl model keys besides SIZES (the family's own where it has
# one: Pythia's head is untied, Phi-3's too); the defaults stay the family's.
TRAINED = {
    "qwen2": dict(n_kv_head=2, tie_embeddings=False),  # grouped-query attention
    "gpt_neox": dict(tie_embeddings=False),  # Pythia: fused qkv interleaved per head, embed_out stored
    "phi3": dict(n_kv_head=2, tie_embeddings=False),  # fused [q|k|v] and [gate|up]
    "gemma": dict(n_kv_head=2),  # x_hat * (1 + w), embedding * sqrt(hidden), tied
    "qwen3": dict(n_kv_head=2),  # per-head q/k norms
    "starcoder2": dict(n_kv_head=2),  # grouped-query attention with biases, LayerNorm
    "opt": dict(),  # model.decoder.*, learned positions with an offset, a key bias with a zero gradient
    "gpt2": dict(),  # saved as published: the base model alone, h.* and wte.weight without a prefix
    "bloom": dict(),  # transformer.*, alibi
    "falcon": dict(n_kv_head=2, config={"new_decoder_architecture": True}),  # Falcon-40B style
    "gpt_bigcode": dict(config={"multi_query": False}),  # StarCoder, multi-head
}
# Read in one process (test_stored_names...): experts stored one tensor each.
MOE = {"mixtral": dict(n_kv_head=2, config={"num_local_experts": 3})}
ROUND_TRIP = ("none-dp4", "2d-4")


def _model_cfg(family: str, **extra):
    from omegaconf import OmegaConf

    from tpctl.config import typed_model

    keys = {**SIZES, "bias": None, "dropout": 0.0, **{**TRAINED, **MOE}.get(family, {}), **extra}
    return typed_model(OmegaConf.create({"arch": family, **keys}))


def save_family(family: str, directory, base_only: bool = False, **extra) -> None:
    """A save_pretrained directory of `family` as transformers writes it:
    the family's config (tiny sizes, its own defaults otherwise, the cache
    on), weights from transformers' own init, the LM head scaled so that
    greedy decoding is decisive (no near-ties for round-off to flip).
    base_only: the base model saved alone (GPT-2 as published: `h.*`,
    `wte.weight`, no `transformer.` prefix). `extra`: tpctl model keys."""
    from transformers import AutoModel, AutoModelForCausalLM

    from tpctl.models.hf import family_config

    config = family_config(_model_cfg(family, **extra))
    assert config.use_cache, "the directory must keep the family's default (cache on)"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(10)
    if base_only:
        base = AutoModel.from_config(config)
        base.load_state_dict(model.base_model.state_dict())
        base.config.architectures = [type(model).__name__]
        base.save_pretrained(directory)
    else:
        model.save_pretrained(directory)


def _reference_tokens(directory) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    prompt = torch.tensor([PROMPT])
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=NEW, do_sample=False)  # stops at the family's eos, as tpctl does
    return out[0, len(PROMPT):].tolist()


def _greedy(model, par) -> list[int]:
    """tpctl's greedy tokens, stopping at the model's end-of-sequence ids as
    transformers' generate does."""
    from tpctl.training.generation import generate, stop_ids

    return generate(model, par.mode, PROMPT, NEW, stop=sorted(stop_ids(model, None)))


def _batch():
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (BATCH, SEQ), generator=gen)


def _local(par, full: torch.Tensor, width: int) -> torch.Tensor:
    """This rank's block of whole-model logits (its rows, its vocabulary block)."""
    rows = par.rows(full.shape[0])
    start = par.mode.vocab_block() * width
    return par.mode.split_target(full[rows.start:rows.stop])[..., start:min(start + width, full.shape[-1])]


def _logits_gap(model, par, directory) -> float:
    """Largest difference between this rank's logits and its block of
    from_pretrained(directory)'s."""
    from transformers import AutoModelForCausalLM

    from tpctl.models import logits_of

    ref = AutoModelForCausalLM.from_pretrained(directory).eval()
    ids = _batch()
    with torch.no_grad():
        got = logits_of(model(par.shard_batch(ids)))
        want = _local(par, logits_of(ref(ids, use_cache=False)), got.shape[-1])
    got = got[..., :want.shape[-1]]
    torch.testing.assert_close(got, want, **TOL)
    return (got - want).abs().max().item()


def _cfg(key: str, family: str, directory: str):
    from omegaconf import OmegaConf

    from tpctl.config import default_config

    layout = MESHES[key]
    cfg = default_config()
    cfg.model = _model_cfg(family, pretrained=directory)
    for k, v in {"mode": layout.mode, "size": layout.size, "depth": layout.depth, "dp": layout.dp,
                 # (random windows: the reference's learning check below, first step's loss against the last's,
                 # was written for them; its few steps in epoch order read other windows)
                 "seq_parallel": layout.seq_parallel, "data.name": "text", "data.order": "random",
                 "data.max_bytes": 200_000, "train.batch_size": BATCH, "train.seq_len": SEQ, "train.steps": STEPS,
                 "train.eval_every": 0, "train.log_every": 1, "train.progress": False, "optim.lr": 1e-2, "optim.eps": 1e-5,
                 "optim.warmup_steps": 0, "checkpoint.every": 0}.items():
        OmegaConf.update(cfg, k, v)
    return cfg


def _in_and_out(key: str, family: str, directory: str, decode: bool, run_dir: str | None) -> dict:
    """On every rank of the pool: read the directory in layout `key`
    (verified rewrite, as a worker does), compare with from_pretrained,
    decode greedily (if `decode`), train, and with
    `run_dir` save a checkpoint, export it (rank 0) and load the export."""
    from pathlib import Path

    import torch.distributed as dist

    from tpctl.commands.export import export

    # The step after the reading checks (the Trainer makes it, step=False).
    run = build(_cfg(key, family, directory), MESHES[key], verify=True, step=False)
    model, par = run.model, run.par
    out = {"loaded": _logits_gap(model, par, directory)}
    if decode:
        out["tokens"] = _greedy(model, par)
    trainer = trainer_of(run, run_dir)
    out["curve"] = [(r["loss"], r["grad_norm"]) for r in trainer.fit()]
    if run_dir:
        exported = Path(run_dir) / "exported"
        dist.barrier()
        if dist.get_rank() == 0:
            export(Path(run_dir) / "checkpoints" / f"step_{STEPS}", exported)
        dist.barrier()
        out["exported"] = _logits_gap(model, par, exported)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> (directory, transformers' greedy tokens)."""
    out = {}
    for family in TRAINED:
        directory = tmp_path_factory.mktemp(family)
        save_family(family, directory, base_only=family == "gpt2")
        out[family] = (str(directory), _reference_tokens(directory))
    return out


@pytest.fixture(scope="module")
def references():
    """family -> mode=none's results (with an export)."""
    return {}


def _none(pool, saved, references, family, tmp_path_factory):
    if family not in references:
        directory = saved[family][0]
        run_dir = str(tmp_path_factory.mktemp(f"{family}-none"))
        references[family] = (pool.run(_in_and_out, "none-dp4", family, directory, True, run_dir)[0], run_dir)
    return references[family]


def deviation(want, got) -> tuple[float, float]:
    loss = max(abs(g[0] - w[0]) / abs(w[0]) for w, g in zip(want, got))
    norm = max(abs(g[1] - w[1]) / abs(w[1]) for w, g in zip(want, got))
    return loss, norm


# Every family in 2d, with the round trip (generate, export, reload); 1d for
# the families whose stored layout the 1d split cuts differently (fused and
# grouped projections) -- the layouts themselves are test_models' subject.
IN_1D = ("qwen2", "gpt_neox", "phi3", "falcon")
HF_CASES = [(family, key) for family in TRAINED for key in (("1d-2-dp2",) if family in IN_1D else ()) + ("2d-4",)]


@pytest.mark.parametrize("family,key", HF_CASES)
def test_pretrained_directory_trains_generates_and_exports(pool, saved, references, tmp_path_factory, family, key):
    from transformers import AutoModelForCausalLM

    directory, want = saved[family]
    none, none_dir = _none(pool, saved, references, family, tmp_path_factory)
    assert none["tokens"] == want, (family, none["tokens"], want)
    assert none["curve"][-1][0] < none["curve"][0][0], f"{family}: the reference did not learn"
    round_trip = key in ROUND_TRIP
    run_dir = str(tmp_path_factory.mktemp(f"{family}-{key}")) if round_trip else None
    results = pool.run(_in_and_out, key, family, directory, round_trip, run_dir)
    for r in results:
        assert r["loaded"] < 1e-5
        loss, norm = deviation(none["curve"], r["curve"])
        assert len(r["curve"]) == STEPS and loss < 1e-4 and norm < 1e-4, (loss, norm)
        if round_trip:
            assert r["tokens"] == want, (family, key, r["tokens"], want)
            assert r["exported"] < 1e-5
    if round_trip:  # the 2d run's export and the none run's: the same model
        a, b, start = (AutoModelForCausalLM.from_pretrained(d).state_dict()
                       for d in (f"{none_dir}/exported", f"{run_dir}/exported", directory))
        assert a.keys() == b.keys()
        gap, name = max((_export_gap(a[n], b[n], start[n]), n) for n in a)
        assert gap < EXPORT_GAP, (family, name, gap)


# Two layouts' exports after STEPS steps of AdamW at lr 1e-2 differ by their
# sums' round-off, which AdamW amplifies where a gradient nearly cancels, and
# by how much depends on the CPU (its logits were 7e-5 apart on one machine,
# 6.7e-4 on another). So each tensor's gap is judged against how far training
# moved it: round-off leaves a small fraction of that, while an export that
# slices a tensor wrongly is as far off as the tensor itself (measured in
# test_export_gap_catches_a_wrongly_sliced_tensor).
EXPORT_GAP = 1e-2


def _export_gap(a: torch.Tensor, b: torch.Tensor, start: torch.Tensor, lr: float = 1e-2) -> float:
    """How far apart two runs' exports of one tensor are, relative to how far
    the first run's training moved it from `start` plus one AdamW step of
    the whole tensor (lr per element): a tensor whose gradient is round-off
    in exact arithmetic (a key bias under absolute positions) moves by
    round-off alone, and its two runs' gaps are then of that size too."""
    a, b, start = a.double(), b.double(), start.double()
    return ((a - b).norm() / ((a - start).norm() + lr * a.numel() ** 0.5)).item()


def test_export_gap_catches_a_wrongly_sliced_tensor():
    """The measure EXPORT_GAP is applied to: an export whose rows are taken
    in the wrong order, or whose two halves are swapped (a shard misplaced),
    is about as far off as the tensor is large, past EXPORT_GAP by a wide
    margin, even where training moved it by as much as its initial size;
    round-off far below training's step passes."""
    gen = torch.Generator().manual_seed(0)
    for start in (torch.randn(64, 32, generator=gen) * 0.02, torch.zeros(64)):  # a weight; a bias from zeros
        trained = start + torch.randn(start.shape, generator=gen) * 1e-2 * STEPS  # STEPS full steps of lr 1e-2
        assert _export_gap(trained, trained.roll(trained.shape[0] // 2, dims=0), start) > 50 * EXPORT_GAP
        assert _export_gap(trained, trained.flip(0), start) > 50 * EXPORT_GAP
        assert _export_gap(trained, trained * (1 + 1e-4 * torch.randn(start.shape, generator=gen)), start) \
            < EXPORT_GAP / 50


# ---- size keys, names, initial values: in one process -----------------------

def test_size_keys_map_onto_each_familys_own_names():
    from tpctl.models.hf import family_config

    gpt2 = family_config(_model_cfg("gpt2", dropout=0.1))  # GPT-2 calls them n_embd, n_inner, *_pdrop
    assert (gpt2.n_embd, gpt2.n_layer, gpt2.n_head, gpt2.n_positions, gpt2.n_inner) == (32, 2, 4, 64, 64)
    assert gpt2.resid_pdrop == gpt2.attn_pdrop == gpt2.embd_pdrop == 0.1
    falcon = family_config(_model_cfg("falcon"))  # num_kv_heads, ffn_hidden_size
    assert (falcon.num_kv_heads, falcon.ffn_hidden_size, falcon.new_decoder_architecture) == (2, 64, True)
    opt = family_config(_model_cfg("opt"))
    assert (opt.ffn_dim, opt.hidden_size, opt.max_position_embeddings) == (64, 32, 64)
    gemma = family_config(_model_cfg("gemma"))  # its own default head_dim (256) follows the width
    assert (gemma.head_dim, gemma.num_key_value_heads, gemma.tie_word_embeddings) == (8, 2, True)
    qwen2 = family_config(_model_cfg("qwen2", config={"rope_theta": 12345.0}))  # passed through
    assert (qwen2.num_key_value_heads, qwen2.rope_parameters["rope_theta"]) == (2, 12345.0)
    assert len(qwen2.layer_types) == 2  # derived by the family from n_layer, as a user's config would be
    # bias: null keeps the family's own; true/false sets every bias setting it has.
    assert family_config(_model_cfg("gpt_neox")).attention_bias is True
    assert family_config(_model_cfg("gpt_neox", bias=False)).attention_bias is False
    llama = family_config(_model_cfg("llama", bias=True))
    assert llama.attention_bias is True and llama.mlp_bias is True


def test_settings_sized_for_the_familys_default_heads_follow_the_size_keys():
    """GPT-J's and CodeGen's rotary part of a head (64 of a 256-wide head by
    default) keeps its share of a head of 8; X-MOD's one language is the
    input's; each then runs a forward. A router left without its top-k
    (DeepSeek-V2) is refused naming the setting."""
    from tpctl.errors import ConfigError
    from tpctl.models import build_model, logits_of
    from tpctl.models.hf import family_config

    for family in ("gptj", "codegen", "xmod"):
        config = family_config(_model_cfg(family))
        if family == "xmod":
            assert config.default_language == "en_XX"
        else:
            assert config.rotary_dim == 2
        logits = logits_of(build_model(_model_cfg(family), seed=0)(torch.randint(0, 256, (1, 8))))
        assert logits.shape == (1, 8, 256) and torch.isfinite(logits).all()
    with pytest.raises(ConfigError, match=r"num_experts_per_tok \(its router's top-k\) unset: set it with "
                                          r"\+model.config.num_experts_per_tok=K"):
        family_config(_model_cfg("deepseek_v2"))
    assert family_config(_model_cfg("deepseek_v2", config={"num_experts_per_tok": 2})).num_experts_per_tok == 2


@pytest.mark.parametrize("overrides, key, phrase", [
    (["model.arch=qwen7"], "model.arch", "builds as a causal LM (did you mean 'qwen"),
    (["model.arch=qwen2", "+model.config.no_such_setting=1"], "model.config.no_such_setting", "not a setting of Qwen2Config"),
    (["model.arch=qwen2", "+model.config.num_attention_heads=four"], "model", "Qwen2Config refuses"),
    (["model.arch=gpt_neox", "model.n_kv_head=2"], "model.n_kv_head", "GPTNeoXConfig has no setting for it"),
    (["model.arch=gpt2", "model.bias=false"], "model.bias", "GPT2Config has no bias setting"),
])
def test_what_a_family_cannot_take_is_refused_naming_the_key(overrides, key, phrase):
    from tpctl.config import compose_jobs, validate
    from tpctl.errors import ConfigError

    cfg = compose_jobs(["model=hf", "train.seq_len=16", *overrides])[0]
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert e.value.key == key and phrase in str(e.value), str(e.value)


def test_a_family_setting_without_its_plus_says_how_to_add_it():
    from tpctl.config import compose_jobs
    from tpctl.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        compose_jobs(["model=hf", "model.arch=qwen2", "model.config.rope_theta=1e6"])
    assert e.value.key == "model.config.rope_theta" and "+model.config.rope_theta=<value>" in str(e.value)


def test_stored_names_are_read_through_transformers_own_mapping(tmp_path):
    """GPT-NeoX stores its head as embed_out (the model calls it lm_head),
    GPT-2 as published has no transformer. prefix, a mixture of experts
    stores one tensor per expert (the model stacks them): each parameter
    knows its stored tensor, or the conversion that makes it."""
    from tpctl.models import build_model

    names = {}
    for family, base_only in (("gpt_neox", False), ("gpt2", True), ("mixtral", False)):
        save_family(family, tmp_path / family, base_only=base_only)
        model = build_model(_model_cfg(family, pretrained=str(tmp_path / family)), seed=0, lazy=True)
        names[family] = model.tpctl_init.stored
    assert names["gpt_neox"].direct["lm_head.weight"] == "embed_out.weight"
    assert names["gpt2"].direct["transformer.h.0.attn.c_attn.weight"] == "h.0.attn.c_attn.weight"
    assert names["gpt2"].source(["lm_head.weight", "transformer.wte.weight"]) == ("stored", "wte.weight")  # tied: once
    moe = names["mixtral"]
    assert moe.source(["model.layers.0.mlp.experts.gate_up_proj"]) == ("converted", "model.layers.0.mlp.experts.gate_up_proj")
    stacked = [key for key, _ in moe.groups["model.layers.0.mlp.experts.gate_up_proj"][1]]
    assert len(stacked) == 6 and all(".experts." in key for key in stacked)  # 3 experts x (gate, up)
    # The converted (and renamed) values are from_pretrained's: the same logits.
    from transformers import AutoModelForCausalLM

    from tpctl.models import logits_of

    ids = _batch()
    for family in names:
        model = build_model(_model_cfg(family, pretrained=str(tmp_path / family)), seed=0).eval()
        ref = AutoModelForCausalLM.from_pretrained(tmp_path / family).eval()
        with torch.no_grad():
            torch.testing.assert_close(logits_of(model(ids)), ref(ids, use_cache=False).logits, **TOL)


@pytest.mark.parametrize("damage, phrase", [
    ("drop", "no stored tensor for 1 parameter(s) of Qwen2ForCausalLM, first model.layers.1.mlp.down_proj.weight"),
    ("shrink", "model.layers.1.mlp.down_proj.weight has shape (32, 63), Qwen2ForCausalLM.model.layers.1.mlp.down_proj.weight expects (32, 64)"),
])
def test_a_directory_that_does_not_fit_the_family_is_refused_before_any_worker(tmp_path, damage, phrase):
    """A parameter no stored tensor feeds (from_pretrained would leave it
    randomly initialised), a stored tensor of another shape: one line,
    before any worker starts."""
    from safetensors.torch import load_file, save_file

    from tpctl.config import compose_jobs, validate
    from tpctl.errors import ConfigError

    save_family("qwen2", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    key = "model.layers.1.mlp.down_proj.weight"
    if damage == "drop":
        del tensors[key]
    else:
        tensors[key] = tensors[key][:, :63].contiguous()
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    cfg = compose_jobs(["model=hf", f"model.pretrained={tmp_path}", "train.seq_len=16"])[0]
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert phrase in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert cfg.model.arch == "qwen2", "a pretrained directory names its family"


def test_a_directory_of_a_family_transformers_does_not_build_is_refused_naming_its_model_type(tmp_path):
    from pathlib import Path

    from tpctl.commands.generate import compose
    from tpctl.config import compose_jobs, validate
    from tpctl.errors import ConfigError

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen7"}))
    cfg = compose_jobs(["model=hf", f"model.pretrained={tmp_path}", "train.seq_len=16"])[0]
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert e.value.key == "model.pretrained" and "model_type 'qwen7'" in str(e.value), str(e.value)
    with pytest.raises(ConfigError) as e:  # tpctl generate DIR: the same reason
        compose(Path(tmp_path), "dir", [])
    assert e.value.key == "SOURCE" and "did you mean 'qwen" in str(e.value), str(e.value)
    assert "expected gpt2" not in str(e.value), "a directory's family is a transformers model_type"


def test_a_checkpoint_written_before_model_config_existed_is_the_same_model():
    from tpctl.checkpoint import model_difference

    before = {"arch": "llama", "n_layer": 2, "bias": False}
    assert model_difference(before, {**before, "config": {}}) is None
    assert "model.config={} in the checkpoint" in model_difference(before, {**before, "config": {"rope_theta": 1.0}})


def test_random_weights_of_any_family_are_fixed_by_the_seed_alone():
    """Rules tpctl knows (Linear, Embedding, norms: the identity scale,
    0 for Gemma's 1 + w) and the family's own init for the rest (stacked
    experts), each from (seed, name): lazily sliced or built whole, the
    same values."""
    from tpctl.models import build_model
    from tpctl.parallel.shard import ShardSpec

    gemma = build_model(_model_cfg("gemma"), seed=3)
    assert torch.count_nonzero(gemma.model.norm.weight) == 0  # x_hat * (1 + 0)
    moe_cfg = _model_cfg("mixtral")
    whole = build_model(moe_cfg, seed=3)
    experts = whole.model.layers[0].mlp.experts.gate_up_proj
    assert torch.isfinite(experts).all() and 0.01 < experts.std().item() < 0.03  # initializer_range 0.02
    lazy = build_model(moe_cfg, seed=3, lazy=True)
    meta = lazy.model.layers[0].mlp.experts.gate_up_proj
    half = ShardSpec(tuple(meta.shape), (None, ((0, meta.shape[1] // 2),), None))
    assert torch.equal(lazy.tpctl_init.shard(meta, half), half.slice(experts.detach()))
    assert not torch.equal(build_model(moe_cfg, seed=4).model.layers[0].mlp.experts.gate_up_proj, experts)


# ---- through the command line ---------------------------------------------------

@pytest.mark.timeout(120)
def test_an_unknown_family_exits_2_naming_the_valid_ones(tpctl):  # noqa: F811
    result = tpctl.run(["train", "model=hf", "model.arch=qwen7"])
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tpctl: error: invalid config: model.arch='qwen7': "), lines
    assert "qwen2" in lines[0] and "gpt_neox" in lines[0] and "llama" in lines[0]
    assert not (tpctl.cwd / "outputs").exists()


@pytest.mark.parametrize("a_shape, b_shape, offs", [((12, 8), (3, 8, 16), [4, 8, 12]), ((3, 4, 8), (3, 8, 16), None)])
def test_grouped_mm_traced_has_the_kernels_shape(a_shape, b_shape, offs):
    """transformers' stacked experts call torch._grouped_mm by default; on a
    stand-in weight or the meta device the trace answers with zeros
    (roles/tracing._skip_grouped_mm) whose shape must be the CPU kernel's."""
    from tpctl.parallel.roles.tracing import _skip_grouped_mm

    a, b = torch.randn(a_shape), torch.randn(b_shape)
    kwargs = {} if offs is None else {"offs": torch.tensor(offs, dtype=torch.int32)}
    real = torch._grouped_mm(a, b, **kwargs)
    traced = _skip_grouped_mm(torch._grouped_mm, (a.to("meta"), b.to("meta")), kwargs, set())
    assert traced.shape == real.shape and traced.dtype == real.dtype and traced.is_meta
    assert _skip_grouped_mm(torch._grouped_mm, (a, b), kwargs, set()) is None  # real operands: computed


def _split_ratio(stdout: str) -> float:
    """The whole model's parameter bytes over rank 0's, from inspect's caption."""
    found = re.search(r"parameters: .* whole, .* on rank 0[^(]*\(([\d.]+)x less\)", stdout)
    assert found, stdout[-2000:]
    return float(found.group(1))


def _moe_keys(arch: str, experts: str) -> list[str]:
    return ["model=hf", f"model.arch={arch}", "model.vocab_size=256", "model.n_layer=1", "model.n_head=4",
            "model.n_embd=32", "model.block_size=32", f"+model.config.{experts}=4", "+model.config.num_experts_per_tok=2",
            "train.seq_len=16", "train.batch_size=4"]


@pytest.mark.timeout(420)
def test_experts_on_grouped_mm_inspect_and_train_like_mode_none(tpctl):  # noqa: F811
    """GPT-OSS with transformers' default experts implementation (grouped
    matmuls) through the command line: inspect describes it (its trace on
    the meta device failed in grouped_mm's meta kernel, a traceback) with
    its experts split (they are ~80% of its parameters: whole, rank 0 would
    hold ~1.1x less; inspect counted the experts' shards, rewritten in
    place, as the whole model's), and 1d-2 and 2d-4 train as mode=none."""
    keys = _moe_keys("gpt_oss", "num_local_experts")
    for layout, least in ((["mode=1d", "size=2"], 1.9), (["mode=2d", "size=4"], 2.1)):
        shown = tpctl.run(["inspect", *keys, *layout], timeout=180)
        assert shown.returncode == 0 and "GptOssExperts" in shown.stdout, shown.stderr[-2000:]
        assert "(sharded in place)" in shown.stdout and _split_ratio(shown.stdout) >= least, shown.stdout[-3000:]
    run = ["train", *keys, "train.steps=2", "data=synthetic", "train.progress=false", "optim.eps=1e-5",
           "train.log_every=1", "train.eval_every=0", "checkpoint.at_end=false"]
    losses = {}
    for layout in (["mode=none"], ["mode=1d", "size=2"], ["mode=2d", "size=4"]):
        out = tpctl.cwd / layout[0].split("=")[1]
        done = tpctl.run([*run, *layout, f"hydra.run.dir={out}"], timeout=180)
        assert done.returncode == 0, done.stderr[-2000:]
        losses[layout[0]] = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
                             if "loss" in json.loads(line)]
    assert len(losses["mode=none"]) == 2
    assert losses["mode=1d"] == pytest.approx(losses["mode=none"], rel=1e-6)
    assert losses["mode=2d"] == pytest.approx(losses["mode=none"], rel=1e-6)


@pytest.mark.timeout(180)
def test_transposed_experts_on_grouped_mm_inspect_split(tpctl):  # noqa: F811
    """Mixtral's experts (not transposed: (E, 2I, H)) hand grouped_mm a
    transposed view of their weight, not the trace's stand-in itself
    (roles/tracing._stand_in): with the default implementation inspect
    ended in "Invalid strides/sizes"; now the experts are split."""
    shown = tpctl.run(["inspect", *_moe_keys("mixtral", "num_local_experts"), "mode=1d", "size=2"], timeout=150)
    assert shown.returncode == 0 and "MixtralExperts" in shown.stdout, shown.stderr[-2000:]
    assert _split_ratio(shown.stdout) >= 1.9, shown.stdout[-3000:]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch, experts, inner, size", [("gpt_oss", "num_local_experts", 20, 2), ("mixtral", "num_local_experts", 24, 4)])
def test_experts_shards_grouped_mm_refuses_run_eager(tpctl, arch, experts, inner, size):  # noqa: F811
    """grouped_mm's kernels refuse operands whose strides are no multiple of
    16 bytes: a shard's inner width (20 / 2, 24 / 4 in fp32) gives such
    strides where the whole's did not. GPT-OSS's split (measured on shards)
    was not found and its experts ran whole; Mixtral's 1d-4 refused to start
    ("strides should be multiple of 16 bytes"). Now both are measured and
    run by the module's eager forward (roles/experts.run_eager), split, and
    train as mode=none."""
    keys = [*_moe_keys(arch, experts), f"model.intermediate_size={inner}"]
    layout = ["mode=1d", f"size={size}"]
    shown = tpctl.run(["inspect", *keys, *layout], timeout=180)
    assert shown.returncode == 0 and _split_ratio(shown.stdout) >= 1.5, shown.stdout[-3000:] + shown.stderr[-2000:]
    run = ["train", *keys, "train.steps=2", "data=synthetic", "train.progress=false", "optim.eps=1e-5",
           "train.log_every=1", "train.eval_every=0", "checkpoint.at_end=false"]
    losses = []
    for where, mode in (("none", ["mode=none"]), ("tp", layout)):
        done = tpctl.run([*run, *mode, f"hydra.run.dir={tpctl.cwd / where}"], timeout=180)
        assert done.returncode == 0, done.stderr[-2000:]
        losses.append([json.loads(line)["loss"] for line in (tpctl.cwd / where / "metrics.jsonl").read_text().splitlines()
                       if "loss" in json.loads(line)])
    assert len(losses[0]) == 2 and losses[1] == pytest.approx(losses[0], rel=1e-6)


def _tokenizer(directory) -> None:
    """A byte-level BPE tokenizer of 200 ids, trained here (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = "".join(f"def f{i}(x):\n    return x * {i % 7} + {i}\n" for i in range(300))
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=200, special_tokens=["[UNK]"]))
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(directory)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_pretrained_directory_through_train_export_and_generate(tpctl):  # noqa: F811
    """As a user: a Pythia-style directory (embed_out stored) trained in 1d
    with its tokenizer, exported, and the export decoded by tpctl in 1d to
    transformers' own greedy tokens (every family in 2d: on the pool above)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, tok, out = tpctl.cwd / "pythia", tpctl.cwd / "tok", tpctl.cwd / "exported"
    _tokenizer(tok)
    # The vocabulary of the tokenizer: tpctl never picks an id the tokenizer
    # lacks, transformers' generate does not know of it.
    vocab = len(AutoTokenizer.from_pretrained(tok))
    save_family("gpt_neox", source, vocab_size=vocab)
    run = tpctl.cwd / "run"
    trained = tpctl.run(["train", "model=hf", f"model.pretrained={source}", f"data.tokenizer={tok}", f"data.vocab_size={vocab}",
                         "mode=1d", "size=2",
                         "train.steps=3", "train.batch_size=8", "train.seq_len=16", "train.eval_every=0",
                         "data.max_bytes=100000", f"hydra.run.dir={run}"], timeout=600)
    assert trained.returncode == 0, trained.stdout[-2000:] + trained.stderr[-2000:]
    exported = tpctl.run(["export", str(run / "checkpoints" / "step_3"), str(out)], timeout=300)
    assert exported.returncode == 0, exported.stderr
    stored = json.loads((out / "config.json").read_text())
    assert stored["model_type"] == "gpt_neox" and stored["use_cache"] is True  # the family's config, as the user had it
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as f:
        assert "embed_out.weight" in f.keys() and "lm_head.weight" not in f.keys()  # the family's stored names
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)  # the run's tokenizer came along
    prompt = "def f3(x):"
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids):]
    done = tpctl.run(["generate", str(out), f"prompt={prompt}", "temperature=0", "max_new_tokens=6", "--json",
                      "mode=1d", "size=2"], timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["prompt_ids"] == ids and got["ids"] == want.tolist(), (got, want.tolist())


def measure() -> None:
    """The table of docs/benchmarks.md: `python tests/test_hf_io.py` (8 gloo ranks, a
    few minutes on 2 cores): per family, the largest difference to
    from_pretrained's logits as read (mode=none, 2d), the largest relative
    loss difference of 1d and 2d to mode=none over the steps, whether
    greedy tokens equal transformers' (none, 2d), and the exported models'
    logits against the trained ones and the 2d export's against none's."""
    import sys
    import tempfile
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from tpctl.launch.pool import DistPool

    sys.path.insert(0, str(Path(__file__).parent))
    pool = DistPool(4, timeout_s=scaled(900))  # every layout below has 4 ranks
    root = Path(tempfile.mkdtemp(prefix="hf-io-"))
    print("| family | read, none / 2d | train 1d / 2d vs none | greedy = transformers, none / 2d "
          "| export vs trained, none / 2d | 2d export vs none export |")
    print("|---|---|---|---|---|---|")
    try:
        for family in TRAINED:
            directory = root / family
            save_family(family, directory, base_only=family == "gpt2")
            want = _reference_tokens(directory)
            row, runs = {}, {}
            for key in ("none-dp4", "1d-2-dp2", "2d-4"):
                run_dir = None
                if key in ROUND_TRIP:
                    run_dir = str(root / f"{family}-{key}")
                    Path(run_dir).mkdir()
                row[key] = pool.run(_in_and_out, key, family, str(directory), key in ROUND_TRIP, run_dir)
                runs[key] = run_dir
            none = row["none-dp4"]
            read = " / ".join(f"{max(r['loaded'] for r in row[k]):.1e}" for k in ROUND_TRIP)
            greedy = " / ".join(str(all(r["tokens"] == want for r in row[k])).lower() for k in ROUND_TRIP)
            trained = " / ".join(f"{max(deviation(none[0]['curve'], r['curve'])[0] for r in row[k]):.1e}"
                                 for k in ("1d-2-dp2", "2d-4"))
            exported = " / ".join(f"{max(r['exported'] for r in row[k]):.1e}" for k in ROUND_TRIP)
            a, b = (AutoModelForCausalLM.from_pretrained(f"{runs[k]}/exported").eval() for k in ROUND_TRIP)
            with torch.no_grad():
                ids = _batch()
                across = f"{(a(ids, use_cache=False).logits - b(ids, use_cache=False).logits).abs().max().item():.1e}"
            print(f"| {family} | {read} | {trained} | {greedy} | {exported} | {across} |", flush=True)
    finally:
        pool.close()


if __name__ == "__main__":
    measure()
