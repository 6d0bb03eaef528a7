"""Mechanisms of two families found in transformers' zoo (issue 46), each
trained a few steps within 1e-6 of mode=none on the shared pool, in
process (tests/hf_families.py: tiny, random init, transformers' defaults):

* Doge's dynamic attention mask: `dt_proj` reads all value heads and makes
  one rate per head, scaled by a per-head `A` -- split by heads, its partial
  products reduce-scattered over the heads' ranks (tensor/head_reduce.py),
  `A` held with its heads (rewrite._hold_heads).
* Dory's LM head: a Linear whose forward multiplies its logits by a learned
  per-token `logit_scale` -- held as the vocabulary is, applied by the
  head's own forward to each rank's logits (tensor/output_params.py); its
  L2 norms (x / |x|, no parameters) on the stream, split as an RMSNorm's
  sum of squares is in 2d (probes.sums_squares).
"""

from __future__ import annotations

import pytest
from test_families import _curve, deviation

pytest.importorskip("transformers")

STEPS = 4
# Relative, every step's loss and gradient norm: 1e-6, or where mode=none's
# own curve from weights one fp32 round-off away moves further (lr 1e-2 on a
# tiny model amplifies round-off step by step), FLOOR_RATIO times that, with
# the first step (the same weights' gradient: what a rewrite could get
# wrong) within 1e-6 still (benchmarks/hf_all_families.py's judgement).
TOLERANCE, ROUNDOFF, FLOOR_RATIO = 1e-6, 2.0 ** -24, 10.0


def _shapes_and_curve(key: str, family: str, steps: int):
    """This rank's parameter shapes as the planner's dry run gives them and
    as the real rewrite makes them, its collectives of one step, and the
    training curve (test_families_anymodel._planned_shapes_and_curve)."""
    from test_families_anymodel import _planned_shapes_and_curve

    return _planned_shapes_and_curve(key, family, steps)


def _moved_curve(key: str, family: str, steps: int):
    """mode=none's (`key`) curve from every initial weight times (1 + 2^-24 N(0, 1))."""
    import torch
    from conftest import build, trainer_of
    from test_families import _cfg

    from tpctl.parallel.layout import Layout

    run = build(_cfg(key, family, steps), Layout.parse(key), lazy=False, verify=True, step=False)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in run.model.parameters():
            p.mul_(1 + ROUNDOFF * torch.randn(p.shape, generator=gen))
    return [(r["loss"], r["grad_norm"]) for r in trainer_of(run).fit()]


def _trains_like_mode_none(pool, none_curves: dict, family: str, key: str) -> None:
    """As test_families_anymodel.trains_like_mode_none (shapes and
    collectives counted == planned), with the curve judged against
    mode=none's own round-off where it is above 1e-6 (see above)."""
    if family not in none_curves:
        none_curves[family] = pool.run(_curve, "none-dp4", family, STEPS)[0]
    want = none_curves[family]
    from test_families_anymodel import _planned_comm

    from tpctl.parallel.layout import Layout

    by_rank = _planned_comm(key, family)
    ranks = pool.run(_shapes_and_curve, key, family, STEPS)
    for rank, (planned, counted, kinds, _) in enumerate(ranks):
        assert {n: planned.get(n) for n in counted} == counted, f"rank {rank}"
        # counted == planned: calls and bytes of each kind (a per-head reduction's reduce-scatter too)
        assert {k: v[:2] for k, v in kinds.items()} == {k: v[:2] for k, v in by_rank[rank].items()}, f"rank {rank}"
    assert Layout.parse(key).pp == 1
    got = ranks[0][3]
    assert got[0] != "refused", got[1]
    assert len(got) == STEPS and max(deviation(want[:1], got[:1])) < TOLERANCE, (want, got)
    dev = max(deviation(want, got))
    if dev >= TOLERANCE:
        floor = max(deviation(want, pool.run(_moved_curve, "none-dp4", family, STEPS)[0]))
        assert dev <= FLOOR_RATIO * floor, (dev, floor, want, got)
    print(f"{family} {key}: step 1 {max(deviation(want[:1], got[:1])):.1e}, {STEPS} steps {dev:.1e}"
          f"{f' (mode=none from weights {ROUNDOFF:.0e} away: {floor:.1e})' if dev >= TOLERANCE else ''}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("key", ["1d-2-dp2", "2d-4"])
def test_a_dynamic_mask_split_by_heads_trains_like_mode_none(pool, none_curves, key):
    _trains_like_mode_none(pool, none_curves, "doge", key)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("key", ["1d-2-dp2", "2d-4", "2.5d-8-d2", "3d-8"])
def test_a_logit_scale_held_as_the_vocabulary_trains_like_mode_none(pool, none_curves, key):
    """(and, in 2d, Dory's L2 norms on the split stream: a sum of squares over
    the ranks holding the features, probes.sums_squares). Counted == planned:
    Dory calls each block twice (its input and output sections hold the same
    layers at this depth) and its final norm four times, and the planner
    counts each module as often as the traced forward calls it
    (RolePlan.calls; 2d-4: 46 all-reduces, 9 all-gathers and reduce-scatters;
    2.5d-8-d2: 48, 9; 3d-8: 47, 13)."""
    _trains_like_mode_none(pool, none_curves, "dory", key)


def test_a_per_head_reduction_is_found_with_its_heads():
    """Doge's dt_proj reads v_proj's heads (not a latent attention's
    up-projection of a latent), its A is per head."""
    from hf_families import build

    from tpctl.parallel.roles.inference import infer_plan

    plan = infer_plan(build("doge"))
    attn = "model.layers.0.self_attn"
    assert plan.roles[f"{attn}.dt_proj"] == "head_reduce" and plan.sources[f"{attn}.dt_proj"] == f"{attn}.v_proj"
    assert {plan.roles[f"{attn}.{p}_proj"] for p in "qkv"} == {"attn_in"}
    assert plan.heads[attn].params == ("A",) and not plan.problems


def test_extra_parameters_of_a_linear_are_carried_only_when_they_act_on_each_output_alone():
    import torch
    import torch.nn as nn

    from tpctl.parallel.tensor.output_params import output_params

    class Scaled(nn.Linear):  # Dory's head: one scale per output feature, and a scalar
        def __init__(self):
            super().__init__(8, 6, bias=False)
            self.s, self.t = nn.Parameter(torch.rand(6)), nn.Parameter(torch.ones(()))

        def forward(self, x):
            return super().forward(x) * self.s * self.t

    class Mixed(Scaled):  # each output reads its neighbour
        def forward(self, x):
            return (super().forward(x) * self.s).roll(1, -1)

    class Own(Scaled):  # its product not made by nn.Linear's forward
        def forward(self, x):
            return x @ (self.weight * 2).t() * self.s

    class Wide(Scaled):
        def __init__(self):
            super().__init__()
            self.s = nn.Parameter(torch.rand(6, 2))

    assert output_params(Scaled()) == ["s", "t"]
    for cls, why in ((Mixed, "to each output feature alone"), (Own, "from nn.Linear's forward alone"),
                     (Wide, "s (6, 2) neither a scalar nor one entry per output feature")):
        with pytest.raises(ValueError, match=why.replace("(", r"\(").replace(")", r"\)")):
            output_params(cls())
