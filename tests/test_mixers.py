"""Mixers split by heads in 1d (parallel/roles/mixers.py, issue 46):
Mamba-2's (a rank holds whole heads and groups of in_proj's rows, the
convolution's channels, the per-head parameters and the gated norm,
out_proj's columns) and the gated delta rule's (Qwen3-Next: whole key
heads and their value heads of in_proj_qkvz's and in_proj_ba's rows, the
convolution's channels, A_log and dt_bias, out_proj's columns; the gated
norm's one head-wide weight on every rank; OLMo Hybrid's and Kimi
Linear's separate projections alike, Kimi's low-rank gates' latent on
every rank); the partial outputs summed over the group. The families
train like mode=none in 1d, with pipeline stages, sequence parallelism and
data parallelism, their shapes and collectives as planned: Bamba (beside
attention, biases on in_proj and out_proj), Qwen3.5 (its projections
unfused), OLMo Hybrid and Kimi Linear here; NemotronH (beside
experts) and Qwen3-Next (beside gated attention and experts) in
test_families_hybrid's 1d layouts, which now split their mixers. A wrong
layout fails the measurement; a mixer whose groups (key heads) do not
split runs whole and says why. Mamba-1's (Mamba, Jamba, FalconMamba) by
inner channels: a block of in_proj's x and z rows, the conv, A_log, D,
dt_proj's rows, x_proj's and out_proj's columns, x_proj's partial
products summed inside the mixer both ways; Jamba's dt/B/C norms on every
rank. MiniMax's lightning attention by heads (qkv_proj's rows per head,
output_gate's, the decay buffers, out_proj's columns), its norm over every
head's features split too, its moments summed across the ranks.
A Mamba-2 mixer with ONE group of heads (Falcon-H1's default; Bamba's at
n_groups=1) by heads too: B's and C's rows of in_proj and channels of the
conv whole on every rank of the split, their gradients summed over those
ranks, its gated norm over the whole inner width summing its moments.
RecurrentGemma's recurrent block by the RG-LRU's heads (its layout
measured here, its training in test_families_hybrid's four layouts).
"""

from __future__ import annotations

import pytest
from cli_support import tpctl  # noqa: F401  (fixture)
from test_families_anymodel import trains_like_mode_none

pytest.importorskip("transformers")

