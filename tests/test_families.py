"""The Hugging Face families users train (tests/hf_families.py), built with
`transformers` (tiny configs, random weights) and trained through
`model=custom` in none, 1d, 2d and 3d: 4 steps at lr 1e-2 with no warm-up,
so that a wrong gradient shows (it moves every later loss). Every step's loss must be within 1e-4
relative of mode=none's and the gradient norm within 1e-4 -- or the run is
refused before training, for the reason the table below states.

The session's pools (4 ranks, 8 for 3d) serve every case: each case is a few in-process
training steps, not a CLI run.
"""

from __future__ import annotations

import pytest
from cli_support import tpctl  # noqa: F401  (fixture)
from conftest import build, layouts, trainer_of

from tpctl.parallel.layout import Layout

pytest.importorskip("transformers")

MESHES = layouts("none-dp4", "1d-2-dp2", "2d-4", "3d-8")
STEPS, BATCH, SEQ = 4, 8, 8
FAMILIES = ("gpt_neox", "bloom", "gpt_bigcode", "gpt_bigcode_mha", "falcon", "falcon_gqa", "phi3", "gemma",
            "opt", "qwen3", "olmo", "qwen2_kv1", "olmo2", "qwen2_moe", "mixtral", "olmoe", "qwen3_moe",
            "ernie4_5_moe", "gpt_oss")
# (family, mode) -> a phrase the refusal must contain.
REFUSED: dict = {}


def _cfg(key: str, family: str, steps: int = STEPS):
    from omegaconf import OmegaConf

    from tpctl.config import default_config
    from tpctl.parallel.layout import Layout

    cfg = Layout.parse(key).write_to(default_config())
    cfg.model = OmegaConf.create({"arch": "custom", "_target_": "tests.hf_families.build", "family": family,
                                  "vocab_size": 256, "width": 32, "depth": 2, "max_len": 64})
    for k, v in {"data.name": "text",
                 "data.max_bytes": 200_000, "train.batch_size": BATCH, "train.seq_len": SEQ,
                 "train.steps": steps, "train.eval_every": 0, "train.log_every": 1, "train.progress": False,
                 "optim.lr": 1e-2, "optim.eps": 1e-5, "optim.warmup_steps": 0}.items():
        OmegaConf.update(cfg, k, v)
    return cfg


def _curve(key: str, family: str, steps: int = STEPS):
    """[(loss, grad norm)] of every step, or ("refused", reason)."""
    from tpctl.models import build_model
    from tpctl.parallel.layout import Layout
    from tpctl.parallel.verify.proof import RewriteRefused

    cfg = _cfg(key, family, steps)
    try:  # as a worker does it: rewritten, then proven against the original
        run = build(cfg, Layout.parse(key), lazy=False, verify=True, step=False)
    except (ValueError, RewriteRefused) as e:
        return ("refused", str(e))
    model = run.model
    counts = {k: v for k, v in vars(model.config).items() if "head" in k and isinstance(v, int)}
    assert counts == {k: v for k, v in vars(build_model(cfg.model, cfg.seed).config).items() if k in counts}, \
        "the model's config (what export writes) must keep the whole model's head counts"
    records = trainer_of(run).fit()
    return [(r["loss"], r["grad_norm"]) for r in records]


def deviation(want, got) -> tuple[float, float]:
    """Largest relative difference of the losses and of the gradient norms."""
    loss = max(abs(g[0] - w[0]) / abs(w[0]) for w, g in zip(want, got))
    norm = max(abs(g[1] - w[1]) / abs(w[1]) for w, g in zip(want, got))
    return loss, norm


# Every family in one split layout, the layouts taking turns down the list
# (so each layout meets fused, grouped, multi-query and expert attention);
# the families with the most mechanisms at once in every layout. The
# layouts' own exactness is the subject of test_models, test_verify and
# test_families_anymodel; here it is that each family is carried.
SPLITS = [k for k in MESHES if k != "none-dp4"]
EVERY_LAYOUT = ("falcon_gqa", "phi3", "qwen2_moe", "gpt_oss")
CASES = [(family, key) for i, family in enumerate(FAMILIES)
         for key in (SPLITS if family in EVERY_LAYOUT else [SPLITS[i % len(SPLITS)]])]
