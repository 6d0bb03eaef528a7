"""A rewrite that proves itself (`train.verify_rewrite`, on by default).

Before the first step, the rewritten model is run next to the original, one
piece at a time, on the same random input, forward and backward, at two levels:

  * every distinct replaced module (a Linear, an embedding, a norm, ... as
    the mode rewrote it) against its original;
  * every distinct block of the model's repeated stack (a decoder layer)
    against its original. Module checks alone cannot see the worst cases: a
    fused projection sliced [q|k|v] when its rows are interleaved per head
    computes its own rows exactly right; only the attention's output is wrong;
  * the two stages of the model's own forward around the stack, forward
    only: the embedding stage (ids to the first block's input) and the head
    (the last block's output to the logits), which see arithmetic no module
    holds (a scale, or a width read from a rewritten module).

"Distinct" means same class, same printed configuration (shapes, eps, ...)
and the same extra call arguments (a layer given another attention mask is
checked on its own). For each, ONE instance is materialised whole (with the
values training starts from: the model's parameter source makes the whole
tensor, the rank's shard is the slice of it), so the cost is one block's
memory and a few milliseconds of compute, never the whole model.

Inputs. A module's or block's real call arguments are captured with a
forward pre-hook twice: in the original model's forward (parameters stood in
for as in the roles tracer, so nothing is materialised) and in the rewritten
model's forward on this rank's share of the same token ids. The replay keeps
every argument but the first tensor (hidden states, token ids), so attention
masks, position ids and rotary tables reach the layer as training gives them.

  * Blocks take the residual stream: the full random input X, and on this
    rank `mode.shard_hidden` of its rows, the layout training uses.
  * Modules compute row by row (a Linear, a norm, a lookup), so every row of
    their random input is the same vector: the rows a rank holds then do not
    matter, only the features, which its parameters' ShardSpecs name.
    Token-id inputs use one id per run, over a few ids that touch every
    vocabulary block (and the padding id, whose row must get no gradient).

Compared on each rank: the output, the input gradient and every parameter's
gradient (after summing partial gradients over their replicas), each against
this rank's slice of the original's; the worst difference relative to the
reference tensor's largest magnitude, agreed over all ranks with one
all-reduce. Above TOLERANCE the run is refused before step 1.
"""

from __future__ import annotations

import copy
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from . import comm
from .layers import CacheOff, is_norm, linearize, norm_width
from .roles import RolePlan, logits_of, repeated_blocks, resolve_plan, trace
from .shard import ShardSpec, spec_of
from tpctl.errors import EXIT_USAGE, TpctlError

# fp32 round-off: a reordered sum of k terms is off by about sqrt(k) * 6e-8
# of its scale (k = the widths summed over, up to ~1e4 here: ~1e-5 at worst,
# ~1e-6 typical), while every layout or semantics error seen so far moves a
# block's output by 1e-2 to 1e0 of its scale. 1e-4 of the scale sits between
# the two with room on both sides.
TOLERANCE = 1e-4
SEED = 1234  # of the random inputs, the same on every rank
SKIPPED_ROLES = ("dropout", "attn_dropout")  # identity in eval: nothing to compare
# Checked in their block only: a mixture of experts' router and experts take
# routing decisions and weights, which only real rows make (a module check
# feeds every row one vector).
BLOCK_ONLY_ROLES = ("experts", "router")


class RewriteRefused(TpctlError):
    """The rewritten model differs from the original: refuse to train.
    str() is the one-line verdict; `report` holds every check."""

    exit_code = EXIT_USAGE

    def __init__(self, line: str, report: Optional["Report"] = None):
        super().__init__(line)
        self.report = report


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

    @property
    def failed(self) -> bool:
        return not self.diff <= TOLERANCE  # NaN fails too


