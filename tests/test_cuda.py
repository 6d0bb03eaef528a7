"""CUDA: run with `pytest -m cuda` on a machine with a GPU (skipped without
one; CI has none). Every rank of a test shares the machine's GPU(s) over
gloo (launcher.backend=gloo), so one GPU runs every mode:

  * every mode on CUDA reproduces mode=none on CUDA (fp32), and bf16 stays
    in the suite's bf16 band;
  * every pipeline schedule (the stage exchange through host buffers: gloo
    does not send CUDA tensors) and every ZeRO stage reproduce mode=none;
  * ring context parallelism (its passes through host buffers, as the
    stages') and Ulysses' in every mode reproduce mode=none;
  * the loss's CUDA policy (fused chunks, compiled) equals F.cross_entropy;
  * torch.compile (inductor) equals eager on CUDA;
  * a checkpoint saved and resumed through `tpctl train device=cuda`
    continues the uninterrupted curve (the CUDA generators included);
  * `tpctl bench device=cuda` runs, with its plain row and MFU column;
  * NCCL with more ranks than GPUs keeps its one-line exit 2.
"""

from __future__ import annotations

import json

import pytest
import torch
from cli_support import tpctl  # noqa: F401 (fixture)
from conftest import build_trainer, layouts, tiny_config

from tpctl.parallel.layout import Layout

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pytest -m cuda on a GPU machine)")]

MESHES = layouts("none-dp8", "1d-2-dp4", "1d-4-sp-dp2", "2d-4-dp2", "2.5d-8-d2", "3d-8")
STEPS = 4
TOL = 1e-5  # fp32 modes against none (the suite's band)
BF16_MODE_TOL = 1e-3  # bf16 modes against bf16 none (tests/test_train_features.py)


def _cfg(**overrides):
    return tiny_config(STEPS, **{"model.n_embd": 32, "device": "cuda", **overrides})


def _train_cuda(key: str, **overrides) -> list[float]:
    import torch.distributed as dist


    gpu = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
    torch.cuda.set_device(gpu)
    torch._dynamo.reset()
    layout = MESHES[key] if key in MESHES else Layout.parse(key)
    trainer = build_trainer(_cfg(**layout.to_dict(), **overrides), pooled=False, device=gpu)
    model = trainer.model
    assert all(p.is_cuda for p in model.parameters())
    staged = trainer.par.pipeline.staged_bytes if trainer.par.pipeline is not None else None
    losses = [r["loss"] for r in trainer.fit()]
    if staged is not None:  # gloo: the stages' exchange went through host buffers
        assert trainer.par.pipeline.staged_bytes > 0
    return losses


def _rel(a, b) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def reference(pool):
    return {p: pool.run(_train_cuda, "none-dp8", precision=p)[0] for p in ("fp32", "bf16")}


@pytest.mark.parametrize("key", [k for k in MESHES if k != "none-dp8"])
def test_every_mode_on_cuda_matches_none(pool, reference, key):
    for losses in pool.run(_train_cuda, key):
        assert _rel(losses, reference["fp32"]) <= TOL, (losses, reference["fp32"])


@pytest.mark.parametrize("key", ["1d-4-sp-dp2", "3d-8"])
def test_bf16_on_cuda(pool, reference, key):
    for losses in pool.run(_train_cuda, key, precision="bf16"):
        assert _rel(losses, reference["bf16"]) <= BF16_MODE_TOL, (losses, reference["bf16"])


@pytest.mark.parametrize("key", ["none-dp8", "2d-4-dp2"])
def test_compile_on_cuda_equals_eager(pool, reference, key):
    eager = reference["fp32"] if key == "none-dp8" else pool.run(_train_cuda, key)[0]
    for losses in pool.run(_train_cuda, key, **{"train.compile": "true"}):
        assert _rel(losses, eager) <= TOL, (losses, eager)


TINY = ["model=gpt-tiny", "optim.eps=1e-5", "model.n_layer=1", "data=synthetic", "data.synthetic_tokens=20000", "train.batch_size=8",
        "train.seq_len=16", "train.log_every=1", "train.eval_every=0", "train.progress=false", "seed=0",
        "model.dropout=0.1", "device=cuda", "launcher.backend=gloo",
        "optim.warmup_steps=0", "optim.min_lr=0.001"]  # a constant LR: the schedule does not depend on train.steps


