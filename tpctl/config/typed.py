"""A run config typed by the schema without Hydra: the workers' reading of
a run dir's config.yaml, the defaults for code and tests, and a model
config checked against ModelConfig."""

from __future__ import annotations

import copy
import functools
import os
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ValidationError

from tpctl.errors import ConfigError
from tpctl.parallel.registry import import_mode_module
from tpctl.schema import ModelConfig, TrainConfig

from .messages import expected_type, valid_keys_hint


@functools.lru_cache(maxsize=None)
def _schema(cls) -> DictConfig:
    """The schema's defaults as a config, built once per process: building
    one from the dataclass costs ~15 ms (every worker, every config a test
    builds); callers get a copy (OmegaConf.merge copies its first
    argument; default_config copies it), never this one."""
    return OmegaConf.structured(cls)


def load_worker_config(path: str | os.PathLike) -> DictConfig:
    """The resolved config a run dir holds, typed by TrainConfig. A mode
    defined outside tpctl (`mode_module`) is imported, so that the worker
    reading it finds the mode by name."""
    cfg = OmegaConf.merge(_schema(TrainConfig), OmegaConf.load(path))
    cfg.model = typed_model(cfg.model)
    import_mode_module(cfg.get("mode_module"))
    return cfg


def default_config(**model: Any) -> DictConfig:
    """The schema's defaults as one config (a built-in model's keys under
    `model`, overridden by `model`), for code and tests that build a config
    without Hydra."""
    cfg = copy.deepcopy(_schema(TrainConfig))
    cfg.model = OmegaConf.merge(_schema(ModelConfig), model)
    return cfg


def typed_model(model: Any) -> DictConfig:
    """The model config checked against ModelConfig (a built-in or Hugging
    Face model: every key known and typed, defaults filled in), or as given
    for a custom model (arch=custom: its keys are its builder's arguments)."""
    if isinstance(model, DictConfig) and model._is_missing():
        raise ConfigError("model", "???", "no model chosen: expected model=<name> (e.g. model=gpt-tiny)")
    arch = model.get("arch") if isinstance(model, DictConfig) else getattr(model, "arch", None)
    if arch == "custom":
        target = model.get("_target_")
        if not isinstance(target, str) or "." not in target:
            raise ConfigError("model._target_", target, "model=custom needs model._target_=package.module.callable (a function or class that returns the model)")
        return model
    schema = _schema(ModelConfig)
    for key in model.keys():
        if key not in schema:
            raise ConfigError(f"model.{key}", model[key], valid_keys_hint(str(key), list(schema.keys()), "model.")
                              + "; a custom model (model=custom) takes any keys")
    try:
        return OmegaConf.merge(schema, model)
    except ValidationError as e:
        key = str(getattr(e, "full_key", "") or "model")
        key = key if key.startswith("model.") else f"model.{key}"
        return _raise(ConfigError(key, model.get(key.split(".", 1)[1]), expected_type(key, OmegaConf.create({"model": copy.deepcopy(schema)}))))


def _raise(error: Exception):
    raise error

