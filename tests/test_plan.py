"""The planner against reality: a whole GPT through one full train step
(forward, vocab-parallel loss, backward, sync_grads, clip_grad_norm_, the
logged global mean) in every mode, with data parallelism, each ZeRO stage
and pipeline stages, on real gloo ranks. The bytes and calls comm.STATS
counts per collective kind, and the parameter, gradient and AdamW bytes each
rank holds, must equal `tpctl plan`'s exactly (with pp > 1: the plan of the
rank's stage)."""

from __future__ import annotations

import pytest
import torch
from cli_support import tpctl, scaled  # noqa: F401  (fixture)
from conftest import LAYOUTS, layouts

from tpctl.parallel.layout import Layout

# id: (layout, grad_accum, data-parallel bucket bytes: None the default, one
# bucket for this model; 2048 several, filled and started during the backward)
MESHES = {**{k: (v, 1, None) for k, v in layouts("none-dp4", "1d-2-dp2", "1d-4-sp").items()},
          "2d-4-dp2-accum2": (LAYOUTS["2d-4-dp2"], 2, None),
          **{k: (v, 1, None) for k, v in layouts("2.5d-8-d2", "3d-8").items()},
          # ZeRO: every stage, in every mode with dp > 1 on 4 or 8 ranks (2.5d
          # and 3d with q = 2 and dp = 2 need 16: test_context's 16-rank pool
          # checks their bytes); 2.5d-2-d2 has depth replicas, q = 1.
          "none-dp4-z1-buckets": (Layout.parse("none-dp4-z1"), 1, 2048),
          "1d-2-dp2-z2-buckets": (Layout.parse("1d-2-dp2-z2"), 1, 2048),
          "1d-2-sp-dp2-z3": (Layout.parse("1d-2-sp-dp2-z3"), 1, None),
          "2d-4-dp2-z3-accum2": (Layout.parse("2d-4-dp2-z3"), 2, 2048),
          "2d-4-dp2-z2-accum2": (Layout.parse("2d-4-dp2-z2"), 2, None),
          "2.5d-2-d2-dp2-z1": (Layout.parse("2.5d-2-d2-dp2-z1"), 1, 2048),
          "2.5d-2-d2-dp4-z3": (Layout.parse("2.5d-2-d2-dp4-z3"), 1, None),
          "3d-1-dp8-z2": (Layout.parse("3d-1-dp8-z2"), 1, 2048),
          "none-dp8-buckets": (LAYOUTS["none-dp8"], 1, 2048),
          # pp > 1: 1F1B over pp micro-batches (the pool's default pipeline),
          # and ZeRO 1 under a pipeline
          **{k: (Layout.parse(k), 2, None) for k in ("none-pp2-dp2", "1d-2-pp2-dp2", "2d-4-pp2")},
          "1d-2-pp2-dp2-z1-buckets": (Layout.parse("1d-2-pp2-dp2-z1"), 2, 2048)}
BATCH, SEQ = 16, 8


def _model_cfg(tied: bool):
    from tpctl.schema import ModelConfig

    # vocab 37 divides by nothing: the padded vocabulary is exercised too
    return ModelConfig(arch="gpt", vocab_size=37, n_layer=2, n_head=4, n_embd=16, block_size=SEQ,
                       dropout=0.0, bias=True, tie_embeddings=tied)