@dataclass
class Report:
    checks: list[Check]
    seconds: float
    # The most held whole at once: a unit's parameters and gradients, or the
    # parameters outside the stack (for the stages).
    peak_extra_bytes: int = 0

    @property
    def failure(self) -> Optional[Check]:
        """The check a refusal names: the most specific that failed (a broken
        module also breaks its block and the stage it sits in)."""
        failed = [c for c in self.checks if c.failed]
        return min(failed, key=lambda c: ("module", "block", "stage").index(c.kind)) if failed else None

    def line(self, mode) -> str:
        """The one-line verdict (a refusal, or the start-up summary)."""
        where = f"mode={mode.name} size={mode.geo.size}"
        bad = self.failure
        if bad is not None and math.isinf(bad.diff) and bad.note:  # it could not run: say why
            return (f"the rewrite for {where} could not be verified: {bad.kind} {bad.name} ({bad.cls}): {bad.note}; "
                    f"refusing to train (train.verify_rewrite=false skips this check)")
        if bad is not None:
            what = f" in {bad.what}" if bad.what else ""
            return (f"the rewrite for {where} is not the original model: {bad.kind} {bad.name} ({bad.cls}) differs "
                    f"by {bad.diff:.2e} of its scale{what} (fp32 round-off is below {TOLERANCE:g}); "
                    f"refusing to train (train.verify_rewrite=false skips this check)")
        count = {kind: sum(c.kind == kind and not c.note for c in self.checks) for kind in ("module", "block", "stage")}
        worst = max((c.diff for c in self.checks if not c.note), default=0.0)
        return (f"verified the rewrite for {where}: {count['module']} distinct modules, {count['block']} distinct "
                f"blocks and {count['stage']} stages (embedding, head) match the original (worst {worst:.1e} of "
                f"scale) in {self.seconds:.2f}s; largest piece made whole {self.peak_extra_bytes / 2**20:.1f} MiB")


# ---- the flow -----------------------------------------------------------------

def parallelize_verified(model: nn.Module, mode, plan=None, verify: bool = True) -> tuple[nn.Module, Optional[Report]]:
    """`parallelize(model, mode, plan)`, moved to the mesh's device, and (if
    `verify`) proven against the original model: returns the model and the
    report; RewriteRefused (on every rank alike) when they differ."""
    from .base import as_mode, parallelize

    mode = as_mode(mode)
    if not verify or not mode.rewrites:  # mode none replaces nothing
        return parallelize(model, mode, plan).to(mode.mesh.device), None
    linearize(model)
    if not isinstance(plan, RolePlan):
        plan = resolve_plan(model, plan)
    start = time.perf_counter()
    originals = capture_originals(model, plan, mode)
    setup = time.perf_counter() - start
    model = parallelize(model, mode, plan).to(mode.mesh.device)
    report = verify_rewrite(model, mode, originals)
    report.seconds += setup
    if report.failure is not None:
        raise RewriteRefused(report.line(mode), report)
    return model, report


@dataclass
class _Unit:
    check: Check
    original: nn.Module  # a copy of the original, parameters possibly on meta
    origin: dict[int, torch.Tensor]  # id(copied parameter) -> the model's own (what the parameter source knows)
    full_call: tuple  # (args, kwargs) of its first call in the original's forward


@dataclass
class Originals:
    """What the check needs of the original model, taken before the rewrite."""

    units: list[_Unit]
    ids: torch.Tensor  # the token ids both forwards ran on
    source: Any  # the model's parameter source (models.init), or None: real parameters
    skipped: list[Check] = field(default_factory=list)
    stages: list["_Stage"] = field(default_factory=list)
    stage_bytes: int = 0  # the parameters outside the stack, made whole for the stages


@dataclass
class _Stage:
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


def capture_originals(model: nn.Module, plan: RolePlan, mode) -> Originals:
    """Before the rewrite: the distinct modules and blocks to check, a copy
    of one instance of each, and their real call arguments (one forward of
    the original with stand-in parameters)."""
    # Per-head norms kept in a list, or holding one weight row per head, run
    # as written on a rank's own heads: their block checks them.
    lists = tuple(f"{name}." for name in getattr(plan, "head_lists", {}))
    names = [n for n, role in plan.roles.items() if role not in SKIPPED_ROLES + BLOCK_ONLY_ROLES
             and not (lists and n.startswith(lists)) and n not in getattr(plan, "head_rows", {})]
    blocks = _block_names(model)
    targets = {n: model.get_submodule(n) for n in dict.fromkeys(names + blocks)}
    calls = _capture_calls(targets, lambda: _trace_forward(model, mode))
    units: list[_Unit] = []
    by_key: dict[tuple, _Unit] = {}
    skipped = []
    for name in names + blocks:
        kind, role = ("block", "") if name in blocks and name not in plan.roles else ("module", plan.roles[name])
        module = targets[name]
        if name not in calls:
            skipped.append(Check(kind, name, type(module).__name__, role, [name], note="never called in the forward"))
            continue
        key = (kind, role, type(module).__qualname__, repr(module), _fingerprint(calls[name]))
        if key in by_key:
            by_key[key].check.instances.append(name)
            continue
        own = dict(module.named_parameters(remove_duplicate=False))
        clone = copy.deepcopy(module)
        origin = {id(p): own[n] for n, p in clone.named_parameters(remove_duplicate=False)}
        unit = _Unit(Check(kind, name, type(module).__name__, role, [name]), clone, origin, calls[name])
        by_key[key] = unit
        units.append(unit)
    source = getattr(model, "tpctl_init", None)
    stages = _capture_stages(model, mode, plan, blocks, calls, source) if blocks else []
    stack = tuple(b + "." for b in blocks)
    stage_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if not n.startswith(stack)) if stages else 0
    return Originals(units, _check_ids(model, mode), source, skipped, stages, stage_bytes)


