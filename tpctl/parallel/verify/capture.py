"""What the start-up check (parallel/verify/proof.py) takes of a model: before
the rewrite, the distinct modules and blocks to check, a copy of one
instance of each, and the two stages around the stack; in either forward,
each unit's real call arguments.

A module's or block's real call arguments are captured with a forward
pre-hook twice: in the original model's forward (parameters stood in for as
in the roles tracer, so nothing is materialised) and in the rewritten
model's forward on this rank's share of the same token ids. The replay
(parallel/verify/compare.py) keeps every argument but the first tensor
(hidden states, token ids), so attention masks, position ids and rotary
tables reach the layer as training gives them.

"Distinct" means same class, same printed configuration (shapes, eps, ...)
and the same extra call arguments (a layer given another attention mask is
checked on its own).
"""

from __future__ import annotations

import copy
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from tpctl.parallel.roles.mixers import MixerSplit
from tpctl.parallel.roles.plan import RolePlan, logits_of, named_stack
from tpctl.parallel.roles.probes import CacheOff
from tpctl.parallel.roles.tracing import trace

SEED = 1234  # of the random inputs, the same on every rank
SKIPPED_ROLES = ("dropout", "attn_dropout")  # identity in eval: nothing to compare
# A unit no instance of which this rank's pipeline stage holds: another
# stage checks it (the ranks agree on every unit's verdict).
ELSEWHERE = "held by another pipeline stage"
# Checked in their block only: a mixture of experts' router and experts take
# routing decisions and weights, which only real rows make (a module check
# feeds every row one vector).
# A latent attention's pieces and elementwise modules compute on activations
# a module check does not make (whole latent rows; a split activation):
# their block checks them.
# A per-head reduction reads a projection's heads, which a module check does not make.
BLOCK_ONLY_ROLES = ("experts", "router", "latent", "latent_norm", "latent_up", "elementwise", "split_elementwise",
                    "head_reduce")
# fp32 round-off: a reordered sum of k terms is off by about sqrt(k) * 6e-8
# of its scale (k = the widths summed over, up to ~1e4 here: ~1e-5 at worst,
# ~1e-6 typical), while every layout or semantics error seen so far moves a
# block's output by 1e-2 to 1e0 of its scale. 1e-4 of the scale sits between
# the two with room on both sides.
TOLERANCE = 1e-4


@dataclass
class Check:
    """One distinct module or block, or a stage, and what its check found."""

    kind: str  # "module", "block" or "stage"
    name: str  # the instance checked
    cls: str  # the original's class
    role: str  # the module's role ("" for a block)
    instances: list[str]  # every module or block sharing its key
    diff: float = 0.0  # worst relative difference, over ranks
    what: str = ""  # which tensor it was in
    note: str = ""  # why it was not checked, or what failed
    # The original's parameters this rank's rewritten instance holds no
    # counterpart of (by name); a name missing on every rank is a failure.
    missing: tuple[str, ...] = ()

    @property
    def failed(self) -> bool:
        return not self.diff <= TOLERANCE  # NaN fails too


class CannotVerify(Exception):
    """A unit the check cannot run as it is (no tensor argument, an output
    holding none, a layout it has no rule for): refused with the reason,
    never passed unchecked."""


@dataclass
class Unit:
    check: Check
    original: nn.Module  # a copy of the original, parameters possibly on meta
    origin: dict[int, torch.Tensor]  # id(copied parameter) -> the model's own (what the parameter source knows)
    full_call: tuple  # (args, kwargs) of its first call in the original's forward


@dataclass
class Originals:
    """What the check needs of the original model, taken before the rewrite."""

    units: list[Unit]
    ids: torch.Tensor  # the token ids both forwards ran on
    source: Any  # the model's parameter source (models.init), or None: real parameters
    skipped: list[Check] = field(default_factory=list)
    stages: list["Stage"] = field(default_factory=list)
    stage_bytes: int = 0  # the parameters outside the stack, made whole for the stages


@dataclass
class Stage:
    """The model's own forward between the model's input and its first
    block (the embedding stage), or between its last block and the logits
    (the head): top-level modules plus whatever arithmetic the model's
    forward does around them (a scale, a cast, a logit multiplier)."""

    check: Check
    block: str  # the first block (its input is the stage's output) or the last (its output, the stage's input)
    stream: Optional[torch.Tensor] = None  # the head: the random residual stream fed in
    expected: Optional[torch.Tensor] = None  # the original's whole output: first block's input, or logits


def batch_shape(geo) -> tuple[int, int]:
    """(sequences, length) of the check's batch: every split of any mode
    divides it (rows by up to `size`, the sequence by size in 1d + SP)."""
    size = max(1, geo.size)
    return size, size * max(1, math.ceil(4 / size))


