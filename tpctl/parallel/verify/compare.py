"""How the start-up check (parallel/verify/proof.py) compares a unit: its
original made whole and the rewritten one run on the same random input,
forward and backward, each on its own layout.

  * Blocks take the residual stream: the full random input X, and on this
    rank `mode.shard_hidden` of its rows, the layout training uses.
  * Modules compute row by row (a Linear, a norm, a lookup), so every row of
    their random input is the same vector: the rows a rank holds then do not
    matter, only the features, which its parameters' ShardSpecs name.
    Token-id inputs use one id per run, over a few ids that touch every
    vocabulary block (and the padding id, whose row must get no gradient).
  * The stages around the stack, forward only: the first block's input, and
    the logits from a random stream out of the last block.

Compared on each rank: the output, the input gradient and every parameter's
gradient (after summing partial gradients over their replicas), each against
this rank's slice of the original's, relative to a scale (the reference
tensor's largest magnitude; for a gradient, its module's largest, widened
in a block whose gradients are off to what the reference's own fp32
round-off, measured against the block in float64, allows:
`_conditioned_scales`).
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.nn as nn

from tpctl.parallel import comm
from tpctl.parallel.roles.plan import logits_of
from tpctl.parallel.roles.probes import CacheOff, is_norm, norm_width
from tpctl.parallel.shard import ShardSpec, spec_of
from tpctl.parallel.tensor.mode import RewriteContext
from tpctl.parallel.verify.capture import (
    SEED,
    TOLERANCE,
    CannotVerify,
    Check,
    Stage,
    Unit,
    first_tensor,
    first_tensor_path,
    freeze,
    with_first,
)


def materialise(unit: Unit, source, device) -> tuple[nn.Module, int]:
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


def is_rewritten(rewritten: nn.Module, original: nn.Module) -> bool:
    """Whether the mode changed the module: another class, or a parameter
    sharded (not held whole)."""
    if type(rewritten) is not type(original):
        return True
    return any(spec_of(p) is not None and any(i is not None for i in spec_of(p).index)
               for p in rewritten.parameters())


def _replay(module: nn.Module, call: tuple, x: torch.Tensor, device, ids: bool = False) -> torch.Tensor:
    """module.forward on `call` with its first tensor (`ids`: its first
    integer tensor) replaced by `x`; the output's first tensor. forward, not
    __call__: the module's own hooks (the mode's layout changes at the ends
    of the stack) already acted on the captured arguments."""
    args, kwargs = _to(freeze(call), device)
    path = first_tensor_path(call, ids)
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
            raise CannotVerify(f"its output ({type(out).__name__}) holds no tensor")
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


def _relative(got: torch.Tensor, want: torch.Tensor, scale) -> float:
    """max |got - want| relative to `scale`: a number, or a tensor whose
    largest magnitude it is (the whole reference's, the same on every rank)."""
    if got.shape != want.shape:
        raise CannotVerify(f"a tensor of shape {tuple(got.shape)} where the layout gives {tuple(want.shape)}")
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
            raise CannotVerify(f"the rewritten {type(rewritten).__name__} has a parameter {name!r} the original has not")
        pairs.append((name, ref[name], p))
    return pairs


def _sync_partial(params: list[torch.Tensor]) -> None:
    """Sum partial gradients over their replicas inside the tensor-parallel
    group, as training does (data-parallel replicas check the same data)."""
    for p in params:
        spec = spec_of(p)
        for piece, group in spec.partial_parts(p.grad) if p.grad is not None and spec is not None else ():
            comm.all_reduce(piece, group)  # a view: summed in place


def _compare_grads(reference: nn.Module, rewritten: nn.Module, worst: list, scales=None, sync: bool = True) -> None:
    """Every parameter's gradient against this rank's slice of the
    reference's, relative to `scales` (default: _gradient_scales); `sync`:
    partial gradients first summed over their replicas (once: a second
    comparison of the same gradients passes False)."""
    pairs = _param_pairs(reference, rewritten)
    if sync:
        _sync_partial([p for _, _, p in pairs])
    scales = scales or _gradient_scales(reference)
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


def check_block(reference, rewritten, full_call, local_call, mode, check: Check) -> tuple[float, str]:
    """A block on the residual stream: random X, this rank's piece by the
    mode's own layout (shard_hidden of its rows)."""
    device = mode.mesh.device
    shape = tuple(first_tensor(full_call).shape)
    gen = torch.Generator().manual_seed(SEED + 1)
    x = torch.randn(shape, generator=gen)
    x_local = _stream_piece(mode, x).to(device).requires_grad_()
    expected = tuple(first_tensor(local_call).shape)
    if tuple(x_local.shape) != expected:
        raise CannotVerify(f"it takes {expected} on this rank where the residual stream's layout gives {tuple(x_local.shape)}")
    x = x.to(device).requires_grad_()
    out = _replay(reference, full_call, x, device)
    got = _replay(rewritten, local_call, x_local, device)
    worst = [0.0, ""]
    _worse(worst, _relative(got, _stream_piece(mode, out.detach()), out), "the output")
    dy = torch.randn(out.shape, generator=gen).to(device)
    out.backward(dy)
    got.backward(_stream_piece(mode, dy))
    _worse(worst, _relative(x_local.grad, _stream_piece(mode, x.grad), x.grad), "the input gradient")
    grads = [0.0, ""]
    _compare_grads(reference, rewritten, grads)
    if not grads[0] <= TOLERANCE:  # an ill-conditioned gradient's own round-off, or a wrong one
        grads = [0.0, ""]
        _compare_grads(reference, rewritten, grads, _conditioned_scales(reference, full_call, x, dy), sync=False)
    _worse(worst, *grads)
    return worst[0], worst[1]


def _conditioned_scales(reference: nn.Module, call: tuple, x: torch.Tensor, dy: torch.Tensor) -> dict[str, float]:
    """The gradients' scales (_gradient_scales), each widened to what the
    reference's own fp32 round-off in it allows: its parameter group's
    largest difference from the same block run in float64, times 10, is
    within TOLERANCE of the scale. A gradient summed from terms that
    cancel (DiffLlama's lambda_q1 * lambda_k1 is a scalar's gradient over
    every element of the attention's output: the reference itself was
    measured 3.9e-4 of its scale from float64 on the block check's input)
    loses digits to round-off in any order of summation; a rewrite summing
    it in another order is as exact as the reference is. A block that
    cannot run in float64, or be copied, keeps its scales."""
    scales = _gradient_scales(reference)
    try:  # (a module keeping its last call's graph in an attribute, RecurrentGemma's rg_lru.recurrent_states,
        # does not deepcopy: its scales kept, the difference reported)
        exact = copy.deepcopy(reference).double()
        exact.zero_grad(set_to_none=True)
        x64 = x.detach().double().requires_grad_()
        _replay(exact, _double(call), x64, x.device).backward(dy.double())
    except Exception:  # (an op without a float64 kernel, a dtype the module insists on)
        return scales
    off: dict[str, float] = {}
    for (name, p), q in zip(reference.named_parameters(), exact.parameters()):
        if p.grad is not None and q.grad is not None:
            owner = name.rpartition(".")[0]
            off[owner] = max(off.get(owner, 0.0), (p.grad.double() - q.grad).abs().max().item())
    return {name: max(scale, 10 * off.get(name.rpartition(".")[0], 0.0) / TOLERANCE) for name, scale in scales.items()}


def _double(value):
    """Call arguments with their floating tensors in float64."""
    if isinstance(value, torch.Tensor):
        return value.double() if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_double(v) for v in value)
    if isinstance(value, dict):
        return {k: _double(v) for k, v in value.items()}
    return value


