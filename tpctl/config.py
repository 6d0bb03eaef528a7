"""Config: the typed schema in Hydra's ConfigStore, composition of the jobs a
command line asks for, and validation — every error found before any worker
starts and reported as one `ConfigError` line (docs/DESIGN.md, sections 2 and 3).

Three entry points:
  * `compose_jobs(overrides, multirun)` composes every job of a command line
    with Hydra's Compose API and turns Hydra's errors into ConfigErrors;
  * `validate(cfg)` checks values (the mode-specific rules live in
    `tpctl.parallel.layout.Layout.validate`);
  * `load_worker_config(path)` reads a run dir's resolved config.yaml, typed,
    for the workers, which never run Hydra.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any, Iterable

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from .errors import ConfigError
from .parallel.layout import Layout
from .schema import ARCHS, ModelConfig, TrainConfig

# configs/ lives at the repository root, next to the package (the install is
# editable, see the Makefile).
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
CONFIG_NAME = "train"
# Named experiments; configs/recipe is a link to this folder, so Hydra sees
# each file as an option of the `recipe` group (`tpctl train recipe=NAME`).
RECIPE_DIR = CONFIG_DIR.parent / "recipes"

DATASETS = ("synthetic", "text")
DEVICES = ("cpu", "cuda")
PRECISIONS = ("fp32", "bf16")
LOGGERS = ("jsonl", "tensorboard")
LAUNCHERS = ("local", "slurm")
NONFINITE_POLICIES = ("stop", "skip")



def register_configs() -> None:
    """Register the schema in Hydra's ConfigStore (idempotent).

    configs/train.yaml lists `train_schema` first in its defaults list, so the
    YAML files and the command line are merged onto TrainConfig. Its fields
    are typed with the group dataclasses (model: ModelConfig, ...), so each
    group's file (configs/model/*.yaml, ...) is checked against its dataclass
    as it is merged: a misspelt key or a wrong type anywhere is an error.
    """
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def load_worker_config(path: str | os.PathLike) -> DictConfig:
    """The resolved config a run dir holds, typed by TrainConfig."""
    cfg = OmegaConf.merge(OmegaConf.structured(TrainConfig), OmegaConf.load(path))
    cfg.model = typed_model(cfg.model)
    return cfg


def default_config(**model: Any) -> DictConfig:
    """The schema's defaults as one config (a built-in model's keys under
    `model`, overridden by `model`), for code and tests that build a config
    without Hydra."""
    cfg = OmegaConf.structured(TrainConfig)
    cfg.model = OmegaConf.merge(OmegaConf.structured(ModelConfig), model)
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
    schema = OmegaConf.structured(ModelConfig)
    for key in model.keys():
        if key not in schema:
            raise ConfigError(f"model.{key}", model[key], _valid_keys_hint(str(key), list(schema.keys()), "model.")
                              + "; a custom model (model=custom) takes any keys")
    try:
        return OmegaConf.merge(schema, model)
    except ValidationError as e:
        key = str(getattr(e, "full_key", "") or "model")
        key = key if key.startswith("model.") else f"model.{key}"
        return _raise(ConfigError(key, model.get(key.split(".", 1)[1]), _expected_type(key, OmegaConf.create({"model": schema}))))


def _raise(error: Exception):
    raise error


# --------------------------------------------------------------------------
# Validation of values
# --------------------------------------------------------------------------


def validate(cfg: Any, model_check: bool = True, training: bool = True) -> None:
    """Raise ConfigError for the first invalid value in a composed config.
    model_check=False skips building the model (tpctl inspect shows what a
    mode cannot shard instead of refusing it); training=False: a config
    that is only decoded (tpctl generate)."""
    _check_resolvable(cfg)
    _check_known_keys(cfg, OmegaConf.structured(TrainConfig), "")
    _check_finite(cfg, "")
    if not 0 <= cfg.seed < 2**63:
        raise ConfigError("seed", cfg.seed, f"expected an integer in [0, 2**63) = [0, {2**63 - 1}]")
    _check_choice("train.on_nonfinite", cfg.train.on_nonfinite, NONFINITE_POLICIES)
    _check_hf_arch(cfg.model)
    cfg.model = typed_model(cfg.model)
    _check_choice("data.name", cfg.data.name, DATASETS)
    _check_choice("device", cfg.device, DEVICES)
    _check_choice("precision", cfg.precision, PRECISIONS)
    _check_choice("logger", cfg.logger, LOGGERS)
    if cfg.logger == "tensorboard":
        import importlib.util

        if importlib.util.find_spec("tensorboard") is None:
            raise ConfigError("logger", cfg.logger, "needs the tensorboard package: pip install 'tpctl[tensorboard]' (or pip install tensorboard), or use logger=jsonl")
    Layout.from_config(cfg).validate(cfg)
    _check_nodes(cfg)
    _check_backend(cfg)
    _check_compile(cfg)

    t, m, o = cfg.train, cfg.model, cfg.optim
    _check_at_least("train.steps", t.steps, 1)
    _check_at_least("train.log_every", t.log_every, 1)
    _check_at_least("train.eval_every", t.eval_every, 0)
    _check_at_least("train.eval_batches", t.eval_batches, 1)
    _check_at_least("train.seq_len", t.seq_len, 1)
    _check_at_least("train.sample_every", t.sample_every, 0)
    _check_at_least("train.sample_tokens", t.sample_tokens, 1)
    sized = m.arch != "custom" and not m.get("pretrained")  # sizes known from the config
    if sized and t.seq_len > m.block_size:
        raise ConfigError("train.seq_len", t.seq_len, f"expected at most model.block_size={m.block_size}")
    if sized and t.sample_every and t.sample_tokens >= m.block_size:
        raise ConfigError("train.sample_tokens", t.sample_tokens, f"the prompt needs a position too: expected less than model.block_size={m.block_size}")
    if not 0.0 <= t.label_smoothing < 1.0:
        raise ConfigError("train.label_smoothing", t.label_smoothing, "expected a value in [0, 1)")
    if not o.lr > 0:
        raise ConfigError("optim.lr", o.lr, "expected a positive learning rate")
    if not 0 <= o.min_lr <= o.lr:
        raise ConfigError("optim.min_lr", o.min_lr, f"the cosine schedule decays to it: expected 0 <= min_lr <= optim.lr={o.lr}")
    _check_at_least("optim.warmup_steps", o.warmup_steps, 0)
    _check_at_least("optim.grad_clip", o.grad_clip, 0)
    if cfg.data.path is not None and not Path(cfg.data.path).exists():
        raise ConfigError("data.path", cfg.data.path, "no such file")
    if cfg.data.path is not None and Path(cfg.data.path).is_dir() and not (Path(cfg.data.path) / "index.json").is_file():
        raise ConfigError("data.path", cfg.data.path, "a directory without index.json: expected a UTF-8 text file, a .bin "
                          "file of token ids, or a directory written by `tpctl prepare-data SRC... out=DIR`")
    if cfg.data.cache_dir is not None:
        check_writable_dir("data.cache_dir", cfg.data.cache_dir)
    _check_launcher(cfg.launcher)
    c = cfg.checkpoint
    _check_at_least("checkpoint.every", c.every, 0)
    _check_at_least("checkpoint.keep", c.keep, 0)
    _check_resume_path(cfg)
    if sized and cfg.data.vocab_size > m.vocab_size:
        raise ConfigError("data.vocab_size", cfg.data.vocab_size, f"the data has more token ids than the model: expected at most model.vocab_size={m.vocab_size}")
    if cfg.data.tokenizer is not None and not Path(cfg.data.tokenizer).is_dir():
        raise ConfigError("data.tokenizer", cfg.data.tokenizer, "expected a local Hugging Face tokenizer directory (save_pretrained)")
    if cfg.data.tokenizer is not None:
        _check_tokenizer(cfg.data.tokenizer)
    if m.get("pretrained") is not None and not (Path(m.pretrained) / "config.json").is_file():
        raise ConfigError("model.pretrained", m.pretrained, "expected a local save_pretrained directory holding config.json and safetensors")
    if model_check:
        from .models import check_model  # imports torch: after every cheap check

        check_model(cfg, training)


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
    from .models.hf import check_arch

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


BACKENDS = ("auto", "nccl", "gloo")


def _check_backend(cfg: Any) -> None:
    """launcher.backend against the device, and the CUDA devices it needs:
    nccl one GPU per rank, gloo at least one GPU (ranks may share it)."""
    backend = cfg.launcher.get("backend", "auto")
    _check_choice("launcher.backend", backend, BACKENDS)
    if backend == "nccl" and cfg.device != "cuda":
        raise ConfigError("launcher.backend", backend, f"NCCL runs on CUDA devices only: with device={cfg.device} use launcher.backend=gloo (or auto)")
    if cfg.device != "cuda" or cfg.launcher.name != "local":  # Slurm's nodes are checked by gpus_per_node
        return
    # torch is imported only here: a CPU config check stays fast.
    import torch

    world = Layout.from_config(cfg).world // cfg.launcher.nnodes  # this node's share
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have == 0:
        raise ConfigError("device", "cuda", "this machine has no CUDA device (torch.cuda.is_available() is False"
                          f"{'; torch ' + torch.__version__ + ' is a CPU build' if torch.version.cuda is None else ''}): use device=cpu")
    if backend != "gloo" and have < world:
        raise ConfigError("device", "cuda", f"size*pp*dp/nnodes={world} ranks need {world} CUDA devices with NCCL, this machine has {have}: "
                          "use launcher.backend=gloo to let ranks share a GPU (for testing), or device=cpu")


def _check_compile(cfg: Any) -> None:
    from tpctl.training.compile import COMPILE_SETTINGS, compile_setting, compiler_problem

    setting = compile_setting(cfg)
    _check_choice("train.compile", setting, COMPILE_SETTINGS)
    if setting == "true":

        problem = compiler_problem(cfg.device)
        if problem:
            raise ConfigError("train.compile", "true", f"{problem}: use train.compile=false, or auto to fall back to eager")


def _check_nodes(cfg: Any) -> None:
    """ConfigError for a launcher or multi-node setting that cannot work."""
    lc, world = cfg.launcher, Layout.from_config(cfg).world
    if lc.name not in LAUNCHERS:
        raise ConfigError("launcher.name", lc.name, f"expected one of {', '.join(LAUNCHERS)} (launcher=local or launcher=slurm)")
    if lc.nnodes < 1:
        raise ConfigError("launcher.nnodes", lc.nnodes, "expected a positive number of nodes")
    if world % lc.nnodes:
        raise ConfigError("launcher.nnodes", lc.nnodes,
                          f"every node runs the same number of workers: size*pp*dp={world} must divide by nnodes")
    if not 0 <= lc.node_rank < lc.nnodes:
        raise ConfigError("launcher.node_rank", lc.node_rank, f"expected 0 <= node_rank < launcher.nnodes={lc.nnodes}")
    if lc.name == "slurm":
        if cfg.device == "cuda" and lc.gpus_per_node != world // lc.nnodes:
            raise ConfigError("launcher.gpus_per_node", lc.gpus_per_node,
                              f"device=cuda runs one worker per GPU: expected size*pp*dp/nnodes={world // lc.nnodes}")
        if lc.time_min < 1:
            raise ConfigError("launcher.time_min", lc.time_min, "expected a positive number of minutes")
        return  # Slurm tells each node its rank and the rendezvous host
    if lc.nnodes > 1 and not lc.rdzv_endpoint:
        raise ConfigError("launcher.rdzv_endpoint", lc.rdzv_endpoint,
                          "several nodes meet at node 0: expected HOST:PORT, reachable from every node")
    if lc.rdzv_endpoint:
        host, _, port = lc.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError("launcher.rdzv_endpoint", lc.rdzv_endpoint, "expected HOST:PORT, e.g. node0.cluster:29500")
        import socket

        try:
            socket.getaddrinfo(host, int(port))
        except (OSError, UnicodeError) as e:
            raise ConfigError("launcher.rdzv_endpoint", lc.rdzv_endpoint,
                              f"the host {host!r} does not resolve here ({getattr(e, 'strerror', None) or e})") from None
    if lc.rdzv_timeout_s < 1:
        raise ConfigError("launcher.rdzv_timeout_s", lc.rdzv_timeout_s, "expected a value >= 1")


def _check_launcher(launcher: Any) -> None:
    import socket

    _check_at_least("launcher.max_restarts", launcher.max_restarts, 0)
    _check_at_least("launcher.collective_timeout_s", launcher.collective_timeout_s, 1)
    if not launcher.monitor_interval_s > 0:
        raise ConfigError("launcher.monitor_interval_s", launcher.monitor_interval_s, "expected a positive number of seconds")
    try:
        socket.getaddrinfo(launcher.master_addr, None)
    except (OSError, UnicodeError) as e:
        raise ConfigError("launcher.master_addr", launcher.master_addr, f"not a host name or address this machine resolves ({e})") from None
    port = launcher.master_port
    if not 0 <= port <= 65535:
        raise ConfigError("launcher.master_port", port, "expected a TCP port 1..65535, or 0 to pick a free one")
    if port:
        # torchrun's rendezvous store listens there: it must be free now.
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((launcher.master_addr, port))
            except OSError as e:
                raise ConfigError("launcher.master_port", port, f"cannot listen there ({e.strerror}): choose a free port, or 0 to pick one") from None


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
        raise ConfigError(key, raw, _one_line(e)) from None


def _check_choice(key: str, value: Any, valid: Iterable[str]) -> None:
    if value not in valid:
        raise ConfigError(key, value, f"expected one of {', '.join(valid)}" + _did_you_mean(str(value), valid))


def _check_at_least(key: str, value: float, low: float) -> None:
    if value < low:
        raise ConfigError(key, value, f"expected a value >= {low}")


def _check_known_keys(cfg: Any, schema: DictConfig, prefix: str) -> None:
    """`+key=value` may add keys that the schema lacks; nothing would read them."""
    for key in cfg.keys():
        full = f"{prefix}{key}"
        if key not in schema.keys():  # (`in` is False for a ??? key)
            value = cfg[key]
            if isinstance(value, DictConfig):
                value = OmegaConf.to_container(value)
            raise ConfigError(full, value, _valid_keys_hint(str(key), list(schema.keys()), prefix))
        if isinstance(schema._get_node(key), DictConfig):
            _check_known_keys(cfg._get_node(key), schema._get_node(key), full + ".")


def _did_you_mean(word: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, [str(c) for c in candidates], n=2)
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


def _valid_keys_hint(word: str, keys: Iterable[Any], prefix: str) -> str:
    keys = [str(k) for k in keys]
    where = f"under {prefix.rstrip('.')!r}" if prefix else "at the top level"
    return f"unknown key; valid keys {where}: {', '.join(keys)}" + _did_you_mean(word, keys)


# --------------------------------------------------------------------------
# Composition of the jobs of a command line
# --------------------------------------------------------------------------


def compose_jobs(overrides: list[str], multirun: bool = False, config_name: str = CONFIG_NAME, config_dir: str | None = None) -> list[DictConfig]:
    """Compose the config of every job that `tpctl train [-m] overrides` runs.

    For a multirun the sweep is expanded the way Hydra's basic sweeper does
    (the cartesian product of the comma-separated values). Any Hydra or
    OmegaConf error becomes a ConfigError naming the override at fault.
    """
    from hydra import compose, initialize_config_dir
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    register_configs()
    parsed = _parse_overrides(overrides)
    if multirun:
        try:
            jobs = BasicSweeper.split_arguments(parsed, max_batch_size=None)[0]
        except HydraException as e:
            raise ConfigError("overrides", " ".join(overrides), _one_line(e)) from None
    else:
        for o in parsed:
            if o.is_sweep_override():
                raise ConfigError(o.get_key_element(), _value_text(o),
                                  "a comma-separated value is a sweep: add -m (--multirun), or write [a,b] for a list or 'a,b' for a string")
        jobs = [list(overrides)]

    # -cd/--config-dir adds a directory to the search path, as Hydra does.
    extra = [f"hydra.searchpath=[file://{Path(config_dir).resolve()}]"] if config_dir else []
    composed = []
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        for job in jobs:
            try:
                composed.append(compose(config_name, overrides=extra + job))
            except (HydraException, OmegaConfBaseException) as e:
                raise _explain(e, OverridesParser.create().parse_overrides(job), config_name) from None
            except Exception as e:  # a file that is not YAML, a defaults list that includes itself
                raise _file_error(e, job, config_dir) from None
    return composed


def _config_file(text: str) -> str:
    """A config file's path as a user names it (recipes/x.yaml, configs/model/y.yaml)."""
    path = Path(text)
    for root in (RECIPE_DIR, CONFIG_DIR):
        try:
            return f"{root.name}/{path.resolve().relative_to(root.resolve())}"
        except ValueError:
            continue
    return text


