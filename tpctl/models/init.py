"""Where a lazily built model's parameters come from, one shard at a time.

A model built on the meta device carries a `ParamSource` as
`model.tpctl_init`. The rewrite asks it for each parameter's shard
(`shard(param, spec)`), and `materialize` gives whatever no layer sharded
its whole value. Two sources exist:

  * `ParamInit` (here): each parameter drawn from its own generator, seeded
    by (seed, parameter name), so the whole model's initial values are fixed
    by the seed alone -- whatever the mode -- while a rank that needs only a
    shard makes that one parameter whole, slices it and lets it go: peak
    memory is the largest parameter, not the model (docs/DESIGN.md, section 2: "build the
    model without materialising it whole where it is large").
  * `pretrained.SafetensorsSource`: the slices read straight from a
    checkpoint's safetensors files.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Callable, Optional

import torch
import torch.nn as nn

from tpctl.parallel.roles.probes import is_norm, norm_offset
from tpctl.parallel.shard import ShardSpec
from tpctl.seeding import derive_seed


class ParamSource:
    """Names every parameter of `model` (tied ones under each of their
    names, the first one canonical) and hands out values by parameter."""

    def __init__(self, model: nn.Module):
        # id(param) -> (names, owning module as built, the param itself:
        # kept alive so that its id stays unique).
        self._params: dict[int, tuple[list[str], nn.Module, torch.Tensor]] = {}
        built = as_built(model)
        for module_name, module in model.named_modules(remove_duplicate=False):
            for attr, param in module.named_parameters(recurse=False):
                name = f"{module_name}.{attr}" if module_name else attr
                entry = self._params.setdefault(id(param), ([], built[id(module)], param))
                if name not in entry[0]:
                    entry[0].append(name)

    def names(self, param: torch.Tensor) -> list[str]:
        return self._params[id(param)][0]

    def full(self, param: torch.Tensor) -> torch.Tensor:
        """The whole value of `param` (a parameter of the model)."""
        raise NotImplementedError

    def shard(self, param: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
        """The slice `spec` of `param`'s value."""
        return spec.slice(self.full(param))

    def materialize(self, model: nn.Module) -> None:
        """Give every parameter still on the meta device its value, keeping
        tied parameters tied and any tpctl_spec tag."""
        made: dict[int, nn.Parameter] = {}
        for module in model.modules():
            for attr, param in list(module.named_parameters(recurse=False)):
                if not param.is_meta:
                    continue
                if id(param) not in made:
                    new = nn.Parameter(self.full(param), requires_grad=param.requires_grad)
                    if hasattr(param, "tpctl_spec"):
                        new.tpctl_spec = param.tpctl_spec
                    made[id(param)] = new
                setattr(module, attr, made[id(param)])


def as_built(model: nn.Module) -> dict[int, nn.Module]:
    """id(module) -> a copy of each module of `model` as it is now, for
    computing its parameters' whole values later: shallow copies, each
    with its own tables (parameters, buffers, hooks) and attributes, whose
    submodules are each other's copies.

    Why: the rewrite asks for a parameter's value after it has begun to
    change the model in place -- a mixer split by heads, or experts run by
    their own forward, hold this rank's shards and the shard's counts
    (num_v_heads, a conv's groups) -- and the start-up proof makes a whole
    module after the rewrite is done. An initialiser reading the live
    module (a family's `_init_weights`: A_log from num_heads, dt_bias drawn
    after A_log from one generator, stacked experts' down_proj drawn after
    gate_up_proj, a conv weight of the module's shape) would then give the
    shard's init, not the whole one's slice
    (docs/DESIGN.md, section 2: "Initial weights are those of the whole
    model, sliced"); and one that writes into its submodules' parameters
    (NemotronH's mixer rescales out_proj.weight in place) would overwrite
    a rank's real shard. Copies taken before any rewrite see the whole
    model on the meta device, as the eager build's initialiser sees it
    (a submodule not yet made is meta there too); their parameters are the
    meta ones, so they cost no memory. (What the rewrite changes on a
    module are entries of these tables and integer attributes, each
    replaced, not mutated: copies of the containers suffice.)"""
    built = {}
    for module in model.modules():
        snapshot = copy.copy(module)
        for key, value in vars(module).items():
            if isinstance(value, (dict, set, list)):
                vars(snapshot)[key] = copy.copy(value)
        built[id(module)] = snapshot
    for snapshot in built.values():
        vars(snapshot)["_modules"] = {k: None if m is None else built[id(m)] for k, m in snapshot._modules.items()}
    return built


