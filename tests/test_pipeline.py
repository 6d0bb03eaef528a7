"""Pipeline parallelism (pp > 1) against one process: every schedule, with
every tensor mode the 8-rank pool can lay out, reproduces mode=none's loss
curve and gradient norm (fp32 round-off); every rank logs the same loss;
a stage holds only its share of the parameters; what cannot be cut is
refused in one line."""

from __future__ import annotations

import pytest
import torch
from cli_support import tpctl, scaled  # noqa: F401  (fixture)
from conftest import build, build_trainer, tiny_config

from tpctl.parallel.layout import Layout
from tpctl.parallel.pipeline.stages import PipelineSpec

REL = 1e-4  # the issue's bound; fp32 round-off measured here is ~1e-6


def _run(name: str, steps: int, spec: PipelineSpec | None = None, verify: bool = True, run_dir: str | None = None,
         resume: str | None = None, **overrides):
    """Train the tiny GPT (or `overrides`' model) in layout `name` on a pool
    rank as a worker does (lazy build, verified rewrite, Trainer); returns
    this rank's (loss, grad_norm) per step, its parameter bytes and the
    run's summary. `run_dir`: checkpoints every 2 steps; `resume`: a
    checkpoint to continue from."""
    from pathlib import Path

    from tpctl import checkpoint
    from tpctl.config import check_layout

    layout = Layout.parse(name)
    saving = {"checkpoint.every": 2, "checkpoint.keep": 0} if run_dir else {}
    cfg = layout.write_to(tiny_config(steps, **{"model.n_layer": 4, "model.dropout": 0.0, "train.eval_every": 2,
                                                "train.eval_batches": 1, **saving, **overrides}))
    if spec is not None:
        cfg.pipeline.schedule, cfg.pipeline.microbatches = spec.schedule, spec.microbatches
        cfg.pipeline.virtual_stages = max(spec.virtual, 2)
    check_layout(cfg, layout)
    if run_dir:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
    trainer = build_trainer(cfg, layout, run_dir=run_dir, verify=verify)
    model = trainer.model
    if resume is not None:
        trainer.resume(Path(resume), checkpoint.verify(Path(resume)))
    records = trainer.fit()
    from tpctl.parallel.roles.plan import repeated_blocks

    blocks = list(repeated_blocks(model).children())
    facts = {"compiled": trainer.compiled, "checkpointed": [getattr(b, "tpctl_checkpointed", False) for b in blocks]}
    return [(r["loss"], r["grad_norm"], r.get("val_loss")) for r in records], trainer.step.memory()["param_bytes"], trainer.summary(records), facts


def _assert_same_curve(got_by_rank, want):
    got = got_by_rank[0]
    assert all(g == got for g in got_by_rank), "every rank logs the same loss and gradient norm"
    assert want[-1][0] < want[0][0], "the reference did not learn"
    for step, ((loss, norm, val), (want_loss, want_norm, want_val)) in enumerate(zip(got, want), 1):
        assert loss == pytest.approx(want_loss, rel=REL), f"step {step}: loss"
        assert norm == pytest.approx(want_norm, rel=REL), f"step {step}: gradient norm"
        assert (val is None) == (want_val is None) and (val is None or val == pytest.approx(want_val, rel=REL)), \
            f"step {step}: validation loss (the stages' forward-only pass)"


_references: dict = {}


def _reference(pool, arch: str) -> list:
    """mode=none's curve of the model (8 data-parallel replicas: the same
    global batch), once per module."""
    if arch not in _references:
        _references[arch] = pool.run(_run, "none-dp8", 4, **_arch(arch))[0][0]
    return _references[arch]


