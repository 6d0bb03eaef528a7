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
  * 2d, 2.5d, 3d: every expert runs on every row this rank holds, as ONE
    product of the mode's own Linear (SUMMA, the 3d cube) over all experts'
    gate/up shards stacked along the output features, each expert's gate,
    the dense routing weights (zero where a row was not routed) applied,
    then ONE product over all experts' down shards stacked along the input
    features, which sums the experts inside the matmul: two products'
    collectives whatever the expert count, where a product per expert
    issued E times as many. Dense because the mode's collectives must run
    in lockstep over ranks holding different rows, which route
    differently. Exact (a product with 0 adds 0; routing_e * (a_e D_e^T) =
    (routing_e * a_e) D_e^T), at E/k times the routed compute. 3d's cube
    returns the first product in the flipped layout, other rows than the
    routing weights' (rows (i, l), not (i, j)): the mode brings the
    (rows, E) routing weights there first (ParallelMode.rows_like_output:
    3d one small gather; the others hold the same rows, nothing).

Expert parallelism (experts placed on data-parallel ranks) is not done:
every tensor-parallel group holds every expert.
"""

from __future__ import annotations

import copy
import functools
import itertools
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn

from tpctl.parallel.roles.fused import FusedLayout, ProbeError

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


def expert_count(module: nn.Module) -> Optional[int]:
    """The experts of an experts module: its 3-d parameters' first dimension."""
    three = [p for p in module.parameters(recurse=False) if p.dim() == 3]
    return three[0].shape[0] if three else None


