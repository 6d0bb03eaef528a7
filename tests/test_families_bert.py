"""BERT-style LM heads (transformers' BERT, RoBERTa and their kin as causal
LMs): after the stack, a transform (dense hidden -> hidden, GELU,
LayerNorm) on the stream, then a decoder Linear (the LM head) whose bias
the head module also registers as its own `bias`:

* tied (BERT's default): the same tensor as the decoder's bias -- the head
  is a container (tracing.own_params), and after the rewrite the alias
  holds the decoder's shard (rewrite.repoint_aliases), the name
  named_parameters, checkpoints and export read first;
* untied (tie_word_embeddings=False, RoBERTa's here): a parameter the
  forward never reads (RolePlan.unread), held whole, never trained, as in
  mode=none;
* the transform's dense Linear pairs with no other: it runs whole on every
  rank, on whole rows of the rows a rank holds (roles/whole.py), its
  LayerNorm a norm on the stream.

RoFormer's (tied, as BERT's) beside a frozen sinusoidal rotary table one
head wide, held whole (RolePlan.frozen), and head counts its
self-attention stores below the attention module (plan.head_attrs).

Each trains like mode=none within 1e-4 in 1d, 2d, 3d and 1d with two
pipeline stages (its shapes the planner's dry run, its collectives counted
== planned), on the shared pool, in process (tests/hf_families.py).
"""

from __future__ import annotations

import pytest
from test_families import _curve, deviation
from test_families_anymodel import STEPS, trains_like_mode_none

pytest.importorskip("transformers")