def _capture_stages(model, mode, plan, blocks: list[str], calls: dict, source) -> list[_Stage]:
    """The original's embedding stage and head, in one forward with every
    parameter outside the stack made whole (the blocks' stood in for): the
    first block's input, and the logits when the last block puts out a
    random residual stream."""
    if blocks[0] not in calls or blocks[-1] not in calls:
        return []
    name = type(model).__name__
    embedding = _Stage(Check("stage", "embedding", name, "", [f"<input> -> {blocks[0]}"]), blocks[0])
    head = _Stage(Check("stage", "head", name, "", [f"{blocks[-1]} -> <logits>"]), blocks[-1])
    head.stream = torch.randn(tuple(_first_tensor(calls[blocks[-1]]).shape), generator=torch.Generator().manual_seed(SEED + 4))
    stack = tuple(b + "." for b in blocks)
    outside = [m for n, m in model.named_modules() if n not in blocks and not n.startswith(stack)]
    logits: list = []
    hooks = [model.get_submodule(blocks[-1]).register_forward_hook(lambda m, a, out: _with_first(out, head.stream)),
             model.register_forward_hook(lambda m, a, out: logits.append(logits_of(out).detach().clone()))]
    try:
        with _whole_params(outside, source):
            first = _capture_calls({blocks[0]: model.get_submodule(blocks[0])}, lambda: _trace_forward(model, mode))
    finally:
        for h in hooks:
            h.remove()
    embedding.expected, head.expected = _first_tensor(first[blocks[0]]).clone(), logits[0]
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


def _with_first(out, x: torch.Tensor):
    """A module's output with its first tensor replaced by `x`."""
    if isinstance(out, torch.Tensor):
        return x.to(device=out.device, dtype=out.dtype)
    if isinstance(out, (tuple, list)) and out:
        return type(out)([_with_first(out[0], x), *out[1:]])
    raise _CannotVerify(f"a block returning {type(out).__name__}")


