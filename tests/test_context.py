"""Context parallelism (parallel/context/split.py): each sequence split across
cp ranks, ring and Ulysses attention, trains as one process does."""

from __future__ import annotations

import pytest
import torch
from cli_support import scaled, tpctl  # noqa: F401  (tpctl: fixture)
from conftest import tiny_config, worst_grad_error

from tpctl.parallel.layout import Layout


def _cp_against_one_process(name: str, impl: str, matmul: bool = False, **overrides) -> tuple[float, float, dict]:
    """One forward and backward of a global batch in layout `name` against
    one process's: the loss's relative error, the worst gradient's
    (norm-relative), and the bytes comm counted by kind. `matmul`: the ring
    computes its blocks as it does off the CPU (explicit scores), not with
    the CPU's flash kernel."""
    from tpctl.parallel.context import attention as context_attention

    flash = context_attention._FLASH
    context_attention._FLASH = None if matmul else flash
    try:
        return _compare(name, impl, **overrides)
    finally:
        context_attention._FLASH = flash


def _compare(name: str, impl: str, **overrides) -> tuple[float, float, dict]:
    import torch.nn.functional as F
    from conftest import build

    from tpctl.models import build_model
    from tpctl.parallel import comm
    from tpctl.parallel.roles.plan import logits_of

    settings = {"model.n_embd": 32, "model.n_head": 8, "context.impl": impl, **overrides}
    cfg = tiny_config(1, **settings)
    layout = Layout.parse(name)
    run = build(cfg, layout)
    gen = torch.Generator().manual_seed(5)
    batch, seq, vocab = cfg.train.batch_size, cfg.train.seq_len, cfg.model.vocab_size
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    x, y = ids[:, :-1], ids[:, 1:]
    ref = build_model(cfg.model, cfg.seed)
    ref_loss = F.cross_entropy(logits_of(ref(x)).reshape(-1, vocab), y.reshape(-1), reduction="sum") / y.numel()
    ref_loss.backward()
    par = run.par
    comm.STATS.reset()
    loss_sum = run.step.forward_backward([(par.shard_batch(x), par.shard_targets(y))], 0)
    counted = dict(comm.STATS.bytes)
    par.finish_grads([run.model])
    loss = par.global_mean(loss_sum, y.numel())
    worst = worst_grad_error(run.model, ref)
    return abs(loss - ref_loss.item()) / abs(ref_loss.item()), worst, counted


GPT2, LLAMA = {"model.arch": "gpt2", "model.bias": None}, {"model.arch": "llama", "model.bias": None}


@pytest.mark.parametrize("name,impl,matmul,model", [
    ("none-cp2-dp2", "ring", False, {}), ("none-cp4", "ring", False, {}), ("none-cp4-dp2", "ring", True, {}),
    ("none-cp4", "ulysses", False, {}), ("1d-2-cp4", "ulysses", False, {}), ("1d-2-sp-cp2", "ring", False, {}),
    ("2d-4-cp2", "ulysses", False, {}), ("2d-4-cp2", "ring", False, {}), ("2.5d-4-cp2", "ring", False, {}),
    ("2.5d-4-cp2", "ulysses", False, {}),
    ("none-cp4", "ring", False, GPT2), ("1d-2-cp2-dp2", "ulysses", False, LLAMA), ("1d-2-cp4", "ring", False, LLAMA),
    ("none-cp2-dp2", "ring", False, {**LLAMA, "model.arch": "qwen2"}),
    ("none-cp2-dp2", "ulysses", False, {**LLAMA, "model.arch": "mistral"}),
], ids=lambda v: v.get("model.arch", "gpt") if isinstance(v, dict) else str(v))
def test_cp_trains_as_one_process_and_sends_what_is_planned(pool, name, impl, matmul, model):
    from tpctl.cost.planner import model_shape, plan_split

    kind = {"ring": "ring_pass", "ulysses": "all_to_all"}[impl]
    cfg = tiny_config(1, **{"model.n_embd": 32, "model.n_head": 8, **model})
    plan = plan_split(model_shape(cfg.model), Layout.parse(name), cfg.train.batch_size, cfg.train.seq_len, context=impl)
    results = pool.run(_cp_against_one_process, name, impl, matmul, ranks=Layout.parse(name).world,
                       timeout_s=600, **model)
    for loss_err, grad_err, counted in results:
        assert loss_err < 1e-6 and grad_err < 1e-6, (loss_err, grad_err)
        assert counted[kind] == plan.comm[(kind, "cp")].bytes > 0


MISTRAL = {**LLAMA, "model.arch": "mistral"}