def _arch(arch: str) -> dict:
    return {"gpt": {}, "llama": {"model.arch": "llama", "model.n_kv_head": 2}, "gpt2": {"model.arch": "gpt2", "model.bias": None}}[arch]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name, schedule, m, arch", [
    ("none-pp2-dp4", "1f1b", 2, "gpt"),
    ("none-pp4-dp2", "gpipe", 4, "gpt"),
    ("none-pp2-dp4", "interleaved", 2, "gpt"),
    ("1d-2-pp2-dp2", "1f1b", 2, "gpt"),
    ("2d-4-pp2", "1f1b", 2, "gpt"),
    ("1d-2-pp2-dp2", "1f1b", 2, "llama"),  # Hugging Face Llama: rotary tables and masks on every stage
    ("1d-2-pp2-dp2", "gpipe", 2, "gpt2"),  # Hugging Face GPT-2: the head tied to the first stage's embedding
    ("1d-2-pp2-dp2-z1", "1f1b", 2, "gpt2"),  # ZeRO 1 under a pipeline: AdamW state sharded, the tied head too
])
def test_pipeline_trains_like_one_process(pool, name, schedule, m, arch):
    spec = PipelineSpec(Layout.parse(name).pp, schedule, 2 if schedule == "interleaved" else 1, m)
    results = pool.run(_run, name, 4, spec, **_arch(arch))
    _assert_same_curve([r[0] for r in results], _reference(pool, arch))