def _file_error(error: Exception, job: list[str], config_dir: str | None) -> ConfigError:
    """A ConfigError naming the config file at fault when YAML cannot parse
    one, or when a defaults list includes itself (Hydra recurses forever)."""
    import yaml

    if isinstance(error, yaml.YAMLError):
        mark = getattr(error, "problem_mark", None)
        name = _config_file(mark.name) if mark is not None else "a config file"
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or _one_line(str(error))
        return ConfigError("config file", name, f"not valid YAML{where}: {problem}")
    if isinstance(error, RecursionError):
        roots = ([Path(config_dir)] if config_dir else []) + [CONFIG_DIR]
        for override in job:
            group, _, option = override.partition("=")
            cycle = _defaults_cycle([(group.lstrip("+~/"), option)], roots) if option else None
            if cycle is None:
                continue
            files = [_config_file(str(path)) for path in cycle]
            if len(files) == 1:
                return ConfigError("config file", files[0], f"its defaults list includes itself ({group}/{option}): remove that entry")
            return ConfigError("config file", files[0], "the defaults lists include each other in a cycle: "
                               + " -> ".join(files + files[:1]) + ": remove one of those entries")
        return ConfigError("overrides", " ".join(job), "the defaults lists of the chosen configs include each other in a cycle")
    return ConfigError("overrides", " ".join(job), f"{type(error).__name__}: {_one_line(str(error))}")


