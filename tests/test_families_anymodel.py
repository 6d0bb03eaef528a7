"""Mechanisms rather than classes (issue 32): latent attention, expert
weights fused into a model's own module, elementwise modules with learned
parameters. Each family (tests/hf_families.py: tiny, random init,
transformers' defaults) trains a few steps in 1d, 2d, 3d and 1d with two
pipeline stages within 1e-4 of mode=none, on the shared pool, in process.
"""

from __future__ import annotations

import pytest
from test_families import _curve, deviation

pytest.importorskip("transformers")

KEYS = ("1d-2-dp2", "2d-4", "3d-8", "1d-2-pp2-dp2")
STEPS = 4
FAMILIES = ("deepseek_v3", "dbrx", "apertus", "mixtral", "oss_experts")
# (family, layout): each family in each of KEYS; latent attention alone in
# 2.5d and in 1d with sequence parallelism too.
CASES = [(f, k) for f in FAMILIES for k in KEYS] + [("deepseek_v3_dense", "2.5d-8-d2"),
                                                     ("deepseek_v3_dense", "1d-4-sp")]
# Norms without parameters nor a stored width, over each rotated head (in 2d on a split stream
# too: test_norms_without_a_width_train_like_mode_none).
CASES += [("nanochat", "1d-2-pp2-dp2")]
# DeepSeek's sparse-attention indexer (role `untrained`: whole, on whole rows of its attention's
# rows, its top-k positions mode=none's): 2d, 3d (rows cut again inside attention), and 1d with
# sequence parallelism (its attention's entry gathered the sequence already; without it, 1d-2-dp2
# trained like mode=none too, measured once: the suite's time).
CASES += [("deepseek_v32", k) for k in ("2d-4", "3d-8", "1d-4-sp")]


def _planned_shapes_and_curve(key: str, family: str, steps: int):
    """This rank's parameter shapes as the planner's dry run of the rewrite
    gives them (what it counts bytes from) and as the real rewrite makes
    them, the collectives (comm.STATS per kind) of one training step of the
    real run, and the training curve (test_families._curve)."""
    import torch
    import torch.distributed as dist
    from conftest import build
    from test_families import _cfg

    from tpctl.models import build_model
    from tpctl.parallel import comm
    from tpctl.parallel.layout import Layout
    from tpctl.parallel.parallelism import parallelism
    from tpctl.parallel.pipeline.stages import PipelineSpec
    from tpctl.parallel.shard import spec_of

    cfg, layout = _cfg(key, family, steps), Layout.parse(key)
    dry = parallelism(layout, rank=dist.get_rank(), groups=False).rewrite(build_model(cfg.model, cfg.seed),
                                                                          dry_run=True).model
    planned = {n: tuple(spec_of(p).local_shape()) for n, p in dry.named_parameters()}
    real = build(cfg, layout, pipeline=PipelineSpec.plain(layout.pp) if layout.pp > 1 else None,
                 lazy=False, verify=False, schedule=False)
    counted = {n: tuple(p.shape) for n, p in real.model.named_parameters()}
    accum, t = layout.pp, cfg.train
    ids = torch.randint(0, cfg.model.vocab_size, (t.batch_size, t.seq_len + 1), generator=torch.Generator().manual_seed(0))
    comm.STATS.reset()
    real.step([(real.par.shard_batch(ids[:, :-1], m, accum), real.par.shard_targets(ids[:, 1:], m, accum))
               for m in range(accum)], 0)
    s = comm.STATS
    kinds = {k: (s.calls[k], s.bytes[k], s.wire_bytes[k]) for k in s.calls}
    return planned, counted, kinds, _curve(key, family, steps)


_SHAPES: dict = {}