def _run_through_host(name: str, steps: int, spec: PipelineSpec):
    """_run with the stage exchange staged through host buffers (what gloo
    with device=cuda needs; forced here, on a CPU): the curve, and the bytes
    that crossed through host buffers on this rank."""
    from tpctl.parallel.pipeline import schedule as pipeline

    made, init = [], pipeline.Pipeline.__init__

    def keep(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    pipeline.Pipeline.force_host_staging, pipeline.Pipeline.__init__ = True, keep
    try:
        curve = _run(name, steps, spec)[0]
    finally:
        pipeline.Pipeline.force_host_staging, pipeline.Pipeline.__init__ = False, init
    return curve, sum(p.staged_bytes for p in made)


@pytest.mark.timeout(900)
def test_the_stage_exchange_through_host_buffers_trains_like_one_process(pool):
    """Every send copied to the host, every receive landed from a host
    buffer into torch's device buffer (training and evaluation; the
    interleaved schedule: two chunks per rank, each exchanging): the same
    curve; a receive not landed leaves the stage reading stale buffers (checked: it fails)."""
    spec = PipelineSpec(2, "interleaved", 2, 2)
    results = pool.run(_run_through_host, "none-pp2-dp4", 4, spec)
    assert all(staged > 0 for _, staged in results)
    _assert_same_curve([curve for curve, _ in results], _reference(pool, "gpt"))


def _run_with_written_back_broadcasts(name: str, steps: int, spec: PipelineSpec):
    """_run with every broadcast writing its tensor back on every rank, the
    source included, as gloo does with a CUDA tensor (its host buffer is
    copied back): the tensor's autograd version moves, its values do not."""
    from tpctl.parallel import comm

    issue = comm.broadcast

    class WrittenBackOnWait:
        """An asynchronous broadcast's handle that writes the tensor back
        when waited on, as gloo does at completion: a write issued beside the
        receive in flight would race with it (and did, under load)."""

        def __init__(self, work, tensor):
            self.work, self.tensor = work, tensor

        def wait(self, *args, **kwargs):
            out = self.work.wait(*args, **kwargs)
            with torch.no_grad():
                self.tensor.add_(0)
            return out

        def __getattr__(self, name):
            return getattr(self.work, name)

    def written_back(tensor, src, group, async_op=False):
        handle = issue(tensor, src, group, async_op)
        if async_op and handle is not None:
            return WrittenBackOnWait(handle, tensor)
        with torch.no_grad():
            tensor.add_(0)
        return handle

    comm.broadcast = written_back
    try:
        return _run(name, steps, spec)[0]
    finally:
        comm.broadcast = issue


@pytest.mark.timeout(300)
def test_summa_broadcasts_leave_the_saved_weights_alone_with_micro_batches_in_flight(pool):
    """2d under 1F1B holds two micro-batches' forwards before their
    backwards: a SUMMA broadcast that wrote into the weight it sends (gloo's
    CUDA path, failing on an H100 with 'modified by an inplace operation')
    would invalidate the first one's saved weight. Checked: it fails when the
    owner broadcasts the weight tensor itself."""
    spec = PipelineSpec(2, "1f1b", 2, 2)
    want = pool.run(_run, "2d-4-pp2", 1, spec)[0][0]
    assert all(curve == want for curve in pool.run(_run_with_written_back_broadcasts, "2d-4-pp2", 1, spec))


def test_only_a_device_tensor_over_a_host_backend_is_staged():
    from tpctl.parallel.pipeline.schedule import host_staging

    cuda = torch.device("cuda", 0)
    assert host_staging(cuda, "gloo") and not host_staging(cuda, "nccl")
    assert not host_staging(torch.device("cpu"), "gloo") and not host_staging(cuda, None)


@pytest.mark.timeout(900)
def test_a_2d_pp2_checkpoint_resumes_as_3d_and_as_1d_pp2_dp2(pool, tmp_path):
    """The checkpoint of a pipeline (each stage writes its parameters under
    the whole model's names) loads into a layout without stages and into
    other stages: the resumed runs continue the uninterrupted curve."""
    whole = pool.run(_run, "2d-4-pp2", 4, None, True, str(tmp_path / "2d-pp2"))[0][0]
    step_2 = str(tmp_path / "2d-pp2" / "checkpoints" / "step_2")
    for name in ("3d-8", "1d-2-pp2-dp2"):
        resumed = pool.run(_run, name, 4, None, True, str(tmp_path / name), step_2)
        got = resumed[0][0]
        assert len(got) == 2 and all(r[0] == got for r in resumed)
        for (loss, norm, _), (want_loss, want_norm, _) in zip(got, whole[2:]):
            assert loss == pytest.approx(want_loss, rel=REL) and norm == pytest.approx(want_norm, rel=REL), name


def _compiled_run(*args, **kwargs):
    """_run with train.compile=true on aot_eager (dynamo and AOT autograd
    without inductor's C++ build, as tests/test_compile.py)."""
    import os

    import torch._dynamo

    from tpctl.training.compile import BACKEND_ENV

    os.environ[BACKEND_ENV] = "aot_eager"
    torch._dynamo.reset()
    return _run(*args, **kwargs, **{"train.compile": True})


@pytest.mark.timeout(900)
@pytest.mark.parametrize("feature", ["activation_checkpointing", "bf16",
                                     pytest.param("compile", marks=pytest.mark.slow)])
def test_a_pipeline_composes_with(pool, feature):
    """Activation checkpointing recomputes each block of a stage (equal to
    one process); bf16 autocasts each stage and the loss (within the band
    of any mode against bf16 mode=none); train.compile compiles each block
    of a stage (the stage's hooks stay eager)."""
    spec = PipelineSpec(2, "1f1b", 1, 2)
    if feature == "bf16":
        want = pool.run(_run, "none-dp8", 4, precision="bf16")[0][0]
        got = pool.run(_run, "none-pp2-dp4", 4, spec, precision="bf16")
        for (loss, _, _), (want_loss, _, _) in zip(got[0][0], want):
            assert loss == pytest.approx(want_loss, rel=1e-3)  # test_train_features.BF16_MODE_TOL
        return
    run, extra = (_compiled_run, {}) if feature == "compile" else (_run, {"train.activation_checkpointing": True})
    results = pool.run(run, "none-pp2-dp4", 4, spec, **extra)
    _assert_same_curve([r[0] for r in results], _reference(pool, "gpt"))
    facts = [r[3] for r in results]
    if feature == "compile":
        assert all(f["compiled"] for f in facts)
    else:  # every block a stage holds recomputes (each stage holds some)
        assert all(f["checkpointed"] and all(f["checkpointed"]) for f in facts), facts


# ---- one process: a stage computes what its blocks compute in the whole model

def _whole_and_stages(dropout: float, schedule: str = "1f1b", pp: int = 2, **model):
    """The tiny GPT's run whole (mode none, one process) and each pipeline
    rank's stage of it, built as workers build them (meta, lazy, rewritten)."""
    from tpctl.parallel.parallelism import parallelism
    from tpctl.training.build import build_run

    cfg = tiny_config(1, **{"model.n_layer": 4, "model.dropout": dropout, **model})
    whole = build(cfg, Layout("none"), pooled=False, groups=False, step=False)  # (its mesh draws the masks)
    layout = Layout("none", pp=pp)
    spec = PipelineSpec(pp, schedule, 2 if schedule == "interleaved" else 1, pp)
    stages = []
    for rank in range(pp):
        run = build_run(cfg, parallelism(layout, groups=False, rank=rank, pipeline=spec), step=False)
        stages.append((run.par, run.model))
    return cfg, whole, stages


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_each_stage_draws_the_dropout_masks_of_one_process(schedule):
    """Dropout on: fed the stream the whole model's blocks received, each
    chunk of each stage puts out exactly what those blocks put out (the
    logits on the last): the same weights, the same masks (dropout streams
    are keyed by step, micro-batch and block, not by what ran before)."""
    cfg, run, stages = _whole_and_stages(0.3, schedule)
    whole, mesh = run.model, run.par.mesh
    whole.train()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    seen: dict[str, tuple] = {}
    for key, block in whole.blocks._modules.items():
        block.register_forward_hook(lambda m, a, out, key=key: seen.__setitem__(key, (a[0].detach(), out.detach())))
    mesh.draw_step, mesh.draw_micro = 5, 1
    logits = whole(ids).detach()
    checked = 0
    for par, stage in stages:
        stage.train()
        par.mesh.draw_step, par.mesh.draw_micro = 5, 1
        for chunk in par.pipeline.chunks:
            received = None if chunk.first else seen[str(chunk.blocks[0])][0]
            out = par.pipeline.forward_chunk(chunk, received, ids)
            want = logits if chunk.last else seen[str(chunk.blocks[-1])][1]
            assert torch.equal(out, want), f"stage {chunk.index}"
            checked += 1
    assert checked == len(stages) * (2 if schedule == "interleaved" else 1)
    # Dropout acts: another micro-batch draws other masks.
    mesh.draw_micro = 2
    assert not torch.equal(whole(ids).detach(), logits)


def test_a_stage_keeps_the_whole_models_names_and_only_its_share():
    from tpctl.parallel.shard import spec_of

    cfg, run, stages = _whole_and_stages(0.0)
    whole = run.model
    names = dict(whole.named_parameters())
    held = [dict(stage.named_parameters()) for _, stage in stages]
    assert set(held[0]) | set(held[1]) == set(names), "every parameter on some stage, under its own name"
    # The blocks in order, a prefix on the first stage and the rest on the second (where the cut falls is
    # the cut's business: tests/test_pipeline.py's weighting tests).
    first = sorted({int(k.split(".")[1]) for k in held[0] if k.startswith("blocks.")})
    assert 0 < len(first) < 4 and first == list(range(len(first))), first
    for part, wanted in ((held[0], first), (held[1], range(len(first), 4))):
        prefixes = tuple(f"blocks.{i}." for i in wanted)
        assert [k for k in part if k.startswith("blocks.")] == [k for k in names if k.startswith(prefixes)]
    assert "wte.weight" in held[1] and held[1]["wte.weight"] is stages[1][1].lm_head.weight, "tied: one parameter"
    # The record of the tied weight: the first stage's copy is the one counted and written.
    assert not spec_of(held[1]["wte.weight"]).first_on_stages(1) and spec_of(held[0]["wte.weight"]).first_on_stages(0)
    assert spec_of(held[0]["wte.weight"]).stage_ranks == spec_of(held[1]["wte.weight"]).stage_ranks == (0, 1)
    for part in held:
        for name, p in part.items():
            assert torch.equal(p, names[name]), name
    whole_bytes = sum(p.numel() * 4 for p in names.values())
    # Only its share: nothing held twice but the tied weight's second copy (the cut by FLOPs decides the sizes).
    held_bytes = [sum(p.numel() * 4 for p in part.values()) for part in held]
    assert sum(held_bytes) == whole_bytes + names["wte.weight"].numel() * 4 and max(held_bytes) < whole_bytes


def _custom_loop_grads() -> int:
    """A custom loop over a pipeline (tpctl.init_parallel, the stage's own
    schedule, then `sync_grads`): every gradient equals one process's,
    the embedding tied to the LM head included (summed between the end
    stages as the training step sums it)."""
    import tpctl
    from tpctl.models import build_model
    from tpctl.parallel.shard import spec_of
    from tpctl.schema import ModelConfig

    cfg = ModelConfig(vocab_size=50, n_embd=16, n_head=4, block_size=8, n_layer=2, tie_embeddings=True)
    ids = torch.randint(0, 50, (8, 9), generator=torch.Generator().manual_seed(3))
    x, y = ids[:, :-1], ids[:, 1:]
    ref = build_model(cfg, seed=0)
    (torch.nn.functional.cross_entropy(ref(x).reshape(-1, 50), y.reshape(-1), reduction="sum") / y.numel()).backward()

    tp = tpctl.init_parallel(Layout.parse("none-pp2-dp4"))
    model = tpctl.parallelize(build_model(cfg, seed=0), tp)
    pipe, m = tp.pipeline, tp.pipeline.spec.microbatches
    micro = [(tp.shard_batch(x, k, m), tp.shard_targets(y, k, m)) for k in range(m)]
    stream = pipe.stream_shape(len(tp.rows(8, m)), 8, tp.mode)
    pipe.forward_backward(micro, lambda logits, t: tp.cross_entropy(logits, t, 50).sum(), y.numel(), stream)
    tp.sync_grads(model)
    want = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, spec_of(p).slice(want[name].grad), rtol=1e-5, atol=1e-6, msg=name)
    assert "wte.weight" in dict(model.named_parameters())
    return len(list(model.parameters()))


