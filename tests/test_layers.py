"""Every parallel layer against the single-process layer it replaces.

The session's pools serve every mode (4 gloo ranks, or 8 for 2.5d and
3d); a layout with dp > 1 exercises data parallelism too. For each case
the reference module runs whole on every rank; the parallel copy runs on this
rank's rows and shards; outputs, input grads and parameter grads (after the
gradient sync) must equal the reference's slices within fp32 round-off.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from conftest import layouts

from tpctl.launch.pool import parallelism_of

MESHES = layouts("none-dp4", "1d-2-dp2", "1d-4-sp", "1d-4", "2d-4", "2.5d-8-d2", "3d-8")
TOL = dict(rtol=1e-5, atol=1e-5)
BATCH, SEQ, HIDDEN, HEADS = 8, 8, 16, 4

# --------------------------------------------------------------------------
# Code run on the ranks.


def _mode(key: str):
    """The tensor-parallel mode of layout `key` (its Parallelism: _parallel)."""
    return _parallel(key).mode


def _parallel(key: str):
    return parallelism_of(MESHES[key])


def _model_cfg(**kw):
    from tpctl.schema import ModelConfig

    base = dict(vocab_size=37, n_layer=2, n_head=HEADS, n_embd=HIDDEN, block_size=SEQ, dropout=0.0)
    base.update(kw)
    return ModelConfig(**base)


class Sandwich(nn.Module):
    """Embedding -> [block] -> norm -> LM head: the input and output ends."""

    tp_plan = {"wte": "embedding", "wpe": "pos_embedding", "ln": "norm", "lm_head": "lm_head"}

    def __init__(self, cfg, tied: bool, head_bias: bool):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.ln = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=head_bias)
        if tied:
            self.lm_head.weight = self.wte.weight

    def forward(self, ids):
        return self.lm_head(self.ln(self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))))


def _build(case: str):
    """(module, plan, kind) for a case; kind says what it maps."""
    from tpctl.models.gpt import GPT, MLP, Block, CausalSelfAttention
    from tpctl.models.mlp import TokenMLP

    cfg = _model_cfg()
    attn_plan = {"qkv": "qkv", "proj": "attn_out", "attn_drop": "attn_dropout", "resid_drop": "dropout"}
    if case == "mlp":
        return MLP(cfg), {"fc": "mlp_in", "proj": "mlp_out", "drop": "dropout"}, "hidden"
    if case == "mlp-nobias":
        return MLP(_model_cfg(bias=False)), {"fc": "mlp_in", "proj": "mlp_out", "drop": "dropout"}, "hidden"
    if case == "norm":
        norm = nn.LayerNorm(HIDDEN)
        nn.init.normal_(norm.weight)
        nn.init.normal_(norm.bias)
        return nn.Sequential(norm), {"0": "norm"}, "hidden"
    if case == "norm-nobias":
        norm = nn.LayerNorm(HIDDEN, bias=False)
        nn.init.normal_(norm.weight)
        return nn.Sequential(norm), {"0": "norm"}, "hidden"
    if case == "attention":
        return CausalSelfAttention(cfg), attn_plan, "hidden"
    if case == "block":
        plan = {"ln_1": "norm", "ln_2": "norm", "mlp.fc": "mlp_in", "mlp.proj": "mlp_out", "mlp.drop": "dropout"}
        plan.update({f"attn.{k}": v for k, v in attn_plan.items()})
        return Block(cfg), plan, "hidden"
    if case == "embedding":
        class Embed(nn.Module):
            tp_plan = {"wte": "embedding", "wpe": "pos_embedding"}

            def __init__(self):
                super().__init__()
                self.wte, self.wpe = nn.Embedding(cfg.vocab_size, HIDDEN), nn.Embedding(SEQ, HIDDEN)

            def forward(self, ids):
                return self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        return Embed(), None, "ids->hidden"
    if case == "head-tied":
        return Sandwich(cfg, tied=True, head_bias=False), None, "ids->loss"
    if case == "head-untied-bias":
        return Sandwich(cfg, tied=False, head_bias=True), None, "ids->loss"
    if case == "gpt":
        return GPT(_model_cfg(vocab_size=64)), None, "ids->loss"
    if case == "token-mlp":
        return TokenMLP(_model_cfg(tie_embeddings=False)), None, "ids->loss"
    raise KeyError(case)


def _compare(key: str, case: str, label_smoothing: float = 0.0) -> int:
    """One layer (or a tiny stack) rewritten alone, deliberately not a run
    (build_run): its forward and backward against the original's."""
    import torch.nn.functional as F

    from tpctl.parallel.tensor.rewrite import rewrite_layers

    tp = _parallel(key)
    mode = tp.mode
    torch.manual_seed(0)
    ref, plan, kind = _build(case)
    torch.manual_seed(0)
    par = rewrite_layers(_build(case)[0], mode, plan).model
    gen = torch.Generator().manual_seed(1)
    rows = tp.rows(BATCH)
    vocab = getattr(ref, "wte", None).num_embeddings if kind.startswith("ids") else None

    if kind == "hidden":
        x = torch.randn(BATCH, SEQ, HIDDEN, generator=gen, requires_grad=True)
        x_local = mode.shard_hidden(x.detach()[rows.start:rows.stop]).clone().requires_grad_()
        ref_in, par_in = x, x_local
    else:
        ids = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
        ref_in, par_in = ids, mode.split_input(ids[rows.start:rows.stop])

    ref_params = dict(ref.named_parameters())
    for name, p in par.named_parameters():  # initialised whole, then sliced
        assert torch.equal(p, p.tpctl_spec.slice(ref_params[name].detach())), name
    ref_out, par_out = ref(ref_in), par(par_in)
    if kind == "ids->loss":
        targets = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
        ref_loss = F.cross_entropy(ref_out.reshape(-1, vocab), targets.reshape(-1), reduction="sum",
                                   label_smoothing=label_smoothing)
        local = mode.split_target(targets[rows.start:rows.stop])
        par_loss = mode.cross_entropy(par_out, local, vocab, label_smoothing).sum()
        total = par_loss.detach().double().reshape(1).clone()
        torch.distributed.all_reduce(total)  # world: every rank holds some rows
        torch.testing.assert_close(total.item() / mode.loss_replicas, ref_loss.item(), **TOL)
        ref_loss.backward()
        par_loss.backward()
    else:
        probe = torch.randn(ref_out.shape, generator=gen)
        expected = mode.shard_hidden(ref_out.detach()[rows.start:rows.stop])
        torch.testing.assert_close(par_out, expected, **TOL)
        (ref_out * probe).sum().backward()
        (par_out * mode.shard_hidden(probe[rows.start:rows.stop])).sum().backward()
        if kind == "hidden":
            torch.testing.assert_close(x_local.grad, mode.shard_hidden(x.grad[rows.start:rows.stop]), **TOL)

    tp.sync_grads(par)
    checked = 0
    for name, p in par.named_parameters():
        torch.testing.assert_close(p.grad, p.tpctl_spec.slice(ref_params[name].grad), **TOL,
                                   msg=lambda m, name=name: f"grad of {name}: {m}")
        checked += 1
    return checked


