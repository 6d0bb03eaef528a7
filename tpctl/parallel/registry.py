"""The registry of tensor-parallel modes: name -> `ParallelMode` subclass.

A mode is one module holding one `ParallelMode` subclass, which declares
its grid (axes, named groups, geometry) and registers itself with
`@register`. The built-in modes are the modules listed in `BUILTIN`; adding a
mode is a new module plus its line there, or, from outside the package, a
module of its own that registers it, named by the run config's
`mode_module` key (`import_mode_module`: the launcher imports it before it
validates the config, every worker before it builds the mesh).
"""

from __future__ import annotations

import importlib
from typing import Optional

from tpctl.errors import ConfigError

# Modules of the built-in modes, imported on the first lookup. In the order
# the modes are listed (and planned).
BUILTIN = tuple(f"tpctl.parallel.tensor.modes.{name}" for name in ("none", "one_d", "two_d", "two_p5_d", "three_d"))

_MODES: dict[str, type] = {}
_loaded = False


def register(cls: type) -> type:
    """Make `cls` (a ParallelMode subclass) the mode named `cls.name`."""
    _MODES[cls.name] = cls
    return cls


def unregister(name: str) -> None:
    """Forget mode `name` (a test's own mode, when the test ends)."""
    _MODES.pop(name, None)


def _load() -> None:
    global _loaded
    if not _loaded:
        for module in BUILTIN:
            importlib.import_module(module)
        _loaded = True


def import_mode_module(module: Optional[str]) -> None:
    """Import `module`, which registers a mode defined outside tpctl (the
    config's `mode_module`; None: nothing to import). ConfigError if it does
    not import."""
    if not module:
        return
    try:
        importlib.import_module(module)
    except Exception as e:  # whatever the user's module raises is about the config that names it
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError("mode_module", module, f"expected an importable module that registers a mode "
                          f"(on PYTHONPATH): {type(e).__name__}: {first}") from None


# The hooks through which a mode tells the planner what its rewrite costs
# (parallel/tensor/mode.py); ParallelMode's own describe a grid that splits nothing.
COST_HOOKS = ("cost_rows", "cost_hidden", "cost_vocab", "cost_embedding", "cost_norm", "cost_linear", "cost_loss")


def check_costed() -> None:
    """ConfigError naming the first mode that rewrites layers but defines
    none of the COST_HOOKS: the planner would count its communication as
    zero and its memory as mode=none's."""
    for cls in mode_classes():
        root = next(k for k in reversed(cls.__mro__) if "cost_linear" in vars(k))  # ParallelMode
        if cls.rewrites and all(getattr(cls, hook) is getattr(root, hook) for hook in COST_HOOKS):
            raise ConfigError("mode", cls.name, f"it rewrites layers but defines none of the planner's cost hooks "
                              f"({', '.join(COST_HOOKS)}; see parallel/tensor/mode.py), so tpctl plan would count its "
                              "communication as zero: define them to plan it")


def mode_classes() -> list[type]:
    _load()
    return list(_MODES.values())


def mode_class(name: str) -> type:
    """The class of mode `name`, or ConfigError naming the valid ones."""
    _load()
    if name not in _MODES:
        raise ConfigError("mode", name, f"expected one of {', '.join(_MODES)}")
    return _MODES[name]
