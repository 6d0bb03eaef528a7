"""Composition of the jobs a command line asks for, with Hydra's Compose
API: the schema registered in its ConfigStore, sweeps expanded, and every
Hydra or OmegaConf error turned into one ConfigError naming the override or
the config file at fault."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, open_dict
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from tpctl.errors import ConfigError
from tpctl.parallel.registry import import_mode_module
from tpctl.schema import TrainConfig

from .messages import did_you_mean, expected_type, one_line, valid_keys_hint

# configs/ lives at the repository root, next to the package (the install is
# editable, see the Makefile).
CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
CONFIG_NAME = "train"
# Named experiments; configs/recipe is a link to this folder, so Hydra sees
# each file as an option of the `recipe` group (`tpctl train recipe=NAME`).
RECIPE_DIR = CONFIG_DIR.parent / "recipes"
# Hardware profiles (layout=auto, tpctl plan): no Hydra group, so `hardware=NAME` is a plain key.
HARDWARE_DIR = CONFIG_DIR / "hardware_profiles"


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


def compose_jobs(overrides: list[str], multirun: bool = False, config_name: str = CONFIG_NAME, config_dir: str | None = None) -> list[DictConfig]:
    """Compose the config of every job that `tpctl train [-m] overrides` runs.

    For a multirun the sweep is expanded the way Hydra's basic sweeper does
    (the cartesian product of the comma-separated values). Any Hydra or
    OmegaConf error becomes a ConfigError naming the override at fault; a
    `mode_module` that does not import, one naming it.
    """
    return _compose(overrides, multirun, config_name, config_dir, None)


def compose_run(overrides: list[str], config_name: str = CONFIG_NAME,
                config_dir: str | None = None) -> tuple[list[DictConfig], tuple[str, str]]:
    """`compose_jobs` of one job (no -m) and its `run_dir_setting`, from one
    composition: Hydra composes a config in ~0.2 CPU-s, a share of `tpctl
    train --check`'s few seconds."""
    found: list = []
    jobs = _compose(overrides, False, config_name, config_dir, found)
    return jobs, ("hydra.run.dir", found[0])


def _compose(overrides: list[str], multirun: bool, config_name: str, config_dir: str | None,
             run_dirs: list | None) -> list[DictConfig]:
    """compose_jobs; `run_dirs`: a list to append each job's hydra.run.dir to
    (resolved as composed, then the hydra node dropped as Hydra's compose does)."""
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
            raise ConfigError("overrides", " ".join(overrides), one_line(e)) from None
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
                cfg = compose(config_name, overrides=extra + job, return_hydra_config=run_dirs is not None)
            except (HydraException, OmegaConfBaseException) as e:
                raise _explain(e, OverridesParser.create().parse_overrides(job), config_name) from None
            except Exception as e:  # a file that is not YAML, a defaults list that includes itself
                raise _file_error(e, job, config_dir) from None
            if run_dirs is not None:
                try:  # as run_dir_setting says it
                    run_dirs.append(str(cfg.hydra.run.dir))
                except OmegaConfBaseException as e:
                    raise ConfigError("hydra.run.dir", None, one_line(e)) from None
                with open_dict(cfg):
                    del cfg["hydra"]
            composed.append(cfg)
            # A mode defined outside tpctl exists from here on: every command
            # (train, plan, bench, inspect) looks it up by name.
            import_mode_module(composed[-1].get("mode_module"))
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
        problem = getattr(error, "problem", None) or one_line(str(error))
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
    return ConfigError("overrides", " ".join(job), f"{type(error).__name__}: {one_line(str(error))}")


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
            raise ConfigError("hydra.run.dir", None, one_line(e)) from None


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
            return ConfigError(group, option, f"no such {group}{where}; available: {', '.join(options)}" + did_you_mean(option, options))

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
        return ConfigError(group, option, f"the config file {path} is invalid{at}: {one_line(detail)}")

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
            return ConfigError(key, value, expected_type(key, reference))
        return ConfigError(key, value, one_line(cause))
    return ConfigError("overrides", " ".join(o.input_line for o in overrides), one_line(error))


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
            return valid_keys_hint(part, [k for k in node.keys() if prefix or k != "hydra"], prefix)
        node, prefix = node._get_node(part), f"{prefix}{part}."
    return None
