"""ZeRO over data parallelism (parallel/data_parallel/zero.py): every tensor mode with
zero = 1, 2, 3 trains exactly as mode=none (loss and gradient norm, 10
steps), holds the fraction of the memory the stages promise, and its
checkpoints load into any other layout and stage.

On the session's pools (4 ranks; 8 for 2d with dp) through the trainer;
the reference (mode=none, one process) runs on each rank without any
process group. 2.5d and 3d need 16 ranks with dp=2: that case runs on
test_context's 16-rank pool; one CLI run below checks `tpctl train`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cli_support import scaled
from conftest import build_trainer, tiny_config

REL = 1e-4
STEPS = 6


def _cfg(layout, **overrides):
    # Dropout off unless asked: dropout draws its masks per row block, and
    # the reference must see the same (DESIGN.md, "Dropout").
    return layout.write_to(tiny_config(STEPS, **{"model.n_layer": 2, "train.batch_size": 16, **overrides}))


def _fit(layout, pooled: bool = True, bucket_bytes: int | None = None, groups: bool = True, **overrides):
    trainer = build_trainer(_cfg(layout, **overrides), layout, pooled=pooled, bucket_bytes=bucket_bytes, groups=groups)
    records = trainer.fit()
    tensors = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    tensors += [p.grad for p in tensors] + [t for s in trainer.optimizer.state.values() for t in s.values() if t.dim()]
    return {"loss": [r["loss"] for r in records], "norm": [r["grad_norm"] for r in records],
            "summary": trainer.summary(records), "optimizer_dtypes": {str(t.dtype) for t in tensors}}


def _curve(layout, bucket_bytes: int | None = None, **overrides) -> dict:
    """On a pool rank: train `layout`; its curve and what its summary says
    it held."""
    return _fit(layout, bucket_bytes=bucket_bytes, **overrides)


_references: dict = {}


def reference(**overrides) -> dict:
    """mode=none's curve, in this process (no process group)."""
    from tpctl.parallel.layout import Layout

    key = tuple(sorted(overrides.items()))
    if key not in _references:
        _references[key] = _fit(Layout(), pooled=False, groups=False, **overrides)
    return _references[key]


def _assert_equal_to_none(result: dict, ref: dict, what: str, rel: float = REL, steps: int = STEPS) -> None:
    for step, (got, want) in enumerate(zip(result["loss"], ref["loss"]), 1):
        assert got == pytest.approx(want, rel=rel), f"{what}: step {step} loss {got} vs none {want}"
    for step, (got, want) in enumerate(zip(result["norm"], ref["norm"]), 1):
        assert got == pytest.approx(want, rel=rel), f"{what}: step {step} grad norm {got} vs none {want}"
    assert len(result["loss"]) == steps and result["loss"][-1] < result["loss"][0]  # it trains


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["none-dp4", "1d-2-dp2", "1d-2-sp-dp2", "2d-4-dp2"])
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_every_stage_trains_as_mode_none(pool, name, zero):
    from tpctl.parallel.layout import Layout

    layout = Layout.parse(name).replace(zero=zero)
    # Small buckets: several per step, reduced while the backward goes on.
    result = pool.run(_curve, layout, 4096, timeout_s=600)[0]
    _assert_equal_to_none(result, reference(), layout.label())


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["2d-4-dp2-z3", "1d-2-sp-dp2-z2"])
def test_dropout_and_recomputed_blocks_change_nothing(pool, name):
    """With dropout each replica draws its own masks (mode=none draws other
    ones): a stage must give the curve its layout gives without ZeRO. With
    activation checkpointing stage 3 gathers a block once for its backward
    and its recomputation."""
    from tpctl.parallel.layout import Layout

    layout = Layout.parse(name)
    settings = {"model.dropout": 0.1, "train.activation_checkpointing": True}
    sharded = pool.run(_curve, layout, 4096, timeout_s=600, **settings)[0]
    plain = pool.run(_curve, layout.replace(zero=0), timeout_s=600, **settings)[0]
    assert sharded["loss"] == pytest.approx(plain["loss"], rel=1e-6)
    assert sharded["norm"] == pytest.approx(plain["norm"], rel=1e-6)
    assert sharded["loss"] != pytest.approx(reference()["loss"], rel=1e-4)  # the masks act
    checkpointed = pool.run(_curve, layout, 4096, timeout_s=600, **{"train.activation_checkpointing": True})[0]
    _assert_equal_to_none(checkpointed, reference(), f"{layout.label()} recomputed")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["none-dp4-z3", "2d-4-dp2-z2"])
