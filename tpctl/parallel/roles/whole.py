"""Modules run whole: a module tpctl has no split for (a state-space or
linear-attention mixer, a recurrence, a convolution over the sequence, a
norm over an MLP's inner width, an elementwise module with per-feature
parameters) is run as written, on every rank, on whole hidden vectors of the
rows that rank holds, when it sits on the residual stream: it reads the
stream and its output has the stream's shape.

That is exact in every mode for the same reason a router is: each rank
gathers its rows' hidden features over the ranks holding the others, runs
the module's own forward on them with its parameters whole, and keeps its
own block of the output; the gather's backward sums the input gradients of
every rank that ran it, and each rank's parameter gradient is the part of
its rows and its output block, summed over the tensor-parallel group. What
it costs: the module's parameters and compute are not divided.

Except for mixers: one declaring transformers' Mamba-2 layout (heads,
groups of heads, in_proj to [z | x | B | C | dt], ...), the gated delta
rule's (key heads, value heads, in_proj_qkvz / in_proj_ba grouped per key
head, ...), Mamba-1's (inner channels, x_proj, dt_proj, ...) or
RecurrentGemma's recurrent block (the RG-LRU's heads) gets,
beside its role `whole`, a measured split as its layout (roles/mixers.py,
as Megatron-Core splits them): the ranks holding a row (1d's group, 2d's
q) hold whole heads and groups (Mamba-1: a block of channels, x_proj's
partial product summed among them) and sum out_proj's partial outputs. A
mixer whose split does not reproduce its output, or does not divide (one
group of heads or key head; groups, key heads or channels not a multiple
of the ranks splitting them), runs whole, its reason kept with why it runs
whole (`tpctl inspect` shows both).

Found after the other roles (inference.infer_plan): for every module with a
problem, the innermost module holding it (itself included) that sits on the
stream, inside a block of the model's stack or outside the stack (a block
itself, or the stack, is never run whole: sequence parallelism and pipeline
stages cut there). Outside it: BERT's LM head's transform (a dense Linear
hidden -> hidden, an activation, a LayerNorm) between the last block and
the decoder: its dense pairs with no Linear, so it runs whole (its
LayerNorm is a norm on the stream), exactly as inside a block, on the
last pipeline stage.
Everything under it loses its role and its problem; it gets role `whole`.
"""

from __future__ import annotations

import torch.nn as nn

from tpctl.parallel.roles.fused import ProbeError
from tpctl.parallel.roles.mixers import is_mixer, mixer_split
from tpctl.parallel.roles.plan import named_stack


def under(name: str, root: str) -> bool:
    return name == root or name.startswith(root + ".")


def whole_roots(found) -> dict[str, str]:
    """{module run whole: why (its first problem)} for the problems of
    `found` (inference._Inference) that a module on the stream holds."""
    modules, flows, hidden = found.modules, found.flows, found.hidden
    if hidden is None:
        return {}
    stack = named_stack(found.model)
    stack_name = stack[0] if stack is not None else None
    blocks = {f"{stack_name}.{k}" for k in stack[1]._modules} if stack is not None else set()
    # Split activations: inside attention, or an MLP's hidden features.
    inner = found.inner

    def on_stream(name: str) -> bool:
        flow = flows.get(name)
        if not name or flow is None or name in blocks or (stack_name is not None and under(stack_name, name)):
            return False
        # (an output of the input's rows flattened, [rows * seq, hidden], is the stream too: Llama 4's MoE)
        return len(flow.shape) == 3 and flow.shape[-1] == hidden and not (flow.inputs & inner) \
            and (flow.out == flow.shape or flow.out == (flow.shape[0] * flow.shape[1], hidden))

    roots: dict[str, str] = {}
    # A layer of a type tpctl has no rule for says most of why (the Linears
    # around it fit no pattern because of it): its problem first.
    for name, reason in sorted(found.problems.items(), key=lambda item: not fundamental(item[1])):
        if name not in modules:
            continue
        parts = name.split(".")
        root = next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if on_stream(".".join(parts[:i]))), None)
        if root is not None:
            roots.setdefault(root, f"{name}: {reason}")
    # The outermost of nested ones.
    return {r: why for r, why in roots.items() if not any(o != r and under(r, o) for o in roots)}


def untrained_modules(found) -> frozenset:
    """Modules inside an attention that hold parameters and return indices
    only (no floating-point tensor: DeepSeek's sparse-attention indexer, its
    top-k positions): no gradient reaches their parameters, in mode=none
    either, so they run as written, whole, on whole rows of their
    attention's rows (role `untrained`). The outermost of nested ones."""
    names = {name for name, flow in found.flows.items()
             if name and flow.floating is False and flow.shape
             and any(True for _ in found.modules[name].parameters())
             and any(under(name, owner) and name != owner for owner in found.heads)}
    return frozenset(n for n in names if not any(o != n and under(n, o) for o in names))


def fundamental(reason: str) -> bool:
    """Whether a problem is a module's own (a layer type with no rule, a
    module whose parameters its owner's forward reads directly), not the
    confusion such a module causes around it (a Linear fitting no pattern)."""
    return reason.startswith(("an unsupported layer type", "never called"))


def run_whole(found, roots: dict[str, str]) -> None:
    """Give each of `roots` the role `whole`: what is under it loses its
    role, its problem and its records; a unit or attention outside it that
    pairs with a Linear inside it is a problem (its partner runs whole)."""
    records = (found.roles, found.problems, found.heads, found.units, found.layouts, found.sources,
               found.head_lists, found.head_rows, found.widths, found.routed, found.expert_rows, found.stream_tensors)
    for root in roots:
        dropout = next((n for n, m in found.modules[root].named_modules()
                        if isinstance(m, nn.Dropout) and m.p > 0), None)
        outside = [(owner, members) for owner, members in found.units.items()
                   if not under(owner, root) and any(under(m, root) for m in members)]
        for record in records:
            for key in [k for k in record if under(k, root)]:
                del record[key]
        if dropout is not None:  # its draws would follow the rows a rank holds, not the whole batch's
            found.problems[root] = (f"runs whole (no split fits it) and holds a Dropout ({dropout}, p > 0): "
                                    "its draws would differ from mode=none's; set the model's dropout to 0")
            continue
        found.roles[root] = "whole"
        _split_heads(found, root, roots)
        for owner, members in outside:
            for member in members:
                if not under(member, root):
                    found.problems[member] = f"pairs with a Linear inside {root}, which runs whole"


def _split_heads(found, root: str, roots: dict[str, str]) -> None:
    """A mixer's measured split by heads (roles/mixers.py: Mamba-2's or the
    gated delta rule's) as its layout; where it has none, why not, after
    why it runs whole."""
    module = found.modules[root]
    if not is_mixer(module):
        return
    args, kwargs = found.first_inputs.get(root, ((), {}))
    shapes = tuple(tuple(p.shape) for p in module.parameters())
    split = found.probe((type(module), "mixer", shapes),
                        lambda: mixer_split(module, args, kwargs))
    if isinstance(split, ProbeError):
        roots[root] = f"{roots[root]}; not split by heads: {split}"
    else:
        found.layouts[root] = split