def verify_rewrite(model: nn.Module, mode, originals: Originals) -> Report:
    """Check every unit of `originals` against the rewritten `model` on this
    rank; every rank of the world must call it (collectives)."""
    start = time.perf_counter()
    units = originals.units
    local_ids = _local_rows(mode, originals.ids).to(mode.mesh.device)
    try:
        calls = _capture_calls({u.check.name: model.get_submodule(u.check.name) for u in units},
                               lambda: _eval_forward(model, local_ids))
    except (RuntimeError, ValueError, TypeError, IndexError) as e:  # alike on every rank: a shape error
        where = f"mode={mode.name} size={mode.geo.size}"
        raise RewriteRefused(f"the rewrite for {where} cannot run the model: its forward fails with "
                             f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    peak = 0
    was_training = model.training
    model.eval()
    try:
        for unit in units:
            c = unit.check
            rewritten = model.get_submodule(c.name)
            if c.kind == "module" and not _is_rewritten(rewritten, unit.original):
                c.note = "kept as it is"
                continue
            if c.name not in calls:
                c.diff, c.note = math.inf, "the rewritten model never calls it"
                continue
            try:
                reference, nbytes = _materialise(unit, originals.source, mode.mesh.device)
                peak = max(peak, nbytes)
                check = _check_block if c.kind == "block" else _check_module
                c.diff, c.what = check(reference, rewritten, unit.full_call, calls[c.name], mode, c)
            except _CannotVerify as e:
                c.diff, c.note = math.inf, f"cannot verify: {e}"
            except (RuntimeError, ValueError, TypeError, IndexError) as e:
                c.diff, c.note = math.inf, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            finally:
                for p in rewritten.parameters():
                    p.grad = None
                reference = None  # one whole unit at a time: let it go before the next is made
        for stage in originals.stages:
            try:
                stage.check.diff, stage.check.what = _check_stage(model, mode, stage, calls, local_ids)
            except _CannotVerify as e:
                stage.check.diff, stage.check.note = math.inf, f"cannot verify: {e}"
    finally:
        model.train(was_training)
    _agree(units + originals.stages, mode)
    checks = [s.check for s in originals.stages[:1]] + [u.check for u in units] + \
        [s.check for s in originals.stages[1:]] + originals.skipped
    return Report(checks, time.perf_counter() - start, max(peak, originals.stage_bytes))


# ---- capturing real calls ----------------------------------------------------------

def _block_names(model: nn.Module) -> list[str]:
    """Paths of the blocks of the model's repeated stack (none if it has none)."""
    stack = repeated_blocks(model)
    if stack is None:
        return []
    prefix = next(name for name, m in model.named_modules() if m is stack)
    return [f"{prefix}.{i}" if prefix else str(i) for i in range(len(stack))]


def _freeze(value):
    """A copy of call arguments as they were at the call: caches and other
    objects the forward goes on to mutate are copied too."""
    try:
        return copy.deepcopy(value)
    except Exception:  # an argument that cannot be copied: keep it as it is
        return value


def _capture_calls(targets: dict[str, nn.Module], run: Callable[[], Any]) -> dict[str, tuple]:
    """{name: (args, kwargs)} of each target's first call during `run()`,
    as its forward receives them (after any pre-hook the rewrite added)."""
    calls: dict[str, tuple] = {}  # in the order of the first calls
    handles = []
    for name, module in targets.items():
        def capture(mod, args, kwargs, name=name):
            if name not in calls:
                calls[name] = _freeze((args, kwargs))
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


def _eval_forward(model: nn.Module, ids: torch.Tensor) -> None:
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), CacheOff(model):
            model(ids)
    finally:
        model.train(was_training)


def _local_rows(mode, full: torch.Tensor) -> torch.Tensor:
    """This rank's model input of a batch, as training feeds it (the
    tensor-parallel group's rows; data-parallel replicas check the same)."""
    index, count = mode.read_block()
    return mode.split_input(full.chunk(count, 0)[index])


def _fingerprint(call: tuple) -> tuple:
    """What tells two calls apart, beyond their first tensor (hidden states
    or ids, replaced in the check): the other arguments' shapes and values."""
    args, kwargs = call
    first = _first_tensor_path(call)

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


# ---- replaying a call with another first tensor --------------------------------

def _first_tensor_path(call: tuple, ids: bool = False) -> Optional[tuple]:
    """Where the call's first tensor is (with `ids`: its first integer
    tensor, what a table lookup indexes with: OPT's position table takes a
    float mask first and the position ids as a keyword)."""
    args, kwargs = call
    for path, value in [(("args", i), a) for i, a in enumerate(args)] + [(("kwargs", k), v) for k, v in kwargs.items()]:
        if isinstance(value, torch.Tensor) and not (ids and value.is_floating_point()):
            return path
    return None


def _first_tensor(call: tuple, ids: bool = False) -> torch.Tensor:
    path = _first_tensor_path(call, ids)
    if path is None:
        raise _CannotVerify(f"its call has no {'integer ' if ids else ''}tensor argument")
    return call[0][path[1]] if path[0] == "args" else call[1][path[1]]


def _replay(module: nn.Module, call: tuple, x: torch.Tensor, device, ids: bool = False) -> torch.Tensor:
    """module.forward on `call` with its first tensor (`ids`: its first
    integer tensor) replaced by `x`; the output's first tensor. forward, not
    __call__: the module's own hooks (the mode's layout changes at the ends
    of the stack) already acted on the captured arguments."""
    args, kwargs = _to(_freeze(call), device)
    path = _first_tensor_path(call, ids)
    if path[0] == "args":
        args = tuple(x if i == path[1] else a for i, a in enumerate(args))
    else:
        kwargs = {**kwargs, path[1]: x}
    out = module.forward(*args, **kwargs)
    while not isinstance(out, torch.Tensor):
        if isinstance(out, (tuple, list)) and out:
            out = out[0]
        elif getattr(out, "last_hidden_state", None) is not None:
            out = out.last_hidden_state
        elif getattr(out, "logits", None) is not None:
            out = out.logits
        else:
            raise _CannotVerify(f"its output ({type(out).__name__}) holds no tensor")
    return out