def _losses(run_dir) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(600)
def test_checkpoint_saved_and_resumed_on_cuda(tpctl):
    """Dropout on: the resumed curve needs the CUDA generators restored."""
    whole, first = tpctl.cwd / "whole", tpctl.cwd / "first"
    base = ["train", *TINY, "mode=1d", "size=2", "checkpoint.keep=0"]
    full = tpctl.run([*base, "train.steps=6", "checkpoint.every=0", f"hydra.run.dir={whole}"], timeout=300)
    assert full.returncode == 0, full.stderr
    assert "not for speed" in full.stderr  # the one line saying ranks share the GPU
    part = tpctl.run([*base, "train.steps=3", "checkpoint.every=3", f"hydra.run.dir={first}"], timeout=300)
    assert part.returncode == 0, part.stderr
    resumed = tpctl.run([*base, "train.steps=6", "checkpoint.every=0", f"hydra.run.dir={first}", "train.resume=auto"],
                        timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert _losses(first) == pytest.approx(_losses(whole), rel=1e-6)


@pytest.mark.timeout(600)
def test_bench_on_cuda(tpctl):
    """hardware=auto: the GPU's own profile (an H100 or H200 here), named in the columns."""
    result = tpctl.run(["bench", "device=cuda", "size=2", "modes=[none,plain,1d]", "steps=2",
                        "rounds=1", "warmup=1", "model.n_layer=1"], timeout=500)
    assert result.returncode == 0, result.stderr
    assert "MFU (h" in result.stdout and "plan ms (cpu)" not in result.stdout and "x plain" in result.stdout


def test_nccl_with_more_ranks_than_gpus_exits_2(tpctl):
    ranks = torch.cuda.device_count() + 1
    result = tpctl.run(["train", "device=cuda", "launcher.backend=nccl", "mode=1d", f"size={ranks}",
                        f"hydra.run.dir={tpctl.cwd / 'run'}"], timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "CUDA devices with NCCL" in lines[0] and "launcher.backend=gloo" in lines[0]


DEEP = {"model.n_layer": 4, "pipeline.microbatches": 2, "pipeline.virtual_stages": 2}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("key, schedule", [("none-pp2-dp4", "gpipe"), ("1d-2-pp2-dp2", "1f1b"),
                                           ("none-pp2-dp4", "interleaved"), ("2d-4-pp2", "1f1b")])
def test_every_pipeline_schedule_on_one_gpu_over_gloo(pool, key, schedule):
    want = pool.run(_train_cuda, "none-dp8", **DEEP)[0]
    for losses in pool.run(_train_cuda, key, **DEEP, **{"pipeline.schedule": schedule}):
        assert _rel(losses, want) <= TOL, (losses, want)


# Context parallelism in every mode: 8 ranks, or 16 where the mode's
# smallest grid is 8 (a pool of 16 ranks sharing the GPU).
CP_MESHES = ("none-cp2-dp4", "none-cp4-dp2", "1d-2-cp2-dp2", "2d-4-cp2", "2.5d-8-d2-cp2", "3d-8-cp2")
CP_TOL = 1e-6  # cp against none (issue 48; tests/test_context.py's band on CPU)


def _train_cuda_cp(key: str, impl: str) -> list[float]:
    """_train_cuda with context parallelism `impl` (context.impl): the
    ring's passes crossed through host buffers (gloo does not send CUDA
    tensors; comm.ring_pass), Ulysses' all-to-alls did not."""
    from tpctl.parallel import comm

    comm.RING_STAGING.bytes = 0
    losses = _train_cuda(key, **{"context.impl": impl})
    assert (comm.RING_STAGING.bytes > 0) == (impl == "ring"), (impl, comm.RING_STAGING.bytes)
    return losses


@pytest.mark.timeout(600)
@pytest.mark.parametrize("impl", ["ring", "ulysses"])
@pytest.mark.parametrize("key", CP_MESHES)
def test_context_parallelism_on_one_gpu_over_gloo_matches_none(pool, reference, key, impl):
    world = Layout.parse(key).world
    results = pool.run(_train_cuda_cp, key, impl, ranks=world, timeout_s=300)
    assert len(results) == world
    for losses in results:
        assert _rel(losses, reference["fp32"]) <= CP_TOL, (losses, reference["fp32"])


@pytest.mark.parametrize("key", ["none-dp8-z1", "none-dp8-z2", "none-dp8-z3", "2d-4-dp2-z3"])
def test_every_zero_stage_on_cuda_matches_none(pool, reference, key):
    for losses in pool.run(_train_cuda, key):
        assert _rel(losses, reference["fp32"]) <= TOL, (losses, reference["fp32"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cuda_loss_policy_equals_torch_on_cuda(dtype):
    """The device's own policy (policy_for: one compiled kernel each way
    where Triton is), and its eager fallback in ragged chunks, padding included."""
    import torch.nn.functional as F

    from tpctl.parallel.tensor import loss

    policy = loss.policy_for(torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (3 * torch.randn(1000, 300, device="cuda", generator=g)).to(dtype)
    targets = torch.randint(0, 290, (1000,), device="cuda", generator=g)
    for p in (policy, loss.ChunkPolicy(7 * 290, fused=True)):
        ours_in = logits.clone().requires_grad_()
        ref_in = logits[:, :290].float().clone().requires_grad_()
        ours = loss.vocab_parallel_cross_entropy(ours_in, targets, 0, 290, None, 0.1, p)
        ref = F.cross_entropy(ref_in, targets, reduction="none", label_smoothing=0.1)
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
        ours.sum().backward()
        ref.sum().backward()
        assert ours_in.grad.dtype == dtype and not ours_in.grad[:, 290:].any()
        torch.testing.assert_close(ours_in.grad[:, :290].float(), ref_in.grad.to(dtype).float(),
                                   rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)


def test_tf32_is_named_at_start_and_set():
    from tpctl.training.step import set_tf32

    line = set_tf32(False, torch.device("cuda"), "fp32")
    if torch.cuda.get_device_capability() >= (8, 0):
        assert "train.tf32=true" in line
    set_tf32(True, torch.device("cuda"))
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    set_tf32(False, torch.device("cuda"))


def test_adamw_is_fused_on_cuda_and_updates_as_foreach_does():
    """optim.fused=auto: the trainer's AdamW runs fused on CUDA weights, and
    its update equals the foreach one within fp32 round-off."""
    from omegaconf import OmegaConf

    from tpctl.schema import OptimConfig
    from tpctl.training.step import build_optimizer

    def run(fused: str):
        g = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(64, 32, generator=g).cuda()), torch.nn.Parameter(torch.randn(32, generator=g).cuda())]
        cfg = OmegaConf.structured(OptimConfig)
        cfg.fused = fused
        opt = build_optimizer(params, cfg)
        for _ in range(5):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g).cuda()
            opt.step()
        return bool(opt.defaults.get("fused")), [p.detach().cpu() for p in params]

    (auto_fused, fused), (_, foreach) = run("auto"), run("false")
    assert auto_fused
    for a, b in zip(fused, foreach):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