def _defaults_cycle(chain: list[tuple[str, str]], roots: list[Path]) -> list[Path] | None:
    """The config files of a cycle of defaults lists reached from the last
    (group, option) of `chain` (Hydra recurses forever on one), or None."""
    path = _group_file(*chain[-1], roots)
    if path is None:
        return None
    for included in _defaults_of(path, chain[-1][0]):
        if included in chain:
            return [f for f in (_group_file(*c, roots) for c in chain[chain.index(included):]) if f is not None]
        cycle = _defaults_cycle(chain + [included], roots)
        if cycle is not None:
            return cycle
    return None


def _group_file(group: str, option: str, roots: list[Path]) -> Path | None:
    return next((r / group / f"{option}.yaml" for r in roots if (r / group / f"{option}.yaml").is_file()), None)


def _defaults_of(path: Path, group: str) -> list[tuple[str, str]]:
    """The (group, option) pairs a config file's defaults list names (a
    plain name is of the file's own group)."""
    import yaml

    try:
        defaults = (yaml.safe_load(path.read_text()) or {}).get("defaults") or []
    except (OSError, yaml.YAMLError, AttributeError):
        return []
    pairs = []
    for entry in defaults:
        if isinstance(entry, str) and entry.strip() != "_self_":
            name = entry.removeprefix("override ").strip().strip("/")
            pairs.append(tuple(name.rsplit("/", 1)) if "/" in name else (group, name))
        elif isinstance(entry, dict):
            pairs += [(str(k).removeprefix("override ").strip().strip("/"), str(v)) for k, v in entry.items()
                      if isinstance(v, str)]
    return pairs