def test_a_custom_loop_over_a_pipeline_sums_the_tied_weight(pool):
    assert min(pool.run(_custom_loop_grads)) > 0


def test_the_stage_weighting_is_pluggable():
    """The stages are balanced by a weight per block: its training FLOPs
    by default (4 equal blocks and the tied LM head, 1.3 blocks of FLOPs,
    on the last stage, the embedding none: 3 and 1; by parameters, which
    count the embedding first, it was 2 and 2), or what `weigh` says (the
    last block heavy: it alone on the last stage)."""
    from tpctl.models import build_model
    from tpctl.parallel.mesh import build_mesh
    from tpctl.parallel.pipeline.cut import StageCut

    cfg = tiny_config(1, **{"model.n_layer": 4})
    mesh = build_mesh(Layout("none", pp=2), rank=0, groups=False)
    spec = PipelineSpec(2, "1f1b", 1, 2)
    default = StageCut(mesh, spec)
    default.assign(build_model(cfg.model, cfg.seed, lazy=True))
    assert default.blocks_of == [range(0, 3), range(3, 4)]
    weighed: list = []

    def weigh(block):
        weighed.append(block)
        return 10**9 if len(weighed) == 4 else 1

    heavy_last = StageCut(mesh, spec, weigh)
    model = build_model(cfg.model, cfg.seed, lazy=True)
    heavy_last.assign(model)
    # the blocks weighed first, then what runs before and after them
    assert heavy_last.blocks_of == [range(0, 3), range(3, 4)] and weighed[:4] == list(model.blocks)


