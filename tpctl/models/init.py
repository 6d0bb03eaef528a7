"""Initial weights that any rank can make one parameter at a time.

Each parameter is drawn from its own generator, seeded by (seed, parameter
name), so the whole model's initial values are fixed by the seed alone --
whatever the mode -- while a rank that needs only a shard makes that one
parameter whole, slices it and lets it go: peak memory is the largest
parameter, not the model (DESIGN.md: "build the model without materialising
it whole where it is large").
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..seeding import derive_seed


class ParamInit:
    """The initial value of every parameter of `model` (built on the meta
    device), by its own generator. The model may scale the default std per
    parameter with a method `init_std(name) -> float`."""

    def __init__(self, model: nn.Module, seed: int):
        self.seed = seed
        self._std = getattr(model, "init_std", lambda name: 0.02)
        # id(param) -> (name, owning module, the param itself: kept alive so
        # that its id stays unique). A tied parameter keeps its first name.
        self._params: dict[int, tuple[str, nn.Module, torch.Tensor]] = {}
        for module_name, module in model.named_modules():
            for attr, param in module.named_parameters(recurse=False):
                name = f"{module_name}.{attr}" if module_name else attr
                self._params.setdefault(id(param), (name, module, param))

    def full(self, param: torch.Tensor) -> torch.Tensor:
        """The whole initial value of `param` (a parameter of the model)."""
        name, module, _ = self._params[id(param)]
        attr = name.rpartition(".")[2]
        shape = tuple(param.shape)
        if isinstance(module, nn.LayerNorm):
            return torch.ones(shape) if attr == "weight" else torch.zeros(shape)
        if isinstance(module, (nn.Linear, nn.Embedding)) and attr == "weight":
            generator = torch.Generator().manual_seed(derive_seed(self.seed, name))
            return torch.randn(shape, generator=generator).mul_(self._std(name))
        if isinstance(module, nn.Linear) and attr == "bias":
            return torch.zeros(shape)
        raise ValueError(f"no initial value rule for {name} ({type(module).__name__}.{attr})")

    def materialize(self, model: nn.Module) -> None:
        """Give every parameter still on the meta device its initial value,
        keeping tied parameters tied and any tpctl_spec tag."""
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
