"""Validation of a composed run config: every refusal that can be decided
before a worker starts, each one `ConfigError` line naming the key, the
value and what would be valid (docs/DESIGN.md, sections 2 and 3). The
layout's rules are in `layout_checks.py`, the launcher's and the machine's
in `machine.py`; the model is built (on the meta device) last."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from tpctl.errors import ConfigError
from tpctl.parallel.layout import Layout
from tpctl.parallel.registry import import_mode_module
from tpctl.schema import ARCHS, FUSED_SETTINGS, TrainConfig

from .layout_checks import check_decoding, check_layout, name_unreplaceable_attention
from .machine import check_backend, check_compile, check_launcher, check_nodes
from .messages import check_at_least, check_choice, one_line, valid_keys_hint
from .typed import typed_model

DATASETS = ("synthetic", "text")
DEVICES = ("cpu", "cuda")
PRECISIONS = ("fp32", "bf16")
LOGGERS = ("jsonl", "tensorboard", "mlflow", "wandb")  # training/trackers.py LOGGERS
NONFINITE_POLICIES = ("stop", "skip")


def validate(cfg: Any, model_check: bool = True, training: bool = True) -> Optional[tuple]:
    """Raise ConfigError for the first invalid value in a composed config;
    return what the model check built: (the model on the meta device, its
    role plan), None with model_check=False, which skips building the model
    (tpctl inspect shows what a mode cannot shard instead of refusing it).
    training=False: a config that is only decoded (tpctl generate), whose
    training keys become the decoding's."""
    if not training:
        import_mode_module(cfg.get("mode_module"))
        check_decoding(cfg)
    _check_values(cfg)
    import_mode_module(cfg.get("mode_module"))  # before the mode is looked up
    if model_check:
        name_unreplaceable_attention(cfg)  # builds the model (imports torch): only with cp on a model cp cannot split
    check_layout(cfg)
    _check_auto(cfg)
    check_nodes(cfg)
    check_backend(cfg)
    check_compile(cfg)
    _check_loop(cfg)
    _check_files(cfg)
    if model_check:
        from tpctl.models import check_model  # imports torch: after every cheap check

        return check_model(cfg, training)
    return None


def _check_values(cfg: Any) -> None:
    """Keys and values that need nothing but the config itself."""
    _check_resolvable(cfg)
    _check_known_keys(cfg, OmegaConf.structured(TrainConfig), "")
    _check_finite(cfg, "")
    if not 0 <= cfg.seed < 2**63:
        raise ConfigError("seed", cfg.seed, f"expected an integer in [0, 2**63) = [0, {2**63 - 1}]")
    check_choice("train.on_nonfinite", cfg.train.on_nonfinite, NONFINITE_POLICIES)
    _check_hf_arch(cfg.model)
    cfg.model = typed_model(cfg.model)
    check_choice("data.name", cfg.data.name, DATASETS)
    from tpctl.data.mix import check_data_keys

    check_data_keys(cfg)  # data.order, data.mix (its form, weights and files)
    from tpctl.data.documents import check_documents

    check_documents(cfg)  # data.documents: after the mix's files (it reads their index.json)
    check_choice("device", cfg.device, DEVICES)
    check_choice("precision", cfg.precision, PRECISIONS)
    _check_logger(cfg.logger)


def _check_logger(setting: Any) -> None:
    """`logger`: a name or a list of names, each with its package installed
    (checked here, before any worker starts: training/trackers.py)."""
    from tpctl.training.trackers import loggers_of, missing_package

    names = loggers_of(setting)
    if isinstance(setting, (dict, DictConfig)) or not names:
        raise ConfigError("logger", setting, f"expected one of {', '.join(LOGGERS)}, or a list of them: [jsonl,mlflow]")
    for name in names:
        check_choice("logger", name, LOGGERS)
        if names.count(name) > 1:
            raise ConfigError("logger", name, "named twice: list each logger once")
        problem = missing_package(name)
        if problem:
            raise ConfigError("logger", name, problem)