def test_the_cut_weighs_what_the_plan_counts():
    """The stages are balanced by the FLOPs the planner counts for them:
    each block's products and attention scores at the run's seq_len, the
    LM head's product and the cross entropy over its logits (nothing for
    the embedding), so the cut and the planned bubble see the same costs."""
    from tpctl.cost.planner import model_shape, plan_split
    from tpctl.models import build_model
    from tpctl.parallel.mesh import build_mesh
    from tpctl.parallel.pipeline.cut import StageCut

    cfg = tiny_config(1, **{"model.n_layer": 4})
    layout = Layout("none", pp=2)
    spec = PipelineSpec(2, "1f1b", 1, 2, seq_len=cfg.train.seq_len)
    cut = StageCut(build_mesh(layout, rank=0, groups=False), spec)
    cut.assign(build_model(cfg.model, cfg.seed, lazy=True))
    blocks, before, after = cut.weights
    per_block, before, after = [w >> 40 for w in blocks], before >> 40, after >> 40  # FLOPs (parameters below)
    per_token = [sum(per_block[i] for i in r) + (before if c == 0 else 0) + (after if c == 1 else 0)
                 for c, r in enumerate(cut.blocks_of)]
    plan = plan_split(model_shape(cfg.model, cfg.seed), layout, cfg.train.batch_size, cfg.train.seq_len, pipeline=spec)
    tokens = cfg.train.batch_size * cfg.train.seq_len
    assert [p.flops for p in plan.stages] == pytest.approx([f * tokens for f in per_token], rel=1e-12)
    assert before == 0 and after > 6 * 256 * 16  # the head's product and the loss