class ParamInit(ParamSource):
    """The initial value of every parameter of `model` (built on the meta
    device), by its own generator. `std(name)` gives the normal std of a
    weight; by default the model's method `init_std(name)`, else 0.02.
    `fallback(name, module, attr)` gives a parameter no rule covers (a
    model's own init, seeded by name); without one such a parameter is an
    error."""

    def __init__(self, model: nn.Module, seed: int, std: Optional[Callable[[str], float]] = None,
                 fallback: Optional[Callable[[str, nn.Module, str], torch.Tensor]] = None):
        super().__init__(model)
        self.seed = seed
        self._std = std or getattr(model, "init_std", lambda name: 0.02)
        self._fallback = fallback

    def _randn(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        generator = torch.Generator().manual_seed(derive_seed(self.seed, name))
        return torch.randn(shape, generator=generator).mul_(self._std(name))

    def full(self, param: torch.Tensor) -> torch.Tensor:
        names, module, _ = self._params[id(param)]
        name = names[0]
        attr = name.rpartition(".")[2]
        shape = tuple(param.shape)
        if is_norm(module) and attr == "bias":
            return torch.zeros(shape)
        if is_norm(module) and attr == "weight":
            try:  # the identity scale: 1, or 0 for a weight entering as (1 + w) (Gemma)
                return torch.full(shape, 1.0 - norm_offset(module))
            except ValueError:  # a norm of another kind: its model's own init, if it has one
                if self._fallback is None:
                    return torch.ones(shape)
        if isinstance(module, nn.Linear) and attr == "bias":
            return torch.zeros(shape)
        if isinstance(module, (nn.Linear, nn.Embedding)) and attr == "weight":
            return self._randn(name, shape)
        if self._fallback is not None:  # the family's own init (stacked experts)
            return self._fallback(name, module, attr)
        if len(shape) >= 2:  # a matrix of another layer (experts' 3-d weights, a router's experts x hidden)
            return self._randn(name, shape)
        raise ValueError(f"no initial value rule for {name} ({type(module).__name__}.{attr})")


# In-place random fills: on a meta tensor they have nothing to fill, and
# PyTorch routes some (normal_) through a decomposition that imports the
# compiler (about a second, in every `tpctl train` before a worker starts).
_RANDOM_FILLS = frozenset({"normal_", "uniform_", "exponential_", "log_normal_", "cauchy_", "geometric_",
                           "random_", "bernoulli_"})


class _NoFillsOnMeta(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in _RANDOM_FILLS:
            # Tensor.normal_(...) passes the tensor first, nn.init.normal_ as tensor=.
            target = args[0] if args else kwargs.get("tensor")
            if getattr(target, "is_meta", False):
                return target
        return func(*args, **kwargs)


@contextmanager
def on_meta():
    """Build on the meta device (shapes only), skipping the random
    initialisation a constructor does: a ParamSource gives every value."""
    with torch.device("meta"), _NoFillsOnMeta():
        yield


# Parameters up to this many elements keep the value their constructor gave
# them (as `tpctl_constructed` on the meta parameter); larger ones are tables
# and matrices, which a constructor leaves to an init.
CONSTRUCTED_LIMIT = 1 << 16


@contextmanager
def params_on_meta():
    """Build a model whose parameters land on the meta device while its
    buffers (rotary frequencies, masks) are computed for real. Each
    parameter exists for real only while its constructor runs."""
    register = nn.Module.register_parameter
    # Linear and Embedding would fill their (uninitialised, so not yet
    # resident) weights before they move to meta: skip that, a ParamSource
    # gives every value later.
    resets = {cls: cls.reset_parameters for cls in (nn.Linear, nn.Embedding)}

    def register_on_meta(self, name, param):
        if param is not None and not param.is_meta:
            value = param.detach()
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            if value.numel() <= CONSTRUCTED_LIMIT and not isinstance(self, tuple(resets)):
                # A value the constructor chose (a learned scale's start):
                # a model's own init may not set it again.
                param.tpctl_constructed = value.clone()
        register(self, name, param)

    nn.Module.register_parameter = register_on_meta
    for cls in resets:
        cls.reset_parameters = lambda self: None
    try:
        with _NoFillsOnMeta():
            yield
    finally:
        nn.Module.register_parameter = register
        for cls, reset in resets.items():
            cls.reset_parameters = reset