def _planned_comm(key: str, family: str) -> list[dict]:
    """The planner's collectives per kind of one step, per rank (its
    stage's plan, SplitPlan.comm_of: ranks summing other sets of shared
    key/value replicas have their own): from the model's shapes and roles
    (a dry run), not from running it."""
    from test_families import _cfg

    from tpctl.cost.planner import model_shape, plan_split
    from tpctl.parallel.layout import Layout

    cfg, layout = _cfg(key, family), Layout.parse(key)
    if family not in _SHAPES:  # (the same model in every layout: traced once)
        _SHAPES[family] = model_shape(cfg.model, cfg.seed)
    plan = plan_split(_SHAPES[family], layout, cfg.train.batch_size, cfg.train.seq_len, layout.pp)
    stages = plan.stages or [plan]
    return [{k: (v["calls"], v["bytes"], v["wire_bytes"])
             for k, v in stages[layout.coords(rank)["pp"]].by_kind(rank).items()} for rank in range(layout.world)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family,key", CASES)
def test_a_mechanism_trains_like_mode_none(pool, none_curves, family, key):
    trains_like_mode_none(pool, none_curves, family, key)


@pytest.mark.timeout(300)
def test_norms_without_a_width_train_like_mode_none(pool, none_curves):
    """NanoChat's RMSNorms store no weight nor width: on 2d's split stream
    each sums its moments over the ranks holding the features, like a norm
    with a weight. Counted == planned: NanoChat calls its final norm twice,
    and the planner counts it twice (RolePlan.calls)."""
    trains_like_mode_none(pool, none_curves, "nanochat", "2d-4")


def trains_like_mode_none(pool, none_curves: dict, family: str, key: str) -> None:
    """`family` in layout `key` trains like mode=none within 1e-4 (loss
    and gradient norm, every step), and counted == planned: every rank's
    parameter shapes equal the planner's dry run, and its collectives of
    one step the plan's (calls, bytes, wire bytes of each kind: latent
    attention's entries, routers, modules run whole, experts in Linears'
    3-d weights or a module's own, replica sums). Not with sequence
    parallelism: a Hugging Face attention or MLP module's entry gathers the
    sequence for all its Linears, which the planner does not count
    (cost/layer_comm.py). `none_curves`: family -> mode=none's curve.
    Returns each rank's (planned shapes, real shapes, collectives, curve)
    and the largest (loss, gradient norm) differences."""
    from tpctl.parallel.layout import Layout

    if family not in none_curves:
        none_curves[family] = pool.run(_curve, "none-dp4", family, STEPS)[0]
    want = none_curves[family]
    layout = Layout.parse(key)
    by_rank = None if layout.seq_parallel else _planned_comm(key, family)
    ranks = pool.run(_planned_shapes_and_curve, key, family, STEPS)
    for rank, (planned, counted, kinds, _) in enumerate(ranks):  # (its stage's, pp > 1)
        assert {n: planned.get(n) for n in counted} == counted, f"rank {rank}"
        if by_rank is None:
            continue
        plan = by_rank[rank]
        assert {k: v[:2] for k, v in kinds.items()} == {k: v[:2] for k, v in plan.items()}, f"rank {rank}"
        for k, v in kinds.items():  # wire bytes also check each group's size
            assert v[2] == pytest.approx(plan[k][2], rel=1e-9), f"rank {rank} {k}"
    got = ranks[0][3]
    assert got[0] != "refused", got[1]
    loss, norm = deviation(want, got)
    assert len(got) == STEPS and loss < 1e-4 and norm < 1e-4, (loss, norm)
    return ranks, (loss, norm)


# ---- the mechanisms on modules of no family, in one process ------------------

def _toy(act):
    import torch.nn as nn

    class Toy(nn.Module):  # embedding, one MLP with the activation under test, a head
        def __init__(self):
            super().__init__()
            self.emb, self.up, self.act, self.down, self.head = (
                nn.Embedding(37, 16), nn.Linear(16, 32), act, nn.Linear(32, 16), nn.Linear(16, 37))

        def forward(self, ids):
            h = self.emb(ids)
            return self.head(h + self.down(self.act(self.up(h))))

    return Toy()


def test_elementwise_modules_are_found_by_what_they_do_not_by_name():
    import torch
    import torch.nn as nn

    from tpctl.parallel.roles.inference import infer_plan

    class Gate(nn.Module):  # a scalar gate and a learned slope: acts on each element alone
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Parameter(torch.ones(())), nn.Parameter(torch.full((1,), 0.5))

        def forward(self, x):
            return self.a * torch.where(x > 0, x, self.b * x)

    class Scale(Gate):  # one scale per feature
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.ones(32))

    class Mix(Gate):  # each output reads its neighbour: not elementwise
        def forward(self, x):
            return self.a * x + self.b * x.roll(1, -1)

    plan = infer_plan(_toy(Gate()))
    assert plan.roles["act"] == "split_elementwise" and plan.roles["down"] == "mlp_out" and not plan.problems
    assert "tpctl replicates only scalar ones" in infer_plan(_toy(Scale())).problems["act"]
    assert infer_plan(_toy(Mix())).problems["act"].startswith("an unsupported layer type (Mix)")


def noisy_build(vocab_size: int = 37):
    """A model=custom target whose build warns as transformers' families do."""
    import logging
    import warnings

    logging.getLogger("transformers.activations").warning("CUDA-fused xIELU not available")
    warnings.warn("rope_parameters look odd")
    return _toy(__import__("torch").nn.GELU())


def test_a_models_build_warnings_go_to_the_log_not_the_terminal(capfd, caplog):
    import logging

    import transformers  # noqa: F401  (its logger and handler, as a family's build has them)
    from omegaconf import OmegaConf

    from tpctl.models import build_model

    with caplog.at_level(logging.INFO, logger="tpctl.model"):
        build_model(OmegaConf.create({"arch": "custom", "_target_": "test_families_anymodel.noisy_build"}), 0)
    assert capfd.readouterr().err == ""
    logged = " ".join(r.getMessage() for r in caplog.records if r.name == "tpctl.model")
    assert "CUDA-fused xIELU not available" in logged and "rope_parameters look odd" in logged


@pytest.mark.parametrize("family,key", [("dbrx", "1d-2"), ("mixtral", "2d-4"), ("qwen2_moe", "1d-2-pp2"),
                                        ("oss_experts", "3d-8")])
def test_inspect_names_the_role_of_every_module_of_a_model_that_trains(family, key):
    """`tpctl inspect`'s table (a dry run on rank 0) for experts split as
    measured in a module's own forward (DBRX: OwnSplit) and as 3-d gate/up
    and down parameters beside a router module (Mixtral, Qwen2-MoE)."""
    from test_families import _cfg

    from tpctl.commands.inspect_model import inspect_model

    rows, summary, problems = inspect_model(_cfg(key, family))
    assert not problems, problems
    roles = {name: role for name, _, role, *_ in rows}
    experts = [row for row in rows if row[2] == "experts"]
    assert experts and all(row[6].startswith("experts: ") for row in experts), experts
    assert any(role == "router" for role in roles.values()), roles
    assert summary["per rank"] < summary["whole model"]
