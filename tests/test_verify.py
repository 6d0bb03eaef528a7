"""The start-up verification (parallel/verify/proof.py): every mode passes it on
tpctl's GPT and on Hugging Face Llama and GPT-2; a replacement whose
arithmetic is broken on purpose, and a fused projection sliced in the wrong
layout, are refused, naming the module or block. The session's pools
(4 ranks, 8 for 2.5d and 3d) serve every case; one slow CLI run checks the exit-2 line."""

from __future__ import annotations

import pytest
import torch
from cli_support import tpctl  # noqa: F401  (fixture)
from conftest import layouts

from tpctl.launch.pool import parallelism_of

MESHES = layouts("none-dp4", "1d-2-dp2", "1d-2-sp-dp2", "2d-4", "2.5d-8-d2", "3d-8")
VOCAB = 37
# Models of tests/verify_models.py with one mechanism each, which every mode must carry and the check accept.
MECHANISMS = ("positions", "head_norm_list", "fused_head_norms", "mqa", "fused_mqa")


def _model(name: str) -> torch.nn.Module:
    """The model lazily built from its config, as a worker builds it."""
    from omegaconf import OmegaConf

    from tpctl.config import typed_model
    from tpctl.models import build_model

    if name in ("interleaved", "width_scaled"):
        from tests import verify_models

        torch.manual_seed(0)
        return getattr(verify_models, name)(VOCAB, 16, 4, 2)
    if name in MECHANISMS:
        from tests.verify_models import mechanism

        torch.manual_seed(0)
        return mechanism(name, VOCAB, 16, 4, 2)
    if name == "qwen2_moe":
        from tests.hf_families import build

        torch.manual_seed(0)
        return build(name, VOCAB, 16, 2, 16)
    if name == "neox":
        from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

        torch.manual_seed(0)
        return GPTNeoXForCausalLM(GPTNeoXConfig(
            vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32,
            max_position_embeddings=32, use_cache=False, bos_token_id=None, eos_token_id=None, pad_token_id=None))
    sizes = {"gpt": {"n_head": 4, "n_embd": 16, "bias": True},
             "llama": {"n_head": 8, "n_kv_head": 4, "n_embd": 32, "intermediate_size": 48, "tie_embeddings": False},
             "gpt2": {"n_head": 4, "n_embd": 16, "tie_embeddings": True}}[name]
    cfg = typed_model(OmegaConf.create({"arch": name, "vocab_size": VOCAB, "n_layer": 2, "block_size": 16,
                                        "bias": None, **sizes}))
    return build_model(cfg, seed=0, lazy=True)


def _verify(key: str, name: str, plan=None, break_role: str = "", how: str = "") -> dict:
    """Rewrite and verify model `name` in layout `key` on this rank; with
    `break_role`, the mode's layer for that role broken on purpose (`how`)."""
    import dataclasses

    from tpctl.parallel.tensor import rewrite
    from tpctl.parallel.verify.proof import TOLERANCE, RewriteRefused, rewrite_verified

    par = parallelism_of(MESHES[key])
    mode = par.mode
    share_slices = rewrite.share_slices
    if how == "no shared sum":  # a key/value head several ranks hold: gradients never summed
        rewrite.share_slices = lambda *a, **k: None
    model = _model(name)
    if break_role:
        convert = getattr(mode, f"convert_{break_role}")

        def broken(module, ctx):
            new = convert(module, ctx)
            forward = new.forward
            if how == "drop a scale":
                new.forward = lambda *a, **k: forward(*a, **k) * 0.5
            elif how == "skip the bias":
                new.forward = lambda *a, **k: forward(*a, **k) - new.bias
            elif how == "no replica sum":  # its parameters' gradients left partial
                for p in new.parameters():
                    p.tpctl_spec = dataclasses.replace(p.tpctl_spec, partial_grad=False)
            elif how == "drop its entry hook":  # 1d experts: input and routing weights' gradients not summed
                new._forward_pre_hooks.clear()
            elif how == "drop the bias":  # forgotten: its initial value (zeros) shows in no output
                new.register_parameter("bias", None)
            return new

        setattr(mode, f"convert_{break_role}", broken)  # on this instance; removed below
    try:
        done, report = rewrite_verified(model, par, plan)
        model = done.model
        refusal = None
    except RewriteRefused as e:
        refusal, report = str(e), e.report
    finally:
        mode.__dict__.pop(f"convert_{break_role}", None)
        rewrite.share_slices = share_slices
    checks = [] if report is None else report.checks
    return {"refusal": refusal, "tolerance": TOLERANCE, "seconds": None if report is None else report.seconds,
            "checks": {c.name: (c.kind, c.cls, c.diff, c.note, len(c.instances)) for c in checks}}