def dense_weights(rows: int, experts: int, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The (rows, experts) routing matrix: each row's top-k weights at its
    experts, zero elsewhere (an index equal to `experts` marks no expert)."""
    index, weights = index.reshape(rows, -1), weights.reshape(rows, -1)
    full = torch.zeros(rows, experts + 1, dtype=weights.dtype, device=weights.device)
    return full.scatter(1, index, weights)[:, :experts]


class DenseExperts(nn.Module):
    """An experts module whose every expert runs on every row through the
    mode's Linear layers (`linear_in`, `linear_out`: (x, weight) -> y),
    weighted by the dense routing matrix: all experts in one gate/up
    product and one down product. `rows_like` brings a per-row tensor held
    in the input's rows to those `linear_in`'s output holds. Holds this
    rank's shards under the original parameter names."""

    def __init__(self, module: nn.Module, gate_up: str, down: str, weights: dict[str, nn.Parameter],
                 linear_in: Callable, linear_out: Callable, rows_like: Callable = lambda t: t):
        super().__init__()
        self.gate_up, self.down = gate_up, down
        for name, p in weights.items():
            self.register_parameter(name, p)
        self.num_experts = getattr(module, gate_up).shape[0]
        self.linear_in, self.linear_out, self.rows_like = linear_in, linear_out, rows_like
        # The module's own gate (act(gate) * up, or a family's variant), run
        # on a parameterless copy of it (its attributes, not its weights).
        bare = copy.copy(module)
        bare._parameters = {}
        self.apply_gate = functools.partial(type(module)._apply_gate, bare)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        rows = hidden_states.reshape(-1, hidden_states.shape[-1])
        routing = dense_weights(rows.shape[0], self.num_experts, top_k_index, top_k_weights)
        gate_up, down = getattr(self, self.gate_up), getattr(self, self.down)
        experts, parts = gate_up.shape[:2]
        # One product over every expert's gate/up shard stacked along the
        # output features: a mode's product acts on local shards of one
        # shape on every rank, so the stack is the shard of a stacked weight.
        y = self.linear_in(rows, gate_up.reshape(experts * parts, -1))
        # Its output holds `blocks` such shards gathered along the output
        # features in rank order (3d's cube gathers q over i, SUMMA none),
        # each stacked by expert: each expert's pieces put together again,
        # in the order its own product gives them, for its gate.
        n, blocks = y.shape[0], y.shape[-1] // (experts * parts)
        a = self.apply_gate(y.reshape(n, blocks, experts, parts).transpose(1, 2).reshape(n, experts, blocks * parts))
        # The routing weights in the rows `a` holds (3d's cube returned it
        # in other rows than its input's), in its dtype (what the product
        # multiplies: a smaller gather under autocast), applied
        # before the down product (linear), then one product over every
        # expert's down shard stacked along the input features, expert by
        # expert as `a` is: it sums the experts inside the matmul.
        routing = self.rows_like(routing.to(a.dtype))
        a = (a * routing[:, :, None]).reshape(n, -1)
        out = self.linear_out(a, down.transpose(0, 1).reshape(down.shape[1], -1)).to(rows.dtype)  # as the sum's
        return out.reshape(*hidden_states.shape[:-1], out.shape[-1])


def routing_weights_arg(args: tuple, kwargs: dict):
    """Where an experts call's routing weights are: (args index or kwarg
    name), or None where the call has none (Llama 4's experts are fed every
    row already scaled by its score)."""
    if len(args) >= 3:
        return 2
    return next((k for k in ("top_k_weights", "routing_weights") if k in kwargs), None)


def rows_per_row(args, kwargs: dict, hidden: Optional[int], tokens: int) -> int:
    """Rows an experts call computes per row of the stream (`tokens` rows
    traced): 1 where it is fed the stream's rows (routing inside it); the
    expert count where every row is fed to every expert (Llama 4's dense
    experts): what its collectives carry per stream row."""
    x = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(x, torch.Tensor) or not hidden or not tokens:
        return 1
    return max(1, x.numel() // hidden // tokens)


def routed_per_row(args, kwargs: dict, hidden: Optional[int]) -> int:
    """Routing weights per row (the top-k) of an experts call: of its
    routing weights' elements, one row's share of the hidden states'
    (0 where the call has none)."""
    x = args[0] if args else kwargs.get("hidden_states")
    at = routing_weights_arg(tuple(args), kwargs)
    weights = args[at] if isinstance(at, int) else kwargs.get(at)
    if not all(isinstance(t, torch.Tensor) for t in (x, weights)) or not hidden or not x.numel():
        return 0
    return weights.numel() * hidden // x.numel()


# ---- transformers' experts implementations -----------------------------------

def run_eager(module: nn.Module) -> nn.Module:
    """`module`, an experts module dispatching on transformers'
    `config._experts_implementation` (use_experts_implementation; default
    "grouped_mm"), run by its eager forward from now on: a config of its own
    says so, the model's other modules keep theirs. A no-op for any other."""
    config = getattr(module, "config", None)
    if getattr(config, "_experts_implementation", None) in (None, "eager"):
        return module
    config = copy.copy(config)
    if "_experts_implementation_internal" in vars(config):  # (not the setter: it would set shared sub-configs)
        vars(config)["_experts_implementation_internal"] = "eager"
    else:
        config._experts_implementation = "eager"
    module.config = config
    return module


def eager_where_misaligned(module: nn.Module) -> nn.Module:
    """A rank's experts module (its shards), run by its eager forward where
    grouped_mm's kernels would refuse them: they read every operand with
    strides of a multiple of 16 bytes, which the whole experts' widths may
    give and a shard's (inner / shards: fp32 widths not a multiple of 4) not
    ("strides should be multiple of 16 bytes"). Eager computes the same
    function (a loop over the experts hit), so training stays mode=none's up
    to round-off, where refusing would leave the layout to the user."""
    misaligned = any(p.dim() == 3 and any(w * p.element_size() % 16 for w in p.shape[1:]) for p in module.parameters())
    return run_eager(module) if misaligned else module


# ---- experts in a model's own module, run by its own forward ------------------

def holds_experts(module: nn.Module) -> bool:
    """A module holding expert weights as raw parameters (no Linear inside),
    at least two, each of two or more dimensions: DBRX's (experts x inner,
    hidden) matrices in a module of their own, Llama 4's (experts, hidden,
    2 x inner). Whether it is one is then measured (`own_split`).

    A module composing two holders of parameters (a router holding a raw
    (experts x hidden) weight beside an experts module, as transformers 5
    builds a MoE block) is not one: its experts are its child's."""
    params = list(module.parameters())
    holders = [c for c in module.children() if any(True for _ in c.parameters())]
    return len(params) >= 2 and all(p.dim() >= 2 for p in params) and len(holders) <= 1 \
        and not any(isinstance(m, (nn.Linear, nn.Embedding)) for m in module.modules())


# The "dimension" of a parameter an experts module's shards hold whole, each
# scaled by 1/shards in their forward: a term added once to each expert's
# output (the down projection's bias), which the sum of S partial outputs
# would otherwise count S times.
WHOLE = -1


@dataclass(frozen=True)
class OwnSplit:
    """How an experts module run by its own forward splits: per parameter
    (name inside the module), the dimension holding the inner features and
    how it is laid out (`groups` experts, each `parts` parts of `inner`
    features: [gate; up]; or WHOLE), and the integer attributes holding the
    inner width (module path, attribute), set to a shard's. A shard holds
    block s of S of every part of every expert, in order."""

    dims: tuple[tuple[str, int, int, int], ...]  # (parameter, dim, groups, parts; -2: interleaved pairs)
    inner: int
    attrs: tuple[tuple[str, str], ...]

    def whole(self) -> tuple[str, ...]:
        """The parameters every shard holds whole, scaled by 1/shards."""
        return tuple(name for name, dim, _, _ in self.dims if dim == WHOLE)

    def ranges(self, name: str, shards: int, s: int):
        _, dim, groups, parts = next(d for d in self.dims if d[0] == name)
        step = self.inner // shards
        if parts < 0:  # each inner feature's -parts entries side by side ([gate0, up0, gate1, up1, ...])
            k = -parts
            return dim, tuple((u * self.inner * k + s * step * k, u * self.inner * k + (s + 1) * step * k)
                              for u in range(groups))
        return dim, tuple((u * self.inner + s * step, u * self.inner + (s + 1) * step) for u in range(groups * parts))

    def split_problem(self, shards: int, blocks: Optional[int] = None) -> Optional[str]:
        if self.inner % shards:
            return f"{self.inner} inner features of each expert do not split {shards} ways"
        return None

    def shares(self, shards: int) -> bool:
        return False

    def describe(self) -> str:
        return f"own forward, {self.inner} inner features an expert: " + \
            ", ".join(f"{n} whole (1/shards each)" if d == WHOLE else
                      f"{n} dim {d} ({g} x {-p} interleaved)" if p < 0 else f"{n} dim {d} ({g} x {p})"
                      for n, d, g, p in self.dims)


def _candidates(shape: tuple, hidden: int, counts: set[int]):
    """(dim, groups, parts, inner) a parameter's inner features may lie in."""
    for dim, size in enumerate(shape):
        if dim == 0 and len(shape) == 3 or size == hidden and len(shape) == 2 and dim == 1:
            continue  # (the experts' own dimension; a 2-d matrix's hidden side)
        for groups in sorted({1} | {c for c in counts if len(shape) == 2 and dim == 0}):
            for parts in (1, 2, -2):  # -2: gate and up interleaved, feature by feature
                if size % (groups * abs(parts)) == 0 and size // (groups * abs(parts)) > 1:
                    yield dim, groups, parts, size // (groups * abs(parts))


def _run_shard(clone: nn.Module, split: OwnSplit, shards: int, s: int, args, kwargs):
    shard = copy.deepcopy(clone)
    for name, p in list(shard.named_parameters()):
        owner, _, leaf = name.rpartition(".")
        if name in split.whole():
            piece = p / shards
        else:
            dim, ranges = split.ranges(name, shards, s)
            piece = torch.cat([p.narrow(dim, a, b - a) for a, b in ranges], dim)
        setattr(shard.get_submodule(owner), leaf, nn.Parameter(piece, requires_grad=False))
    for owner, attr in split.attrs:
        setattr(shard.get_submodule(owner), attr, split.inner // shards)
    return shard(*args, **kwargs)


def own_split(module: nn.Module, args, kwargs, hidden: int, tokens: int) -> OwnSplit:
    """The split of an experts module run by its own forward, measured: of
    the layouts its parameters' shapes allow, the first whose two shards'
    outputs, on the module's traced call with random weights and input, sum
    to the whole module's (each expert's MLP is a sum over its inner
    features). `tokens`: the stream's rows in the traced forward.
    ProbeError if none does."""
    from tpctl.parallel.roles.fused import real_copy

    # An experts call holds routing indices among its arguments, or is fed
    # more rows than the stream holds (Llama 4's: every row to every expert,
    # scaled by its score); a router (Ernie 4.5's, holding statistics beside
    # its weight) is fed the stream's rows and no indices.
    if not any(isinstance(a, torch.Tensor) and not a.is_floating_point() for a in [*args, *kwargs.values()]) \
            and rows_per_row(args, kwargs, hidden, tokens) == 1:
        raise ProbeError("no routing indices among its arguments, nor more rows than the stream's")
    params = dict(module.named_parameters())
    counts = {v for m in module.modules() for v in vars(m).values()
              if isinstance(v, int) and not isinstance(v, bool) and v > 1}
    # Each parameter split by the inner features, or (last: a bias added
    # once per expert's output) held whole and scaled by 1/shards.
    options = [[(name, *c) for c in _candidates(tuple(p.shape), hidden, counts)] + [(name, WHOLE, 1, 1, None)]
               for name, p in params.items()]
    # Measured by the module's eager forward whatever the implementation
    # configured: the split is the function's, and grouped_mm's kernels
    # refuse a shard whose width gives strides of no multiple of 16 bytes.
    clone = run_eager(real_copy(module))
    gen = torch.Generator().manual_seed(4)
    args = [torch.randn(a.shape, generator=gen, dtype=torch.float32).to(a.dtype) if i == 0 else a
            for i, a in enumerate(args)]

    def one_inner(combo) -> bool:  # every split parameter by the same (even) inner width
        inner = {c[4] for c in combo} - {None}
        return len(inner) == 1 and not next(iter(inner)) % 2

    with torch.no_grad():
        whole = clone(*args, **kwargs)
        for combo in itertools.islice(filter(one_inner, itertools.product(*options)), 256):
            inner = next(c[4] for c in combo if c[4] is not None)
            split = OwnSplit(tuple(c[:4] for c in combo), inner,
                             tuple((n, a) for n, m in clone.named_modules() for a, v in vars(m).items()
                                   if v == inner and isinstance(v, int) and not isinstance(v, bool)))
            try:
                parts = [_run_shard(clone, split, 2, s, args, kwargs) for s in range(2)]
            except Exception:  # the module's forward does not run on this split: not it
                continue
            # Round-off is relative to the output's scale (a sum of large
            # terms may cancel near 0); a wrong split is off by O(1) of it.
            if all(isinstance(t, torch.Tensor) and t.shape == whole.shape for t in parts) \
                    and (parts[0] + parts[1] - whole).abs().max() <= 1e-5 * whole.abs().max():
                return split
    raise ProbeError(f"{type(module).__name__}: no split of its parameters by an expert's inner features "
                     f"({', '.join(f'{n} {tuple(p.shape)}' for n, p in params.items())}) reproduces its output")
