"""Norms over all heads of q or k (`proj_norm`: OLMo-2's, OLMo Hybrid's
attention's), issue 46: split as their projection's output features are,
their moments summed over the ranks splitting them (mode.convert_proj_norm).
A pipeline stage's role plan keeps each one's source projection (the cut
once dropped it: KeyError in convert_proj_norm), and the planner counts
their sums (cost_proj_norm), so counted == planned in 1d, 2d and 3d.
"""

from __future__ import annotations

import pytest
from test_families_anymodel import trains_like_mode_none

pytest.importorskip("transformers")

FAMILIES = ("olmo2", "olmo_hybrid")


@pytest.mark.parametrize("family", FAMILIES)
def test_every_pipeline_stage_places_its_norms_over_all_heads(family):
    """Each stage of 1d-2-pp2 (the planner's dry run of its rewrite, no
    process group) converts the proj_norms of the blocks it holds, from the
    source projections the whole model's plan names, and the stages
    together hold every one of them."""
    import hf_families

    from tpctl.parallel.layout import Layout
    from tpctl.parallel.parallelism import parallelism
    from tpctl.parallel.roles.inference import resolve_plan
    from tpctl.parallel.roles.probes import linearize
    from tpctl.parallel.tensor.layers import SplitNorm

    whole = hf_families.build(family)
    linearize(whole)
    want = resolve_plan(whole, None).sources
    assert want, f"{family} has no norm over all heads of q or k"
    layout, seen = Layout.parse("1d-2-pp2"), {}
    for stage in range(layout.pp):
        rank = next(r for r in range(layout.world) if layout.coords(r)["pp"] == stage)
        done = parallelism(layout, rank=rank, groups=False).rewrite(hf_families.build(family), dry_run=True, stage=True)
        mine = dict(done.plan.sources)
        assert all(isinstance(done.model.get_submodule(n), SplitNorm) for n in mine), mine
        seen.update(mine)
    assert seen == want


# OLMo-2 in each mode (its comm comparison never ran before: test_families compares curves only);
# OLMo Hybrid in plain 1d (before: 24 all-reduces counted, 20 planned) and with two stages (a crash).
CASES = [("olmo2", key) for key in ("1d-2-dp2", "2d-4", "2.5d-8-d2", "3d-8")]
CASES += [("olmo_hybrid", "1d-2-dp2"), ("olmo_hybrid", "1d-2-pp2-dp2")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family,key", CASES)
def test_norms_over_all_heads_train_like_mode_none_and_send_what_is_planned(pool, none_curves, family, key):
    trains_like_mode_none(pool, none_curves, family, key)