@pytest.mark.parametrize("key", list(MESHES))
@pytest.mark.parametrize("name", ["gpt", "llama", "gpt2"])
def test_every_mode_passes_verification(pool, name, key):
    results = pool.run(_verify, key, name)
    for r in results:
        assert r["refusal"] is None, r["refusal"]
        if key.startswith("none"):  # nothing replaced, nothing to check
            assert r["checks"] == {}
            continue
        checked = {n: c for n, c in r["checks"].items() if not c[3]}
        blocks = [c for c in checked.values() if c[0] == "block"]
        modules = [c for c in checked.values() if c[0] == "module"]
        # Both decoder layers are one distinct block: checked once.
        assert len(blocks) == 1 and blocks[0][4] == 2, r["checks"]
        assert len(modules) >= 4, r["checks"]
        assert {n for n, c in checked.items() if c[0] == "stage"} == {"embedding", "head"}
        assert all(0 <= c[2] <= r["tolerance"] for c in checked.values()), checked
    assert results[0]["checks"] == results[-1]["checks"], "ranks must agree on every difference"


# A real error moves a module's output or a gradient by 0.3 to 1.7 of its
# scale; fp32 round-off, 1e-7 to 1e-6 (a gradient judged against its
# module's largest gradient): a refusal must come with a difference at least
# 100 times the tolerance.
@pytest.mark.parametrize("key,role,how,module", [
    ("2d-4", "embedding", "drop a scale", "wte"),
    ("3d-8", "embedding", "drop a scale", "wte"),
    ("1d-2-dp2", "embedding", "drop a scale", "wte"),
    ("2d-4", "norm", "skip the bias", "blocks.0.ln_1"),
    ("3d-8", "mlp_out", "skip the bias", "blocks.0.mlp.proj"),
    ("2d-4", "norm", "no replica sum", "blocks.0.ln_1"),
    ("2.5d-8-d2", "mlp_in", "no replica sum", "blocks.0.mlp.fc"),
])
def test_broken_replacement_is_refused_naming_the_module(pool, key, role, how, module):
    for r in pool.run(_verify, key, "gpt", break_role=role, how=how):
        assert r["refusal"] is not None, f"{how} in the {role} layer was not refused"
        assert f"module {module} (" in r["refusal"], r["refusal"]
        assert r["checks"][module][2] > 100 * r["tolerance"]


# 1d keeps norms as they are, so there the block names what its norms lack.
@pytest.mark.parametrize("key,where", [("1d-2-dp2", "block blocks.0 (Block): the rewrite holds ln_1.bias, ln_2.bias"),
                                       ("2d-4", "module blocks.0.ln_1 (LayerNorm): the rewrite holds bias"),
                                       ("3d-8", "module blocks.0.ln_1 (LayerNorm): the rewrite holds bias")])
def test_a_parameter_the_rewrite_drops_is_refused(pool, key, where):
    """Norms whose bias the rewrite forgets: its initial value (zeros)
    leaves every output and every other gradient as the original's, so only
    a count of the original's parameters sees that nothing would train it."""
    for r in pool.run(_verify, key, "gpt", break_role="norm", how="drop the bias"):
        assert r["refusal"] is not None, "a dropped bias was not refused"
        assert where in r["refusal"] and "on no rank" in r["refusal"], r["refusal"]


@pytest.mark.parametrize("key", ["1d-2-dp2", "2d-4", "2.5d-8-d2", "3d-8"])
@pytest.mark.parametrize("name", MECHANISMS)
def test_each_mechanism_is_accepted_in_every_mode(pool, name, key):
    """Correct rewrites refused before for untrue reasons: a zero-gradient
    key bias, per-head norms in a list, norms after a fused qkv's split,
    one key/value head for all query heads."""
    for r in pool.run(_verify, key, name):
        assert r["refusal"] is None, r["refusal"]
        assert all(c[2] <= r["tolerance"] for c in r["checks"].values() if not c[3]), r["checks"]


def test_a_key_bias_under_absolute_positions_has_a_zero_gradient():
    """The premise of the scale the check judges a gradient against: the
    key bias's gradient is round-off, not of its own size (softmax ignores
    a shift common to every key), while its weight's is not."""
    model = _model("positions")
    model(torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(0))).square().mean().backward()
    k = model.blocks[0].attn.k
    assert k.bias.grad.abs().max() < 1e-5 * k.weight.grad.abs().max(), (k.bias.grad, k.weight.grad.abs().max())