def capture_originals(model: nn.Module, plan: RolePlan, mode, holds: Optional[Callable[[str], bool]] = None) -> Originals:
    """Before the rewrite: the distinct modules and blocks to check, a copy
    of one instance of each, and their real call arguments (one forward of
    the original with stand-in parameters). `holds(name)`: whether this
    rank's pipeline stage holds a module (the instance copied is one it
    holds; a unit it holds none of is left to another stage)."""
    holds = holds or (lambda name: True)
    # Per-head norms kept in a list, or holding one weight row per head, run
    # as written on a rank's own heads: their block checks them.
    lists = tuple(f"{name}." for name in getattr(plan, "head_lists", {}))
    # A mixer split by heads (roles/mixers.py) recurs over the sequence: a
    # module check's equal rows say nothing of it; its block checks it.
    mixers = {n for n, layout in getattr(plan, "layouts", {}).items() if isinstance(layout, MixerSplit)}
    names = [n for n, role in plan.roles.items() if role not in SKIPPED_ROLES + BLOCK_ONLY_ROLES
             and not (lists and n.startswith(lists)) and n not in getattr(plan, "head_rows", {}) and n not in mixers]
    blocks = _block_names(model)
    targets = {n: model.get_submodule(n) for n in dict.fromkeys(names + blocks)}
    calls = capture_calls(targets, lambda: _trace_forward(model, mode))
    units: list[Unit] = []
    by_key: dict[tuple, Unit] = {}
    skipped = []
    for name in names + blocks:
        kind, role = ("block", "") if name in blocks and name not in plan.roles else ("module", plan.roles[name])
        module = targets[name]
        if name not in calls:
            skipped.append(Check(kind, name, type(module).__name__, role, [name], note="never called in the forward"))
            continue
        key = (kind, role, type(module).__qualname__, repr(module), _fingerprint(calls[name]))
        unit = by_key.get(key)
        if unit is None:
            unit = by_key[key] = Unit(Check(kind, name, type(module).__name__, role, [], note=ELSEWHERE), None, {}, ())
            units.append(unit)
        unit.check.instances.append(name)
        if unit.original is None and holds(name):  # the first instance this rank holds: the one it checks
            own = dict(module.named_parameters(remove_duplicate=False))
            clone = copy.deepcopy(module)
            unit.origin = {id(p): own[n] for n, p in clone.named_parameters(remove_duplicate=False)}
            unit.original, unit.full_call = clone, calls[name]
            unit.check.name, unit.check.note = name, ""
    source = getattr(model, "tpctl_init", None)
    stages = _capture_stages(model, mode, plan, blocks, calls, source) if blocks else []
    for stage, block in zip(stages, (blocks[:1], blocks[-1:])):
        if not holds(block[0]):  # the embedding on the first stage, the head on the last
            stage.check.note = ELSEWHERE
    stack = tuple(b + "." for b in blocks)
    stage_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if not n.startswith(stack)) if stages else 0
    return Originals(units, _check_ids(model, mode), source, skipped, stages, stage_bytes)


def _capture_stages(model, mode, plan, blocks: list[str], calls: dict, source) -> list[Stage]:
    """The original's embedding stage and head, in one forward with every
    parameter outside the stack made whole (the blocks' stood in for): the
    first block's input, and the logits when the last block puts out a
    random residual stream."""
    if blocks[0] not in calls or blocks[-1] not in calls:
        return []
    name = type(model).__name__
    embedding = Stage(Check("stage", "embedding", name, "", [f"<input> -> {blocks[0]}"]), blocks[0])
    head = Stage(Check("stage", "head", name, "", [f"{blocks[-1]} -> <logits>"]), blocks[-1])
    head.stream = torch.randn(tuple(first_tensor(calls[blocks[-1]]).shape), generator=torch.Generator().manual_seed(SEED + 4))
    stack = tuple(b + "." for b in blocks)
    outside = [m for n, m in model.named_modules() if n not in blocks and not n.startswith(stack)]
    logits: list = []
    hooks = [model.get_submodule(blocks[-1]).register_forward_hook(lambda m, a, out: with_first(out, head.stream)),
             model.register_forward_hook(lambda m, a, out: logits.append(logits_of(out).detach().clone()))]
    try:
        with _whole_params(outside, source):
            first = capture_calls({blocks[0]: model.get_submodule(blocks[0])}, lambda: _trace_forward(model, mode))
    finally:
        for h in hooks:
            h.remove()
    embedding.expected, head.expected = first_tensor(first[blocks[0]]).clone(), logits[0]
    return [embedding, head]