# A frozen parameter (Ernie 4.5's router statistics, requires_grad=False) under ZeRO-3: whole on every
# replica, no gradient to reduce, no optimizer state.
CASES += [("ernie4_5_moe", "1d-2-dp2-z3")]
# Sliding-window layers beside global ones, picked by the loop's position: a stage's config lists
# its own blocks' types (pipeline/cut.StageKinds).
CASES += [("gpt_oss", "1d-2-pp2-dp2")]


@pytest.mark.parametrize("family,key", CASES)
def test_family_trains_like_mode_none_or_is_refused(pool, none_curves, family, key):
    if family not in none_curves:
        none_curves[family] = pool.run(_curve, "none-dp4", family)[0]
    want = none_curves[family]
    assert want[-1][0] < want[0][0], f"{family}: the reference did not learn"
    got = pool.run(_curve, key, family, ranks=Layout.parse(key).world)[0]
    refusal = REFUSED.get((family, key), REFUSED.get((family, Layout.parse(key).mode)))
    if refusal is not None:
        assert got[0] == "refused" and refusal in got[1], got
        return
    assert got[0] != "refused", got[1]
    loss, norm = deviation(want, got)
    assert len(got) == STEPS and loss < 1e-4 and norm < 1e-4, (loss, norm)


def test_the_transformers_under_test_is_in_the_declared_range():
    """pyproject's `transformers>=` floor is what `make test-transformers-floor`
    installs and runs these tests on (TPCTL_TRANSFORMERS names it); in the
    venv the newest release the registry serves: never one below the floor."""
    import os
    import re
    from pathlib import Path

    import transformers

    text = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    floor = re.search(r'"transformers>=([0-9.]+)"', text).group(1)
    version = tuple(int(v) for v in re.findall(r"\d+", transformers.__version__)[:2])
    assert version >= tuple(int(v) for v in floor.split(".")[:2]), (transformers.__version__, floor)
    asked = os.environ.get("TPCTL_TRANSFORMERS")
    if asked is not None:
        assert asked == floor and transformers.__version__.startswith(asked + "."), (transformers.__version__, asked)


# ---- layouts and semantics, measured in one process ---------------------------

def _plan(family: str):
    import torch

    from tests.hf_families import build
    from tpctl.parallel.roles.inference import infer_plan

    torch.manual_seed(0)
    model = build(family)
    return model, infer_plan(model)


def _layout(plan, suffix: str):
    return next(v for k, v in plan.layouts.items() if k.endswith(suffix))


@pytest.mark.parametrize("family, fused, described", [
    ("gpt_neox", "layers.0.attention.query_key_value", "[q|k|v] 4+4+4 units, interleaved"),
    ("bloom", "h.0.self_attention.query_key_value", "[q|k|v] 4+4+4 units, interleaved"),
    ("gpt_bigcode", "h.0.attn.c_attn", "[q|k|v] 4+1+1 units, contiguous"),
    ("qwen2_kv1", "layers.0.self_attn.k_proj", "[k] 1 heads"),
    ("qwen2_moe", "layers.0.mlp.experts", "[gate|up] 16+16 units, contiguous"),
    ("falcon_gqa", "h.0.self_attention.query_key_value", "[q|k|v] 4+2+2 units, interleaved"),
    ("phi3", "layers.0.self_attn.qkv_proj", "[q|k|v] 4+2+2 units, contiguous"),
    ("phi3", "layers.0.mlp.gate_up_proj", "[gate|up] 64+64 units, contiguous"),
])
def test_the_layout_of_a_fused_projection_is_measured_from_its_forward(family, fused, described):
    _, plan = _plan(family)
    assert _layout(plan, fused).describe() == described
    assert not plan.problems