def _windowed(name: str, impl: str, window: int, matmul: bool) -> tuple[float, float, set]:
    """_cp_against_one_process of a Mistral whose sliding `window` cuts a
    16-position sequence, with the windows cp surveyed on this rank."""
    from conftest import build

    settings = {**MISTRAL, "model.n_embd": 32, "model.n_head": 8, "context.impl": impl,
                "model.config": {"sliding_window": window}}
    surveyed = set(build(tiny_config(1, **settings), Layout.parse(name)).par.cp.windows.values())
    return (*_cp_against_one_process(name, impl, matmul, **settings)[:2], surveyed)


@pytest.mark.parametrize("name,impl,window,matmul", [
    # 12: longer than a rank's 8 (or 4) positions, so the family draws no
    # mask there at all (it was computed as plain causal attention before);
    # 5 and 3: bands cutting inside the chunks, pairs of chunks skipped whole.
    ("none-cp2", "ring", 12, False), ("none-cp4", "ring", 5, False), ("none-cp4", "ring", 3, True),
    ("1d-2-cp2", "ulysses", 5, False), ("2d-4-cp2", "ring", 12, False),
])
def test_a_sliding_window_trains_as_one_process_across_cp_ranks(pool, name, impl, window, matmul):
    """The family's window, read from the masks it draws on whole sequences
    (ContextParallel.prove's survey), masks the ring's pairs of chunks and
    Ulysses' sequences in global positions: loss and every gradient as one
    process's (whose window differs from no window: a dropped window fails)."""
    for loss_err, grad_err, surveyed in pool.run(_windowed, name, impl, window, matmul,
                                                 ranks=Layout.parse(name).world, timeout_s=600):
        assert surveyed == {window}
        assert loss_err < 1e-6 and grad_err < 1e-6, (loss_err, grad_err)


@pytest.mark.timeout(400)
def test_tpctl_train_with_a_window_longer_than_a_rank_s_positions_equals_mode_none(tpctl):
    """The case that trained plain causal attention before, through the
    CLI (the survey, then cp's proof): Mistral's window of 12 positions at
    train.seq_len=16 and cp=2, where each rank holds 8 and the family draws
    no mask."""
    import json

    base = ["train", "model=hf", "model.arch=mistral", "model.n_layer=1", "model.n_head=4", "model.n_kv_head=2",
            "model.n_embd=32", "model.block_size=16", "+model.config.sliding_window=12", "train.seq_len=16",
            "train.steps=3", "train.log_every=1", "train.batch_size=4", "train.progress=false", "mode=none"]
    losses = {}
    for name, layout in (("none", []), ("cp", ["cp=2"]), ("causal", ["+model.config.sliding_window=null"])):
        run = tpctl.cwd / name
        args = [a for a in base if not (layout and a.startswith(layout[0].split("=")[0]))] + layout
        done = tpctl.run([*args, f"hydra.run.dir={run}"], timeout=200)
        assert done.returncode == 0, done.stderr
        losses[name] = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses["none"]) == 3 and losses["cp"] == pytest.approx(losses["none"], rel=1e-6)
    assert losses["causal"] != pytest.approx(losses["none"], rel=1e-5), "the window changes the run"


def test_a_window_pipeline_stages_cannot_survey_is_refused():
    from tpctl.config import check_layout
    from tpctl.errors import ConfigError

    cfg = tiny_config(1, cp=2, pp=2, **{**MISTRAL, "model.config": {"sliding_window": 8}})
    with pytest.raises(ConfigError, match=r"^invalid config: cp=2: with pp=2: model.arch=mistral attends through a "
                                          r"sliding window of 8 positions, shorter than train.seq_len=16"):
        check_layout(cfg)
    check_layout(tiny_config(1, cp=2, pp=2, **{**MISTRAL, "model.config": {"sliding_window": 16}}))