def test_the_planned_bubble_counts_what_each_stage_costs():
    """Equal stages: the schedule's formula; a last stage three times as
    costly (GPT-2's head) paces the others, who then wait longer."""
    spec = PipelineSpec(4, "1f1b", 1, 8)
    assert spec.bubble_for([2.0] * 4) == pytest.approx(spec.bubble())
    # wall = 7 * 3 + 6 = 27 per-micro-batch units, busy 8 * 1.5 on average
    assert spec.bubble_for([1, 1, 1, 3]) == pytest.approx(1 - 8 * 1.5 / 27)


# ---- what cannot be pipelined is refused before any worker starts, in one line

def flat_lm(vocab_size: int = 32, width: int = 16):
    """A language model without a stack of repeated blocks."""
    return torch.nn.Sequential(torch.nn.Embedding(vocab_size, width), torch.nn.Linear(width, width),
                               torch.nn.Linear(width, vocab_size))


def stacked_lm(vocab_size: int = 32, width: int = 16, depth: int = 2):
    """A user's own model: a ModuleList of `depth` blocks between an embedding and a head."""
    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(vocab_size, width)
            self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, width))
                                              for _ in range(depth))
            self.head = torch.nn.Linear(width, vocab_size)

        def forward(self, ids):
            x = self.embed(ids)
            for block in self.blocks:
                x = x + block(x)
            return self.head(x)
    return LM()


@pytest.mark.parametrize("overrides, key, phrase", [
    (["pp=3"], "pp", "pp=3 makes 3 stages, more than the model's 2 blocks"),
    (["pp=2", "pipeline.schedule=interleaved"], "pipeline.virtual_stages", "makes 4 stages, more than the model's 2 blocks"),
    (["pp=2", "pipeline.microbatches=4", "train.batch_size=6"], "train.batch_size", "pipeline.microbatches(4) x 1 row blocks"),
    (["pp=2", "pipeline.microbatches=1"], "pipeline.microbatches", "expected at least pp=2"),
    (["pp=2", "train.grad_accum=2"], "train.grad_accum", "the pipeline's micro-batches split the batch"),
    (["pp=2", "mode=1d", "size=2", "seq_parallel=true"], "seq_parallel", "not sequence-sharded"),
    (["pp=2", "pipeline.schedule=zb"], "pipeline.schedule", "expected one of gpipe, 1f1b, interleaved"),
    (["pp=2", "pipeline.split=[1,2]"], "pipeline.split", "summing to the model's 2"),
    (["pp=2", "train.sample_every=5"], "train.sample_every", "not through pipeline stages"),
    (["pp=2", "dp=2", "train.batch_size=4"], "pipeline.microbatches", "none does; set pipeline.microbatches"),
    (["pp=2", "model=custom", "+model._target_=tests.test_pipeline.flat_lm"], "model", "has none (an nn.ModuleList"),
    (["pp=4", "model=custom", "+model._target_=tests.test_pipeline.stacked_lm"], "pp", "more than the 2 blocks of LM"),
])
def test_what_cannot_be_pipelined_is_refused_in_one_line(overrides, key, phrase):
    from tpctl.config import compose_jobs, validate
    from tpctl.errors import ConfigError

    with pytest.raises(ConfigError) as refused:
        validate(compose_jobs(overrides)[0])
    line = str(refused.value)
    assert "\n" not in line and line.startswith(f"invalid config: {key}=") and phrase in line, line


