"""Mixture-of-experts blocks: a router and a set of expert MLPs.

A block (Qwen2-MoE, Mixtral, OLMoE, DeepSeek-style ...) routes each row
(token) of the residual stream to its top-k experts: a `router` (a module
with an (experts x hidden) weight, or a Linear) scores the row from its
whole hidden vector, and an `experts` module computes
sum_k weight_k * MLP_k(row). `transformers` 5.x stores the experts as two
3-d parameters, gate_up (E, 2I, H) and down (E, H, I), and declares their
layout on the module (`is_concatenated`, `is_transposed`, `has_bias`, ...).

Tensor parallelism shards every expert's MLP like any MLP: its gate/up rows
(the hidden features I, in [gate | up] order) and its down columns. The
router stays whole on every rank: routing must be identical wherever a row
is held, so where a mode splits the hidden dimension (2d, 2.5d, 3d) the
router's input is gathered over the ranks holding the row's other features.

  * 1d: the experts module's own forward on this rank's slice of every
    expert (routed rows only), its partial output summed once over the
    group; the routing weights' gradient (partial: each rank's experts see
    a slice of the hidden features) summed over the group too.
  * 2d, 2.5d, 3d: every expert runs on every row this rank holds through
    the mode's own Linear layers (SUMMA, the 3d cube), weighted by a dense
    routing matrix that is zero where a row was not routed: the mode's
    collectives must run in lockstep over ranks holding different rows,
    which route differently. Exact (a product with 0 adds 0), at E/k times
    the routed compute.

Expert parallelism (experts placed on data-parallel ranks) is not done:
every tensor-parallel group holds every expert.
"""

from __future__ import annotations

import copy
import functools
from typing import Callable

import torch
import torch.nn as nn

from .fused import FusedLayout, ProbeError

# What transformers' `use_experts_implementation` declares on an experts
# module, and the value tpctl shards.
DECLARED = {"is_transposed": False, "is_concatenated": True, "has_bias": False, "has_gate": True,
            "has_post_expert_norm": False}


def experts_layout(module: nn.Module) -> tuple[str, str, FusedLayout]:
    """(name of the gate/up parameter, of the down parameter, the layout of
    gate/up's rows) of an experts module, or ProbeError naming a layout
    tpctl does not shard."""
    cls = type(module).__name__
    missing = [a for a in DECLARED if not hasattr(module, a)] + ([] if hasattr(type(module), "_apply_gate") else ["_apply_gate"])
    if missing:
        raise ProbeError(f"{cls} does not declare its experts' layout ({', '.join(missing)}: transformers' "
                         "use_experts_implementation does)")
    odd = [f"{a}={getattr(module, a)}" for a, want in DECLARED.items() if bool(getattr(module, a)) != want]
    if odd:
        raise ProbeError(f"{cls} stores its experts with {', '.join(odd)}; tpctl shards gate/up concatenated "
                         "[gate; up] as (experts, 2 x inner, hidden) and down as (experts, hidden, inner), no biases")
    own = dict(module.named_parameters(recurse=False))
    three = {n: p for n, p in own.items() if p.dim() == 3}
    if len(three) != 2 or len(own) != 2:
        raise ProbeError(f"{cls} holds {', '.join(f'{n} {tuple(p.shape)}' for n, p in own.items())}: "
                         "expected two 3-d expert weights (gate/up and down)")
    (a, pa), (b, pb) = three.items()
    for gate_up, down, gu, dn in ((a, b, pa, pb), (b, a, pb, pa)):
        _, two_inner, hidden = gu.shape
        if dn.shape[1:] == (hidden, two_inner // 2) and two_inner % 2 == 0:
            inner = two_inner // 2
            part = (0,) * inner + (1,) * inner
            return gate_up, down, FusedLayout(("gate", "up"), (inner, inner), part, tuple(range(inner)) * 2)
    raise ProbeError(f"{cls}: {a} {tuple(pa.shape)} and {b} {tuple(pb.shape)} are not (experts, 2 x inner, hidden) "
                     "and (experts, hidden, inner)")


def dense_weights(rows: int, experts: int, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The (rows, experts) routing matrix: each row's top-k weights at its
    experts, zero elsewhere (an index equal to `experts` marks no expert)."""
    index, weights = index.reshape(rows, -1), weights.reshape(rows, -1)
    full = torch.zeros(rows, experts + 1, dtype=weights.dtype, device=weights.device)
    return full.scatter(1, index, weights)[:, :experts]


class DenseExperts(nn.Module):
    """An experts module whose every expert runs on every row through the
    mode's Linear layers (`linear_in`, `linear_out`: (x, weight) -> y),
    weighted by the dense routing matrix. Holds this rank's shards under
    the original parameter names."""

    def __init__(self, module: nn.Module, gate_up: str, down: str, weights: dict[str, nn.Parameter],
                 linear_in: Callable, linear_out: Callable):
        super().__init__()
        self.gate_up, self.down = gate_up, down
        for name, p in weights.items():
            self.register_parameter(name, p)
        self.num_experts = getattr(module, gate_up).shape[0]
        self.linear_in, self.linear_out = linear_in, linear_out
        # The module's own gate (act(gate) * up, or a family's variant), run
        # on a parameterless copy of it (its attributes, not its weights).
        bare = copy.copy(module)
        bare._parameters = {}
        self.apply_gate = functools.partial(type(module)._apply_gate, bare)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        rows = hidden_states.reshape(-1, hidden_states.shape[-1])
        routing = dense_weights(rows.shape[0], self.num_experts, top_k_index, top_k_weights)
        gate_up, down = getattr(self, self.gate_up), getattr(self, self.down)
        out = torch.zeros_like(rows)
        for e in range(self.num_experts):  # in order, as the original adds its routed experts
            y = self.linear_out(self.apply_gate(self.linear_in(rows, gate_up[e])), down[e])
            out = out + y * routing[:, e, None].to(y.dtype)
        return out.reshape(*hidden_states.shape[:-1], out.shape[-1])


def routing_weights_arg(args: tuple, kwargs: dict):
    """Where an experts call's routing weights are: (args index or kwarg name)."""
    if len(args) >= 3:
        return 2
    return "top_k_weights" if "top_k_weights" in kwargs else "routing_weights"