# The cases of 16 ranks: 3d's smallest cube (8) times cp=2, and 2d's and
# 2.5d's smallest grids (4) times cp=4, each with ring and Ulysses.
SIXTEEN = ("3d-8-cp2", "2d-4-cp4", "2.5d-4-cp4")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_16_rank_cp_layouts_train_as_one_process():
    """Every 16-rank layout of SIXTEEN with ring and Ulysses, once each, on
    a pool of 16 ranks started for them (six CLI runs of 16 workers would
    cost six times its start-up)."""
    from tpctl.cost.planner import model_shape, plan_split
    from tpctl.launch.pool import DistPool

    cfg = tiny_config(1, **{"model.n_embd": 32, "model.n_head": 8})
    pool16 = DistPool(16, timeout_s=scaled(300))
    try:
        for name in SIXTEEN:
            assert Layout.parse(name).world == 16, name
            for impl, kind in (("ring", "ring_pass"), ("ulysses", "all_to_all")):
                plan = plan_split(model_shape(cfg.model), Layout.parse(name), cfg.train.batch_size,
                                  cfg.train.seq_len, context=impl)
                results = pool16.run(_cp_against_one_process, name, impl, timeout_s=scaled(600))
                assert len(results) == 16
                for loss_err, grad_err, counted in results:
                    assert loss_err < 1e-6 and grad_err < 1e-6, (name, impl, loss_err, grad_err)
                    assert counted[kind] == plan.comm[(kind, "cp")].bytes > 0, (name, impl)
        # Training, with ZeRO-2 over the cp replicas and 2.5d's depth sums
        # meeting the replica buckets (16 ranks caught a bug there once):
        # every step's loss as 16 data-parallel ranks give it, and every
        # byte rank 0 sends in a step as planned.
        batch = {"train.batch_size": 16}
        want = pool16.run(_curve, "none-dp16", 4, timeout_s=scaled(600), **batch)[0]
        name = "2.5d-8-d2-cp2-z2"
        planned = plan_split(model_shape(cfg.model), Layout.parse(name), 16, cfg.train.seq_len).comm_bytes
        results = pool16.run(_curve_and_bytes, name, 4, timeout_s=scaled(600), **batch)
        assert results[0][1] == planned > 0, (results[0][1], planned)
        for losses, _ in results:
            assert losses == pytest.approx(want, rel=1e-6) and losses != pytest.approx(want[:1] * 4), name
    finally:
        pool16.close()


def _curve(name: str, steps: int = 3, **overrides) -> list[float]:
    """The global loss of `steps` optimizer steps in layout `name`."""
    return _curve_and_bytes(name, steps, **overrides)[0]


def _curve_and_bytes(name: str, steps: int = 3, **overrides) -> tuple[list[float], int]:
    """_curve, and the bytes this rank's collectives carried in the last step."""
    from conftest import build

    from tpctl.parallel import comm

    cfg = tiny_config(steps, **{"model.n_embd": 32, "model.n_head": 8, **overrides})
    run = build(cfg, Layout.parse(name))
    gen = torch.Generator().manual_seed(7)
    out, last = [], 0
    for step in range(steps):
        ids = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1), generator=gen)
        x, y = ids[:, :-1], ids[:, 1:]
        micros = run.step.micro_count
        before = comm.STATS.total_bytes()
        result = run.step([(run.par.shard_batch(x, k, micros), run.par.shard_targets(y, k, micros))
                           for k in range(micros)], step)
        last = comm.STATS.total_bytes() - before
        out.append(float(result["loss"]))
    return out, last


def test_zero_and_pipeline_stages_with_cp_train_as_one_process(pool):
    """ZeRO's replicas are dp x cp (each holds the same parameters with other
    tokens' gradients): stage 2 over 8 ranks, 2 of them splitting each
    sequence; and pipeline stages pass a stream of the rank's positions."""
    ref = pool.run(_curve, "none-dp8", timeout_s=600)[0]
    for name, impl in (("none-cp2-dp4-z2", "ring"), ("none-cp2-dp4-z2", "ulysses"), ("none-pp2-cp2-dp2", "ring")):
        got = pool.run(_curve, name, timeout_s=600, **{"context.impl": impl})
        assert got[0] == pytest.approx(ref, rel=1e-6) and got[0] != pytest.approx(ref[:1] * 3), name


@pytest.mark.parametrize("overrides,key", [
    ({"cp": 2, "model.dropout": 0.1, "model.arch": "llama", "model.bias": None}, "model.dropout"),  # inside sdpa
    ({"cp": 2, "model.dropout": 0.1, "mode": "1d", "size": 2, "seq_parallel": True}, "model.dropout"),
    ({"cp": 4, "train.seq_len": 36}, "train.seq_len"),  # the ring cuts 8 chunks
    ({"cp": 4, "context.impl": "ulysses", "mode": "1d", "size": 2}, "model.n_head"),  # 4 heads, 2 per tensor rank
    ({"cp": 2, "context.impl": "zigzag"}, "context.impl"),
    ({"cp": 2, "model.arch": "mlp"}, "cp"),
    ({"cp": 2, "train.sample_every": 5}, "train.sample_every"),
])
def test_what_cp_cannot_make_exact_is_refused_naming_the_key(overrides, key):
    from tpctl.config import check_layout
    from tpctl.errors import ConfigError

    cfg = tiny_config(1, **overrides)
    with pytest.raises(ConfigError) as refused:
        check_layout(cfg)
    assert str(refused.value).startswith(f"invalid config: {key}=") and "\n" not in str(refused.value)