def _dropout_masks(key: str) -> list[bool]:
    """Same-mask / own-mask rule: returns, for each dropout role, whether the
    tensor-parallel ranks drew identical masks."""
    from tpctl.parallel.tensor.rewrite import rewrite_layers

    mode = _mode(key)
    net = rewrite_layers(nn.Sequential(nn.Dropout(0.5), nn.Dropout(0.5)), mode, {"0": "dropout", "1": "attn_dropout"}).model
    out = []
    for layer in net:
        mask = layer(torch.ones(64)).ne(0).float()
        masks = [torch.empty_like(mask) for _ in range(mode.mesh.tp_size)]
        torch.distributed.all_gather(masks, mask, group=mode.mesh.tp_group)
        out.append(all(torch.equal(m, masks[0]) for m in masks))
    return out


# --------------------------------------------------------------------------
# The tests.

CASES = ["mlp", "mlp-nobias", "norm", "norm-nobias", "attention", "block", "embedding",
         "head-tied", "head-untied-bias", "token-mlp", "gpt"]


@pytest.mark.parametrize("key", list(MESHES))
@pytest.mark.parametrize("case", CASES)
def test_layer_matches_single_process(pool, key, case):
    checked = pool.run(_compare, key, case)
    assert all(n > 0 for n in checked)