def _stream_piece(mode, full: torch.Tensor) -> torch.Tensor:
    index, count = mode.read_block()
    return mode.shard_hidden(full.chunk(count, 0)[index])


def check_module(reference, rewritten, full_call, local_call, mode, check: Check) -> tuple[float, str]:
    """A module that computes row by row, fed the same row everywhere (so
    only the features matter): features in and out from its parameters'
    ShardSpecs."""
    full_in, local_in = first_tensor(full_call), first_tensor(local_call)
    if not full_in.is_floating_point() or isinstance(reference, nn.Embedding):
        return _check_lookup(reference, rewritten, full_call, local_call, mode)
    device = mode.mesh.device
    features_in, features_out = _features(reference, rewritten, mode, check)
    gen = torch.Generator().manual_seed(SEED + 2)
    x0 = torch.randn(full_in.shape[-1], generator=gen)
    x = x0.expand(full_in.shape).clone().to(device).requires_grad_()
    piece = features_in.slice(x0)
    if local_in.shape[-1] != piece.numel():
        raise CannotVerify(f"it takes {local_in.shape[-1]} features on this rank where its parameters' "
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
        raise CannotVerify("it does not compute row by row (equal input rows gave different output rows)")
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
    full_in, local_in = first_tensor(full_call, ids=True), first_tensor(local_call, ids=True)
    weight = getattr(reference, "weight", None)
    if weight is None or weight.dim() != 2:
        raise CannotVerify("a module fed integers that is not a table lookup")
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
        raise CannotVerify("its own forward accepts none of the ids tried")
    _compare_grads(reference, rewritten, worst)
    return worst[0], worst[1]


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
        raise CannotVerify(f"cannot tell which features a rank holds for {type(reference).__name__}")
    raise CannotVerify(f"no rule for the features of {type(reference).__name__}")


def _spec_features(pairs, name: str, dim: int, width: int) -> ShardSpec:
    for pname, ref, p in pairs:
        if pname == name:
            spec = spec_of(p)
            return ShardSpec((width,), ((spec.index[dim] if spec is not None else None),))
    raise CannotVerify(f"the rewritten module has no {name!r}")


def _linear_outputs(reference: nn.Linear, rewritten: nn.Module, mode, check: Check) -> ShardSpec:
    """The output features of a rewritten Linear on this rank: where its
    bias lands (a bias is added to the rank's own output features, in every
    mode). Without a bias: the same Linear with one, converted the same way
    (same role, same name) on meta, shapes only."""
    bias = dict(rewritten.named_parameters()).get("bias")
    if bias is not None and spec_of(bias) is not None:
        return ShardSpec((reference.out_features,), (spec_of(bias).index[0],))
    probe = copy.deepcopy(reference).to("meta")
    if probe.bias is None:
        probe.bias = nn.Parameter(torch.empty(reference.out_features, device="meta"))
    ctx = RewriteContext(mode.mesh, shapes_only=True)
    ctx.name = check.name
    converted = mode.convert(check.role, probe, ctx)
    spec = spec_of(dict(converted.named_parameters())["bias"])
    return ShardSpec((reference.out_features,), ((spec.index[0] if spec is not None else None),))


def check_stage(model, mode, stage: Stage, calls: dict, local_ids: torch.Tensor, pipeline=None,
                 stream=None) -> tuple[float, str]:
    """Forward only (their modules' gradients are checked module by module):
    the rewritten model's input to its first block against the original's
    (this rank's piece of the residual stream); and its logits, fed this
    rank's piece of the same random stream out of the last block, against
    this rank's rows and vocabulary block of the original's."""
    expected = stage.expected.to(mode.mesh.device)
    if stage.stream is None:
        if stage.block not in calls:
            raise CannotVerify(f"the rewritten model never calls {stage.block}")
        return _relative(first_tensor(calls[stage.block]), _stream_piece(mode, expected), expected), "the output"
    piece = _stream_piece(mode, stage.stream).to(mode.mesh.device)
    # First among the block's hooks: the mode's own (1d + SP gathers the
    # sequence after the last block) then act on it as on the real output.
    hook = model.get_submodule(stage.block).register_forward_hook(lambda m, a, out: with_first(out, piece), prepend=True)
    try:
        with torch.no_grad(), CacheOff(model):
            if pipeline is None:
                got = logits_of(model(local_ids))
            else:  # the last chunk (the rank holds it: the head is checked where it is)
                last = next(c for c in pipeline.chunks if c.last)
                got = pipeline.forward_chunk(last, None if last.first else stream, local_ids)
    finally:
        hook.remove()
    index, count = mode.read_block()
    rows = mode.split_target(expected.chunk(count, 0)[index])
    start = mode.vocab_block() * got.shape[-1]
    want = rows[..., start:start + got.shape[-1]]
    return _relative(got[..., :want.shape[-1]], want, expected), "the logits"