def test_generate_with_cp_is_refused():
    from tpctl.config.layout_checks import check_decoding
    from tpctl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^invalid config: cp=2: generate decodes one token at a time"):
        check_decoding(tiny_config(1, cp=2))


def test_attention_cp_cannot_replace_is_refused_naming_the_module():
    """An attention module that computes its softmax itself (no call cp can
    answer) would attend over this rank's positions alone: refused, never silent."""
    from tpctl.parallel.context.split import ContextParallel, ContextRefused
    from tpctl.parallel.mesh import build_mesh

    class EagerAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.proj((x @ x.transpose(-2, -1)).softmax(-1) @ x)

    model = torch.nn.Sequential()
    model.add_module("attn", EagerAttention())
    ContextParallel(build_mesh(Layout(cp=2), rank=0, groups=False)).install(model, {"attn.proj": "attn_out"})
    with pytest.raises(ContextRefused, match=r"^cp=2: attn \(EagerAttention\) computes attention without torch's"):
        model(torch.randn(1, 3, 4))


@pytest.mark.parametrize("cp,early", [(1, True), (2, False)])
def test_2p5d_sums_depth_replicas_early_only_without_dp_or_cp_replicas(cp, early):
    """2.5d sums a depth-replicated gradient during the backward only where no
    data-parallel bucket holds it first: cp ranks are such replicas (a
    16-rank 2.5d-8-d2-cp2 run trains as one process with this, 0.88 off without)."""
    from types import SimpleNamespace

    from tpctl.parallel.mesh import build_mesh

    layout = Layout("2.5d", 8, 2, cp=cp)
    mode = layout.mode_class(build_mesh(layout, rank=0, groups=False))
    spec = SimpleNamespace(partial_grad=True, row_replicas=(), stage_ranks=(0,),
                           replica_ranks=tuple(mode.mesh.group_ranks["depth"]))
    assert mode.sums_during_backward(spec) is early


def test_bf16_with_cp_stays_near_one_process(pool):
    """Under autocast the ring merges its blocks in fp32 and hands the flash
    backward the output in the inputs' dtype."""
    ref = pool.run(_curve, "none-dp8", timeout_s=600, precision="bf16")[0]
    got = pool.run(_curve, "none-cp2-dp4", timeout_s=600, precision="bf16")[0]
    assert got == pytest.approx(ref, rel=1e-3)



def _fit(name: str, run_dir: str, resume: str | None = None):
    """6 steps of test_checkpoint's tiny run in layout `name`, checkpointed
    at 3 and 6 (resumed from `resume`): its curve and its trainer."""
    from pathlib import Path

    from conftest import build_trainer
    from test_checkpoint import _train_cfg

    from tpctl import checkpoint

    layout = Layout.parse(name)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    trainer = build_trainer(_train_cfg(layout, 6, 3), layout, run_dir=run_dir)
    if resume is not None:
        trainer.resume(Path(resume), checkpoint.verify(Path(resume)))
    return [(r["step"], r["loss"]) for r in trainer.fit()], trainer


def _fit_and_decode(tmp: str) -> dict:
    """On every rank: 6 steps at cp=2; its step-3 checkpoint resumed in 1d
    (size 2) and in one process's layout; its step-6 checkpoint loaded as
    `tpctl generate` loads it (launch/generate_worker.py: an inference
    rewrite, checkpoint.load) in 1d size 2 and decoded greedily, beside the
    resumed one-process layout's final model decoding."""
    from pathlib import Path

    from conftest import build
    from test_checkpoint import _train_cfg

    from tpctl import checkpoint
    from tpctl.training.generation import generate

    curves = {"cp": _fit("none-cp2-dp4", f"{tmp}/cp")[0]}
    step3 = f"{tmp}/cp/checkpoints/step_3"
    curves["1d-2-dp4"] = _fit("1d-2-dp4", f"{tmp}/1d", resume=step3)[0]
    curves["none-dp8"], trainer = _fit("none-dp8", f"{tmp}/none", resume=step3)
    reference = generate(trainer.model, trainer.par.mode, [1, 2, 3], 6)
    layout = Layout.parse("1d-2-dp4")
    cfg = _train_cfg(layout, 1, 0)
    run = build(cfg, layout, step=False, training=False)  # (decoded only)
    model, par = run.model, run.par
    path = Path(tmp, "cp", "checkpoints", "step_6")
    checkpoint.load(path, model, None, par, checkpoint.verify(path, checksums=False), cfg.seed)
    return {"curves": curves, "ids": generate(model, par.mode, [1, 2, 3], 6), "reference": reference}


