"""`tpctl recipes`: the named experiments in recipes/, one line each.

A recipe is a Hydra config (`# @package _global_`) in the `recipe` group
(configs/recipe links to recipes/), so `tpctl train recipe=NAME k=v` composes
defaults < recipe < command line. Its `recipe:` block says what the run must
reach (tpctl.schema.RecipeConfig); `tpctl check-recipes` checks it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from omegaconf import DictConfig

from tpctl.config import RECIPE_DIR, compose_jobs
from tpctl.errors import ConfigError, error
from tpctl.parallel.layout import Layout


def recipe_dirs(config_dir: str | None = None) -> list[Path]:
    """Where recipes are found: recipes/, then <config_dir>/recipe (as Hydra
    searches them with -cd/--config-dir)."""
    dirs = [RECIPE_DIR]
    if config_dir:
        dirs.append(Path(config_dir) / "recipe")
    return dirs


def recipe_names(config_dir: str | None = None) -> list[str]:
    names = {p.stem for d in recipe_dirs(config_dir) if d.is_dir() for p in d.glob("*.yaml")}
    return sorted(names)


def recipe_path(name: str, config_dir: str | None = None) -> str:
    """The file a recipe comes from, as a user would name it."""
    for d in reversed(recipe_dirs(config_dir)):  # an added dir wins, as in Hydra
        path = d / f"{name}.yaml"
        if path.exists():
            return f"{RECIPE_DIR.name}/{path.name}" if d == RECIPE_DIR else str(path)
    return f"{RECIPE_DIR.name}/{name}.yaml"


def compose_recipe(name: str, overrides: list[str] = (), config_dir: str | None = None) -> DictConfig:
    """The config `tpctl train recipe=NAME *overrides` would run; ConfigError
    if it does not compose (a bad key in the recipe file is named there)."""
    cfg = compose_jobs([f"recipe={name}", *overrides], config_dir=config_dir)[0]
    cfg.recipe.name = name
    return cfg


def describe(cfg: DictConfig) -> str:
    """One line: layout, model, data, length, optimizer, and what it must reach."""
    layout = Layout.from_config(cfg).label()
    r = cfg.recipe
    goals = []
    if r.final_loss is not None:
        goals.append(f"loss in [{r.final_loss[0]:g}, {r.final_loss[1]:g}]")
    if r.equals:
        goals.append(f"= {r.equals}")
    if r.peak_mib is not None:
        goals.append(f"peak MiB/rank in [{r.peak_mib[0]:g}, {r.peak_mib[1]:g}]")
    m = cfg.model
    sized = m.arch != "custom" and not m.get("pretrained")
    model = f"{m.arch} {m.n_layer}x{m.n_embd}" if sized else str(m.get("_target_") or m.get("pretrained") or m.arch)
    return (f"{cfg.recipe.name:<18} {layout:<22} {model:<12} {cfg.data.name:<9} "
            f"{cfg.train.steps:>4} steps  {cfg.optim.name} lr={cfg.optim.lr:g}  {'; '.join(goals)}  # {r.description}")


def main(args: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tpctl recipes", description="List the recipes (recipes/*.yaml), one line each.")
    parser.add_argument("--config-dir", "-cd", help="also list <dir>/recipe/*.yaml")
    flags = parser.parse_args(args)
    status = 0
    for name in recipe_names(flags.config_dir):
        try:
            print(describe(compose_recipe(name, config_dir=flags.config_dir)))
        except ConfigError as e:
            error(f"{recipe_path(name, flags.config_dir)}: {e}")
            status = 2
    return status
