"""Context parallelism (parallel/context.py): each sequence split across
cp ranks, ring and Ulysses attention, trains as one process does."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_config
from tpctl.parallel.layout import Layout


def _cp_against_one_process(name: str, impl: str, **overrides) -> tuple[float, float, dict]:
    """One forward and backward of a global batch in layout `name` against
    one process's: the loss's relative error, the worst gradient's
    (norm-relative), and the bytes comm counted by kind."""
    import torch.nn.functional as F

    from conftest import build
    from tpctl.models import build_model
    from tpctl.parallel import comm

    settings = {"model.n_embd": 32, "model.n_head": 8, "context.impl": impl, **overrides}
    cfg = tiny_config(1, **settings)
    layout = Layout.parse(name)
    run = build(cfg, layout)
    gen = torch.Generator().manual_seed(5)
    batch, seq, vocab = cfg.train.batch_size, cfg.train.seq_len, cfg.model.vocab_size
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    x, y = ids[:, :-1], ids[:, 1:]
    ref = build_model(cfg.model, cfg.seed)
    ref_loss = F.cross_entropy(ref(x).reshape(-1, vocab), y.reshape(-1), reduction="sum") / y.numel()
    ref_loss.backward()
    par = run.par
    comm.STATS.reset()
    loss_sum = run.step.forward_backward([(par.shard_batch(x), par.shard_targets(y))], 0)
    counted = dict(comm.STATS.bytes)
    par.finish_grads([run.model])
    loss = par.global_mean(loss_sum, y.numel())
    ref_grads = dict(ref.named_parameters())
    worst = 0.0
    for pname, p in run.model.named_parameters():
        spec = getattr(p, "tpctl_spec", None)
        want = ref_grads[pname].grad
        want = spec.slice(want) if spec is not None else want
        worst = max(worst, ((p.grad - want).norm() / want.norm().clamp_min(1e-30)).item())
    return abs(loss - ref_loss.item()) / abs(ref_loss.item()), worst, counted


@pytest.mark.parametrize("name,impl", [("none-cp2-dp4", "ring"), ("none-cp4-dp2", "ring"),
                                       ("none-cp4-dp2", "ulysses"), ("1d-2-cp4", "ulysses"),
                                       ("1d-2-sp-cp2-dp2", "ring"), ("2d-4-cp2", "ulysses")])
def test_cp_trains_as_one_process_and_sends_what_is_planned(pool, name, impl):
    from tpctl.cost.planner import model_shape, plan_split

    kind = {"ring": "ring_pass", "ulysses": "all_to_all"}[impl]
    cfg = tiny_config(1, **{"model.n_embd": 32, "model.n_head": 8})
    plan = plan_split(model_shape(cfg.model), Layout.parse(name), cfg.train.batch_size, cfg.train.seq_len, context=impl)
    for loss_err, grad_err, counted in pool.run(_cp_against_one_process, name, impl, timeout_s=120):
        assert loss_err < 1e-6 and grad_err < 1e-6, (loss_err, grad_err)
        assert counted[kind] == plan.comm[(kind, "cp")].bytes > 0


def _curve(name: str, steps: int = 3, **overrides) -> list[float]:
    """The global loss of `steps` optimizer steps in layout `name`."""
    from conftest import build

    cfg = tiny_config(steps, **{"model.n_embd": 32, "model.n_head": 8, **overrides})
    run = build(cfg, Layout.parse(name))
    gen = torch.Generator().manual_seed(7)
    out = []
    for step in range(steps):
        ids = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1), generator=gen)
        x, y = ids[:, :-1], ids[:, 1:]
        result = run.step([(run.par.shard_batch(x), run.par.shard_targets(y))], step)
        out.append(float(result["loss"]))
    return out


def test_zero_over_dp_and_cp_trains_as_one_process(pool):
    """ZeRO's replicas are dp x cp (each holds the same parameters with other
    tokens' gradients): stage 2 over 8 ranks, 2 of them splitting each sequence."""
    ref = pool.run(_curve, "none-dp8", timeout_s=120)[0]
    for impl in ("ring", "ulysses"):
        got = pool.run(_curve, "none-cp2-dp4-z2", timeout_s=120, **{"context.impl": impl})
        assert got[0] == pytest.approx(ref, rel=1e-6) and got[0] != pytest.approx(ref[:1] * 3)
