"""A Linear of a linear role holding parameters beside its weight and bias
that its forward applies to its output entry by entry (Dory's LM head: the
logits times a learned per-token `logit_scale`): each rank applies them to
its own output, one scalar whole, one entry per output feature held as the
features are (where the bias lands).

What the module's forward does after its Linear is run as written: the
original class's forward on a stand-in whose `nn.Linear.forward` returns the
mode's Linear's output (`_Stand`). Measured before the rewrite on the
original (`output_params`): the forward reaches its Linear through
`nn.Linear.forward`, each output feature depends only on the Linear's same
feature and the parameters' same entry; anything else is refused naming
the parameters. The start-up proof then compares the rewritten module's
output against the original's.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

OWN = ("weight", "bias")


def extra_params(module: nn.Module) -> list[str]:
    """The parameters a Linear holds itself beside its weight and bias."""
    return sorted(set(module._parameters) - set(OWN))


class _LinearOutput(nn.Linear):
    """In a stand-in's class after the original's: `super().forward(x)` of
    the original class lands here and returns the mode's Linear's output
    (its owner's, the module carrying the parameters; or a probe's)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        run = self.__dict__.get("tpctl_linear")
        if run is not None:
            return run(x)
        owner = self.__dict__["tpctl_owner"]
        return type(owner).__mro__[1].forward(owner, x)  # (the mode's Linear class)


def _stand_in(original: nn.Module) -> nn.Module:
    """An instance of the original's class (its forward, its attributes:
    Dory's logit_scale_factor) whose Linear is the mode's; its parameters
    are set before each call."""
    cls = type(f"Carried{type(original).__name__}", (type(original), _LinearOutput), {})
    stand = cls.__new__(cls)
    nn.Module.__init__(stand)
    for key, value in vars(original).items():
        if not key.startswith("_"):
            stand.__dict__[key] = value
    stand._buffers = dict(original._buffers)
    return stand


def _runs(original: nn.Module, linear) -> nn.Module:
    """`original`'s forward with `linear` (x -> its Linear's output) in place of its Linear."""
    stand = _stand_in(original)
    stand._parameters = dict(original._parameters)
    for own in OWN:  # (NaN: a forward computing with them itself, not through its Linear, shows)
        if stand._parameters.get(own) is not None:
            stand._parameters[own] = torch.full_like(stand._parameters[own], float("nan"))
    stand.__dict__["tpctl_linear"] = linear
    return stand


def output_params(module: nn.Module) -> list[str]:
    """The extra parameters of a Linear `module` when its forward applies
    them to its Linear's output entry by entry (each a scalar or one entry
    per output feature); ValueError with the reason otherwise."""
    names = extra_params(module)
    shapes = {n: tuple(getattr(module, n).shape) for n in names}
    wrong = [f"{n} {s}" for n, s in shapes.items() if s != (module.out_features,) and getattr(module, n).numel() != 1]
    why = f"a Linear ({type(module).__name__}) holding parameters beside its weight and bias ({', '.join(names)})"
    if wrong:
        raise ValueError(f"{why}: {', '.join(wrong)} neither a scalar nor one entry per output feature")
    if not isinstance(module, nn.Linear):
        raise ValueError(f"{why}, which tpctl carries only where nn.Linear's forward makes the output they act on")
    if module.weight.is_meta:  # (a model built lazily: measured on its own stand-in weights)
        module = _materialized(module)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, module.in_features, generator=gen, dtype=module.weight.dtype)
    n, k = module.out_features, module.out_features // 2
    others = torch.arange(n) != k
    with torch.no_grad():
        y = F.linear(x, module.weight, module.bias)
        bumped = y.clone()
        bumped[:, k] += 1.0
        ran = _runs(module, lambda _: y)(x)
        same = ran.shape == y.shape and torch.allclose(ran.float(), module(x).float(), rtol=1e-5, atol=1e-6)
        local = same and bool(((_runs(module, lambda _: bumped)(x) - ran)[:, others] == 0).all())
        for name in names if local else ():
            p = getattr(module, name)
            if p.numel() > 1:  # its entry k moves output feature k alone
                saved = p[k].clone()
                p[k] += 1.0
                local = local and bool(((_runs(module, lambda _: y)(x) - ran)[:, others] == 0).all())
                p[k] = saved
    if not same:
        raise ValueError(f"{why}, whose forward does not make its output from nn.Linear's forward alone")
    if not local:
        raise ValueError(f"{why}, which its forward does not apply to each output feature alone")
    return names


def _materialized(module: nn.Module) -> nn.Module:
    """A copy of a meta-device module with random values in its parameters."""
    import copy

    twin = copy.deepcopy(module).to_empty(device="cpu")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in twin.parameters():
            p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
    return twin


def _carried_forward(self, x: torch.Tensor):
    stand = self.__dict__["tpctl_stand"]
    stand.training = self.training
    stand._parameters = dict(self._parameters)  # (this rank's, as they are now)
    return type(stand).forward(stand, x)


def carry_output_params(new: nn.Module, original: nn.Module, names: list[str], feature_spec, scalar_spec,
                        ctx) -> nn.Module:
    """`new` (the mode's Linear for `original`) holding `original`'s extra
    parameters `names` too, and run as `original`'s forward on its output.
    `feature_spec`: where a tensor of one entry per output feature is held
    (the bias's ShardSpec: this rank's output features, and the ranks
    holding the same ones); `scalar_spec(p, partial)`: a scalar held whole,
    its gradient summed over the group where the output is split (any
    split dimension of the features, or partial gradients)."""
    split = feature_spec.partial_grad or any(r is not None for r in feature_spec.index)
    for name in names:
        p = getattr(original, name)
        spec = scalar_spec(p, split) if p.numel() == 1 else dataclasses.replace(feature_spec, full_shape=tuple(p.shape))
        new.register_parameter(name, ctx.shard(p, spec))
    stand = _stand_in(original)
    stand.__dict__["tpctl_owner"] = new
    new.__dict__["tpctl_stand"] = stand
    base = type(new)
    new.__class__ = type(f"{base.__name__}With{''.join(n.title().replace('_', '') for n in names)}", (base,),
                         {"forward": _carried_forward})
    return new


def bias_spec(mode, role: str, module: nn.Module, name: str):
    """Where `mode` holds the output features of a Linear of `role` (the
    ShardSpec its bias gets): read from a conversion of a stand-in Linear
    with a bias, on the meta device."""
    from tpctl.parallel.shard import spec_of
    from tpctl.parallel.tensor.mode import RewriteContext

    twin = nn.Linear(module.in_features, module.out_features, bias=True, device="meta")
    ctx = RewriteContext(mode.mesh, shapes_only=True)
    ctx.name = name
    return spec_of(mode.convert(role, twin, ctx).bias)
