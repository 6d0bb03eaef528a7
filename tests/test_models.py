"""Models tpctl did not write, with no plan: Hugging Face GPT-2 (Conv1D,
fused QKV, tied head) and Llama (separate q/k/v with fewer KV heads, RMSNorm,
rotary positions, gated MLP, untied head), and a user's model in its own
style (tests/custom_model.py). Roles are traced from the forward.

Every mode against the unmodified model in one process: logits, the loss and
every parameter gradient within 1e-5; a 10-step training curve within 1e-4
relative of mode=none's; pretrained safetensors read slice by slice give
from_pretrained's logits. The session's pools (4 ranks, 8 for 2.5d and 3d) serve every case.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import layouts

from tpctl.launch.pool import parallelism_of

pytest.importorskip("transformers")

MESHES = layouts("none-dp4", "1d-4", "1d-2-sp-dp2", "2d-4", "2.5d-8-d2", "3d-8")
TOL = dict(rtol=1e-5, atol=1e-5)
BATCH, SEQ, VOCAB = 8, 8, 37
MODELS = ("gpt2", "llama", "custom")

def _mode(key: str):
    return parallelism_of(MESHES[key])


def _model_cfg(name: str, **extra):
    from omegaconf import OmegaConf

    from tpctl.config import typed_model

    if name == "custom":
        return OmegaConf.create({"arch": "custom", "_target_": "tests.custom_model.build", "vocab_size": VOCAB,
                                 "width": 16, "n_heads": 4, "depth": 2, "max_len": 16, **extra})
    if name == "llama":  # grouped-query attention: 8 query heads share 4 key/value heads
        sizes = {"n_head": 8, "n_kv_head": 4, "n_embd": 32, "intermediate_size": 48, "tie_embeddings": False}
    else:
        sizes = {"n_head": 4, "n_embd": 16, "tie_embeddings": True}
    return typed_model(OmegaConf.create({"arch": name, "vocab_size": VOCAB, "n_layer": 2, "block_size": 16,
                                         "bias": None, **sizes, **extra}))


def _reference(name: str) -> torch.nn.Module:
    """The unmodified model, as its own code initialises it."""
    torch.manual_seed(0)
    if name == "custom":
        from tests.custom_model import build

        return build(VOCAB, 16, 4, 2, 16)
    from transformers import AutoModelForCausalLM

    from tpctl.models.hf import hf_config

    return AutoModelForCausalLM.from_config(hf_config(_model_cfg(name)))


def _batch():
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen), torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)


def _local_logits(mode, full: torch.Tensor, width: int) -> torch.Tensor:
    """This rank's block of whole-model logits: its rows, its vocabulary
    block (padding columns dropped)."""
    rows = mode.rows(full.shape[0])
    start = mode.mode.vocab_block() * width
    return mode.mode.split_target(full[rows.start:rows.stop])[..., start:min(start + width, full.shape[-1])]


def _compare(key: str, name: str) -> dict:
    import torch.nn.functional as F

    from tpctl.models import logits_of

    mode = _mode(key)
    ref = _reference(name)
    done = mode.rewrite(copy.deepcopy(ref))
    par = done.model
    ids, targets = _batch()
    rows = mode.rows(BATCH)

    ref_logits = logits_of(ref(ids))
    par_logits = logits_of(par(mode.shard_batch(ids)))
    expected = _local_logits(mode, ref_logits.detach(), par_logits.shape[-1])
    got = par_logits[..., :expected.shape[-1]]
    torch.testing.assert_close(got, expected, **TOL)

    ref_loss = F.cross_entropy(ref_logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="sum")
    par_loss = mode.cross_entropy(par_logits, mode.mode.split_target(targets[rows.start:rows.stop]), VOCAB).sum()
    total = par_loss.detach().double().reshape(1).clone()
    torch.distributed.all_reduce(total)
    torch.testing.assert_close(total.item() / mode.mode.loss_replicas, ref_loss.item(), **TOL)
    ref_loss.backward()
    par_loss.backward()
    mode.sync_grads(par)

    ref_params = dict(ref.named_parameters())
    transposed = getattr(par, "tpctl_transposed", set())
    worst = 0.0
    for pname, p in par.named_parameters():
        want = ref_params[pname].grad
        want = want.t() if pname in transposed else want
        want = p.tpctl_spec.slice(want)
        torch.testing.assert_close(p.grad, want, **TOL, msg=lambda m, n=pname: f"grad of {n}: {m}")
        worst = max(worst, (p.grad - want).abs().max().item())

    tied = None
    if hasattr(par, "get_output_embeddings"):
        tied = par.get_output_embeddings().weight is par.get_input_embeddings().weight
    heads = {f"{o}.{a}": getattr(par.get_submodule(o), a) for o, h in done.plan.heads.items() for a in h.attrs}
    return {"logits": (got - expected).abs().max().item(), "grads": worst, "tied": tied, "heads": heads,
            "params": sum(1 for _ in par.named_parameters())}


def _curve(key: str, name: str, steps: int = 10) -> list[float]:
    """A `steps`-step training curve through tpctl's Trainer, the model
    built lazily from its config (seeded init, each rank slicing its shards)."""
    from omegaconf import OmegaConf

    from tpctl.config import default_config
    from conftest import build_trainer

    cfg = MESHES[key].write_to(default_config())
    cfg.model = _model_cfg(name, vocab_size=256)  # byte-level text: something to learn
    for k, v in {"data.name": "text",
                 "data.max_bytes": 200_000, "train.batch_size": BATCH,
                 "train.seq_len": SEQ, "train.steps": steps, "train.eval_every": 0, "train.log_every": 1,
                 "train.progress": False, "optim.lr": 1e-2, "optim.eps": 1e-5, "optim.warmup_steps": 2}.items():
        OmegaConf.update(cfg, k, v)
    return [r["loss"] for r in build_trainer(cfg, MESHES[key], lazy=True).fit()]


@pytest.mark.parametrize("key", list(MESHES))
@pytest.mark.parametrize("name", MODELS)
def test_model_matches_the_unmodified_model(pool, name, key):
    results = pool.run(_compare, key, name)
    layout = MESHES[key]
    split = {"none": 1, "1d": layout.size}.get(layout.mode, 2)  # heads split P ways in 1d, q = 2 ways here
    for r in results:
        assert r["params"] > 0
        if name == "gpt2":
            assert r["tied"], "GPT-2's LM head must stay tied to its embedding"
            assert all(v in (16 // split, 4 // split) for v in r["heads"].values()), r["heads"]
            assert r["heads"], "GPT-2's attention stores its head count and width"
        if name == "llama":
            assert r["tied"] is False
        if name == "custom":
            assert set(r["heads"].values()) == {4 // split}


@pytest.fixture(scope="module")
def reference_curves(pool):
    return {name: pool.run(_curve, "none-dp4", name)[0] for name in MODELS}


@pytest.mark.parametrize("key", [k for k in MESHES if k != "none-dp4"])
@pytest.mark.parametrize("name", MODELS)
def test_training_curve_matches_mode_none(pool, reference_curves, name, key):
    want = reference_curves[name]
    got = pool.run(_curve, key, name)[0]
    assert want[-1] < want[0], "the reference did not learn"
    assert got == pytest.approx(want, rel=1e-4)


def _pretrained(key: str, directory: str, name: str) -> float:
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    from tpctl.models import build_model, logits_of

    mode = _mode(key)
    cfg = _model_cfg(name)
    OmegaConf.update(cfg, "pretrained", directory)
    model = build_model(cfg, seed=123, lazy=True)  # the seed must not matter
    assert all(p.is_meta for p in model.parameters())
    par = mode.rewrite(model).model
    ref = AutoModelForCausalLM.from_pretrained(directory)
    ids, _ = _batch()
    got = logits_of(par(mode.shard_batch(ids)))
    expected = _local_logits(mode, logits_of(ref(ids)).detach(), got.shape[-1])
    torch.testing.assert_close(got[..., :expected.shape[-1]], expected, **TOL)
    return (got[..., :expected.shape[-1]] - expected).abs().max().item()


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_pretrained_loads_slices_in_2d_and_3d(pool, tmp_path, name):
    ref = _reference(name)
    ref.save_pretrained(tmp_path / name, safe_serialization=True)
    assert (tmp_path / name / "model.safetensors").exists()
    for key in ("2d-4", "3d-8"):
        assert max(pool.run(_pretrained, key, str(tmp_path / name), name)) < 1e-5


# ---- role inference, in one process ---------------------------------------

def test_traced_roles_of_the_built_in_gpt_equal_its_hand_written_plan():
    from tpctl.config import default_config
    from tpctl.models import build_model
    from tpctl.parallel.roles.inference import infer_plan, resolve_plan

    model = build_model(default_config().model, seed=0, lazy=True)
    traced, written = infer_plan(model), resolve_plan(model)
    assert written.source == "tp_plan" and traced.source == "inferred"
    # attn_drop is only called in training with p > 0; traced, it is still
    # found inside the attention module.
    assert traced.roles == written.roles
    assert not traced.problems


def test_a_given_plan_wins_over_the_trace():
    from tests.custom_model import build
    from tpctl.parallel.roles.inference import resolve_plan

    model = build(VOCAB, 16, 4, 2, 16)
    plan = resolve_plan(model, {"tokens": "embedding", "stack.*.ff.0": "mlp_in", "stack.*.ff.2": "mlp_out"})
    assert plan.source == "plan"
    assert plan.roles == {"tokens": "embedding", "stack.0.ff.0": "mlp_in", "stack.0.ff.2": "mlp_out",
                          "stack.1.ff.0": "mlp_in", "stack.1.ff.2": "mlp_out"}
    with pytest.raises(ValueError, match="unknown role 'colwise'"):
        resolve_plan(model, {"tokens": "colwise"})


def test_what_fits_no_role_is_reported_not_guessed():
    import torch.nn as nn

    from tpctl.parallel.layout import geometry
    from tpctl.parallel.roles.inference import infer_plan
    from tpctl.parallel.tensor.rewrite import check_plan

    class ThreeLinearMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(VOCAB, 16)
            self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 16)
            self.conv = nn.Conv1d(16, 16, 1)
            self.head = nn.Linear(16, VOCAB)

        def forward(self, ids):
            h = self.emb(ids)
            h = h + self.c(self.b(self.a(h)).relu())
            h = h + self.conv(h.transpose(1, 2)).transpose(1, 2)
            return self.head(h)

    model = ThreeLinearMLP()
    plan = infer_plan(model)
    assert plan.roles["head"] == "lm_head" and plan.roles["emb"] == "embedding"
    assert plan.problems["b"] == "used as both mlp_out and mlp_in"  # a Linear between two MLP Linears
    assert "unsupported layer type (Conv1d)" in plan.problems["conv"]
    assert check_plan(plan, model, geometry("none", 1)) == {}  # nothing split: nothing to refuse
    assert "conv" in check_plan(plan, model, geometry("2d", 4))


def test_a_family_setting_may_be_a_list_or_a_sub_config():
    """+model.config.layer_types=[...] and a sub-config ({...}) reach the
    family as a list and a dict: transformers' typed fields refuse
    OmegaConf's containers ("expected a list, got ListConfig")."""
    from omegaconf import OmegaConf

    from tpctl.config import typed_model
    from tpctl.models.hf import family_config

    def config(family: str, settings: dict):
        return family_config(typed_model(OmegaConf.create({"arch": family, "vocab_size": VOCAB, "n_layer": 2,
                                                           "n_head": 4, "n_embd": 16, "bias": None,
                                                           "config": settings})))

    types = ["full_attention", "sliding_attention"]
    assert config("qwen2", {"layer_types": types, "sliding_window": 4}).layer_types == types
    vision = config("phi4_multimodal", {"vision_config": {"hidden_size": 32, "num_hidden_layers": 1}}).vision_config
    assert (vision.hidden_size, vision.num_hidden_layers) == (32, 1)