def _train_step(key: str, tied: bool):
    """Counted collectives of one train step on this rank: the trainer's
    own step (training/step.py)."""
    from omegaconf import OmegaConf

    from tpctl.config import default_config
    from tpctl.launch.pool import pooled_run
    from tpctl.parallel import comm
    from tpctl.parallel.pipeline.stages import PipelineSpec

    layout, accum, bucket_bytes = MESHES[key]
    cfg = default_config()
    cfg.model = OmegaConf.structured(_model_cfg(tied))
    cfg.train.batch_size, cfg.train.seq_len, cfg.train.grad_accum = BATCH, SEQ, accum
    run = pooled_run(cfg, layout, bucket_bytes, PipelineSpec.plain(layout.pp), schedule=False)
    par, step = run.par, run.step
    ids = torch.randint(0, cfg.model.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    x, y = ids[:, :-1], ids[:, 1:]
    comm.STATS.reset()
    step([(par.shard_batch(x, micro, accum), par.shard_targets(y, micro, accum)) for micro in range(accum)], 0)
    s = comm.STATS
    kinds = {k: {"calls": s.calls[k], "bytes": s.bytes[k], "wire_bytes": s.wire_bytes[k]} for k in s.calls}
    return kinds, step.memory()


def _planned(key: str, tied: bool) -> list:
    """(kinds, memory figures) the plan gives each rank (its pipeline
    stage's plan; SplitPlan.comm_of: the rank's own communication)."""
    from tpctl.cost.planner import model_shape, plan_split

    layout, accum, bucket_bytes = MESHES[key]
    plan = plan_split(model_shape(_model_cfg(tied)), layout, BATCH, SEQ, accum, bucket_bytes)
    stages = plan.stages or [plan]
    return [(p.by_kind(rank), {"param_bytes": p.param_bytes, "grad_bytes": p.grad_bytes,
                               "optimizer_bytes": p.optim_bytes})
            for rank, p in enumerate(stages[layout.coords(r)["pp"]] for r in range(layout.world))]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("key", list(MESHES))
def test_counted_equals_planned(pool, key, tied):
    planned = _planned(key, tied)
    for rank, (kinds, memory) in enumerate(pool.run(_train_step, key, tied, ranks=MESHES[key][0].world)):
        want_kinds, want_memory = planned[rank]
        assert memory == want_memory, f"rank {rank}"
        assert {k: (v["calls"], v["bytes"]) for k, v in kinds.items()} == \
            {k: (v["calls"], v["bytes"]) for k, v in want_kinds.items()}, f"rank {rank}"
        for k, v in kinds.items():  # wire bytes also check each group's size
            assert v["wire_bytes"] == pytest.approx(want_kinds[k]["wire_bytes"], rel=1e-9), f"rank {rank} {k}"


# --------------------------------------------------------------------------
# The commands, in-process (no workers are started by `tpctl plan`).


def _plan_cli(args, capsys):
    from tpctl.commands import plan

    status = plan.main(args)
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.mark.timeout(60)
def test_plan_json_ranks_every_valid_split(capsys):
    import json

    status, out, _ = _plan_cli(["model=gpt-tiny", "world=8", "hardware=h100", "--json"], capsys)
    assert status == 0
    doc = json.loads(out)
    labels = [s["label"] for s in doc["splits"]]
    # gpt-tiny (4 heads, batch 16) on 8 ranks: 1d up to 4, 2d 4, 2.5d 8 (depth 2), 3d 8, none dp=8
    for want in ("none size=1 dp=8", "1d size=4 dp=2", "1d size=2 sp dp=4", "2d size=4 dp=2",
                 "2.5d size=8 depth=2", "3d size=8"):
        assert want in labels
    assert doc["recommended"] == labels[0]
    times = [s["step_time_s"] for s in doc["splits"]]
    assert times == sorted(times)
    assert any("1d size=8" in s["label"] and "n_head" in s["reason"] for s in doc["invalid"])


@pytest.mark.timeout(300)
def test_plan_ranks_zero_stages_and_says_which_fit_only_with_them(capsys):
    """gpt-small on 64 ranks: every layout with replicas in each ZeRO stage;
    with 0.3 GiB per rank, 1d size=4 dp=16 needs a stage to fit, and the
    table says so."""
    import json

    args = ["model=gpt-small", "world=64", "hardware=h100", "memory=0.3"]
    status, out, _ = _plan_cli([*args, "--json"], capsys)
    assert status == 0
    splits = {s["label"]: s for s in json.loads(out)["splits"]}
    for zero in (1, 2, 3):
        assert f"2d size=16 dp=4 zero={zero}" in splits
    assert "3d size=64 zero=1" not in splits and "3d size=64" in splits  # one replica: nothing to shard
    base = splits["1d size=4 dp=16"]
    assert base["fits"] is False and not base["fits_by_zero"]
    for zero in (1, 2, 3):
        s = splits[f"1d size=4 dp=16 zero={zero}"]
        assert s["fits"] and s["fits_by_zero"] and s["memory_bytes"] < base["memory_bytes"]
    # Each stage shards its figure 16 ways (a few % of padding aside).
    for zero, figure in ((1, "optim_bytes"), (2, "grad_bytes"), (3, "param_bytes")):
        assert splits[f"1d size=4 dp=16 zero={zero}"][figure] == pytest.approx(base[figure] / 16, rel=0.05)
    status, out, _ = _plan_cli(args, capsys)
    assert status == 0 and "ZeRO makes 6 split(s) fit in 0.3 GiB per rank that do not with zero=0" in out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args,key", [
    (["model=gpt-tiny", "world=8", "memory=0"], "memory"),
    (["model=gpt-tiny", "world=8", "memory=1"], "memory"),
    (["model=gpt-tiny"], "world"),
    (["model=gpt-tiny", "world=0"], "world"),
    (["model=gpt-tiny", "world=8", "hardware=tpu"], "hardware"),
    (["model=gpt-huge", "world=8"], "model"),
])
def test_plan_bad_input_exits_2_with_one_line(capsys, args, key):
    status, _, err = _plan_cli(args, capsys)
    assert status == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"tpctl: error: invalid config: {key}="), err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_runs_every_mode_on_the_same_model():
    """none, our 1d and PyTorch's TP train the same model on the same batch
    (equal step-1 losses), and our counted bytes per step are the plan's."""
    from tpctl.config import compose_jobs
    from tpctl.cost.measure import bench, predicted_ms
    from tpctl.cost.planner import model_shape, plan_split
    from tpctl.parallel.layout import Layout

    cfg = compose_jobs(["model=gpt-tiny", "model.n_layer=1", "train.batch_size=4", "train.seq_len=16"])[0]
    results = bench(cfg, ["none", "1d", "dtensor"], size=2, steps=1, rounds=1, warmup=0, timeout_s=scaled(240))
    losses = [results[m]["first_loss"] for m in ("none", "1d", "dtensor")]
    assert max(losses) - min(losses) < 1e-5, losses
    planned = plan_split(model_shape(cfg.model), Layout("1d", 2), 4, 16)
    assert results["1d"]["comm_bytes"] == planned.comm_bytes
    assert results["1d"]["param_bytes"] == planned.param_bytes
    assert set(predicted_ms(cfg, ["none", "1d", "dtensor"], 2, None, "cpu")) == {"none", "1d", "dtensor"}


@pytest.mark.timeout(120)
def test_plan_refuses_a_mode_without_cost_hooks_by_name(tpctl, tmp_path):
    """A mode defined outside tpctl (test_registry's RowSplit, in a module of
    its own) trains, but the planner cannot know what its rewrite sends."""
    from test_registry import write_mode_module

    plugins = tmp_path / "plugins"
    plugins.mkdir()
    tpctl.extra_env["PYTHONPATH"] = str(plugins)
    result = tpctl.run(["plan", "world=4", "model=gpt-tiny", f"mode_module={write_mode_module(plugins)}"], timeout=100)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "tpctl: error: invalid config: mode='rows': it rewrites layers but defines none of the planner's cost hooks "
        "(cost_rows, cost_hidden, cost_vocab, cost_embedding, cost_norm, cost_linear, cost_loss; see "
        "parallel/tensor/mode.py), so tpctl plan would count its communication as zero: define them to plan it"]