def _to(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(_to(v, device) for v in value)
    if isinstance(value, list):
        return [_to(v, device) for v in value]
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value


class _CannotVerify(Exception):
    pass


# ---- the original, whole -------------------------------------------------------------

def _materialise(unit: _Unit, source, device) -> tuple[nn.Module, int]:
    """A fresh whole copy of the unit's original with the values training
    starts from: the parameter source's whole tensor (the rewritten model's
    shards are slices of it), or the real parameters of a model built whole."""
    reference = copy.deepcopy(unit.original)
    origin = {id(p): unit.origin[id(q)] for p, q in zip(reference.parameters(), unit.original.parameters())}
    made: dict[int, nn.Parameter] = {}
    for module in reference.modules():
        for attr, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in made:
                value = source.full(origin[id(p)]) if p.is_meta else p.detach().clone()
                made[id(p)] = nn.Parameter(value.to(device=device, dtype=torch.float32))
            module._parameters[attr] = made[id(p)]
    reference.to(device).eval()
    nbytes = 2 * sum(p.numel() * p.element_size() for p in reference.parameters())  # values + gradients
    return reference, nbytes


def _is_rewritten(rewritten: nn.Module, original: nn.Module) -> bool:
    """Whether the mode changed the module: another class, or a parameter
    sharded (not held whole)."""
    if type(rewritten) is not type(original):
        return True
    return any(spec_of(p) is not None and any(i is not None for i in spec_of(p).index)
               for p in rewritten.parameters())


# ---- comparisons ---------------------------------------------------------------------

def _relative(got: torch.Tensor, want: torch.Tensor, scale) -> float:
    """max |got - want| relative to `scale`: a number, or a tensor whose
    largest magnitude it is (the whole reference's, the same on every rank)."""
    if got.shape != want.shape:
        raise _CannotVerify(f"a tensor of shape {tuple(got.shape)} where the layout gives {tuple(want.shape)}")
    err = (got.detach().float() - want.detach().float()).abs().max().item() if got.numel() else 0.0
    if isinstance(scale, torch.Tensor):
        scale = _magnitude(scale)
    return err / max(scale, 1e-30)


def _magnitude(t: Optional[torch.Tensor]) -> float:
    return t.detach().abs().max().item() if t is not None and t.numel() else 0.0


def _gradient_scales(reference: nn.Module) -> dict[str, float]:
    """The scale each parameter's gradient is judged against: the largest
    gradient of the module that holds it (its parameter group). A weight
    and a bias are sums of the same output-gradient terms, so their
    round-off is of one size; a gradient that is zero in exact arithmetic
    (a key projection's bias under absolute positions: softmax ignores a
    shift common to every key) holds only that round-off, which its own
    magnitude would turn into a difference of order 1."""
    params = dict(reference.named_parameters())
    group: dict[str, float] = {}
    for name, p in params.items():
        owner = name.rpartition(".")[0]
        group[owner] = max(group.get(owner, 0.0), _magnitude(p.grad))
    return {name: group[name.rpartition(".")[0]] for name in params}


def _param_pairs(reference: nn.Module, rewritten: nn.Module) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, original parameter, rewritten parameter): by name, the
    replacement layers keep their originals' parameter names."""
    ref = dict(reference.named_parameters())
    pairs = []
    for name, p in rewritten.named_parameters():
        if name not in ref:
            raise _CannotVerify(f"the rewritten {type(rewritten).__name__} has a parameter {name!r} the original has not")
        pairs.append((name, ref[name], p))
    return pairs


def _sync_partial(params: list[torch.Tensor]) -> None:
    """Sum partial gradients over their replicas inside the tensor-parallel
    group, as training does (data-parallel replicas check the same data)."""
    for p in params:
        spec = spec_of(p)
        for piece, group in spec.partial_parts(p.grad) if p.grad is not None and spec is not None else ():
            comm.all_reduce(piece, group)  # a view: summed in place


def _compare_grads(reference: nn.Module, rewritten: nn.Module, worst: list) -> None:
    pairs = _param_pairs(reference, rewritten)
    _sync_partial([p for _, _, p in pairs])
    scales = _gradient_scales(reference)
    for name, ref, p in pairs:
        if ref.grad is None and p.grad is None:
            continue
        want = ref.grad if ref.grad is not None else torch.zeros_like(ref)
        got = p.grad if p.grad is not None else torch.zeros_like(p)
        spec = spec_of(p)
        local = spec.slice(want) if spec is not None else want
        _worse(worst, _relative(got, local, scales[name]), f"the gradient of {name}")