@pytest.mark.timeout(300)
def test_a_cp_checkpoint_resumes_in_other_layouts_and_generates(pool, tmp_path):
    """cp holds no state of its own: a checkpoint written at cp=2 continues
    the cp run's curve in 1d and in one process's layout, and decodes as
    that continued run's model does."""
    results = pool.run(_fit_and_decode, str(tmp_path), timeout_s=280)
    curves = results[0]["curves"]
    assert [s for s, _ in curves["1d-2-dp4"]] == [4, 5, 6] and len({l for _, l in curves["cp"]}) == 6
    for name in ("1d-2-dp4", "none-dp8"):
        assert [l for _, l in curves[name]] == pytest.approx([l for _, l in curves["cp"][3:]], rel=1e-6), name
    assert all(len(r["ids"]) == 6 and r["ids"] == r["reference"] == results[0]["ids"] for r in results)


@pytest.mark.timeout(200)
def test_bench_shows_the_step_peak_per_rank_falling_with_cp(pool, capsys):
    """`tpctl bench` runs a cp layout beside one process (the same step-1
    loss) and its step peak per rank is the split's share, in the table."""
    from tpctl.commands.bench import print_table
    from tpctl.cost.measure import bench

    cfg = tiny_config(1, **{"model.n_embd": 32, "model.n_head": 8, "model.block_size": 256, "train.seq_len": 256,
                            "train.batch_size": 2})
    results = bench(cfg, ["none", "none-cp4-dp2"], size=8, steps=1, rounds=1, warmup=0, pool=pool)
    one, split = results["none"], results["none-cp4-dp2"]
    assert split["first_loss"] == pytest.approx(one["first_loss"], rel=1e-6)
    assert split["peak_bytes"] < 0.3 * one["peak_bytes"], (split["peak_bytes"], one["peak_bytes"])
    print_table(results, {}, cfg, 8, {"hardware": "cpu", "pp": 1, "rounds": 1, "steps": 1, "compile": False, "depth": None})
    assert "step peak MiB/rank" in capsys.readouterr().out


def _ring_step_staged_and_not(name: str) -> dict:
    """One ring forward and backward of a global batch in layout `name`,
    its passes sent as they are and then through host buffers (what gloo
    with device=cuda needs, comm.ring_pass; forced here, on a CPU): each
    run's loss sum, gradients, bytes staged and ring bytes counted."""
    from conftest import build

    from tpctl.parallel import comm

    cfg = tiny_config(1, **{"model.n_embd": 32, "model.n_head": 8, "context.impl": "ring"})
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1), generator=gen)
    x, y = ids[:, :-1], ids[:, 1:]
    runs = {}
    for staged in (False, True):
        run = build(cfg, Layout.parse(name))
        comm.STATS.reset()
        comm.RING_STAGING.force, comm.RING_STAGING.bytes = staged, 0
        try:
            loss_sum = run.step.forward_backward([(run.par.shard_batch(x), run.par.shard_targets(y))], 0)
        finally:
            comm.RING_STAGING.force = False
        run.par.finish_grads([run.model])
        runs[staged] = {"loss": loss_sum.detach().clone(), "staged": comm.RING_STAGING.bytes,
                        "ring": comm.STATS.bytes["ring_pass"],
                        "grads": [p.grad.clone() for p in run.model.parameters() if p.grad is not None]}
    return runs


@pytest.mark.parametrize("name", ["none-cp4", "1d-2-cp2"])
def test_the_ring_through_host_buffers_equals_the_ring_bit_for_bit(pool, name):
    """The host staging of the ring's passes (gloo with device=cuda: ranks
    sharing one GPU) changes no bit of the loss or of a gradient, and every
    pass crossed through host buffers: each byte sent once from a host copy
    and received once into a host buffer (so a skipped staging fails)."""
    for runs in pool.run(_ring_step_staged_and_not, name, ranks=Layout.parse(name).world):
        plain, staged = runs[False], runs[True]
        assert plain["staged"] == 0  # a CPU tensor over gloo is sent as it is
        assert staged["ring"] == plain["ring"] > 0  # counted alike (the planner's counts)
        assert staged["staged"] == 2 * staged["ring"], (staged["staged"], staged["ring"])
        assert torch.equal(staged["loss"], plain["loss"])
        assert len(staged["grads"]) == len(plain["grads"]) > 0
        assert all(torch.equal(a, b) for a, b in zip(staged["grads"], plain["grads"]))