def test_the_default_micro_batches_keep_the_bubble_at_most_a_quarter():
    from tpctl.config import compose_jobs
    from tpctl.parallel.pipeline.stages import pipeline_of

    for pp, schedule, want in ((2, "1f1b", 4), (4, "1f1b", 16), (4, "gpipe", 16), (4, "interleaved", 8)):
        cfg = compose_jobs([f"pp={pp}", f"pipeline.schedule={schedule}", "model.n_layer=8", "train.batch_size=32"])[0]
        spec = pipeline_of(Layout.from_config(cfg), cfg)
        assert spec.microbatches == want and spec.bubble() <= 0.25, (pp, schedule, spec)
        smaller = PipelineSpec(pp, schedule, spec.virtual, spec.microbatches // 2)
        assert smaller.bubble() > 0.25 or not 32 % smaller.microbatches


# ---- whole runs through `tpctl train` (16 ranks, two nodes, a restart) ------

CLI = ["model=gpt-tiny", "optim.eps=1e-5", "data=synthetic", "data.synthetic_tokens=20000", "train.batch_size=8", "train.seq_len=16",
       "train.log_every=1", "train.eval_every=0", "train.progress=false", "seed=0"]


def _metrics(run_dir) -> list[dict]:
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_16_rank_pipeline_of_3d_trains_like_one_process(tpctl):
    """3d size 8 with pp=2: 16 workers, the stream between the stages in the
    cube's layout (2.5d's 16 ranks run with ZeRO and cp on test_context's
    16-rank pool: each mode family's 16-rank run once)."""
    runs = {"none": [], "3d": ["mode=3d", "size=8"]}
    curves = {}
    for name, layout in runs.items():
        stages = ["pp=2", "pipeline.microbatches=2"] if layout else []
        result = tpctl.run(["train", *CLI, *layout, *stages, "train.steps=4", "checkpoint.every=0", "checkpoint.at_end=false",
                            f"hydra.run.dir={tpctl.cwd / name}"], timeout=500)
        assert result.returncode == 0, result.stderr[-3000:]
        curves[name] = _metrics(tpctl.cwd / name)
    for name in ("3d",):
        for got, want in zip(curves[name], curves["none"]):
            assert got["loss"] == pytest.approx(want["loss"], rel=REL), (name, got["step"])
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=REL), (name, got["step"])
    summary = __import__("json").loads((tpctl.cwd / "3d" / "summary.json").read_text())
    assert summary["pp"] == 2 and summary["pipeline_bubble_planned"] == pytest.approx(1 / 3)
    assert 0 <= summary["pipeline_bubble"] < 1
    assert tpctl.leftover_pids() == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_nodes_hold_one_stage_each_and_train_like_one_node(tpctl):
    """Loopback multi-node: 1d size 2 with pp=2 on two nodes of two workers:
    each node holds one stage (its tensor-parallel group inside it), only
    the pipeline's sends cross nodes; bit for bit the one-node run."""
    from test_multinode import COMMON as NODE_COMMON
    from test_multinode import curve, node_args

    from tpctl.launch.local import free_port

    layout = ["mode=1d", "size=2", "pp=2", "model.n_layer=2", "train.steps=3", "train.batch_size=8", "train.seq_len=16"]
    single = tpctl.cwd / "single"
    one = tpctl.run(["train", *layout, *NODE_COMMON, f"hydra.run.dir={single}"], timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    port = free_port("127.0.0.1")
    dirs = [tpctl.cwd / "node0", tpctl.cwd / "node1"]
    nodes = [tpctl.start(node_args(dirs[k], port, k, *layout)) for k in (0, 1)]
    outputs = [p.communicate(timeout=scaled(400)) for p in nodes]
    for p, (_, err) in zip(nodes, outputs):
        assert p.returncode == 0, err[-3000:]
    assert "1 whole tensor-parallel group(s) of 2; only pipeline and data-parallel traffic crosses nodes" in outputs[1][1]
    for a, b in zip(curve(*dirs), curve(single)):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"], (a, b)
    assert tpctl.leftover_pids() == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_stage_is_restarted_and_resumes(tpctl):
    """launcher.max_restarts with pp=2: the last stage's rank dies after
    step 5, every worker restarts from the step-4 checkpoint (written by
    both stages) and the run ends where the uninterrupted one does."""
    base = ["train", *CLI, "pp=2", "train.steps=8", "checkpoint.every=4"]
    calm = tpctl.cwd / "calm"
    assert tpctl.run([*base, f"hydra.run.dir={calm}"], timeout=300).returncode == 0
    killed = tpctl.cwd / "killed"
    tpctl.extra_env["TPCTL_TEST_KILL_AT"] = "1:5"
    result = tpctl.run([*base, "launcher.max_restarts=1", f"hydra.run.dir={killed}"], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "after restart 1 of 1" in result.stdout and "step_4" in result.stdout
    got = _metrics(killed)
    assert [r["step"] for r in got] == list(range(1, 9))
    assert got[-1]["loss"] == pytest.approx(_metrics(calm)[-1]["loss"], rel=1e-6)
    # `tpctl generate` loads the pipeline's checkpoint in any layout (the
    # same greedy tokens) and refuses to decode through stages, in one line.
    ids = []
    for layout in (["mode=none"], ["mode=1d", "size=2"]):
        done = tpctl.run(["generate", str(calm / "checkpoints" / "step_8"), "prompt=def", "temperature=0",
                          "max_new_tokens=6", "--json", *layout], timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        ids.append(__import__("json").loads(done.stdout.strip().splitlines()[-1])["ids"])
    assert ids[0] == ids[1] and len(ids[0]) == 6
    refused = tpctl.run(["generate", str(calm / "checkpoints" / "step_8"), "prompt=def", "pp=2"], timeout=120)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        "tpctl: error: invalid config: pp=2: generate decodes in one tensor-parallel group, not through pipeline "
        "stages: expected pp=1 (a checkpoint written with any pp loads into any layout)"]
    assert tpctl.leftover_pids() == []


@pytest.mark.timeout(180)
def test_inspect_shows_the_stage_of_each_module(tpctl):
    """The stage column: the embedding on the first stage, the blocks cut in
    two, the final norm and the (tied) head on the last; the bytes line is
    stage 0's share."""
    result = tpctl.run(["inspect", "pp=2", "model.n_layer=4", "train.verify_rewrite=false"], timeout=150)
    assert result.returncode == 0, result.stderr
    stage = {}
    for line in result.stdout.splitlines():
        cells = [c.strip() for c in line.strip("│ ").split("│")]
        if len(cells) > 2 and cells[1] in ("0", "1", "all"):
            stage[cells[0]] = cells[1]
    assert {k: stage.get(k) for k in ("wte", "wpe", "blocks.1.mlp.fc", "blocks.2.ln_1", "ln_f", "lm_head")} == {
        "wte": "0", "wpe": "0", "blocks.1.mlp.fc": "0", "blocks.2.ln_1": "1", "ln_f": "1", "lm_head": "1"}
    assert "on rank 0 (pipeline stage 0)" in result.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_takes_pp(tpctl):
    """`tpctl bench pp=2`: 1d with two stages of one rank each measures a
    step whose loss is the single-process reference's."""
    import json

    result = tpctl.run(["bench", "size=1", "pp=2", "modes=[none,1d]", "steps=1", "rounds=1", "warmup=0", "--json",
                        "model.n_layer=2", "train.batch_size=4", "train.seq_len=16"], timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(result.stdout[result.stdout.index("{"):])
    assert rows["1d"]["first_loss"] == pytest.approx(rows["none"]["first_loss"], rel=REL)
    assert rows["1d"]["comm_bytes"] > 0  # the stages' sends, counted


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_sweep_over_pp_compares_the_stages(tpctl):
    """`train -m pp=1,2,3`: gpt-tiny's 2 blocks make 1 or 2 stages (3 is
    skipped in one line); both runs end on the same loss, and the
    comparison shows the pipeline's measured bubble."""
    import json

    sweep = tpctl.cwd / "sweep"
    result = tpctl.run(["train", "-m", *CLI, "pp=1,2,3", "train.steps=3", "checkpoint.every=0",
                        "checkpoint.at_end=false", f"hydra.sweep.dir={sweep}"], timeout=550)
    assert result.returncode == 0, result.stderr[-3000:]
    skipped = [line for line in result.stderr.splitlines() if line.startswith("tpctl: skipping")]
    assert len(skipped) == 1 and "job 2 (mode=none size=1 pp=3)" in skipped[0] and "more than the model's 2 blocks" in skipped[0], skipped
    jobs = json.loads((sweep / "comparison.json").read_text())["jobs"]
    assert [(j["pp"], j["status"]) for j in jobs[:2]] == [(1, "ok"), (2, "ok")] and jobs[2]["status"] == "skipped"
    assert jobs[1]["final_loss_rel_diff"] < REL and jobs[0]["pipeline_bubble"] is None
    assert 0 <= jobs[1]["pipeline_bubble"] < 1
    assert "bubble" in (sweep / "comparison.md").read_text()
    assert tpctl.leftover_pids() == []
