"""Recurrent and hybrid token mixers (issue 46): state-space mixers (Mamba-1
alone and beside attention and experts, Mamba-2 beside experts, Mamba-2 in
parallel with attention), gated delta-rule and lightning linear attention,
a real-gated linear recurrence. No split fits them: each runs whole on
every rank, on whole rows of the rows it holds (parallel/roles/whole.py);
but a Mamba-2 mixer (by heads: with one group, Falcon-H1's, its B and C
whole on every rank), a gated delta rule with key heads, a Mamba-1 mixer (Mamba's, Jamba's: by inner channels, x_proj's
partial product summed inside it), MiniMax's lightning attention (by
heads, its norm's moments summed across ranks) and RecurrentGemma's
real-gated recurrent block (by the RG-LRU's heads), which every mode splits
among the ranks holding a row (parallel/roles/mixers.py, tests/test_mixers.py),
and Llama 4's experts, fed every row scaled by its score (no routing
indices), split by each expert's inner features like any experts run by
their own forward (parallel/roles/experts.py).
Each family (tests/hf_families.py: tiny, random init) trains like mode=none
in 1d, 2d, 3d and 1d with two pipeline stages, its shapes and collectives
as planned, on the shared pool, in process.
"""

from __future__ import annotations

import pytest
from test_families import _curve
from test_families_anymodel import trains_like_mode_none

pytest.importorskip("transformers")

FAMILIES = ("mamba", "nemotron_h", "jamba", "falcon_h1", "qwen3_next", "minimax", "recurrent_gemma", "llama4")
KEYS = ("1d-2-dp2", "2d-4", "3d-8", "1d-2-pp2-dp2")
# Families with a mechanism of their own in every layout (a mixer alone; linear attention beside
# gated attention and experts; Mamba-1's inner sum; lightning's norm moments; the RG-LRU's heads),
# the others taking turns down the list (each layout meets several mechanisms; Llama 4's experts,
# fed E rows a row, in 1d with pp=2 and 2d): the mechanism is one for all mixers, the suite's time
# is not.
EVERY_LAYOUT = ("mamba", "qwen3_next", "minimax", "recurrent_gemma")
CASES = [(family, key) for i, family in enumerate(FAMILIES)
         for key in (KEYS if family in EVERY_LAYOUT else [KEYS[i % len(KEYS)], KEYS[(i + 2) % len(KEYS)]])]
# Mamba layers beside attention layers, two classes in one list of blocks: the stack stages cut.
CASES += [("jamba", "1d-2-pp2-dp2")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family,key", CASES)
def test_a_mixer_trains_like_mode_none(pool, none_curves, family, key):
    ranks, _ = trains_like_mode_none(pool, none_curves, family, key)
    if family in ("mamba", "jamba"):  # Mamba-1, split by inner channels 2 ways in each of KEYS
        from test_mixers import assert_mamba1_split

        assert_mamba1_split(ranks, 2)
    if family == "minimax":  # lightning attention, split by heads 2 ways in each of KEYS
        from test_mixers import assert_lightning_split

        assert_lightning_split(ranks, 2)
    if family == "recurrent_gemma":  # its RG-LRU block, split by heads 2 ways in each of KEYS
        assert_rglru_split(ranks, 2)
    if family == "llama4":  # its experts (fed E rows a row), split by inner features 2 ways in each of KEYS
        assert_llama4_experts_split(ranks, 2)


def assert_llama4_experts_split(ranks, ways: int) -> None:
    """Each rank's real shapes of the experts its stage holds (hf_families'
    tiny llama4: 4 experts of 16 inner features, hidden 32): 1/ways of
    every expert's gate and up columns and down rows."""
    want = {"experts.gate_up_proj": (4, 32, 32 // ways), "experts.down_proj": (4, 16 // ways, 32)}
    assert_held_shapes(ranks, want, ".feed_forward.")


def assert_rglru_split(ranks, ways: int) -> None:
    """Each rank's real shapes (trains_like_mode_none's ranks) of the
    recurrent block its stage holds (some rank holds one) (hf_families'
    tiny recurrent_gemma: 4 heads of 8 channels, lru_width 32, hidden 32):
    1/ways of the heads of linear_x's rows, the conv's channels, the
    RG-LRU's gates and recurrent_param, linear_out's columns."""
    want = {"linear_x.weight": (32 // ways, 32), "conv_1d.weight": (32 // ways, 1, 4),
            "rg_lru.input_gate_weight": (4 // ways, 8, 8), "rg_lru.recurrent_param": (32 // ways,),
            "linear_out.weight": (32, 32 // ways)}
    assert_held_shapes(ranks, want, ".temporal_block.")


def assert_held_shapes(ranks, want: dict, inside: str) -> None:
    """Every parameter of `want` (its name after `inside`) that a rank holds
    has the shape `want` gives, and some rank holds each (a pipeline stage
    may hold none)."""
    seen = set()
    for rank, (_, counted, _, _) in enumerate(ranks):
        for name, shape in counted.items():
            kind = next((k for k in want if name.endswith(inside + k)), None)
            if kind is not None:
                assert shape == want[kind], (rank, name, shape)
                seen.add(kind)
    assert seen == set(want), f"no rank holds {inside}{set(want) - seen}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["mamba", "qwen3_next"])
def test_context_parallelism_refuses_a_mixer_that_runs_whole_in_one_line(pool, family):
    """A recurrence over the sequence cannot run on a piece of it."""
    got = pool.run(_curve, "1d-2-cp2", family, ranks=4)[0]
    assert got[0] == "refused" and "runs on the whole sequence" in got[1] and "use cp=1" in got[1], got
    assert "\n" not in got[1]


# (Bamba's two groups of heads on 2d-16's q = 4 ranks of a row; Llama 4's MoE block with experts of an odd
# inner width, which returns its rows flattened. Falcon-H1's one-group mixer and Llama 4's experts of an even
# inner width, run whole here before, now split: test_mixers, test_a_mixer_trains_like_mode_none.)
@pytest.mark.parametrize("family,key", [("bamba", "2d-16"), ("llama4_odd", "1d-2-pp2")])
def test_inspect_names_the_modules_run_whole_and_why(family, key):
    """`tpctl inspect`'s table (a dry run on rank 0): a module's row (a
    mixer's) says it runs whole and why no split fits it; the modules
    inside it say whose."""
    from test_families import _cfg

    from tpctl.commands.inspect_model import inspect_model

    rows, summary, problems = inspect_model(_cfg(key, family))
    assert not problems, problems
    whole = [row for row in rows if row[2] == "whole"]
    assert whole and all(row[6].startswith("run whole on every rank") for row in whole), whole
    inside = [row for row in rows if any(row[0].startswith(w[0] + ".") for w in whole)]
    assert inside and all(row[6].startswith("run whole, inside ") for row in inside), inside
    assert summary["per rank"] < summary["whole model"]


@pytest.mark.timeout(300)
def test_sequence_parallelism_refuses_a_module_run_whole_that_flattens_its_rows(pool):
    """Llama 4's MoE block returns its rows flattened ([rows * seq, hidden]):
    run whole, its output is cut back by hidden features, never by sequence."""
    got = pool.run(_curve, "1d-2-sp-dp2", "llama4_odd")[0]
    assert got[0] == "refused" and "returns its rows flattened" in got[1] and "seq_parallel=false" in got[1], got