def run_dir_setting(overrides: list[str], multirun: bool = False, config_name: str = CONFIG_NAME,
                    config_dir: str | None = None) -> tuple[str, str]:
    """(key, path) of where Hydra will create the run dir: hydra.run.dir, or
    hydra.sweep.dir for -m (whose jobs are sub-dirs of it), as composed."""
    from hydra import compose, initialize_config_dir

    # A sweep (a=1,2) does not compose as one job; the sweep dir rarely
    # depends on swept keys, so compose it from the hydra.* overrides alone.
    job = [o for o in overrides if o.lstrip("+~").startswith("hydra.")] if multirun else list(overrides)
    extra = [f"hydra.searchpath=[file://{Path(config_dir).resolve()}]"] if config_dir else []
    register_configs()
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        try:
            hydra_cfg = compose(config_name, overrides=extra + job, return_hydra_config=True).hydra
            key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
            return key, str(hydra_cfg.sweep.dir if multirun else hydra_cfg.run.dir)
        except OmegaConfBaseException as e:
            raise ConfigError("hydra.run.dir", None, _one_line(e)) from None


def _parse_overrides(overrides: list[str]) -> list:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    for text in overrides:  # one at a time, to name the one that does not parse
        try:
            parser.parse_overrides([text])
        except OverrideParseException as e:
            reason = e.message.splitlines()[1] if len(e.message.splitlines()) > 1 else e.message
            raise ConfigError("override", text, f"expected key=value in Hydra's override syntax ({reason})") from None
    return parser.parse_overrides(overrides)


