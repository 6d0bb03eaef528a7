"""Mesh coordinates and groups for every mode; training-level properties
(2.5d depth replicas stay bit-identical, gradient accumulation changes
nothing, parameter memory per rank follows the layout's theory)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import build_trainer, layouts, tiny_config

MESHES = list(layouts("none-dp8", "1d-4-dp2", "2d-4-dp2", "2.5d-8-d2", "3d-8").values())


def _check_groups(layout) -> dict:
    import torch.distributed as dist

    from tpctl.parallel import comm
    from tpctl.parallel.mesh import build_mesh

    mesh = build_mesh(layout)
    axes = layout.mode_class.axes
    me = torch.tensor([mesh.dp_rank, mesh.tp_rank] + [mesh.coords[a] for a in axes])
    sizes = {}
    named = dict(layout.mode_class.grid_groups, tp=tuple(axes), dp=())
    for name, varying in named.items():
        group = mesh.groups[name]
        n = comm.group_size(group)  # None: this rank alone
        got = [me.clone()]
        if group is not None:
            got = [torch.empty_like(me) for _ in range(n)]
            dist.all_gather(got, me, group=group)
            assert [int(dist.get_global_rank(group, k)) for k in range(n)] == mesh.group_ranks[name]
        else:
            assert mesh.group_ranks[name] == [mesh.rank]
        sizes[name] = n
        for other in got:
            if name == "dp":
                assert other[1] == me[1], "dp replicas must share the tensor-parallel rank"
                continue
            assert other[0] == me[0], f"{name}: members must share the dp rank"
            for k, axis in enumerate(axes):
                if axis not in varying:
                    assert other[2 + k] == me[2 + k], f"{name}: members differ in fixed axis {axis}"
        # members are distinct and cover every value of the varying axes
        assert len({tuple(t.tolist()) for t in got}) == n
    assert mesh.rank == mesh.dp_rank * layout.size + mesh.tp_rank
    return sizes


def _train(overrides: dict, steps: int = 5):
    trainer = build_trainer(tiny_config(steps, **overrides), pooled=False, lazy=False)
    trainer.initial = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    return trainer, [r["loss"] for r in trainer.fit()]


def _depth_replicas_identical() -> int:
    import torch.distributed as dist

    trainer, _ = _train({"mode": "2.5d", "size": 8, "depth": 2})
    mesh, checked = trainer.mesh, 0
    for name, p in trainer.model.named_parameters():
        spec = p.tpctl_spec
        if spec.replica_group is mesh.groups["depth"]:
            assert not torch.equal(p, trainer.initial[name]), f"{name} did not train"
            copies = [torch.empty_like(p) for _ in range(mesh.geo.depth)]
            dist.all_gather(copies, p.detach(), group=spec.replica_group)
            assert all(torch.equal(c, copies[0]) for c in copies), f"{name} drifted across depth"
            checked += 1
    return checked


def _grad_accum_curves() -> tuple[list, list]:
    one = _train({"mode": "2d", "size": 4, "dp": 2, "train.grad_accum": 1})[1]
    two = _train({"mode": "2d", "size": 4, "dp": 2, "train.grad_accum": 2})[1]
    return one, two


def _param_bytes(layout) -> tuple[int, int]:
    from tpctl.models import GPT
    from tpctl.parallel.parallelism import parallelism
    from tpctl.schema import ModelConfig

    gpt_small = ModelConfig(vocab_size=50257, n_layer=12, n_head=12, n_embd=768, block_size=1024)
    with torch.device("meta"):  # shapes only: no 124M-parameter model per rank
        full = GPT(gpt_small)
        total = sum(p.numel() for p in full.parameters()) * 4
        model = parallelism(layout).rewrite(full).model
    return total, sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: m.name)
def test_mesh_groups(pool, mesh):
    sizes = pool.run(_check_groups, mesh)[0]
    mode, size, depth, dp = mesh.mode, mesh.size, mesh.depth, mesh.dp
    assert sizes["tp"] == size and sizes["dp"] == dp
    q = {"2d": 2, "2.5d": 2, "3d": 2}.get(mode)
    if mode in ("2d", "2.5d"):
        assert sizes["row"] == sizes["col"] == q
    if mode == "2.5d":
        assert sizes["depth"] == depth and sizes["hidden_replica"] == depth * q
    if mode == "3d":
        assert sizes["i"] == sizes["j"] == sizes["l"] == q and sizes["ij"] == sizes["il"] == q * q


def test_2p5d_depth_replicas_stay_bit_identical(pool):
    assert min(pool.run(_depth_replicas_identical)) > 0


def test_grad_accumulation_does_not_change_the_curve(pool):
    one, two = pool.run(_grad_accum_curves)[0]
    assert one[-1] < one[0]
    assert two == pytest.approx(one, rel=1e-5)


# Parameters per rank in theory (docs/DESIGN.md's table): 1/P in 1d, 1/q^2 in
# 2d and 2.5d (weights replicated over depth), 1/q^3 in 3d. Norms, biases and
# the position table are split only along the hidden dim, hence "a few %".
@pytest.mark.parametrize("mesh,factor", [
    ("none-dp8", 1), ("1d-2-dp4", 2), ("1d-4-dp2", 4), ("2d-4-dp2", 4), ("2.5d-8-d2", 4), ("3d-8", 8),
])
def test_gpt_small_param_bytes_per_rank_follow_theory(pool, mesh, factor):
    from tpctl.parallel.layout import Layout

    results = pool.run(_param_bytes, Layout.parse(mesh))
    total = results[0][0]
    theory = total / factor
    for _, per_rank in results:
        assert per_rank == pytest.approx(theory, rel=0.05), f"{per_rank / 2**20:.1f} MiB vs {theory / 2**20:.1f} MiB"
    assert not math.isclose(theory, total) or factor == 1


def _public_api_loop() -> float:
    """The docstring's custom loop, one step, against one process."""
    import torch.nn.functional as F

    import tpctl
    from tpctl.models import build_model
    from tpctl.schema import ModelConfig

    cfg = ModelConfig(vocab_size=50, n_embd=16, n_head=4, block_size=8)
    gen = torch.Generator().manual_seed(3)
    ids, targets = torch.randint(0, 50, (8, 8), generator=gen), torch.randint(0, 50, (8, 8), generator=gen)
    ref = build_model(cfg, seed=0)
    ref_loss = F.cross_entropy(ref(ids).reshape(-1, 50), targets.reshape(-1))
    ref_loss.backward()

    tp = tpctl.init_parallel(mode="3d", size=8)
    model = tpctl.parallelize(build_model(cfg, seed=0), tp)
    loss_sum = tp.cross_entropy(model(tp.shard_batch(ids)), tp.shard_targets(targets), 50).sum()
    (loss_sum / targets.numel()).backward()
    tp.sync_grads(model)
    norm = tp.clip_grad_norm_(model, 1e9)  # no clipping: just the global norm
    ref_norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in ref.parameters())).item()
    assert norm == pytest.approx(ref_norm, rel=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, p.tpctl_spec.slice(dict(ref.named_parameters())[name].grad),
                                   rtol=1e-5, atol=1e-6)
    return tp.global_mean(loss_sum, targets.numel()) - ref_loss.item()