def test_a_rank_holds_whole_heads_of_every_part_in_their_original_order():
    _, plan = _plan("gpt_neox")  # q0 k0 v0 q1 k1 v1 ..., 8 features a head
    neox = _layout(plan, "layers.0.attention.query_key_value")
    assert neox.ranges(2, 2, 0) == ((0, 48),) and neox.ranges(2, 2, 1) == ((48, 96),)
    assert neox.ranges(2, 4, 1) == ((24, 48),)  # 3d: a shard stored in q sub-blocks
    _, plan = _plan("phi3")  # [q (4 heads) | k (2) | v (2)]
    phi = _layout(plan, "layers.0.self_attn.qkv_proj")
    assert phi.ranges(2, 2, 1) == ((16, 32), (40, 48), (56, 64))
    gate_up = _layout(plan, "layers.0.mlp.gate_up_proj")
    assert gate_up.ranges(2, 2, 0) == ((0, 32), (64, 96))
    _, plan = _plan("falcon_gqa")  # per key/value group: q q k v
    assert _layout(plan, "h.0.self_attention.query_key_value").ranges(2, 2, 1) == ((32, 64),)
    _, plan = _plan("gpt_bigcode")  # [q (4 heads) | k (1) | v (1)]: the one key/value head on every shard
    mqa = _layout(plan, "h.0.attn.c_attn")
    assert mqa.ranges(2, 2, 0) == ((0, 16), (32, 48)) and mqa.ranges(2, 2, 1) == ((16, 48),)
    assert mqa.holders(2).tolist() == [1] * 32 + [2] * 16
    assert mqa.ranges(2, 4, 1) == mqa.ranges(2, 4, 3) == ((32, 48),)  # 3d: a shard stored in q sub-blocks


def test_a_fused_projection_that_is_no_set_of_heads_is_refused_with_what_was_seen():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    from tpctl.parallel.layout import geometry
    from tpctl.parallel.roles.inference import infer_plan
    from tpctl.parallel.tensor.rewrite import check_plan

    class Mixed(nn.Module):  # every feature of the fused output feeds every head
        def __init__(self):
            super().__init__()
            self.emb, self.qkv, self.out, self.head = (nn.Embedding(37, 16), nn.Linear(16, 48),
                                                       nn.Linear(16, 16), nn.Linear(16, 37))

        def forward(self, ids):
            h = self.emb(ids)
            y = self.qkv(h)
            y = y + y.flip(-1)
            q, k, v = (t.view(*ids.shape, 4, 4).transpose(1, 2) for t in y.split(16, -1))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.head(h + self.out(a.transpose(1, 2).reshape(*ids.shape, 16)))

    model = Mixed()
    plan = infer_plan(model)
    assert "qkv" in plan.problems and "feeds both" in plan.problems["qkv"], plan.problems
    assert "qkv" in check_plan(plan, model, geometry("1d", 2))


def test_qwen3_q_k_norms_are_per_head_norms_not_a_refusal():
    _, plan = _plan("qwen3")
    assert plan.roles["model.layers.0.self_attn.q_norm"] == "head_norm"
    assert plan.roles["model.layers.0.self_attn.k_proj"] == "attn_in"
    assert not plan.problems


def test_norm_offsets_and_embedding_scales_are_measured_not_assumed():
    import torch
    import torch.nn as nn

    from tpctl.parallel.roles.probes import embedding_semantics, norm_offset

    gemma, _ = _plan("gemma")
    assert norm_offset(gemma.model.norm) == 1.0  # x_hat * (1 + w)
    assert norm_offset(nn.LayerNorm(8)) == 0.0 and norm_offset(nn.RMSNorm(8)) == 0.0
    scale, pad = embedding_semantics(gemma.model.embed_tokens)
    assert scale == pytest.approx(32 ** 0.5) and pad == gemma.config.pad_token_id
    opt, _ = _plan("opt")
    assert embedding_semantics(opt.model.decoder.embed_tokens) == (1.0, 1)

    class Doubled(nn.RMSNorm):
        def forward(self, x):
            return super().forward(x) * 2

    with pytest.raises(ValueError, match="computes neither"):
        norm_offset(Doubled(8))

    class Shifted(nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) + 1.0

    with pytest.raises(ValueError, match="does not compute scale"):
        embedding_semantics(Shifted(10, 4))

    from tpctl.parallel.layout import geometry
    from tpctl.parallel.roles.inference import infer_plan
    from tpctl.parallel.tensor.rewrite import check_plan

    gemma.model.norm.__class__ = type("DoubledGemmaRMSNorm", (type(gemma.model.norm),),
                                      {"forward": lambda self, x: super(type(self), self).forward(x) * 2})
    problems = check_plan(infer_plan(gemma), gemma, geometry("2d", 4))
    assert "computes neither" in problems["model.norm"], problems  # refused before training, named
    assert torch.is_tensor(gemma.model.norm.weight)