@pytest.mark.parametrize("key", ["1d-4", "2d-4", "3d-8"])
def test_label_smoothing(pool, key):
    pool.run(_compare, key, "head-untied-bias", 0.1)


def _compare_with_the_cuda_loss(key: str) -> int:
    """_compare with the loss walked by the CUDA policy (fused chunks, run
    eagerly: no GPU here), in chunks of a few rows."""
    from tpctl.parallel.tensor import loss

    saved = loss.policy_for
    loss.policy_for = lambda device: loss.ChunkPolicy(3 * 64, fused=True, compiled=False)
    try:
        return _compare(key, "head-untied-bias", 0.1)
    finally:
        loss.policy_for = saved


@pytest.mark.parametrize("key", ["1d-4-sp", "3d-8"])  # the loss group of 1d, and of 3d's grid
def test_the_cuda_loss_policy_across_a_loss_group(pool, key):
    assert all(n > 0 for n in pool.run(_compare_with_the_cuda_loss, key))


@pytest.mark.parametrize("key,same", [
    ("1d-4", [True, False]),  # replicated residual stream; heads split
    ("1d-4-sp", [False, False]),  # sequence shards
    ("2d-4", [False, False]),
    ("3d-8", [False, False]),
])
def test_dropout_rng_rule(pool, key, same):
    assert pool.run(_dropout_masks, key) == [same] * MESHES[key].world


def _mlp_comm(key: str) -> tuple[dict, dict]:
    """Collectives of one MLP forward + backward (no gradient sync)."""
    from tpctl.models.gpt import MLP
    from tpctl.parallel import comm
    from tpctl.parallel.tensor.rewrite import rewrite_layers

    mode = _mode(key)
    net = rewrite_layers(MLP(_model_cfg()), mode, {"fc": "mlp_in", "proj": "mlp_out", "drop": "dropout"}).model
    rows = _parallel(key).rows(BATCH)
    x = mode.shard_hidden(torch.randn(BATCH, SEQ, HIDDEN)[rows.start:rows.stop]).requires_grad_()
    comm.STATS.reset()
    net(x).sum().backward()
    return dict(comm.STATS.calls), dict(comm.STATS.bytes)