def _explain(error: Exception, overrides: list, config_name: str) -> ConfigError:
    """Turn a composition error into a ConfigError naming key, value, valid."""
    from hydra import compose
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import MissingConfigException

    # An unknown option of a config group: model=gpt-huge.
    if isinstance(error, MissingConfigException) and error.missing_cfg_file and "/" in error.missing_cfg_file:
        group, option = error.missing_cfg_file.rsplit("/", 1)
        options = GlobalHydra.instance().config_loader().get_group_options(group)
        if options:
            where = _recipe_source(group, overrides)
            return ConfigError(group, option, f"no such {group}{where}; available: {', '.join(options)}" + _did_you_mean(option, options))

    # An error inside a config file (configs/model/x.yaml has a bad key or
    # value): Hydra says "In 'model/x': <error>". Name the file's option.
    in_file = re.match(r"In '([^']+)': (?:\w+ raised while composing config:\n)?(.*)", str(error), re.S)
    if in_file and not isinstance(error, MissingConfigException):
        name, detail = in_file.groups()
        group, option = name.rsplit("/", 1) if "/" in name else ("config", name)
        where = re.search(r"full_key: (\S+)", detail)
        at = f" at {where.group(1)}" if where else ""
        # Recipes live in recipes/ at the repo root (configs/recipe links there).
        path = f"{RECIPE_DIR.name}/{option}.yaml" if group == "recipe" else f"{name}.yaml"
        return ConfigError(group, option, f"the config file {path} is invalid{at}: {_one_line(detail)}")

    cause = _omegaconf_cause(error)
    full_key = getattr(cause, "full_key", None) if cause is not None else None
    override = _override_for(full_key, overrides) if full_key else None
    if override is not None:
        key, value = override.key_or_group, _value_text(override)
        # The config as composed without overrides has every key a job can
        # have: all options of a group share the group's schema.
        reference = compose(config_name, return_hydra_config=True)
        if isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
            hint = _unknown_key_hint(key, reference)
            if hint:
                return ConfigError(key, value, hint)
        if isinstance(cause, ValidationError):
            return ConfigError(key, value, _expected_type(key, reference))
        return ConfigError(key, value, _one_line(cause))
    return ConfigError("overrides", " ".join(o.input_line for o in overrides), _one_line(error))