# ---- through the command line -----------------------------------------------

FAMILY = ["model=custom", "model._target_=tests.hf_families.build", "+model.vocab_size=256", "+model.width=32",
          "+model.max_len=64", "train.seq_len=8", "train.batch_size=8", "data.max_bytes=200000"]


@pytest.mark.timeout(120)
def test_a_mixture_of_experts_with_sequence_parallelism_is_refused_before_any_worker_starts(tpctl):
    result = tpctl.run(["train", *FAMILY, "+model.family=qwen2_moe", "mode=1d", "size=2", "seq_parallel=true"])
    assert result.returncode == 2, result.stdout + result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("tpctl: error: invalid config: seq_parallel=True: ") and "mixture-of-experts" in line, line
    assert not (tpctl.cwd / "outputs").exists()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_family_trains_from_the_command_line_like_mode_none(tpctl):
    import json
    from pathlib import Path

    def losses(mode: list[str], name: str) -> list[float]:
        result = tpctl.run(["train", *FAMILY, "+model.family=gemma", *mode, "train.steps=5", "train.log_every=1",
                            "train.eval_every=0", "optim.lr=1e-2", "optim.eps=1e-5", "optim.warmup_steps=0",
                            f"hydra.run.dir={tpctl.cwd / name}"], timeout=400)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        return [json.loads(line)["loss"] for line in Path(tpctl.cwd, name, "metrics.jsonl").read_text().splitlines()]

    want = losses(["mode=none"], "none")
    assert losses(["mode=2d", "size=4"], "2d") == pytest.approx(want, rel=1e-4)


def test_random_draws_in_the_forward_are_refused_with_what_draws_them():
    """A forward that draws from torch's global generator in training (a
    router sampling its experts, jitter, functional dropout) cannot be
    reproduced by a split mode; Dropout modules (replaced by tpctl's) and a
    functional dropout with p=0 draw nothing."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    from tpctl.parallel.layout import geometry
    from tpctl.parallel.roles.inference import infer_plan
    from tpctl.parallel.tensor.rewrite import check_plan

    class Noisy(nn.Module):
        def __init__(self, jitter: float, dropout: float):
            super().__init__()
            self.jitter, self.dropout = jitter, dropout
            self.emb, self.fc, self.out, self.head = nn.Embedding(37, 16), nn.Linear(16, 32), nn.Linear(32, 16), nn.Linear(16, 37)
            self.drop = nn.Dropout(0.1)

        def forward(self, ids):
            h = self.drop(self.emb(ids))
            if self.training and self.jitter:
                h = h * torch.empty_like(h).uniform_(1 - self.jitter, 1 + self.jitter)
            h = h + self.out(F.dropout(F.gelu(self.fc(h)), p=self.dropout, training=self.training))
            return self.head(h)

    for jitter, dropout, found in ((0.0, 0.0, None), (0.01, 0.0, "uniform_"), (0.0, 0.1, "dropout(p=0.1)")):
        model = Noisy(jitter, dropout)
        problems = check_plan(infer_plan(model), model, geometry("2d", 4))
        if found is None:
            assert not problems, problems
        else:
            assert found in problems["<forward>"] and "global generator" in problems["<forward>"], problems
            assert not check_plan(infer_plan(model), model, geometry("none", 1))  # mode=none is the reference


def _frozen_entries(key: str, family: str) -> list[str]:
    """A checkpoint's entries of the frozen parameters of a trained run."""
    from tpctl.checkpoint.state import state_entries

    run = build(_cfg(key, family, 2), Layout.parse(key), lazy=False, step=False)
    trainer = trainer_of(run)
    trainer.fit()
    frozen = [n for n, p in run.model.named_parameters() if not p.requires_grad]
    entries = state_entries(run.model, trainer.optimizer, run.par, 2, 0.0)
    assert frozen and all(f"model.{n}" in entries for n in frozen), frozen
    return sorted(k for k in entries if any(n in k for n in frozen))


def test_a_frozen_parameter_under_zero_3_is_saved_whole_without_optimizer_state(pool):
    key = "1d-2-dp2-z3"
    for names in pool.run(_frozen_entries, key, "ernie4_5_moe", ranks=Layout.parse(key).world):
        assert names and all(n.startswith("model.") for n in names), names