# (bamba with sequence parallelism too: the sequence gathered for the mixer, its output reduce-scattered;
# NemotronH's experts refuse it. nemotron_h 1d-2-pp2-dp2 and qwen3_next 1d-2-dp2 / 1d-2-pp2-dp2 run in
# test_families_hybrid, the same check.)
CASES = [("bamba", "1d-2-pp2-dp2"), ("bamba", "1d-2-sp-dp2"), ("qwen3_5", "1d-2-dp2")]
# The gated delta rule with separate projections: Kimi Linear's (low-rank gates whose latent every rank
# holds whole; its 1d-2-pp2-dp2 run, 65 s, is not repeated here) and OLMo Hybrid's (key and value heads)
# with sequence parallelism (its 1d-2-dp2 and 1d-2-pp2-dp2 runs, collectives compared, are
# test_proj_norm's: its attention's q/k norms over all heads).
CASES += [("olmo_hybrid", "1d-2-sp-dp2"), ("kimi_linear", "1d-2-dp2")]
# RecurrentGemma's RG-LRU block with sequence parallelism (the sequence gathered for it, beside its sliding
# attention; its four layouts without are test_families_hybrid's).
CASES += [("recurrent_gemma", "1d-2-sp-dp2")]
# In 2d and 3d a block of rows' q ranks gather whole rows and split the heads q ways; ranks with
# other rows hold the same heads (qwen3_next and nemotron_h at 2d-4 and 3d-8 run in
# test_families_hybrid, the same check).
CASES += [("bamba", "2d-4"), ("kimi_linear", "3d-8"), ("olmo_hybrid", "2d-4-dp2"), ("qwen3_5", "2.5d-8-d2")]
# A Mamba-2 mixer with ONE group of heads split by heads, its B and C whole on every rank of the split (their
# gradients summed over those ranks), its gated norm over the whole inner width summing its moments:
# Falcon-H1's without the norm (its default; 2d-4 and 1d-2-pp2-dp2 run in test_families_hybrid), with it
# (normalising before the gate), and Bamba's with one group (gating before the norm, biases).
CASES += [("falcon_h1", "3d-8"), ("falcon_h1_norm", "1d-2-sp-dp2"),
          ("falcon_h1_norm", "2d-4"), ("bamba_one_group", "1d-2-pp2-dp2"), ("bamba_one_group", "2.5d-8-d2")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family,key", CASES)
def test_a_mixer_split_by_heads_trains_like_mode_none(pool, none_curves, family, key):
    ranks, (loss, norm) = trains_like_mode_none(pool, none_curves, family, key)
    if family in ONE_GROUP:
        assert_one_group_split(ranks, 2)
        print(f"{family} {key}: loss within {loss:.2g}, grad norm within {norm:.2g} of mode=none")


ONE_GROUP = ("falcon_h1", "falcon_h1_norm", "bamba_one_group")


def assert_one_group_split(ranks, ways: int) -> None:
    """Each rank's real shapes (trains_like_mode_none's ranks) of every
    one-group Mamba-2 mixer its stage holds (some rank holds one)
    (hf_families' tiny falcon_h1 / bamba_one_group: 8 heads of 8, state 8,
    hidden 32): 1/ways of the heads of in_proj's z, x and dt rows, of the
    conv's x channels, of A_log and of out_proj's columns; B's and C's 8
    rows (and channels) each whole."""
    want = {"in_proj.weight": ((64 + 64 + 8) // ways + 16, 32), "conv1d.weight": (64 // ways + 16, 1, 4),
            "A_log": (8 // ways,), "out_proj.weight": (32, 64 // ways)}
    seen = set()
    for rank, (_, counted, _, _) in enumerate(ranks):  # (a pipeline stage may hold none)
        for name, shape in counted.items():
            kind = next((k for k in want if name.endswith(("mamba." + k, "mixer." + k))), None)
            if kind is not None:
                assert shape == want[kind], (rank, name, shape)
                seen.add(kind)
    assert seen == set(want), f"no rank holds a one-group mixer's {set(want) - seen}"


def _mixer(family: str):
    import hf_families

    from tpctl.parallel.roles.mixers import is_mixer

    model = hf_families.build(family)
    return next(m for m in model.modules() if is_mixer(m))


def _call():
    import torch

    return (torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0)),), {}


@pytest.mark.parametrize("family", ["nemotron_h", "bamba"])
def test_the_declared_layout_is_measured_and_a_wrong_one_fails(family):
    """The declared split reproduces the mixer's output; in_proj's segments
    in another order ([x|B|C] before z), or a split that cuts a head, do not."""
    from tpctl.parallel.roles.fused import ProbeError
    from tpctl.parallel.roles.mixers import MixerSplit, declared_split, measure, mixer_split

    mixer, (args, kwargs) = _mixer(family), _call()
    split = mixer_split(mixer, args, kwargs)
    assert split.heads == mixer.num_heads and split.groups == mixer.n_groups
    with pytest.raises(ProbeError, match="no layout of its heads reproduces its output"):
        mixer_split(mixer, args, kwargs, orders=[("xBC", "z", "dt")])
    # The per-head parameters cut at half a head's width: a head split across ranks.
    right = declared_split(mixer)
    dims = tuple((n, d, (s * 2,) if n in ("A_log", "D", "dt_bias") else s) for n, d, s in right.dims)
    wrong = MixerSplit(right.heads, right.groups, dims, right.attrs)
    assert measure(mixer, right, args, kwargs) is None
    assert measure(mixer, wrong, args, kwargs) is not None


@pytest.mark.parametrize("family,kind,wrong", [("qwen3_next", "delta", "concat"), ("qwen3_5", "delta_split", "grouped")])
def test_the_gated_delta_rule_layout_is_measured_and_a_wrong_one_fails(family, kind, wrong):
    """Qwen3-Next's in_proj_qkvz / in_proj_ba grouped per key head, and
    Qwen3.5's in_proj_qkv as [q|k|v], reproduce its output; read the other
    way (Qwen3-Next's concatenated, Qwen3.5's grouped per key head), or the
    gated norm's weight read as 1/shards (held like out_proj's bias), not."""
    from tpctl.parallel.roles.experts import WHOLE
    from tpctl.parallel.roles.fused import ProbeError
    from tpctl.parallel.roles.mixers import MixerSplit, measure, mixer_split

    mixer, (args, kwargs) = _mixer(family), _call()
    split = mixer_split(mixer, args, kwargs)
    assert split.kind == kind and (split.heads, split.groups) == (mixer.num_v_heads, mixer.num_k_heads)
    with pytest.raises(ProbeError, match="no layout of its heads reproduces its output"):
        mixer_split(mixer, args, kwargs, orders=[(wrong,)])
    dims = tuple((n, WHOLE, ()) if n == "norm.weight" else (n, d, s) for n, d, s in split.dims)
    assert measure(mixer, MixerSplit(split.heads, split.groups, dims, split.attrs, split.kind), args, kwargs) is not None


# Value heads of OLMo Hybrid's tensors; Kimi Linear's low-rank gates' projections to their shared latent.
VALUE_HEADS = ("A_log", "dt_bias", "v_proj.weight", "a_proj.weight", "b_proj.weight", "g_proj.weight", "o_proj.weight")
LATENT = ("forget_gate.f_a_proj.weight", "g_a_proj.weight")


def _wrong(split, how: str):
    """`split`'s dims made wrong: "strided", the value heads dealt round the
    ranks (value head j to rank j mod 2, not with its key head); "latent",
    the gates' latent projections read as 1/shards, a partial sum like
    out_proj's bias (the gates' softplus and sigmoid follow, so each rank
    needs the whole latent; splitting its rows does not even run: f_b_proj
    reads all of them); "norm", the gated norm's weight read as 1/shards."""
    from tpctl.parallel.roles.experts import WHOLE

    if how == "strided":
        return tuple((n, d, (s[0] // 2, s[0] // 2) if n in VALUE_HEADS else s) for n, d, s in split.dims)
    names = LATENT if how == "latent" else [n for n, _, _ in split.dims if n.endswith("norm.weight")]
    return tuple((n, WHOLE, ()) if n in names else (n, d, s) for n, d, s in split.dims)


# family -> (kind, its head and group counts, the wrong layouts tried)
SEPARATE = {"olmo_hybrid": ("delta_qkv", "num_v_heads", "num_k_heads", ("strided", "norm")),
            "kimi_linear": ("kda", "num_heads", "num_heads", ("latent", "norm"))}


@pytest.mark.parametrize("family", SEPARATE)
def test_separate_projections_are_measured_and_a_wrong_grouping_fails(family):
    """OLMo Hybrid's q/k/v/a/b/g and Kimi Linear's q/k/v/b and low-rank
    gates split by heads reproduce the output; the conv's channels read per
    head instead of [q|k|v], or a layout _wrong makes, do not."""
    from tpctl.parallel.roles.fused import ProbeError
    from tpctl.parallel.roles.mixers import MixerSplit, measure, mixer_split

    kind, heads, groups, wrongs = SEPARATE[family]
    mixer, (args, kwargs) = _mixer(family), _call()
    split = mixer_split(mixer, args, kwargs)
    assert split.kind == kind and (split.heads, split.groups) == (getattr(mixer, heads), getattr(mixer, groups))
    with pytest.raises(ProbeError, match="no layout of its heads reproduces its output"):
        mixer_split(mixer, args, kwargs, orders=[("grouped",)])
    for how in wrongs:
        dims = _wrong(split, how)
        assert dims != split.dims, how
        assert measure(mixer, MixerSplit(split.heads, split.groups, dims, split.attrs, kind), args, kwargs), how


def _inspect(key: str, family: str):
    from test_families import _cfg

    from tpctl.commands.inspect_model import inspect_model

    rows, summary, problems = inspect_model(_cfg(key, family))
    assert not problems, problems
    return {row[0]: row for row in rows}


@pytest.mark.parametrize("key", ["1d-2", "2d-4"])
def test_each_rank_holds_its_share_of_a_mixer(key):
    """1d-2 (and 2d-4: the heads split among the q = 2 ranks of a block of
    rows): every tensor of the mixer but out_proj's bias is halved on a
    rank (in_proj's rows, conv channels, per-head parameters, the norm,
    out_proj's columns); inspect names the role."""
    import math

    rows = _inspect(key, "bamba")
    mixer = _mixer("bamba")
    name = next(n for n in rows if n.endswith("layers.0.mamba"))
    assert rows[name][2] == "mixer (heads split)" and "8 heads in 2 groups" in rows[name][6], rows[name]
    full = {n: math.prod(p.shape) * p.element_size() for n, p in mixer.named_parameters()}
    own = sum(v for n, v in full.items() if "." not in n)  # A_log, D, dt_bias
    assert rows[name][5] == own // 2
    for sub, whole_bytes in (("in_proj", full["in_proj.weight"] + full["in_proj.bias"]),
                             ("conv1d", full["conv1d.weight"] + full["conv1d.bias"]),
                             ("norm", full["norm.weight"])):
        assert rows[f"{name}.{sub}"][5] == whole_bytes // 2, rows[f"{name}.{sub}"]
        assert rows[f"{name}.{sub}"][6].startswith("split by heads, inside"), rows[f"{name}.{sub}"]
    # out_proj: its weight's columns halved, its bias whole (read as 1/2 on each rank)
    assert rows[f"{name}.out_proj"][5] == full["out_proj.weight"] // 2 + full["out_proj.bias"]


@pytest.mark.parametrize("family,attn,text,held", [
    ("qwen3_next", "linear_attn", "4 value heads of 2 key heads", ("norm.weight",)),
    ("qwen3_5", "linear_attn", "4 value heads of 2 key heads", ("norm.weight",)),
    ("olmo_hybrid", "linear_attn", "4 value heads of 2 key heads", ("o_norm.weight",)),
    ("kimi_linear", "self_attn", "4 heads, a rank's whole heads", ("o_norm.weight", "g_a_proj.weight",
                                                                    "forget_gate.f_a_proj.weight")),
    # Mamba-1: by inner channels (x_proj's columns too); Jamba's RMSNorms over dt, B and C whole
    ("mamba", "mixer", "64 inner channels", ()),
    ("jamba", "mamba", "64 inner channels", ("dt_layernorm.weight", "b_layernorm.weight", "c_layernorm.weight")),
    # MiniMax's lightning attention: by heads, its norm over every head's features too (moments summed)
    ("minimax", "self_attn", "4 heads, a rank's whole heads", ()),
    # RecurrentGemma's RG-LRU block by heads: linear_out's bias whole, read as 1/2 on each rank
    ("recurrent_gemma", "temporal_block", "4 heads, a rank's whole heads", ("linear_out.bias",))])
def test_each_rank_holds_its_share_of_a_gated_delta_rule_attention(family, attn, text, held):
    """1d-2: every tensor of a gated delta-rule linear attention (or a
    Mamba-1 mixer, MiniMax's lightning attention, or RecurrentGemma's
    recurrent block) but those `held`
    whole on every rank (the gated norm's head-wide weight; Kimi's
    projections to its gates' latent, which every head reads; Jamba's norms
    over the summed dt, B and C; the output projection's bias) is halved on
    a rank."""
    import math

    rows = _inspect("1d-2", family)
    mixer = _mixer(family)
    name = next(n for n in rows if n.endswith(f"layers.0.{attn}"))
    assert rows[name][2] == "mixer (heads split)" and text in rows[name][6], rows[name]
    full = {n: math.prod(p.shape) * p.element_size() for n, p in mixer.named_parameters()}
    want = {}  # each module's own parameters' bytes on a rank
    for n, nbytes in full.items():
        owner = n.rpartition(".")[0]
        want[owner] = want.get(owner, 0) + (nbytes if n in held else nbytes // 2)
    for owner, nbytes in want.items():
        row = rows[f"{name}.{owner}" if owner else name]
        assert row[5] == nbytes and (not owner or row[6].startswith("split by heads, inside")), row
    kept = sum(full[n] for n in held)
    before, after = sum(full.values()), sum(rows[n][5] for n in rows if n == name or n.startswith(name + "."))
    assert after == (before - kept) // 2 + kept, (before, after)


# ---- Mamba-2 with ONE group of heads: B and C whole on every rank, the gated norm's moments summed -------

@pytest.mark.parametrize("family", ["falcon_h1_norm", "bamba_one_group", "falcon_h1"])
def test_the_one_group_layout_is_measured_and_a_wrong_one_fails(family):
    """A Mamba-2 mixer with one group split by heads (in_proj's z, x and dt
    rows and the conv's x channels by heads, B's and C's rows and channels
    Kept whole on every shard, the gated norm over the whole inner width
    summing its moments across the shards) reproduces its output (Falcon-H1
    normalising before its gate, Bamba gating before its norm, Falcon-H1
    without a norm); the norm's moments left to each shard's own features,
    or B and C cut into blocks like a group's, do not. Heads that do not
    divide: it runs whole, and says why."""
    import dataclasses

    from tpctl.parallel.roles.mixer_dims import Kept
    from tpctl.parallel.roles.mixers import measure, mixer_split

    mixer, (args, kwargs) = _mixer(family), _call()
    split = mixer_split(mixer, args, kwargs)
    assert split.kind == "mamba2" and (split.heads, split.groups) == (8, 1)
    dims = {n: sizes for n, _, sizes in split.dims}
    assert dims["in_proj.weight"] == (64, 64, 8, 8, 8) and dims["conv1d.weight"] == (64, 8, 8)
    assert [isinstance(s, Kept) for s in dims["in_proj.weight"]] == [False, False, True, True, False]
    assert {"in_proj.weight", "conv1d.weight"} <= set(split.kept_params())
    # (a shard's conv and in_proj: its heads' channels and rows, and B's and C's 16 whole; n_groups stays 1)
    assert ("conv1d", "groups", 32 + 16) in split.shard_attrs(2) and ("in_proj", "out_features", 68 + 16) in \
        split.shard_attrs(2) and not any(a == "n_groups" for _, a, _ in split.attrs)
    assert split.heads_problem(2) is None and split.heads_problem(3) == (
        "8 heads of one group do not split 3 ways (a head's channels would span ranks)")
    cut = tuple((n, d, tuple(int(x) for x in sizes)) for n, d, sizes in split.dims)  # (B and C: blocks of a group)
    assert measure(mixer, dataclasses.replace(split, dims=cut), args, kwargs)
    if family == "falcon_h1":  # (mamba_rms_norm off, its default: no norm, nothing summed)
        assert split.moments == ()
        return
    assert split.moments == (("norm", 1, 64),)
    assert measure(mixer, dataclasses.replace(split, moments=()), args, kwargs)


def _kept_row_grads(key: str, family: str, summed: bool) -> tuple[float, float]:
    """One training step of `family` in `key` (the rewrite's B and C rows'
    gradients `summed` over the ranks splitting the mixer, or, a mutation,
    left each rank's own heads' part: the rewrite handing none of them to
    replicas.share_slices), every in_proj's gradient after the step's sums
    and clipping against the whole model's on the same batch: the largest
    relative differences (of the rows of this rank's heads; of B's and C's
    rows), the whole model's scaled to the rank's by the heads' rows (the
    clipping's factor). B's and C's gradients are ~1e-5 of the others' at
    initialisation, and AdamW's first steps are scale-free: a curve or the
    start-up proof (relative to a module's largest gradient) barely sees
    them, so they are compared alone."""
    import torch
    import torch.nn.functional as F
    from conftest import build
    from test_families import _cfg

    import tpctl.parallel.tensor.rewrite as rewrite
    from tpctl.models import build_model
    from tpctl.parallel.layout import Layout
    from tpctl.parallel.shard import spec_of

    cfg, layout = _cfg(key, family, 1), Layout.parse(key)
    kept_rows = rewrite.kept_rows
    rewrite.kept_rows = kept_rows if summed else lambda plan, mode: []
    try:
        real = build(cfg, layout, lazy=False, verify=False, schedule=False)
    finally:  # (the pool's workers run the next test too)
        rewrite.kept_rows = kept_rows
    ids = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1),
                        generator=torch.Generator().manual_seed(0))
    real.step([(real.par.shard_batch(ids[:, :-1], 0, 1), real.par.shard_targets(ids[:, 1:], 0, 1))], 0)
    whole = build_model(cfg.model, cfg.seed)
    logits = whole(input_ids=ids[:, :-1]).logits
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
    grads = {n: p.grad for n, p in whole.named_parameters()}
    off = {True: 0.0, False: 0.0}  # (B's and C's rows, the others)
    for name, p in real.model.named_parameters():
        if not name.endswith("mamba.in_proj.weight"):
            continue
        spec = spec_of(p)
        rows = torch.cat([torch.arange(a, b) for a, b in spec.index[0]])
        kept = (rows >= 128) & (rows < 144)  # (hf_families' one-group mixers: [z 64 | x 64 | B 8 | C 8 | dt 8])
        want, got = spec.slice(grads[name]), p.grad
        scale = (got[~kept] * want[~kept]).sum() / (want[~kept] * want[~kept]).sum()
        for is_kept, mask in ((True, kept), (False, ~kept)):
            diff = (got[mask] - scale * want[mask]).abs().max() / (scale * want[mask]).abs().max()
            off[is_kept] = max(off[is_kept], diff.item())
    return off[False], off[True]


@pytest.mark.timeout(300)
def test_a_one_group_mixers_b_and_c_gradients_are_summed_over_the_ranks_splitting_it(pool):
    """1d-2-dp2: each rank's gradient of B's and C's rows (held whole) equals the
    whole model's once summed over the two ranks; left unsummed (each its
    own heads' part, the mutation) it does not."""
    for summed in (True, False):
        results = pool.run(_kept_row_grads, "1d-2-dp2", "falcon_h1_norm", summed)
        own, kept = max(r[0] for r in results), max(r[1] for r in results)
        print(f"B and C gradients {'summed' if summed else 'unsummed'}: heads' rows within {own:.2g}, "
              f"B's and C's within {kept:.2g} of the whole model's")
        assert own < 1e-4, (summed, own)
        assert (kept < 1e-4) if summed else (kept > 0.1), (summed, kept)


@pytest.mark.parametrize("key", ["1d-2", "2d-4"])
def test_each_rank_holds_its_share_of_a_one_group_mixer(key):
    """1d-2 and 2d-4 (the heads split among the q = 2 ranks of a block of
    rows): Falcon-H1's one-group mixer is split by heads, every tensor of it
    halved on a rank but B's and C's rows of in_proj and channels of the
    conv, whole; inspect says so."""
    import math

    rows = _inspect(key, "falcon_h1_norm")
    mixer = _mixer("falcon_h1_norm")
    name = next(n for n in rows if n.endswith("layers.0.mamba"))
    assert rows[name][2] == "mixer (heads split)" and "8 heads in one group" in rows[name][6], rows[name]
    assert "in_proj.weight dim 0 [64, 64, 8 whole, 8 whole, 8]" in rows[name][6], rows[name]
    nbytes = {n: math.prod(p.shape) * p.element_size() for n, p in mixer.named_parameters()}
    bc = 4 * 2 * 8  # (B's and C's 8 rows or channels, fp32)
    want = {"in_proj": (nbytes["in_proj.weight"] - 32 * bc) // 2 + 32 * bc,
            "conv1d": (nbytes["conv1d.weight"] - 4 * bc) // 2 + 4 * bc + (nbytes["conv1d.bias"] - bc) // 2 + bc,
            "norm": nbytes["norm.weight"] // 2, "out_proj": nbytes["out_proj.weight"] // 2}
    for sub, held in want.items():
        assert rows[f"{name}.{sub}"][5] == held and rows[f"{name}.{sub}"][6].startswith("split by heads, inside"), \
            rows[f"{name}.{sub}"]


# ---- Mamba-1: split by inner channels, x_proj's partial product summed inside the mixer -------

def assert_mamba1_split(ranks, ways: int) -> None:
    """Each rank's real shapes (trains_like_mode_none's ranks) of every
    Mamba-1 mixer its stage holds (some rank holds one) (hf_families' tiny mamba and jamba: 64
    inner channels, hidden 32, state 4, dt rank 4): 1/ways of the channels
    of in_proj's rows, x_proj's columns and A_log's rows; x_proj's outputs
    (dt rank + 2 x state) whole."""
    want = {"in_proj.weight": (128 // ways, 32), "x_proj.weight": (12, 64 // ways), "A_log": (64 // ways, 4)}
    seen = set()
    for rank, (_, counted, _, _) in enumerate(ranks):  # (a pipeline stage may hold none)
        held = {n: (shape, k) for n, shape in counted.items() for k in want if n.endswith("." + k)}
        for name, (shape, kind) in held.items():
            assert shape == want[kind], (rank, name, shape)
            seen.add(kind)
    assert seen == set(want), f"no rank holds a Mamba-1 mixer's {set(want) - seen}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family,key,ways", [("mamba", "1d-4", 4), ("mamba", "2.5d-8-d2", 2),
                                             ("mamba", "1d-2-sp-dp2", 2), ("falcon_mamba", "1d-2-dp2", 2)])
def test_a_mamba1_mixer_split_by_channels_trains_like_mode_none(pool, none_curves, family, key, ways):
    """Mamba's mixer in 1d-4 (each rank a quarter of its channels, x_proj's
    partial products summed over the four), 2.5d (among the q = 2 ranks of
    a block of rows) and 1d with sequence parallelism (the sequence
    gathered for the mixer); FalconMamba's (weightless norms) in 1d.
    test_families_hybrid runs Mamba's and Jamba's split two ways in 1d,
    2d, 3d and with pipeline stages."""
    ranks, _ = trains_like_mode_none(pool, none_curves, family, key)
    assert_mamba1_split(ranks, ways)


@pytest.mark.parametrize("family", ["mamba", "jamba", "falcon_mamba"])
def test_the_mamba1_layout_is_measured_and_a_wrong_one_fails(family):
    """Mamba-1's split by inner channels (Mamba's, Jamba's with RMSNorms over
    dt, B and C held whole, FalconMamba's weightless ones: buffers)
    reproduces its output, the shards run side by side with x_proj's
    partial products summed; in_proj's rows read as one block (x on one
    rank, z on the other), x_proj's products left unsummed, or Jamba's
    norms read as 1/shards, do not."""
    import dataclasses

    from tpctl.parallel.roles.experts import WHOLE
    from tpctl.parallel.roles.fused import ProbeError
    from tpctl.parallel.roles.mixers import measure, mixer_split

    mixer, (args, kwargs) = _mixer(family), _call()
    split = mixer_split(mixer, args, kwargs)
    assert split.kind == "mamba1" and split.heads == split.groups == mixer.intermediate_size == 64
    assert split.reduced == (("x_proj", mixer.x_proj.out_features),)
    # (channels that do not divide: the mixer runs whole, and says why)
    assert split.heads_problem(4) is None and split.heads_problem(3) == "64 inner channels do not split 3 ways"
    with pytest.raises(ProbeError, match="no layout of its heads reproduces its output"):
        mixer_split(mixer, args, kwargs, orders=[("xz",)])
    assert measure(mixer, dataclasses.replace(split, reduced=()), args, kwargs)
    norms = tuple((n, WHOLE, ()) if "layernorm" in n else (n, d, sizes) for n, d, sizes in split.dims)
    if family == "jamba":
        assert measure(mixer, dataclasses.replace(split, dims=norms), args, kwargs)
    else:
        assert not any(n.endswith("layernorm.weight") for n, _ in mixer.named_parameters())


# ---- MiniMax's lightning attention: split by heads, its norm's moments summed inside the mixer ---

def assert_lightning_split(ranks, ways: int) -> None:
    """Each rank's real shapes (trains_like_mode_none's ranks) of every
    lightning attention its stage holds (some rank holds one) (hf_families'
    tiny minimax: 4 heads of 8, hidden 32): 1/ways of the heads of
    qkv_proj's and output_gate's rows, of the norm's features (its weight)
    and out_proj's columns."""
    want = {"qkv_proj.weight": (96 // ways, 32), "output_gate.weight": (32 // ways, 32),
            "norm.weight": (32 // ways,), "out_proj.weight": (32, 32 // ways)}
    seen = set()
    for rank, (_, counted, _, _) in enumerate(ranks):  # (a pipeline stage may hold none)
        for name, shape in counted.items():
            kind = next((k for k in want if name.endswith("self_attn." + k)), None)  # (full attention: o_proj)
            if kind:
                assert shape == want[kind], (rank, name, shape)
                seen.add(kind)
    assert seen == set(want), f"no rank holds a lightning attention's {set(want) - seen}"


def test_the_lightning_layout_is_measured_and_a_wrong_one_fails():
    """MiniMax's lightning attention split by heads (qkv_proj's rows per
    head [q|k|v], output_gate's, the decay buffers', the norm's features,
    out_proj's columns), the shards run side by side with the norm's
    moments summed, reproduces its output; qkv_proj read as [q..|k..|v..],
    the moments left to each shard's own features, or the norm's weight
    held whole, do not. Heads that do not divide: it runs whole, and says
    why."""
    import dataclasses

    import torch

    from tpctl.parallel.roles.experts import WHOLE
    from tpctl.parallel.roles.fused import ProbeError
    from tpctl.parallel.roles.mixers import measure, mixer_split

    mixer = _mixer("minimax")
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))
    args, kwargs = (x, (torch.ones(2, 8, 8), torch.zeros(2, 8, 8)), None), {}
    split = mixer_split(mixer, args, kwargs)
    assert split.kind == "lightning" and split.heads == split.groups == mixer.num_attention_heads == 4
    assert split.moments == (("norm", 1, 32),) and not split.reduced
    dims = dict((n, (d, sizes)) for n, d, sizes in split.dims)
    assert dims["qkv_proj.weight"] == (0, (96,)) and dims["diagonal_decay"] == (1, (4,))
    assert dims["norm.weight"] == (0, (32,)) and dims["slope_rate"] == (0, (4,))
    assert split.heads_problem(2) is None and split.heads_problem(3) == (
        "4 head(s) do not split 3 ways (a head's query, key, value, gate and decay channels would span ranks)")
    with pytest.raises(ProbeError, match="no layout of its heads reproduces its output"):
        mixer_split(mixer, args, kwargs, orders=[("concat",)])
    assert measure(mixer, dataclasses.replace(split, moments=()), args, kwargs)
    held = tuple((n, WHOLE, ()) if n == "norm.weight" else (n, d, sizes) for n, d, sizes in split.dims)
    assert measure(mixer, dataclasses.replace(split, dims=held), args, kwargs)


def test_the_rglru_layout_is_measured_and_a_wrong_one_fails():
    """RecurrentGemma's recurrent block split by heads (linear_x's and
    linear_y's rows, the conv's channels, the RG-LRU's per-head gates and
    per-channel recurrent_param, linear_out's columns) reproduces its
    output on its traced call's arguments (position ids: the recurrence's
    resets), its cache on or off; the gates' heads dealt round the ranks
    (head 2 with head 0), each rank given the other's block of the gates
    or of recurrent_param, or linear_out's bias added by every rank, do
    not. Heads that do not divide: the block runs whole and says why."""
    import dataclasses

    import torch

    from tpctl.parallel.roles.fused import ProbeError, real_copy
    from tpctl.parallel.roles.mixer_dims import REPLICA
    from tpctl.parallel.roles.mixer_measure import shard_of
    from tpctl.parallel.roles.mixers import measure, mixer_split

    mixer = _mixer("recurrent_gemma")
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))
    for cache in (False, True):
        kwargs = dict(position_ids=torch.arange(8).expand(2, 8), attention_mask=None, use_cache=cache)
        split = mixer_split(mixer, (x,), kwargs)
        assert split.kind == "rglru" and split.heads == split.groups == mixer.rg_lru.num_attention_heads == 4
        assert ("rg_lru", "num_attention_heads", 4) in split.attrs and ("", "lru_width", 32) in split.attrs
        with pytest.raises(ProbeError, match="no layout of its heads reproduces its output"):
            mixer_split(mixer, (x,), kwargs, orders=[("strided",)])
    assert split.heads_problem(2) is None and "4 head(s) do not split 3 ways" in split.heads_problem(3)

    # Each shard's RG-LRU given the other shard's heads of a tensor (its gates; recurrent_param's channels):
    # the shards' outputs no longer sum to the whole block's.
    clone, kwargs = real_copy(mixer, seed=5), {**kwargs, "use_cache": False}  # (no state kept between calls)
    with torch.no_grad():
        whole = clone(x, **kwargs)[0]
        for names in ((), ("input_gate_weight", "recurrent_gate_weight"), ("input_gate_bias",), ("recurrent_param",)):
            shards = [shard_of(clone, split, 2, s) for s in range(2)]
            for n in names:
                a, b = (getattr(sh.rg_lru, n) for sh in shards)
                setattr(shards[0].rg_lru, n, b)
                setattr(shards[1].rg_lru, n, a)
            total = sum(sh(x, **kwargs)[0] for sh in shards)
            off = ((total - whole).abs().max() / whole.abs().max()).item()
            assert (off < 1e-5) == (not names), (names, off)
    # linear_out's bias read as itself on every rank (added twice), not as 1/shards:
    summed = dataclasses.replace(split, dims=tuple((n, REPLICA if n == "linear_out.bias" else d, s)
                                                   for n, d, s in split.dims))
    assert measure(mixer, summed, (x,), kwargs)



@pytest.mark.parametrize("family,key,why", [
    ("bamba", "1d-4", "2 group(s) of heads do not split 4 ways"),
    ("qwen3_next", "1d-4", "2 key head(s) do not split 4 ways"),
    ("qwen3_5", "1d-4", "2 key head(s) do not split 4 ways"),
    ("olmo_hybrid", "1d-4", "2 key head(s) do not split 4 ways"),
    ("bamba", "2d-16", "2 group(s) of heads do not split 4 ways")])
def test_a_mixer_that_does_not_split_runs_whole_and_says_why(family, key, why):
    rows = _inspect(key, family)
    mixers = [row for row in rows.values() if row[2] == "whole" and ("Mixer" in row[1] or "Delta" in row[1])]
    assert mixers and all(row[6].startswith("run whole on every rank") and "not split by heads: " in row[6]
                          and why in row[6] for row in mixers), mixers


# ---- a lazily built model=hf (as workers and inspect build it) -------------------------------

# model=hf at the size keys' tiny sizes, and the family's own settings for its mixers (hf_families.py's).
HF_SIZES = dict(vocab_size=256, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=64, block_size=64,
                tie_embeddings=False)
DELTA = dict(layer_types=["linear_attention", "full_attention"], linear_key_head_dim=8, linear_value_head_dim=8,
             linear_num_key_heads=2, linear_num_value_heads=4)
LAZY = {
    # (A_log from num_v_heads, the conv's weight of its module's shape: a shard's once split)
    "qwen3_5_text": DELTA,
    # (A_log and dt_bias from one generator: dt_bias drawn after as many numbers as A_log has)
    "olmo_hybrid": DELTA,
    # (Mamba-2 beside experts: its init of the mixer rescales out_proj.weight in place, a rank's real
    # shard once the rewrite made it)
    "nemotron_h": dict(layers_block_type=["mamba", "moe"], mamba_num_heads=8, mamba_head_dim=8, n_groups=2,
                       ssm_state_size=8, expand=2, chunk_size=4, n_routed_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=16, moe_shared_expert_intermediate_size=16,
                       experts_implementation="eager"),
    # (beside experts whose stacked down_proj its init draws after gate_up_proj from one generator)
    "qwen3_next": dict(DELTA, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       shared_expert_intermediate_size=16, experts_implementation="eager"),
    # (Mamba-1: init_mamba_weights draws dt_proj's bias from intermediate_size, the whole model's once built)
    "mamba": dict(state_size=4, expand=2, conv_kernel=4, time_step_rank=4),
    # (lightning attention beside experts: its per-head decay buffers, a rank's its heads' block)
    "minimax": dict(layer_types=["linear_attention", "full_attention"], head_dim=8, num_local_experts=4,
                    num_experts_per_tok=2),
    # (the RG-LRU: its init draws recurrent_param with empty_like, a shard's shape once the rewrite made it)
    "recurrent_gemma": dict(lru_width=32, attention_window_size=4, block_types=["recurrent", "attention"]),
}
# size keys a family has no setting for: MambaConfig's (no heads; its inner width is expand x hidden) left
# out, MiniMaxConfig's bias null (the family's default)
UNSET = {"mamba": ("n_head", "n_kv_head", "intermediate_size")}
NULL = {"minimax": ("bias",)}


def _hf_cfg(family: str, key: str):
    from omegaconf import OmegaConf

    from tpctl.config import default_config, typed_model
    from tpctl.parallel.layout import Layout

    cfg = Layout.parse(key).write_to(default_config())
    sizes = {k: v for k, v in HF_SIZES.items() if k not in UNSET.get(family, ())}
    sizes.update(dict.fromkeys(NULL.get(family, ())))
    cfg.model = typed_model(OmegaConf.create({"arch": family, **sizes, "config": LAZY[family]}))
    return cfg


def _lazy_shards(key: str, family: str) -> tuple[int, float]:
    """On each rank: the model built lazily and rewritten as a worker
    builds it (its start-up proof run) against the whole model built
    eagerly: (how many parameters of its mixers and experts are split, the largest
    difference of any parameter to the whole one's slice)."""
    from conftest import build

    from tpctl.models import build_model
    from tpctl.parallel.layout import Layout
    from tpctl.parallel.shard import spec_of

    cfg = _hf_cfg(family, key)
    whole = dict(build_model(cfg.model, cfg.seed).named_parameters())
    run = build(cfg, Layout.parse(key), lazy=True, verify=True, step=False)
    worst, split = 0.0, 0
    for name, p in run.model.named_parameters():
        want = spec_of(p).slice(whole[name].detach())
        assert p.shape == want.shape, (name, tuple(p.shape), tuple(want.shape))
        worst = max(worst, (p.detach() - want).abs().max().item())
        split += p.shape != whole[name].shape and any(k in name for k in ("linear_attn", "mixer", "experts", "qkv_proj",
                                                                          "rg_lru"))
    return split, worst


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", list(LAZY))
def test_a_lazily_built_model_holds_the_whole_models_slices(pool, family):
    """model=hf built lazily (each parameter made whole from its own seed
    and sliced, as workers build it), its mixers split by heads in 1d: it
    passes the start-up proof, and every parameter of every rank equals
    the eagerly built whole model's slice, the mixers' own (A_log,
    dt_bias, the conv's channels, out_proj) included: the family's init
    reads the model as built, not as the rewrite left it (models/init.py's
    as_built)."""
    results = pool.run(_lazy_shards, "1d-2-dp2", family)
    assert all(split > 0 for split, _ in results), results
    assert max(worst for _, worst in results) == 0.0, results


@pytest.mark.timeout(120)
def test_inspect_starts_a_lazily_built_mixer_split_by_heads(tpctl):  # noqa: F811
    """As a user: `tpctl inspect model=hf` (built lazily, its rewrite
    proven) of Qwen3.5 in 1d-2 names its linear attention split by heads."""
    config = [f"+model.config.{k}={v}" for k, v in DELTA.items() if k != "layer_types"]
    args = ["inspect", "model=hf", "model.arch=qwen3_5_text", "mode=1d", "size=2",
            *[f"model.{k}={str(v).lower()}" for k, v in HF_SIZES.items()],
            "+model.config.layer_types=[linear_attention,full_attention]", *config]
    done = tpctl.run(args, timeout=120)
    assert done.returncode == 0, done.stdout[-1500:] + done.stderr[-1500:]
    assert "mixer (heads split)" in done.stdout and "refusing" not in done.stdout + done.stderr, done.stdout[-1500:]


# ---- decoding with the model's cache: RecurrentGemma's block keeps its conv and recurrence state ----

def _rglru_logits(key: str, use_cache: bool):
    """The whole vocabulary's last logits of six forwards of recurrent_gemma
    (the prompt, then one fixed token at a time, with transformers' cache or
    re-running the sequence), decoded as tpctl generate decodes; and this
    rank's shape of the RG-LRU's input gate."""
    import torch
    from test_families import _cfg
    from test_generate import PROMPT, _build

    from tpctl.training.generation import Stepper, last_logits, local_input

    model, mode = _build(_cfg("1d-2-dp2" if key == "none-dp4" else key, "recurrent_gemma").model, key)
    gate = next(tuple(p.shape) for n, p in model.named_parameters() if n.endswith("rg_lru.input_gate_weight"))
    step, out, ids = Stepper(model, use_cache), [], list(PROMPT)
    with torch.no_grad():
        for t in range(6):
            out.append(last_logits(mode, step(local_input(mode, ids[-1:] if t and use_cache else ids, "cpu")), 256))
            ids.append((7 * t + 3) % 256)
    return gate, torch.stack(out)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("use_cache", [True, False])
def test_a_split_rglru_block_decodes_like_mode_none(pool, use_cache):
    """Decoding with RecurrentGemma's cache (its block's conv state and the
    RG-LRU's recurrent state, each a rank's channels: the shard's lru_width)
    or without: the logits of 1d-2 and 2d-4, the block split by heads, are
    mode=none's within fp32 round-off."""
    from test_generate import _run

    want = _run(pool, _rglru_logits, "none-dp4", use_cache)[0][1]
    for key in ("1d-2-dp2", "2d-4"):
        got = _run(pool, _rglru_logits, key, use_cache)
        assert all(gate == (2, 8, 8) for gate, _ in got), (key, [g for g, _ in got])
        off = max((logits - want).abs().max().item() for _, logits in got) / want.abs().max().item()
        assert off < 1e-5, (key, off)
