"""Models: the built-in ones, Hugging Face's, and a user's own, all
parallelised from the outside by role (see parallel/roles/inference.py for how roles are found
when a model has no plan)."""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from tpctl.parallel.roles.inference import resolve_plan
from tpctl.parallel.roles.plan import RolePlan, logits_of
from tpctl.schema import ARCHS

from .gpt import GPT
from .init import ParamInit, on_meta
from .mlp import TokenMLP

__all__ = ["ARCHS", "BUILTIN_MODELS", "GPT", "TokenMLP", "ParamInit", "RolePlan", "build_model", "logits_of",
           "resolve_plan", "vocab_size_of"]

log = logging.getLogger("tpctl.model")
BUILTIN_MODELS = {"gpt": GPT, "mlp": TokenMLP}  # one class per schema.BUILTIN_ARCHS name
# Keys of the model config that are tpctl's, not a custom model's arguments.
CUSTOM_RESERVED = ("arch", "_target_", "plan", "pretrained")


def build_model(cfg: Any, seed: int, lazy: bool = False) -> torch.nn.Module:
    """The model of config `cfg` with initial weights fixed by `seed`.

    Built-in and Hugging Face models are built on the meta device with a
    parameter source attached as `model.tpctl_init` (seeded per parameter,
    see models.init, or the pretrained files): lazy=True leaves them there,
    so that the rewrite (rewrite_layers) makes each parameter whole only to slice this
    rank's shard, one at a time; lazy=False materialises them.

    A custom model (`arch=custom`, `_target_` a callable) is built by its own
    code under `torch.manual_seed(seed)`, whole, with its own initialisation.
    """
    with build_warnings_to_log():
        return _build(cfg, seed, lazy)


@contextlib.contextmanager
def build_warnings_to_log():
    """What a model's own code warns while it is built (transformers'
    logger, Python warnings: a fallback kernel, a config's odd rope
    settings) goes to tpctl's log (a worker's rank log), not to the
    terminal: a refusal that follows stays the one line it is."""
    library = logging.getLogger("transformers")
    saved = library.handlers[:], library.propagate

    class ToLog(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            log.info("%s: %s", record.name, record.getMessage())

    caught: list = []
    library.handlers, library.propagate = [ToLog()], False
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        library.handlers, library.propagate = saved
        for w in caught:
            log.info("%s: %s", w.category.__name__, w.message)


def _build(cfg: Any, seed: int, lazy: bool) -> torch.nn.Module:
    if cfg.arch in BUILTIN_MODELS:
        with on_meta():
            model = BUILTIN_MODELS[cfg.arch](cfg)
        model.tpctl_init = ParamInit(model, seed)
        if not lazy:
            model.tpctl_init.materialize(model)
    elif cfg.arch == "custom":
        model = build_custom(cfg, seed)
    else:  # a Hugging Face family (models/hf.py checks the name)
        from .hf import build_hf

        model = build_hf(cfg, seed, lazy)
    return model


def import_target(path: str):
    """The object `pkg.module.name` names, importing from the working
    directory as well as the Python path."""
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ImportError(f"{path!r} is not a dotted path (package.module.callable)")
    if str(Path.cwd()) not in sys.path and "" not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    module = importlib.import_module(module_name)
    if not hasattr(module, attr):
        raise ImportError(f"module {module_name!r} has no attribute {attr!r}")
    return getattr(module, attr)


def build_custom(cfg: Any, seed: int) -> torch.nn.Module:
    target = import_target(cfg._target_)
    kwargs = {k: v for k, v in cfg.items() if k not in CUSTOM_RESERVED}
    torch.manual_seed(seed)
    model = target(**kwargs)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{cfg._target_} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def vocab_size_of(cfg: Any, plan: RolePlan, model: torch.nn.Module) -> int:
    """The real vocabulary size: the LM head's width (the config's for a
    model without one)."""
    vocab = plan.vocab_size(model)
    if vocab is not None:
        return vocab
    if getattr(cfg, "vocab_size", None) is None:
        raise ValueError("cannot tell the vocabulary size: no LM head found; set model.vocab_size")
    return cfg.vocab_size


def build_checked(m: Any, seed: int) -> torch.nn.Module:
    """build_model(m, seed, lazy=True), or a ConfigError (one line) for a
    model that cannot be built: whatever a user's builder raises is about
    the config that named it."""
    from tpctl.errors import ConfigError

    what = m.get("_target_") or m.get("pretrained") or m.arch
    try:
        return build_model(m, seed, lazy=True)
    except ConfigError:
        raise
    except ImportError as e:
        raise ConfigError("model._target_" if m.arch == "custom" else "model.arch", what, f"cannot import: {e}") from None
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError("model._target_" if m.arch == "custom" else "model", what,
                          f"building the model failed: {type(e).__name__}: {first}") from None


def check_model(cfg: Any, training: bool = True) -> tuple[torch.nn.Module, RolePlan]:
    """Build `cfg.model` as the workers will (on the meta device where it
    can be), find its roles and check that `cfg.mode` can shard every one:
    ConfigError naming the module and the reason, before any worker starts.
    Returns (the model as built, before any rewrite; its plan): the memory
    check reads the planner's shapes from them rather than building and
    tracing the model again (most of its own time)."""
    from tpctl.errors import ConfigError
    from tpctl.parallel.layout import Layout
    from tpctl.parallel.tensor.rewrite import check_plan

    m = cfg.model
    what = m.get("_target_") or m.get("pretrained") or m.arch
    model = build_checked(m, cfg.seed)
    try:
        plan = resolve_plan(model, m.get("plan"))
    except (ValueError, TypeError, RuntimeError) as e:
        raise ConfigError("model", what, f"tracing the model's forward failed: {type(e).__name__}: {e}") from None
    layout = Layout.from_config(cfg)
    problems = check_plan(plan, model, layout.geo, training)
    if cfg.seq_parallel and "experts" in plan.roles.values():
        raise ConfigError("seq_parallel", True, "sequence parallelism with a mixture-of-experts block is not supported "
                          "(its routed experts and shared expert would need one sum over the sequence shards after "
                          "the block flattens its rows); expected seq_parallel=false")
    if problems:
        name, reason = next(iter(problems.items()))
        raise ConfigError("model", what, f"mode={cfg.mode} size={cfg.size} cannot shard module {name}: {reason}")
    if layout.pp > 1:  # where the stages are cut: found in the model, as each worker will
        from tpctl.parallel.pipeline.stages import pipeline_of
        from tpctl.parallel.parallelism import parallelism
        from tpctl.parallel.pipeline.schedule import PipelineRefused

        try:
            parallelism(layout, groups=False, pipeline=pipeline_of(layout, cfg)).pipeline.assign(model)
        except PipelineRefused as e:
            value = {"pp": layout.pp, "model": what}.get(e.key, cfg.get("pipeline", {}).get(e.key.split(".")[-1]))
            raise ConfigError(e.key, value, str(e)) from None
    vocab = vocab_size_of(m, plan, model)
    if cfg.data.vocab_size > vocab:
        raise ConfigError("data.vocab_size", cfg.data.vocab_size, f"the model's vocabulary has {vocab} entries: expected at most {vocab}")
    return model, plan