def _expected_mlp_comm(key: str) -> tuple[dict, dict]:
    """The same from the layout math (docs/DESIGN.md): payload = the full tensor
    of each collective, fp32. fc: HIDDEN -> 4*HIDDEN, proj: back."""
    layout = MESHES[key]
    mode, size, depth, dp = layout.mode, layout.size, layout.depth, layout.dp
    f = 4  # bytes per fp32 element
    linears = [(4 * HIDDEN, HIDDEN), (HIDDEN, 4 * HIDDEN)]  # (out n, in k)
    tokens = BATCH // dp * SEQ  # per data-parallel replica
    if mode == "1d":
        # forward: all-reduce of proj's output; backward: of fc's input grad
        return {"all_reduce": 2}, {"all_reduce": 2 * tokens * HIDDEN * f}
    if mode in ("2d", "2.5d"):
        q = round((size // depth) ** 0.5)
        m = tokens // (depth * q)
        calls = {"broadcast": 0, "reduce": 0}
        nbytes = {"broadcast": 0, "reduce": 0}
        for n, k in linears:
            w, y = n // q * k // q, m * n // q
            calls["broadcast"] += 3 * q  # fwd W; bwd dY and W
            calls["reduce"] += 2 * q  # fwd Y; bwd dW
            nbytes["broadcast"] += q * (w + y + w) * f
            nbytes["reduce"] += q * (y + w) * f
        return calls, nbytes
    if mode == "3d":
        q = round(size ** (1 / 3))
        m = tokens // q  # rows block i: what a linear gathers
        full = 0
        for n, k in linears:
            # each pair's full tensor: X (m x k/q), W (n/q x k/q), Y (m x n/q);
            # forward gathers X and W and reduce-scatters Y, backward
            # gathers dY and reduce-scatters dX and dW.
            full += m * k // q + n // q * k // q + m * n // q
        return {"all_gather": 3 * len(linears), "reduce_scatter": 3 * len(linears)}, \
            {"all_gather": full * f, "reduce_scatter": full * f}
    return {}, {}


@pytest.mark.parametrize("key", ["1d-4", "2d-4", "2.5d-8-d2", "3d-8"])
def test_comm_counter_matches_the_algorithm(pool, key):
    calls, nbytes = pool.run(_mlp_comm, key)[0]
    want_calls, want_bytes = _expected_mlp_comm(key)
    assert calls == want_calls
    assert nbytes == want_bytes


def _compare_lock_step(key: str, case: str) -> int:
    mode = _mode(key)
    mode.grid.overlap = False
    try:
        return _compare(key, case)
    finally:
        mode.grid.overlap = True


@pytest.mark.parametrize("key", ["2d-4", "2.5d-8-d2"])
def test_summa_without_overlap_is_the_same(pool, key):
    """The lock-step SUMMA (benchmarks/summa_overlap.py's baseline)."""
    assert all(n > 0 for n in pool.run(_compare_lock_step, key, "block"))


def test_a_fused_layout_splits_by_runs_exactly_as_feature_by_feature():
    """roles/fused.py selects a shard's features run by run (a head's
    features, or features that are their own units); the definition is
    feature by feature: equal over contiguous and interleaved q/k/v layouts,
    shared key/value heads, per-feature units, 1d/2d shards and 3d's
    sub-blocks."""
    import random

    from tpctl.parallel.roles.fused import FusedLayout
    from tpctl.parallel.shard import _merge

    def by_feature(layout, shards, s):
        held = [layout.held_units(p, shards, s) for p in range(len(layout.names))]
        return _merge([(f, f + 1) for f in range(layout.features) if layout.unit[f] in held[layout.part[f]]])

    rng, checked = random.Random(0), 0
    for _ in range(60):
        heads, width = rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 3])
        kv = rng.choice([h for h in (1, 2, 4, 8) if heads % h == 0])
        part, unit = [], []
        kind = rng.choice(["contiguous", "interleaved", "any order"])
        if kind == "contiguous":  # [q | k | v], each its heads in order
            for p, count in enumerate((heads, kv, kv)):
                for h in range(count):
                    part, unit = part + [p] * width, unit + [h] * width
        elif kind == "any order":  # every unit's features together, the units in any order
            units = [(p, h) for p, count in enumerate((heads, kv, kv)) for h in range(count)]
            rng.shuffle(units)
            for p, h in units:
                part, unit = part + [p] * width, unit + [h] * width
        else:  # per key/value head: its query heads, then k, then v
            group = heads // kv
            for j in range(kv):
                for i in range(group):
                    part, unit = part + [0] * width, unit + [j * group + i] * width
                part, unit = part + [1] * width + [2] * width, unit + [j] * 2 * width
        for layout in (FusedLayout(("q", "k", "v"), (heads, kv, kv), tuple(part), tuple(unit)),
                       FusedLayout.equal(6 * width, ("q", "k", "v")), FusedLayout.heads(width * heads, heads, "k")):
            for shards in (1, 2, 4, 8):
                if layout.split_problem(shards):
                    continue
                for per in (1, 2, 4):
                    for index in range(shards * per):
                        shard, sub = divmod(index, per)
                        whole = by_feature(layout, shards, shard)
                        assert layout.shard_features(shards, shard) == whole
                        flat = [f for a, b in whole for f in range(a, b)]
                        size = len(flat) // per
                        assert layout.ranges(shards, shards * per, index) == _merge(
                            [(f, f + 1) for f in flat[sub * size:(sub + 1) * size]])
                        checked += 1
    assert checked > 1000


def test_a_frozen_parameter_stays_frozen_when_sharded():
    """A tensor mode=none never trains (requires_grad off: Marian's
    sinusoidal position table) is no trainable shard either: a shard made
    trainable would be trained by every split mode, silently off
    mode=none's curve (Marian and Pegasus in 2d, found by the zoo)."""
    import torch

    from tpctl.parallel.shard import ShardSpec
    from tpctl.parallel.tensor.mode import RewriteContext

    ctx = RewriteContext(mesh=None)
    frozen, trained = torch.nn.Parameter(torch.randn(8, 4), requires_grad=False), torch.nn.Parameter(torch.randn(8, 4))
    spec = ShardSpec((8, 4), (None, ((0, 2),)))
    assert not ctx.shard(frozen, spec).requires_grad
    assert ctx.shard(trained, spec).requires_grad