def _worse(worst: list, diff: float, what: str) -> None:
    if not diff <= worst[0]:  # NaN wins
        worst[:] = [diff, what]


def _check_block(reference, rewritten, full_call, local_call, mode, check: Check) -> tuple[float, str]:
    """A block on the residual stream: random X, this rank's piece by the
    mode's own layout (shard_hidden of its rows)."""
    device = mode.mesh.device
    shape = tuple(_first_tensor(full_call).shape)
    gen = torch.Generator().manual_seed(SEED + 1)
    x = torch.randn(shape, generator=gen)
    x_local = _stream_piece(mode, x).to(device).requires_grad_()
    expected = tuple(_first_tensor(local_call).shape)
    if tuple(x_local.shape) != expected:
        raise _CannotVerify(f"it takes {expected} on this rank where the residual stream's layout gives {tuple(x_local.shape)}")
    x = x.to(device).requires_grad_()
    out = _replay(reference, full_call, x, device)
    got = _replay(rewritten, local_call, x_local, device)
    worst = [0.0, ""]
    _worse(worst, _relative(got, _stream_piece(mode, out.detach()), out), "the output")
    dy = torch.randn(out.shape, generator=gen).to(device)
    out.backward(dy)
    got.backward(_stream_piece(mode, dy))
    _worse(worst, _relative(x_local.grad, _stream_piece(mode, x.grad), x.grad), "the input gradient")
    _compare_grads(reference, rewritten, worst)
    return worst[0], worst[1]


def _stream_piece(mode, full: torch.Tensor) -> torch.Tensor:
    index, count = mode.read_block()
    return mode.shard_hidden(full.chunk(count, 0)[index])


def _check_module(reference, rewritten, full_call, local_call, mode, check: Check) -> tuple[float, str]:
    """A module that computes row by row, fed the same row everywhere (so
    only the features matter): features in and out from its parameters'
    ShardSpecs."""
    full_in, local_in = _first_tensor(full_call), _first_tensor(local_call)
    if not full_in.is_floating_point() or isinstance(reference, nn.Embedding):
        return _check_lookup(reference, rewritten, full_call, local_call, mode)
    device = mode.mesh.device
    features_in, features_out = _features(reference, rewritten, mode, check)
    gen = torch.Generator().manual_seed(SEED + 2)
    x0 = torch.randn(full_in.shape[-1], generator=gen)
    x = x0.expand(full_in.shape).clone().to(device).requires_grad_()
    piece = features_in.slice(x0)
    if local_in.shape[-1] != piece.numel():
        raise _CannotVerify(f"it takes {local_in.shape[-1]} features on this rank where its parameters' "
                            f"shards give {piece.numel()}")
    x_local = piece.expand(local_in.shape).clone().to(device).requires_grad_()
    out = _replay(reference, full_call, x, device)
    got = _replay(rewritten, local_call, x_local, device)
    worst = [0.0, ""]
    _compare_rows(out, got, features_out, worst, "the output")
    dy0 = torch.randn(out.shape[-1], generator=gen)
    out.backward(dy0.expand(out.shape).to(device))
    holders = _holders(mode, check)
    if holders is not None:  # shared key/value heads: each copy's share, feature by feature
        dy_local = features_out.slice(dy0 / holders).expand(got.shape)
    else:
        dy_local = features_out.slice(dy0).expand(got.shape) * _broadcast_share(rewritten, out, got)
    got.backward(dy_local.to(device))
    want = features_in.slice(x.grad.reshape(-1, x.shape[-1])[0].cpu()).expand(x_local.shape).to(device)
    got_dx = x_local.grad
    if holders is not None and is_norm(reference):  # its input is the shared head too: each copy got 1/k
        got_dx = got_dx * features_in.slice(holders).to(device)
    diff = _relative(got_dx, want, x.grad)
    if x_local.numel() == x.numel() and mode.mesh.tp_size > 1:
        # An input every rank holds whole may leave its gradient partial for
        # the caller to sum once for several Linears (1d + sequence
        # parallelism gathers an attention's input on entry): compare the
        # group's sum too. A missing sum shows in the block check.
        summed = comm.all_reduce(x_local.grad.clone(), mode.mesh.tp_group)
        diff = min(diff, _relative(summed, want, x.grad))
    _worse(worst, diff, "the input gradient")
    _compare_grads(reference, rewritten, worst)
    return worst[0], worst[1]