def _recipe_source(group: str, overrides: list) -> str:
    """' (set in recipes/X.yaml)' when a group option the command line did not
    choose came from the recipe the command line did choose."""
    if any(o.key_or_group.lstrip("/") == group for o in overrides):
        return ""
    recipe = next((o.value() for o in reversed(overrides) if o.key_or_group == "recipe"), None)
    return f" (set in {RECIPE_DIR.name}/{recipe}.yaml)" if isinstance(recipe, str) else ""


def _value_text(override) -> Any:
    """The value of an override as the user wrote it (5 stays 5, abc stays 'abc')."""
    if override.is_sweep_override():
        return override.input_line.split("=", 1)[1]
    value = override.value()
    return value if value is None or isinstance(value, (int, float, bool, str)) else override.get_value_element_as_str()


def _omegaconf_cause(error: BaseException) -> OmegaConfBaseException | None:
    seen = error
    while seen is not None:
        if isinstance(seen, OmegaConfBaseException):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _override_for(full_key: str, overrides: list):
    """The override that set `full_key` or a key below it."""
    for o in reversed(overrides):  # the last one wins, as in Hydra
        key = o.key_or_group
        if key == full_key or key.startswith(full_key + ".") or full_key.startswith(key + "."):
            return o
    return None


def _unknown_key_hint(key: str, reference: DictConfig) -> str | None:
    """Name the first segment of `key` that does not exist, with the keys that do."""
    if key.rsplit(".", 1)[0] == "model.config":  # an open group, empty by default: new keys take a plus
        return f"model.config takes the family's own settings, each added with a plus: +{key}=<value>"
    node, prefix = reference, ""
    for part in key.split("."):
        if not isinstance(node, DictConfig):
            return f"{prefix.rstrip('.')!r} is a value, not a group of keys"
        if part not in node:
            # At the top level, leave Hydra's own `hydra` node out of the list.
            return _valid_keys_hint(part, [k for k in node.keys() if prefix or k != "hydra"], prefix)
        node, prefix = node._get_node(part), f"{prefix}{part}."
    return None


def _expected_type(key: str, reference: DictConfig) -> str:
    from omegaconf import BooleanNode, FloatNode, IntegerNode, StringNode

    node = reference._get_node(key.split(".")[0])
    for part in key.split(".")[1:]:
        node = node._get_node(part) if isinstance(node, DictConfig) else None
    kinds = {IntegerNode: "an integer", FloatNode: "a number", BooleanNode: "true or false", StringNode: "a string"}
    for cls, what in kinds.items():
        if isinstance(node, cls):
            return f"expected {what}" + (" or null" if node._is_optional() else "")
    if isinstance(node, DictConfig):
        return f"expected a group of keys ({', '.join(str(k) for k in node.keys())}); set one with {key}.<name>=<value>"
    return "the value has the wrong type"


def _one_line(error: BaseException | str) -> str:
    """Hydra's messages span lines (and end with the search path): keep the gist."""
    text = str(error).split("\nConfig search path")[0]
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith(("full_key:", "object_type=", "reference_type="))]
    return "; ".join(lines)