def test_bf16_stays_in_the_band(pool, name):
    """precision=bf16 under ZeRO: fp32 master chunks, fp32 gradients and
    state; the curve within the bf16 band of fp32 mode=none and of bf16
    mode=none (tests/test_train_features.py)."""
    from test_train_features import BF16_BAND, BF16_MODE_TOL

    from tpctl.parallel.layout import Layout

    result = pool.run(_curve, Layout.parse(name), timeout_s=600, precision="bf16")[0]
    for reference_curve, band in ((reference()["loss"], BF16_BAND), (reference(precision="bf16")["loss"], BF16_MODE_TOL)):
        worst = max(abs(a - b) / abs(b) for a, b in zip(result["loss"], reference_curve))
        assert worst <= band, (name, worst)
    assert result["optimizer_dtypes"] == {"torch.float32"}


@pytest.mark.timeout(900)
def test_each_stage_holds_a_quarter_of_its_figure_at_dp4(pool):
    """summary.json's bytes of the largest rank, counted from the tensors it
    holds: optimizer state from stage 1, gradients from stage 2, parameters
    from stage 3, each at most 0.30 of zero=0's at dp=4 (1/4 and padding)."""
    from tpctl.parallel.layout import Layout

    held = [pool.run(_curve, Layout.parse("none-dp4").replace(zero=zero), timeout_s=600,
                     **{"train.steps": 2})[0]["summary"] for zero in range(4)]
    for zero, figure in ((1, "optimizer_bytes_max_rank"), (2, "grad_bytes_max_rank"), (3, "param_bytes_max_rank")):
        assert held[zero][figure] <= 0.30 * held[0][figure], (zero, figure, held[zero][figure], held[0][figure])
        for later in range(zero, 4):  # and stays sharded in the later stages
            assert held[later][figure] <= held[zero][figure], (later, figure)
    for figure in ("grad_bytes_max_rank", "param_bytes_max_rank"):  # stage 1 shards only the optimizer state
        assert held[1][figure] >= held[0][figure]


def _coverage(path) -> dict[str, tuple[int, int]]:
    """{tensor: (elements the saved chunks hold, elements of the tensor)}
    of a checkpoint's model and moments, from DCP's metadata."""
    import math

    from tpctl.checkpoint.dcp import _reader

    saved = _reader(Path(path)).read_metadata().state_dict_metadata
    return {fqn: (sum(math.prod(c.sizes) for c in md.chunks), math.prod(md.size))
            for fqn, md in saved.items() if fqn.startswith("model.") or fqn.endswith(("exp_avg", "exp_avg_sq"))}


@pytest.mark.timeout(900)
def test_a_zero2_checkpoint_resumes_in_other_stages_and_modes(pool, tmp_path):
    """1d dp=2 zero=2 saves at step 4 on 4 ranks (every replica writes its
    chunks); 2d zero=0 and 1d dp=4 zero=1 on 8 ranks, none dp=4 zero=3 and
    the saving layout itself load it and continue the
    uninterrupted curve. Each byte is written once: the saved chunks of
    every tensor add up to the tensor, as zero=0's do."""
    from test_checkpoint import _fit

    from tpctl.parallel.layout import Layout

    source = Layout.parse("1d-2-dp2-z2")
    curve = pool.run(_fit, source, str(tmp_path / "z2"), timeout_s=600)[0]
    assert len({loss for _, loss in curve}) > 1
    step4 = tmp_path / "z2" / "checkpoints" / "step_4"
    for name in ("2d-4-dp2", "none-dp4-z3", "1d-2-dp4-z1", "1d-2-dp2-z2"):
        resumed = pool.run(_fit, Layout.parse(name), str(tmp_path / name), resume=str(step4), timeout_s=600)[0]
        assert [s for s, _ in resumed] == [5, 6, 7, 8], name
        rel = 1e-6 if name == source.name else REL  # the same layout: the same numbers
        for (step, want), (_, got) in zip(curve[4:], resumed):
            assert got == pytest.approx(want, rel=rel), f"{source.name} -> {name} step {step}"
    coverage = _coverage(step4)
    assert len(coverage) > 10 and all(held == whole for held, whole in coverage.values()), coverage