def _compare_rows(out, got, features: ShardSpec, worst: list, what: str) -> None:
    rows = out.detach().reshape(-1, out.shape[-1])
    if (rows - rows[0]).abs().max().item() > TOLERANCE * max(rows.abs().max().item(), 1e-30):
        raise _CannotVerify("it does not compute row by row (equal input rows gave different output rows)")
    want = features.slice(rows[0].cpu()).to(got.device)
    _worse(worst, _relative(got, want.expand(got.shape), out), what)


def _holders(mode, check: Check) -> Optional[torch.Tensor]:
    """Per output feature of a Linear holding shared key/value heads (or of
    a norm over such a Linear's output), how many ranks' copies of it add
    up to one: each block of query heads reading a shared head holds a
    partial sum (its own heads' share of the gradient), so a check feeding
    every copy the whole output gradient gives each 1/k. None for any other
    module."""
    layout = mode.layouts.get(mode.sources.get(check.name, check.name))  # a norm: its projection's
    if layout is None or not layout.shares(mode.geo.head_split):
        return None
    return layout.holders(mode.geo.head_split)


def _broadcast_share(rewritten: nn.Module, out: torch.Tensor, got: torch.Tensor) -> float:
    """The share of the output gradient this rank back-propagates. An output
    every rank of a group holds whole (as many rows as the original's) while
    the parameters' gradients are partial sums over that group is broadcast
    onto their different rows in training (a position table in 2d/3d): each
    of the k replicas contributes 1/k here. Otherwise all of it."""
    if got.shape[:-1].numel() != out.shape[:-1].numel():
        return 1.0
    k = max((len(spec_of(p).replica_ranks) for p in rewritten.parameters()
             if spec_of(p) is not None and spec_of(p).partial_grad), default=1)
    return 1.0 / k


def _check_lookup(reference, rewritten, full_call, local_call, mode) -> tuple[float, str]:
    """A table lookup: one run per id, every row the same id, over ids that
    touch every block of the table (and its padding id), gradients summed.
    A table whose forward shifts the ids it is given (OPT's positions: +2)
    is run on the ids its own forward accepts."""
    device = mode.mesh.device
    full_in, local_in = _first_tensor(full_call, ids=True), _first_tensor(local_call, ids=True)
    weight = getattr(reference, "weight", None)
    if weight is None or weight.dim() != 2:
        raise _CannotVerify("a module fed integers that is not a table lookup")
    rows = weight.shape[0]
    ids = {round(rows * (b + 0.5) / mode.geo.size) % rows for b in range(mode.geo.size)} | {0, rows - 1}
    if getattr(reference, "padding_idx", None) is not None:
        ids.add(reference.padding_idx % rows)
    ids |= set(full_in.unique().tolist())  # ids the real call used: valid for any shift
    features_out = _spec_features(_param_pairs(reference, rewritten), "weight", 1, weight.shape[1])
    gen = torch.Generator().manual_seed(SEED + 3)
    worst = [0.0, ""]
    checked = 0
    for i in sorted(ids):
        try:
            out = _replay(reference, full_call, torch.full_like(full_in, i).to(device), device, ids=True)
        except IndexError:  # outside the table once the module's own shift is applied
            continue
        checked += 1
        got = _replay(rewritten, local_call, torch.full_like(local_in, i).to(device), device, ids=True)
        _compare_rows(out, got, features_out, worst, f"the output for id {i}")
        dy0 = torch.randn(out.shape[-1], generator=gen)
        out.backward(dy0.expand(out.shape).to(device))
        got.backward(features_out.slice(dy0).expand(got.shape).to(device) * _broadcast_share(rewritten, out, got))
    if not checked:
        raise _CannotVerify("its own forward accepts none of the ids tried")
    _compare_grads(reference, rewritten, worst)
    return worst[0], worst[1]


# ---- which features a rank holds ---------------------------------------------------------