def test_public_api_custom_loop(pool):
    assert all(abs(d) < 1e-5 for d in pool.run(_public_api_loop))


def _lazy_equals_eager(layout) -> int:
    """A lazily built model (one parameter made whole at a time) shards to
    exactly what slicing the eagerly built whole model gives."""
    import tpctl
    from tpctl.models import build_model
    from tpctl.schema import ModelConfig

    cfg = ModelConfig(vocab_size=37, n_embd=16, n_head=4, block_size=8, mlp_ratio=4)
    tp = tpctl.init_parallel(layout)
    whole = build_model(cfg, seed=5)
    eager = tpctl.parallelize(build_model(cfg, seed=5), tp)
    lazy = tpctl.parallelize(build_model(cfg, seed=5, lazy=True), tp)
    whole_params = dict(whole.named_parameters())
    lazy_params = dict(lazy.named_parameters())
    assert lazy.lm_head.weight is lazy.wte.weight, "tied weights must stay one parameter"
    for name, p in eager.named_parameters():
        assert not lazy_params[name].is_meta, name
        assert torch.equal(lazy_params[name], p), name
        assert torch.equal(p, p.tpctl_spec.slice(whole_params[name].detach())), name
    return len(lazy_params)


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: m.name)
def test_lazy_build_gives_the_same_shards(pool, mesh):
    assert min(pool.run(_lazy_equals_eager, mesh)) > 0


