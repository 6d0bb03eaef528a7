"""Experts in 2d, 2.5d and 3d (parallel/roles/experts.py DenseExperts): all
experts in one product of the mode's Linear each, against transformers'
own experts module: output, input, weight and routing-weight gradients,
with rows routed to no expert, an expert no row is routed to and a rank
whose rows skip an expert; and the collectives of a forward and backward
do not grow with the number of experts (3d too: the routing weights
brought to the cube's output rows, mode.rows_like_output).

On the session's pools (4 gloo ranks, 8 for 2.5d and 3d), in process.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from conftest import layouts

from tpctl.launch.pool import parallelism_of

pytest.importorskip("transformers")

MESHES = layouts("2d-4", "2.5d-8-d2", "3d-8")
TOL = dict(rtol=1e-5, atol=1e-5)
BATCH, SEQ, HIDDEN, INNER, TOP_K = 8, 4, 16, 8, 2


class Block(nn.Module):
    """An experts module alone, fed the routing: the role plan's `experts`."""

    def __init__(self, experts: int):
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts

        super().__init__()
        cfg = MixtralConfig(hidden_size=HIDDEN, intermediate_size=INNER, num_local_experts=experts)
        cfg._experts_implementation = "eager"  # (what a model's own config says)
        self.experts = MixtralExperts(cfg)
        for p in self.experts.parameters():
            nn.init.normal_(p, std=0.5)

    def forward(self, x, index, weights):
        flat = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731  (rows, features) as a MoE block calls it
        return self.experts(flat(x), flat(index), flat(weights)).reshape(x.shape)


def _routing(experts: int, gen: torch.Generator):
    """(index, weights) of every row, (BATCH, SEQ, TOP_K): the last expert
    never chosen; the first half of the batch (the first rows block in
    every mode here: its ranks' rows) only experts 0 and 1, expert 2 on
    the other ranks alone; some rows routed to no expert (index `experts`:
    transformers' marker), one with a zero weight."""
    chosen = max(experts - 1, 1)
    none = torch.full((max(TOP_K - chosen, 0),), experts)  # (one expert: the other pick none)
    index = torch.stack([torch.cat([torch.randperm(chosen, generator=gen)[:TOP_K], none]) for _ in range(BATCH * SEQ)])
    if experts > 2:
        first = BATCH // 2 * SEQ
        index[:first] = torch.tensor([0, 1])
        index[1] = index[first + 1] = experts  # routed to no expert
        index[first + 2, 1] = experts
    weights = torch.rand(BATCH * SEQ, TOP_K, generator=gen)
    weights[first + 3 if experts > 2 else 3, 0] = 0.0
    return index.reshape(BATCH, SEQ, TOP_K), weights.reshape(BATCH, SEQ, TOP_K)


def _local(mode, t: torch.Tensor, rows: range, hidden_local: int) -> torch.Tensor:
    """This rank's rows of a per-row tensor (its last dim whole), as the
    mode cuts the stream's rows (shard_hidden, on copies side by side)."""
    copies = HIDDEN // hidden_local
    return mode.shard_hidden(t[rows.start:rows.stop].repeat(*(1,) * (t.dim() - 1), copies))


def _compare(key: str, experts: int) -> dict:
    """DenseExperts' forward and backward against the original module's;
    its collectives (comm.STATS calls per kind)."""
    from tpctl.parallel import comm
    from tpctl.parallel.roles.experts import DenseExperts
    from tpctl.parallel.tensor.rewrite import rewrite_layers

    tp = parallelism_of(MESHES[key])
    mode = tp.mode
    torch.manual_seed(0)
    ref = Block(experts)
    torch.manual_seed(0)
    par = rewrite_layers(Block(experts), mode, {"experts": "experts"}).model
    assert isinstance(par.experts, DenseExperts)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=gen, requires_grad=True)
    index, weights = _routing(experts, gen)
    weights.requires_grad_()
    rows = tp.rows(BATCH)
    x_local = mode.shard_hidden(x.detach()[rows.start:rows.stop]).clone().requires_grad_()
    h = x_local.shape[-1]
    index_local = _local(mode, index, rows, h)[..., :TOP_K]
    weights_local = _local(mode, weights.detach(), rows, h)[..., :TOP_K].clone().requires_grad_()

    ref_out = ref(x, index, weights)
    comm.STATS.reset()
    par_out = par(x_local, index_local, weights_local)
    probe = torch.randn(ref_out.shape, generator=gen)
    (ref_out * probe).sum().backward()
    (par_out * mode.shard_hidden(probe[rows.start:rows.stop])).sum().backward()
    calls = dict(comm.STATS.calls)

    torch.testing.assert_close(par_out, mode.shard_hidden(ref_out.detach()[rows.start:rows.stop]), **TOL)
    torch.testing.assert_close(x_local.grad, mode.shard_hidden(x.grad[rows.start:rows.stop]), **TOL)
    # The routing weights' gradient is partial over the ranks holding the
    # row's other features (the router's entry sums it there).
    grad = weights_local.grad.clone()
    torch.distributed.all_reduce(grad, group=mode.stream_group())
    torch.testing.assert_close(grad, _local(mode, weights.grad, rows, h)[..., :TOP_K], **TOL)
    tp.sync_grads(par)
    ref_params = dict(ref.named_parameters())
    for name, p in par.named_parameters():
        torch.testing.assert_close(p.grad, p.tpctl_spec.slice(ref_params[name].grad), **TOL,
                                   msg=lambda m, name=name: f"grad of {name}: {m}")
    return calls


@pytest.mark.timeout(180)
@pytest.mark.parametrize("key", list(MESHES))
def test_dense_experts_match_the_module_and_their_collectives_do_not_grow_with_the_experts(pool, key):
    many = pool.run(_compare, key, 4)
    one = pool.run(_compare, key, 1)
    for rank, (got, base) in enumerate(zip(many, one)):
        # (3d also gathers the routing weights to the cube's output rows:
        # one collective each way, whatever the expert count)
        assert got == base, f"rank {rank}"