# ---- through `tpctl train` -----------------------------------------------------

CLI_STEPS = 6  # a CLI run pays its start-up per rank: few steps (the pool tests above run STEPS)
CLI = ["model=gpt-tiny", "optim.eps=1e-5", "model.n_layer=2", "data=synthetic", "data.synthetic_tokens=40000", f"train.steps={CLI_STEPS}",
       "train.batch_size=16", "train.seq_len=32", "train.log_every=1", "train.eval_every=0", "train.progress=false",
       "train.verify_rewrite=false", "seed=0", "optim.warmup_steps=0"]


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """`tpctl train` of a layout name (with `extra` overrides), cached per
    module: its metrics and summary."""
    from tpctl.commands.run_dir import layout_overrides, read_metrics, read_summary, train_subprocess

    cache: dict = {}

    def run(name: str, *extra: str) -> dict:
        key = (name, extra)
        if key not in cache:
            run_dir = tmp_path_factory.mktemp("zero-cli") / name
            env = dict(os.environ, OMP_NUM_THREADS="1")
            proc = train_subprocess([*layout_overrides(name), *CLI, *extra], run_dir, timeout=scaled(900), env=env)
            assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            cache[key] = {"metrics": read_metrics(run_dir), "summary": read_summary(run_dir), "dir": run_dir,
                          "stdout": proc.stdout}
        return cache[key]

    return run


# The 16-rank ZeRO case (2.5d depth 2 with cp=2, ZeRO-2 over the cp
# replicas) runs on test_context's 16-rank pool, beside the other 16-rank
# layouts; 3d with pipeline stages runs 16 workers through `tpctl train` in
# test_pipeline. Every stage is covered with dp in the smaller modes above.


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_1d_zero2_checkpoint_resumes_as_none_dp2_zero3(cli_run):
    """Through the command line: 1d dp=2 zero=2 (4 ranks) saves at step 2;
    mode=none dp=2 zero=3 (2 ranks) resumes it, says which stage wrote it,
    and continues the curve (more layouts on the pool: above)."""
    first = cli_run("1d-2-dp2-z2", "checkpoint.every=2", "checkpoint.keep=0")
    step2 = first["dir"] / "checkpoints" / "step_2"
    resumed = cli_run("none-dp2-z3", f"train.resume={step2}")
    assert "resumed from" in resumed["stdout"] and "zero=2" in resumed["stdout"]
    assert [r["step"] for r in resumed["metrics"]] == list(range(3, CLI_STEPS + 1))
    for want, got in zip(first["metrics"][2:], resumed["metrics"]):
        assert got["loss"] == pytest.approx(want["loss"], rel=REL), got["step"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_zero_with_one_replica_changes_nothing_and_says_so(cli_run):
    """zero=2 with dp=1: accepted, one line saying why nothing changes, and
    the curve of zero=0 to the bit."""
    got, want = cli_run("none-z2"), cli_run("none")
    notes = [line for line in got["stdout"].splitlines() if "zero=2 with dp=1" in line]
    assert len(notes) == 1 and "nothing to share" in notes[0], got["stdout"]
    assert [r["loss"] for r in got["metrics"]] == [r["loss"] for r in want["metrics"]]
    assert [r["grad_norm"] for r in got["metrics"]] == [r["grad_norm"] for r in want["metrics"]]