@pytest.mark.parametrize("key,name,role,how,where", [
    ("1d-2-dp2", "mqa", "", "no shared sum", "module blocks.0.attn.k ("),
    ("2d-4", "mqa", "", "no shared sum", "module blocks.0.attn.k ("),
    ("2d-4", "head_norm_list", "", "no shared sum", "block blocks.0 ("),
    ("1d-2-dp2", "qwen2_moe", "experts", "drop its entry hook", "block model.layers.0 ("),
])
def test_a_broken_mechanism_is_refused(pool, key, name, role, how, where):
    """Shared key/value heads or per-head norms whose replicas' gradients are
    never summed; experts whose input and routing weights' gradients are
    left partial: refused, with margin."""
    for r in pool.run(_verify, key, name, break_role=role, how=how):
        assert r["refusal"] is not None and where in r["refusal"], r["refusal"]
        assert max(c[2] for c in r["checks"].values()) > 100 * r["tolerance"]


@pytest.mark.parametrize("key", ["1d-2-dp2", "2d-4", "2.5d-8-d2", "3d-8"])
def test_fused_projection_in_the_wrong_layout_is_refused_at_the_block(pool, key):
    """qkv sliced [q|k|v] while the forward reads it interleaved per head:
    every module, qkv included, computes its own rows right; the block's
    output is wrong."""
    for r in pool.run(_verify, key, "interleaved"):
        assert r["refusal"] is not None
        assert "block blocks.0 (Layer)" in r["refusal"], r["refusal"]
        kind, _, diff, _, _ = r["checks"]["blocks.0.attn.qkv"]
        assert kind == "module" and diff <= r["tolerance"], "the module check alone cannot see a wrong layout"
        assert r["checks"]["blocks.0"][2] > 1e-2


@pytest.mark.parametrize("key", ["2d-4", "3d-8"])
def test_wrong_arithmetic_around_the_modules_is_refused_at_the_embedding_stage(pool, key):
    """The model's forward scales by the width of the table it finds: right
    in every module and block, wrong only in the stage around them."""
    for r in pool.run(_verify, key, "width_scaled"):
        assert r["refusal"] is not None
        assert "stage embedding (Interleaved)" in r["refusal"], r["refusal"]
        assert all(c[2] <= r["tolerance"] for n, c in r["checks"].items() if c[0] != "stage"), r["checks"]


# GPT-NeoX's query_key_value is interleaved per head; given as a plain "qkv"
# role it is sliced [q|k|v], which the block check must refuse.
NEOX_PLAN = {"*embed_in": "embedding", "*layernorm": "norm", "*layer_norm": "norm", "*query_key_value": "qkv",
             "*attention.dense": "attn_out", "*dense_h_to_4h": "mlp_in", "*dense_4h_to_h": "mlp_out",
             "lm_head": "lm_head", "embed_out": "lm_head"}


@pytest.mark.parametrize("key", ["1d-2-dp2", "2d-4"])
def test_gpt_neox_sliced_as_q_k_v_is_refused(pool, key):
    pytest.importorskip("transformers")
    for r in pool.run(_verify, key, "neox", NEOX_PLAN):
        assert r["refusal"] is not None
        assert "block gpt_neox.layers.0 (GPTNeoXLayer)" in r["refusal"], r["refusal"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cli_refuses_a_wrong_rewrite_with_one_line(tpctl, tmp_path):
    result = tpctl.run(["train", "model=custom", "model._target_=tests.verify_models.interleaved", "+model.width=32",
                        "mode=1d", "size=2", "train.steps=2", "train.seq_len=16", "train.progress=false",
                        f"hydra.run.dir={tmp_path / 'run'}"], timeout=240)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1, result.stderr
    line = errors[0]
    assert line.startswith("tpctl: error: the rewrite for mode=1d size=2 is not the original model: block blocks.0 (Layer)")
    assert "differs by" in line and "train.verify_rewrite=false" in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists(), "refused before step 1"
    # tpctl inspect runs the same check: a verified column, a row per block, exit 2.
    shown = tpctl.run(["inspect", "model=custom", "model._target_=tests.verify_models.interleaved", "mode=1d", "size=2"],
                      timeout=240)
    assert shown.returncode == 2, shown.stdout[-2000:] + shown.stderr[-2000:]
    assert "verified" in shown.stdout and "blocks.1 " in shown.stdout and "> tolerance" in shown.stdout
    assert shown.stderr.strip().splitlines() == [line]


def test_a_forward_that_fails_after_the_rewrite_is_refused_naming_the_module_it_failed_in():
    """The refusal of a rewritten model whose forward raises names the
    innermost module whose forward was running (a DSA indexer reshaping a
    split projection to its whole heads), not only the error."""
    from tpctl.parallel.verify.proof import _raised_in

    class Boom(torch.nn.Module):
        def forward(self, x):
            return x.view(3, -1)  # 2 x 4 does not reshape to 3 rows

    class Block(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    model = torch.nn.Sequential(Block(torch.nn.Identity()), Block(Boom()))
    with pytest.raises(RuntimeError) as caught:
        model(torch.zeros(2, 4))
    assert _raised_in(model, caught.value) == " in 1.inner (Boom)"
    assert _raised_in(model, RuntimeError("raised outside")) == ""