def test_initial_weights_depend_on_the_seed_only():
    from tpctl.models import build_model
    from tpctl.schema import ModelConfig

    cfg = ModelConfig(n_embd=16, n_head=4, block_size=8)
    a, b, c = build_model(cfg, 1), build_model(cfg, 1), build_model(cfg, 2)
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert not torch.equal(pa["wte.weight"], pc["wte.weight"])
    assert not torch.equal(pa["wte.weight"][:, :8], pa["wpe.weight"][:8, :8].T)  # own generators
    assert pa["blocks.0.attn.proj.weight"].std() < pa["blocks.0.attn.qkv.weight"].std()  # GPT-2 scaled init


def _train_with_dropout(layout) -> tuple[list, int]:
    """Train with dropout; every parameter replicated inside the
    tensor-parallel group must still be identical on all its replicas."""
    import torch.distributed as dist

    trainer, losses = _train({"mode": layout.mode, "size": layout.size, "depth": layout.depth, "dp": layout.dp,
                              "model.dropout": 0.2}, steps=4)
    checked = 0
    for name, p in trainer.model.named_parameters():
        spec = p.tpctl_spec
        if len(spec.replica_ranks) > 1:
            copies = [torch.empty_like(p) for _ in spec.replica_ranks]
            dist.all_gather(copies, p.detach(), group=spec.replica_group)
            assert all(torch.equal(c, copies[0]) for c in copies), f"{name} drifted across its replicas"
            checked += 1
    return losses, checked


@pytest.mark.parametrize("mesh", MESHES[1:], ids=lambda m: m.name)
def test_dropout_training_keeps_replicas_identical(pool, mesh):
    results = pool.run(_train_with_dropout, mesh)
    losses, checked = results[0]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert max(r[1] for r in results) > 0  # some rank holds replicated parameters


def test_the_record_answers_who_holds_counts_and_writes():
    """A ShardSpec asked with a rank: a weight held by two tensor replicas,
    two pipeline stages and two data-parallel replicas (16 ranks: tp stride
    1, pp stride 4, dp stride 8); each element is counted by one rank per
    replica and written by one rank in the world; a ZeRO chunk is its
    replica's own; rows with replicas of their own are decided run by run."""
    from tpctl.parallel.shard import RowReplicas, ShardSpec

    def record(tp, stages, dp, **kw):
        return ShardSpec((8, 4), (None, None), replica_ranks=tp, partial_grad=True, stage_ranks=stages, dp_ranks=dp, **kw)

    at = {0: record((0, 1), (0, 4), (0, 8)), 1: record((0, 1), (1, 5), (1, 9)),
          4: record((4, 5), (0, 4), (4, 12)), 8: record((8, 9), (8, 12), (0, 8))}
    assert at[1].holders(1) == at[0].holders(0) == (0, 1, 4, 5, 8, 9, 12, 13)
    assert [r for r, spec in at.items() if spec.writes(r)] == [0]
    assert [r for r, spec in at.items() if spec.counts(r)] == [0, 8]  # each data-parallel replica computes the norm
    assert at[4].norm_parts(torch.ones(8, 4), 4) == [] and not at[4].first_on_stages(4)
    assert at[8].rows(4, 8).writes(8) and at[8].rows(4, 8).dp_ranks == ()  # under ZeRO replica 1 owns its chunk
    assert [g is None for _, g in at[1].partial_parts(torch.ones(8, 4)) + at[1].stage_parts(torch.ones(8, 4))] == [True, True]

    rows = ShardSpec((4, 2), (((0, 4),), None), row_replicas=(RowReplicas(0, 2, (0, 1)), RowReplicas(2, 4, (1,))))
    assert not rows.writes(1, 0) and rows.writes(1, 2) and rows.writes(1) and not rows.writes_origin(1)
    assert rows.writes_origin(0) and [tuple(p.shape) for p in rows.norm_parts(torch.ones(4, 2), 1)] == [(2, 2)]


def test_the_gradient_norm_is_the_same_however_a_tensor_is_split():
    """Each piece's norm is accumulated in float64 (parallelism._norms): a
    tensor's squares summed in its fp32 drift with its size (2.8e-3 at 25M
    elements on torch 2.13's CPU), so a layout holding it in pieces would
    clip by another factor than one process holding it whole."""
    from tpctl.parallel.parallelism import _norms

    g = torch.randn(4_000_000, generator=torch.Generator().manual_seed(0)) * 1e-3
    exact = g.double().pow(2).sum().item()
    whole = _norms([g])[0].item() ** 2
    pieces = sum(n.item() ** 2 for n in _norms(list(g.chunk(3))))
    assert whole == pytest.approx(exact, rel=1e-12)
    assert pieces == pytest.approx(exact, rel=1e-12)