KEYS = ("1d-2-dp2", "2d-4", "3d-8", "1d-2-pp2-dp2")
# (roberta in 1d pp=2 and roformer in 2d also train like mode=none, measured once: the suite's time)
CASES = [("bert", k) for k in KEYS] + [("roberta", "2d-4"), ("roformer", "3d-8")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family,key", CASES)
def test_a_bert_style_lm_head_trains_like_mode_none(pool, none_curves, family, key):
    ranks, _ = trains_like_mode_none(pool, none_curves, family, key)
    head = {"bert": "cls.predictions", "roberta": "lm_head", "roformer": "cls.predictions"}[family]
    for rank, (_, counted, _, _) in enumerate(ranks):  # (a pipeline stage may hold no head)
        if f"{head}.bias" in counted or f"{head}.decoder.bias" in counted:
            # The alias is the decoder's bias (tied: named once, by the head, its shard) or held whole (untied).
            assert f"{head}.bias" in counted and (f"{head}.decoder.bias" in counted) == (family == "roberta"), \
                (rank, sorted(counted))
            if family == "roberta":
                assert counted[f"{head}.bias"] == (256,), rank


@pytest.mark.timeout(300)
@pytest.mark.parametrize("key", ["1d-2-sp-dp2", "2.5d-8-d2"])
def test_a_bert_style_lm_head_on_another_stack_trains_like_mode_none(pool, none_curves, key):
    """BERT's head on Qwen3 (hf_families.bert_head): with sequence
    parallelism, which BERT's own MLP refuses (its halves in two modules;
    the planner does not count a Hugging Face attention's sequence gather:
    the curve only, trains_like_mode_none), and in 2.5d."""
    trains_like_mode_none(pool, none_curves, "bert_head", key)


def _dry_rewrite(key: str, family: str):
    """The rank-0 dry run of `family`'s rewrite in layout `key`."""
    from hf_families import build

    from tpctl.parallel.layout import Layout
    from tpctl.parallel.parallelism import parallelism

    return parallelism(Layout.parse(key), rank=0, groups=False).rewrite(build(family), dry_run=True)


def test_the_heads_alias_holds_the_decoders_shard_and_would_not_without_repointing(monkeypatch):
    """Mutation check: without rewrite.repoint_aliases the tied head's
    `bias` keeps the whole original (no ShardSpec: a 2d rewrite refuses it as
    a parameter with no role; 1d would hold it untrained), so the checks
    above and training would fail."""
    from tpctl.parallel.roles.inference import infer_plan
    from tpctl.parallel.shard import spec_of
    from tpctl.parallel.tensor import rewrite

    from hf_families import build

    plan = infer_plan(build("bert"))
    head = "cls.predictions"
    assert plan.roles[f"{head}.decoder"] == "lm_head" and plan.roles[f"{head}.transform.dense"] == "whole"
    assert plan.roles[f"{head}.transform.LayerNorm"] == "norm" and head not in plan.roles and not plan.problems
    assert plan.unread == ()
    model = _dry_rewrite("2d-4", "bert").model
    alias, decoder = model.get_submodule(head).bias, model.get_submodule(f"{head}.decoder").bias
    assert alias is decoder and spec_of(alias) is not None and tuple(spec_of(alias).local_shape()) == (128,)
    monkeypatch.setattr(rewrite, "repoint_aliases", lambda model, ctx: None)
    model = _dry_rewrite("2d-4", "bert").model
    alias = model.get_submodule(head).bias
    assert alias is not model.get_submodule(f"{head}.decoder").bias and spec_of(alias) is None


def test_an_unread_head_bias_is_no_layer_and_is_held_whole():
    """Untied, the head's `bias` is never read: the head is no `unsupported
    layer type` (what refused every BERT-style family), the bias whole on
    every rank; were it taken for a layer, the LM head would be lost too
    (the logits would come from the head module, not one Linear)."""
    from tpctl.parallel.roles.inference import infer_plan
    from tpctl.parallel.shard import spec_of

    from hf_families import build

    plan = infer_plan(build("roberta"))
    assert plan.unread == ("lm_head.bias",) and not plan.problems
    assert plan.roles["lm_head.decoder"] == "lm_head" and plan.roles["lm_head.dense"] == "whole"
    model = _dry_rewrite("2d-4", "roberta").model
    spec = spec_of(model.lm_head.bias)
    assert spec is not None and tuple(spec.local_shape()) == (256,) and model.lm_head.bias is not model.lm_head.decoder.bias


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mutation", ["pieces", "unsummed"])
def test_the_transform_run_whole_is_what_makes_it_exact(pool, none_curves, mutation):
    """Mutation check for the transform, in 2d: its dense Linear run on
    this rank's piece of the stream instead of whole rows (mode.whole_split
    gathering nothing: the whole weight meets a block of the features) is
    refused before step 1, naming it; its gradient not summed over the
    ranks that ran it (each rank's rows and output block only) trains, off
    mode=none's gradient norm from step 1 (the start-up proof checks a
    module run whole outside the stack forward only: the head stage), which
    test_a_bert_style_lm_head_trains_like_mode_none would fail."""
    got = pool.run(_curve_mutated, "2d-4", "bert", mutation)[0]
    if mutation == "pieces":
        assert got[0] == "refused" and "cls.predictions.transform.dense" in got[1], got
        assert "shapes cannot be multiplied" in got[1], got
        return
    if "bert" not in none_curves:
        none_curves["bert"] = pool.run(_curve, "none-dp4", "bert", STEPS)[0]
    assert got[0] != "refused", got
    assert deviation(none_curves["bert"][:1], got[:1])[1] > 1e-2, (none_curves["bert"], got)


def _curve_mutated(key: str, family: str, mutation: str):
    from tpctl.parallel.tensor import mode as mode_module
    from tpctl.parallel.tensor.mode import ParallelMode

    original_split, original_run = ParallelMode.whole_split, mode_module.run_whole

    def unsummed(mode, module, ctx):
        split_spec = mode.split_spec
        mode.split_spec = lambda full, *a, **k: split_spec(full, *a, **{**k, "partial": False})
        try:
            return original_run(mode, module, ctx)
        finally:
            del mode.split_spec

    if mutation == "pieces":
        ParallelMode.whole_split = lambda self, ctx: None
    else:
        mode_module.run_whole = unsummed
    try:
        return _curve(key, family)
    finally:
        ParallelMode.whole_split, mode_module.run_whole = original_split, original_run


@pytest.mark.timeout(600)
@pytest.mark.parametrize("family,extra", [("bert", {}), ("roberta", {"tie_embeddings": False})])
def test_a_bert_style_head_reads_checkpoints_and_exports_as_mode_none(pool, tmp_path_factory, family, extra):
    """model=hf (transformers' own BERT / RoBERTa, tied: the alias holds
    the decoder's shard; untied: the unread bias kept whole): a
    save_pretrained directory read in 2d as from_pretrained reads it,
    trained, checkpointed and exported (tpctl export: save_hf writes the
    head's `bias` under both names, tied), the export loading back to the
    2d model's logits and as close to mode=none's export as round-off
    lets them (tests/test_hf_io.py's round trip)."""
    import test_hf_io
    from test_hf_io import EXPORT_GAP, _export_gap, _in_and_out, deviation as curve_gap, save_family
    from transformers import AutoModelForCausalLM

    test_hf_io.TRAINED.setdefault(family, extra)  # (its tpctl model keys)
    directory = tmp_path_factory.mktemp(family)
    save_family(family, directory)
    runs = {}
    for key in ("none-dp4", "2d-4"):
        runs[key] = str(tmp_path_factory.mktemp(f"{family}-{key}"))
        results = pool.run(_in_and_out, key, family, str(directory), False, runs[key])
        assert all(r["loaded"] < 1e-5 and r["exported"] < 1e-5 for r in results), results
        runs[key + "-curve"] = results[0]["curve"]
    assert max(curve_gap(runs["none-dp4-curve"], runs["2d-4-curve"])) < 1e-4
    a, b, start = (AutoModelForCausalLM.from_pretrained(d).state_dict()
                   for d in (f"{runs['none-dp4']}/exported", f"{runs['2d-4']}/exported", directory))
    assert a.keys() == b.keys()
    head = {"bert": "cls.predictions", "roberta": "lm_head"}[family]
    assert {f"{head}.bias", f"{head}.decoder.bias"} <= a.keys()
    gap, name = max((_export_gap(a[n], b[n], start[n]), n) for n in a)
    assert gap < EXPORT_GAP, (name, gap)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_a_bert_style_head_trains_like_mode_none_with_zero3(pool, none_curves, family):
    """ZeRO-3 over dp=2 (each replica holds a part of every parameter and
    gathers it for the step): the tied alias (one parameter, two names) and
    the unread bias (a gradient of none) among them; the curve only."""
    if family not in none_curves:
        none_curves[family] = pool.run(_curve, "none-dp4", family, STEPS)[0]
    got = pool.run(_curve, "1d-2-dp2-z3", family, STEPS, ranks=4)[0]
    assert got[0] != "refused", got[1]
    assert len(got) == STEPS and max(deviation(none_curves[family], got)) < 1e-4, (none_curves[family], got)