def _features(reference: nn.Module, rewritten: nn.Module, mode, check: Check) -> tuple[ShardSpec, ShardSpec]:
    """(input features, output features) this rank holds, as 1-d ShardSpecs."""
    pairs = _param_pairs(reference, rewritten)
    if isinstance(reference, nn.Linear):
        features_in = _spec_features(pairs, "weight", 1, reference.in_features)
        return features_in, _linear_outputs(reference, rewritten, mode, check)
    if is_norm(reference) or not pairs:
        features = getattr(rewritten, "features", None)  # a split norm says which it holds, weight or not
        if is_norm(reference) and features is not None:
            spec = ShardSpec((norm_width(reference),), (features,))
            return spec, spec
        width = reference.weight.shape[-1] if getattr(reference, "weight", None) is not None else None
        if width is not None:
            spec = _spec_features(pairs, "weight", 0, width)
            return spec, spec
        raise _CannotVerify(f"cannot tell which features a rank holds for {type(reference).__name__}")
    raise _CannotVerify(f"no rule for the features of {type(reference).__name__}")


def _spec_features(pairs, name: str, dim: int, width: int) -> ShardSpec:
    for pname, ref, p in pairs:
        if pname == name:
            spec = spec_of(p)
            return ShardSpec((width,), ((spec.index[dim] if spec is not None else None),))
    raise _CannotVerify(f"the rewritten module has no {name!r}")


def _linear_outputs(reference: nn.Linear, rewritten: nn.Module, mode, check: Check) -> ShardSpec:
    """The output features of a rewritten Linear on this rank: where its
    bias lands (a bias is added to the rank's own output features, in every
    mode). Without a bias: the same Linear with one, converted the same way
    (same role, same name) on meta, shapes only."""
    bias = dict(rewritten.named_parameters()).get("bias")
    if bias is not None and spec_of(bias) is not None:
        return ShardSpec((reference.out_features,), (spec_of(bias).index[0],))
    from .base import RewriteContext

    probe = copy.deepcopy(reference).to("meta")
    if probe.bias is None:
        probe.bias = nn.Parameter(torch.empty(reference.out_features, device="meta"))
    ctx = RewriteContext(mode.mesh, shapes_only=True)
    ctx.name = check.name
    converted = mode.convert(check.role, probe, ctx)
    spec = spec_of(dict(converted.named_parameters())["bias"])
    return ShardSpec((reference.out_features,), ((spec.index[0] if spec is not None else None),))


def _check_stage(model, mode, stage: _Stage, calls: dict, local_ids: torch.Tensor) -> tuple[float, str]:
    """Forward only (their modules' gradients are checked module by module):
    the rewritten model's input to its first block against the original's
    (this rank's piece of the residual stream); and its logits, fed this
    rank's piece of the same random stream out of the last block, against
    this rank's rows and vocabulary block of the original's."""
    expected = stage.expected.to(mode.mesh.device)
    if stage.stream is None:
        if stage.block not in calls:
            raise _CannotVerify(f"the rewritten model never calls {stage.block}")
        return _relative(_first_tensor(calls[stage.block]), _stream_piece(mode, expected), expected), "the output"
    piece = _stream_piece(mode, stage.stream).to(mode.mesh.device)
    # First among the block's hooks: the mode's own (1d + SP gathers the
    # sequence after the last block) then act on it as on the real output.
    hook = model.get_submodule(stage.block).register_forward_hook(lambda m, a, out: _with_first(out, piece), prepend=True)
    try:
        with torch.no_grad(), CacheOff(model):
            got = logits_of(model(local_ids))
    finally:
        hook.remove()
    index, count = mode.read_block()
    rows = mode.split_target(expected.chunk(count, 0)[index])
    start = mode.vocab_block() * got.shape[-1]
    want = rows[..., start:start + got.shape[-1]]
    return _relative(got[..., :want.shape[-1]], want, expected), "the logits"


# ---- agreeing over ranks ---------------------------------------------------------------------

def _agree(units: list, mode) -> None:
    """Every rank takes, for each unit, the worst difference over all ranks
    and the name of the tensor it was in on the first rank that saw it, so
    all ranks refuse or train alike and print one and the same line."""
    if not units or not dist.is_initialized():
        return
    diffs = torch.tensor([u.check.diff for u in units], dtype=torch.float64, device=mode.mesh.device)
    diffs = torch.nan_to_num(diffs, nan=math.inf, posinf=math.inf)
    by_rank = comm.all_gather(diffs.unsqueeze(0), dist.group.WORLD).cpu()  # (world, units)
    # Start-up only: the names are short strings, one object gather.
    names = comm.all_gather_object([u.check.what for u in units], dist.group.WORLD)
    worst, owner = by_rank.max(dim=0)  # max picks the first rank among equals
    for i, unit in enumerate(units):
        if not unit.check.note:
            unit.check.what = names[int(owner[i])][i]
        unit.check.diff = float(worst[i])
