"""Recurrent and hybrid token mixers (issue 46): state-space mixers (Mamba-1
alone and beside attention and experts, Mamba-2 beside experts, Mamba-2 in
parallel with attention), gated delta-rule and lightning linear attention,
a real-gated linear recurrence. No split fits them: each runs whole on
every rank, on whole rows of the rows it holds (parallel/roles/whole.py);
but a Mamba-2 mixer with groups of heads, a gated delta rule with key
heads, a Mamba-1 mixer (Mamba's, Jamba's: by inner channels, x_proj's
partial product summed inside it) and MiniMax's lightning attention (by
heads, its norm's moments summed across ranks), which every mode splits among the ranks
holding a row (parallel/roles/mixers.py, tests/test_mixers.py).
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
# Two families (a mixer alone; linear attention beside gated attention and experts) in every
# layout, the others taking turns down the list (each layout meets several mechanisms): the
# mechanism is one for all mixers, the suite's time is not.
EVERY_LAYOUT = ("mamba", "qwen3_next", "minimax")
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


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["mamba", "qwen3_next"])
def test_context_parallelism_refuses_a_mixer_that_runs_whole_in_one_line(pool, family):
    """A recurrence over the sequence cannot run on a piece of it."""
    got = pool.run(_curve, "1d-2-cp2", family, ranks=4)[0]
    assert got[0] == "refused" and "runs on the whole sequence" in got[1] and "use cp=1" in got[1], got
    assert "\n" not in got[1]


@pytest.mark.parametrize("family,key", [("recurrent_gemma", "2d-4"), ("falcon_h1", "1d-2-pp2")])
def test_inspect_names_the_modules_run_whole_and_why(family, key):
    """`tpctl inspect`'s table (a dry run on rank 0): a mixer's row says it
    runs whole and why no split fits it; the modules inside it say whose."""
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
    got = pool.run(_curve, "1d-2-sp-dp2", "llama4")[0]
    assert got[0] == "refused" and "returns its rows flattened" in got[1] and "seq_parallel=false" in got[1], got