@contextmanager
def _whole_params(modules: list[nn.Module], source):
    """The meta parameters of `modules` made whole (values from the
    parameter source) for the duration; stood in for again after."""
    saved, made = [], {}
    for module in modules:
        for attr, p in list(module._parameters.items()):
            if p is not None and p.is_meta and source is not None:
                saved.append((module, attr, p))
                if id(p) not in made:  # a tied parameter: made once
                    made[id(p)] = nn.Parameter(source.full(p), requires_grad=False)
                module._parameters[attr] = made[id(p)]
    try:
        yield
    finally:
        for module, attr, p in saved:
            module._parameters[attr] = p


def with_first(out, x: torch.Tensor):
    """A module's output with its first tensor replaced by `x`."""
    if isinstance(out, torch.Tensor):
        return x.to(device=out.device, dtype=out.dtype)
    if isinstance(out, (tuple, list)) and out:
        return type(out)([with_first(out[0], x), *out[1:]])
    raise CannotVerify(f"a block returning {type(out).__name__}")


def _block_names(model: nn.Module) -> list[str]:
    """Paths of the blocks of the model's repeated stack (none if it has none)."""
    found = named_stack(model)
    if found is None:
        return []
    prefix, stack = found
    return [f"{prefix}.{i}" if prefix else str(i) for i in stack._modules]  # (a pipeline stage keeps whole-model indices)


def freeze(value):
    """A copy of call arguments as they were at the call: caches and other
    objects the forward goes on to mutate are copied too."""
    try:
        return copy.deepcopy(value)
    except Exception:  # an argument that cannot be copied: keep it as it is
        return value


def capture_calls(targets: dict[str, nn.Module], run: Callable[[], Any]) -> dict[str, tuple]:
    """{name: (args, kwargs)} of each target's first call during `run()`,
    as its forward receives them (after any pre-hook the rewrite added)."""
    calls: dict[str, tuple] = {}  # in the order of the first calls
    handles = []
    for name, module in targets.items():
        def capture(mod, args, kwargs, name=name):
            if name not in calls:
                calls[name] = freeze((args, kwargs))
        handles.append(module.register_forward_pre_hook(capture, with_kwargs=True))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return calls


def _check_ids(model: nn.Module, mode) -> torch.Tensor:
    batch, seq = batch_shape(mode.geo)
    vocab = min((m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)), default=2)
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(SEED))


def _trace_forward(model: nn.Module, mode) -> None:
    """The original's forward on the check's ids, parameters stood in for."""
    ids = _check_ids(model, mode)
    trace(model, ids=ids)


def eval_forward(model: nn.Module, ids: torch.Tensor, pipeline=None, stream=None) -> None:
    """The rewritten model's forward (a pipeline stage: each of its chunks,
    fed `stream` where a previous stage would send one)."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), CacheOff(model):
            if pipeline is None:
                model(ids)
            for chunk in pipeline.chunks if pipeline is not None else ():
                pipeline.forward_chunk(chunk, None if chunk.first else stream, ids)
    finally:
        model.train(was_training)


def local_rows(mode, full: torch.Tensor) -> torch.Tensor:
    """This rank's model input of a batch, as training feeds it (the
    tensor-parallel group's rows; data-parallel replicas check the same)."""
    index, count = mode.read_block()
    return mode.split_input(full.chunk(count, 0)[index])


def _fingerprint(call: tuple) -> tuple:
    """What tells two calls apart, beyond their first tensor (hidden states
    or ids, replaced in the check): the other arguments' shapes and values."""
    args, kwargs = call
    first = first_tensor_path(call)

    def fp(value, path):
        if path == first:
            return "x"
        if isinstance(value, torch.Tensor):
            v = value.detach().double()
            return (tuple(value.shape), str(value.dtype), round(v.sum().item(), 6), round(v.abs().sum().item(), 6))
        if isinstance(value, (list, tuple)):
            return tuple(fp(v, path + (i,)) for i, v in enumerate(value))
        if isinstance(value, dict):
            return tuple((k, fp(v, path + (k,))) for k, v in value.items())
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        return type(value).__name__

    return fp(args, ("args",)), fp(kwargs, ("kwargs",))


def first_tensor_path(call: tuple, ids: bool = False) -> Optional[tuple]:
    """Where the call's first tensor is (with `ids`: its first integer
    tensor, what a table lookup indexes with: OPT's position table takes a
    float mask first and the position ids as a keyword)."""
    args, kwargs = call
    for path, value in [(("args", i), a) for i, a in enumerate(args)] + [(("kwargs", k), v) for k, v in kwargs.items()]:
        if isinstance(value, torch.Tensor) and not (ids and value.is_floating_point()):
            return path
    return None


def first_tensor(call: tuple, ids: bool = False) -> torch.Tensor:
    path = first_tensor_path(call, ids)
    if path is None:
        raise CannotVerify(f"its call has no {'integer ' if ids else ''}tensor argument")
    return call[0][path[1]] if path[0] == "args" else call[1][path[1]]