def _check_auto(cfg: Any) -> None:
    """layout=auto is resolved by `tpctl train` before validation: what is
    left must be the layout it picked, for the world asked."""
    hardware = cfg.get("hardware")
    if hardware is not None:  # the profile layout=auto prices the choices on (tpctl.cost.hardware reads it)
        from .compose import HARDWARE_DIR

        check_choice("hardware", hardware, sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml")))
    layout = cfg.get("layout")
    if layout is None:
        return
    if layout != "auto":
        raise ConfigError("layout", layout, "expected auto (with world=N) or null (the layout keys as given)")
    world = Layout.from_config(cfg).world
    if cfg.get("world") != world or not cfg.get("auto"):
        raise ConfigError("layout", layout, f"the layout is picked by tpctl train layout=auto world=N; this config's "
                          f"keys make {world} ranks, world={cfg.get('world')}")


def _check_loop(cfg: Any) -> None:
    """The training loop's and the optimizer's settings."""
    t, m, o = cfg.train, cfg.model, cfg.optim
    check_at_least("train.steps", t.steps, 1)
    check_at_least("train.log_every", t.log_every, 1)
    check_at_least("train.eval_every", t.eval_every, 0)
    check_at_least("train.eval_batches", t.eval_batches, 1)
    check_at_least("train.seq_len", t.seq_len, 1)
    check_at_least("train.sample_every", t.sample_every, 0)
    check_at_least("train.sample_tokens", t.sample_tokens, 1)
    if _sized(m) and t.seq_len > m.block_size:
        raise ConfigError("train.seq_len", t.seq_len, f"expected at most model.block_size={m.block_size}")
    if _sized(m) and t.sample_every and t.sample_tokens >= m.block_size:
        raise ConfigError("train.sample_tokens", t.sample_tokens, f"the prompt needs a position too: expected less than model.block_size={m.block_size}")
    if not isinstance(t.get("tf32", False), bool):
        raise ConfigError("train.tf32", t.tf32, "expected true or false")
    if not 0.0 <= t.label_smoothing < 1.0:
        raise ConfigError("train.label_smoothing", t.label_smoothing, "expected a value in [0, 1)")
    if not o.lr > 0:
        raise ConfigError("optim.lr", o.lr, "expected a positive learning rate")
    if not 0 <= o.min_lr <= o.lr:
        raise ConfigError("optim.min_lr", o.min_lr, f"the cosine schedule decays to it: expected 0 <= min_lr <= optim.lr={o.lr}")
    check_at_least("optim.warmup_steps", o.warmup_steps, 0)
    check_at_least("optim.grad_clip", o.grad_clip, 0)
    check_choice("optim.fused", str(o.get("fused", "auto")).lower(), FUSED_SETTINGS)


def _sized(model: Any) -> bool:
    """Whether the model's sizes are known from the config (not a custom
    builder's or a pretrained directory's)."""
    return model.arch != "custom" and not model.get("pretrained")


def _check_files(cfg: Any) -> None:
    """What the config names on disk or on the network: data, caches, the
    launcher's host and port, checkpoints, tokenizers, pretrained weights."""
    m = cfg.model
    if cfg.data.path is not None and not Path(cfg.data.path).exists():
        raise ConfigError("data.path", cfg.data.path, "no such file")
    if cfg.data.path is not None and Path(cfg.data.path).is_dir() and not (Path(cfg.data.path) / "index.json").is_file():
        raise ConfigError("data.path", cfg.data.path, "a directory without index.json: expected a UTF-8 text file, a .bin "
                          "file of token ids, or a directory written by `tpctl prepare-data SRC... out=DIR`")
    if cfg.data.cache_dir is not None:
        check_writable_dir("data.cache_dir", cfg.data.cache_dir)
    check_launcher(cfg.launcher)
    c = cfg.checkpoint
    check_at_least("checkpoint.every", c.every, 0)
    check_at_least("checkpoint.keep", c.keep, 0)
    _check_resume_path(cfg)
    if _sized(m) and cfg.data.vocab_size > m.vocab_size:
        raise ConfigError("data.vocab_size", cfg.data.vocab_size, f"the data has more token ids than the model: expected at most model.vocab_size={m.vocab_size}")
    if cfg.data.tokenizer is not None and not Path(cfg.data.tokenizer).is_dir():
        raise ConfigError("data.tokenizer", cfg.data.tokenizer, "expected a local Hugging Face tokenizer directory (save_pretrained)")
    if cfg.data.tokenizer is not None:
        _check_tokenizer(cfg.data.tokenizer)
    if m.get("pretrained") is not None and not (Path(m.pretrained) / "config.json").is_file():
        raise ConfigError("model.pretrained", m.pretrained, "expected a local save_pretrained directory holding config.json and safetensors")


def _check_hf_arch(model: Any) -> None:
    """model.arch: tpctl's own, custom, or (a Hugging Face family) a
    model_type transformers builds as a causal LM. A pretrained directory
    names its own family (model.arch becomes its model_type, so that the run
    dir and checkpoints say which), and only a Hugging Face model reads one."""
    import json

    arch, pretrained = model.get("arch"), model.get("pretrained")
    if arch in ARCHS:
        if pretrained is not None:
            raise ConfigError("model.pretrained", pretrained, f"model.arch={arch} is not a Hugging Face family: "
                              "a save_pretrained directory loads with model=hf")
        return
    from tpctl.models.hf import check_arch

    if pretrained is not None:
        try:
            model.arch = json.loads((Path(pretrained) / "config.json").read_text())["model_type"]
        except (OSError, ValueError, KeyError, TypeError):
            return  # checked below: not a save_pretrained directory
    try:
        check_arch(model.arch, ours=pretrained is None)
    except ImportError:
        raise ConfigError("model.arch", arch, f"expected one of {', '.join(ARCHS)}, or a Hugging Face model_type "
                          "with transformers installed (pip install 'tpctl[hf]')") from None
    except ConfigError as e:
        if pretrained is None:
            raise
        raise ConfigError("model.pretrained", pretrained, f"its config.json's model_type {model.arch!r}: {e.valid}") from None


# fp32's largest finite value and its smallest normal one: the settings
# reach tensors and optimizers (AdamW's lr, eps) as fp32.
FP32_MAX, FP32_TINY = 3.4028234663852886e38, 1.1754943508222875e-38


def _check_finite(node: Any, prefix: str) -> None:
    """Every number of the config is finite and fp32 holds it: no setting
    means NaN or infinity, or becomes one (1e300) or 0 (1e-50) in fp32, and
    one would only show as a diverged or silent run, or as each rank's
    failure after the workers started."""
    import math

    def bad(v) -> bool:
        return isinstance(v, float) and (not math.isfinite(v) or abs(v) > FP32_MAX or 0 < abs(v) < FP32_TINY)

    for key in node.keys():
        value = node._get_node(key)
        if OmegaConf.is_missing(node, key):
            continue
        if isinstance(value, DictConfig):
            _check_finite(value, f"{prefix}{key}.")
            continue
        raw = node[key]
        values = list(raw) if OmegaConf.is_list(raw) else [raw]
        if any(bad(v) for v in values):
            raise ConfigError(f"{prefix}{key}", values if OmegaConf.is_list(raw) else raw,
                              f"expected a finite number fp32 holds: 0 or {FP32_TINY:.2g} <= |x| <= {FP32_MAX:.3g}")


def _check_tokenizer(path: str) -> None:
    """The tokenizer directory loads (else every worker would fail on it)."""
    import importlib.util

    from tpctl.data import DataError
    from tpctl.data.tokenizer import hf_tokenizer

    if importlib.util.find_spec("transformers") is None:
        raise ConfigError("data.tokenizer", path, "needs transformers: pip install 'tpctl[hf]'")

    try:
        hf_tokenizer(path)
    except DataError as e:
        raise ConfigError("data.tokenizer", path, f"not a Hugging Face tokenizer directory: {e}") from None



def check_writable_dir(key: str, path: str | os.PathLike) -> None:
    """`path` is, or can be created as, a directory this process can write:
    the nearest existing ancestor must be a directory we can create in
    (tried for real: permission bits do not tell for root or /proc)."""
    import tempfile

    target = Path(path).expanduser().absolute()
    existing = target
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        what = "is" if existing == target else f"is under {existing}, which is"
        raise ConfigError(key, str(path), f"{what} a file, not a directory")
    try:
        tempfile.TemporaryDirectory(dir=existing).cleanup()
    except OSError as e:
        raise ConfigError(key, str(path), f"cannot create a directory in {existing} ({e.strerror})") from None


def _check_resume_path(cfg: Any) -> None:
    """train.resume=PATH: a valid checkpoint of this model, found before
    anything starts (auto needs the run dir: see cli._check_resume)."""
    resume = cfg.train.resume
    if resume in (None, "auto"):
        return
    from tpctl.checkpoint import CheckpointError, resolve_resume

    try:
        resolve_resume(cfg, Path("."))
    except CheckpointError as e:
        raise ConfigError("train.resume", resume, str(e)) from None


def _check_resolvable(cfg: Any) -> None:
    """A broken ${interpolation} would otherwise fail later, at first access."""
    try:
        OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "config"
        node = cfg
        for part in key.split("."):
            node = node._get_node(part) if isinstance(node, DictConfig) and part in node else None
        raw = node._value() if node is not None else None
        raise ConfigError(key, raw, one_line(e)) from None


def _check_known_keys(cfg: Any, schema: DictConfig, prefix: str) -> None:
    """`+key=value` may add keys that the schema lacks; nothing would read them."""
    for key in cfg.keys():
        full = f"{prefix}{key}"
        if key not in schema.keys():  # (`in` is False for a ??? key)
            value = cfg[key]
            if isinstance(value, DictConfig):
                value = OmegaConf.to_container(value)
            raise ConfigError(full, value, valid_keys_hint(str(key), list(schema.keys()), prefix))
        if isinstance(schema._get_node(key), DictConfig) and len(schema._get_node(key)):  # (empty: a free-form map, `auto`)
            _check_known_keys(cfg._get_node(key), schema._get_node(key), full + ".")

