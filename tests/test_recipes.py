"""Recipes: `tpctl train recipe=NAME`, `tpctl recipes`, `tpctl check-recipes`.

The real recipes are run by `.ci/run` (`make check-recipes`, the fast form);
here they are only composed and validated, and check-recipes itself is tested
on tiny throw-away recipes: a missed band and a missed equality must fail it,
naming the recipe; a bad key must exit 2 naming the file and the key.
"""

from __future__ import annotations

import textwrap

import pytest

from cli_support import tpctl  # noqa: F401  (fixture)
from tpctl.commands.check_recipes import recipe_runs
from tpctl.config import RECIPE_DIR, validate
from tpctl.commands.recipes import compose_recipe, recipe_names

# A one-process, three-step recipe on synthetic tokens: seconds to run.
TINY = """\
# @package _global_
defaults:
  - override /model: gpt-tiny
  - override /data: synthetic
mode: none
seed: {seed}
train:
  steps: 3
  batch_size: 4
  seq_len: 16
  eval_every: 0
recipe:
  description: {description}
  final_loss: {band}
  fast: [train.steps=2]
  fast_final_loss: {band}
{extra}
"""


def write_recipe(config_dir, name, seed=0, band="[0.0, 100.0]", description="a test recipe", extra=""):
    (config_dir / "recipe").mkdir(parents=True, exist_ok=True)
    text = TINY.format(seed=seed, band=band, description=description, extra=textwrap.indent(extra, "  ") if extra else "")
    (config_dir / "recipe" / f"{name}.yaml").write_text(text)


def test_every_recipe_composes_and_validates_in_both_forms():
    names = recipe_names()
    assert {"gpt-tiny-none", "gpt-tiny-1d", "gpt-tiny-2d", "gpt-tiny-2.5d", "gpt-tiny-3d",
            "gpt-small-1d", "gpt-small-2d", "gpt-tiny-2d-dp2",
            "gpt-tiny-2d-dp2-zero2", "gpt-tiny-2d-pp2"} <= set(names)
    assert sorted(p.stem for p in RECIPE_DIR.glob("*.yaml")) == names
    for fast in (False, True):
        planned = recipe_runs(names, fast, None)  # raises RecipeError on anything invalid
        assert set(planned) == set(names)
    # The equality family differs from its reference only in the layout.
    reference = compose_recipe("gpt-tiny-none")
    for name in names:
        cfg = compose_recipe(name)
        if cfg.recipe.equals == "gpt-tiny-none":
            for group in ("model", "data", "optim", "train"):
                assert cfg[group] == reference[group], (name, group)
            assert cfg.seed == reference.seed


def test_recipe_sits_between_defaults_and_command_line():
    default = compose_recipe("gpt-tiny-2d")
    assert (default.mode, default.size, default.train.steps) == ("2d", 4, 100)
    cfg = compose_recipe("gpt-tiny-2d", ["train.steps=7", "size=16", "model=gpt-small"])
    assert (cfg.mode, cfg.size, cfg.train.steps, cfg.model.n_layer) == ("2d", 16, 7, 12)
    assert cfg.optim.warmup_steps == 10  # from the recipe it extends (gpt-tiny-none)
    validate(cfg)


@pytest.mark.timeout(60)
def test_recipes_lists_one_line_each(tpctl):
    result = tpctl.run(["recipes"])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines] == recipe_names()
    line = next(line for line in lines if line.startswith("gpt-tiny-3d "))
    assert "3d size=8" in line and "= gpt-tiny-none" in line


@pytest.mark.timeout(60)
@pytest.mark.parametrize("body,expected", [
    ("trian: {steps: 3}\n", ["bad-key.yaml", "trian", "not in 'TrainConfig'"]),
    ("recipe: {final_los: [1, 2]}\n", ["bad-key.yaml", "recipe.final_los", "not in 'RecipeConfig'"]),
    ("mode: 2d\nsize: 3\n", ["bad-key.yaml", "size=3", "square number"]),
    ("recipe: {equals: no-such-recipe}\n", ["bad-key.yaml", "recipe.equals='no-such-recipe'", "no such recipe"]),
])
def test_a_bad_recipe_exits_2_naming_file_and_key(tpctl, body, expected):
    config_dir = tpctl.cwd / "conf"
    (config_dir / "recipe").mkdir(parents=True)
    (config_dir / "recipe" / "bad-key.yaml").write_text("# @package _global_\n" + body)
    result = tpctl.run(["check-recipes", "--fast", "--config-dir", str(config_dir), "--out", str(tpctl.cwd / "out"), "bad-key"])
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for fragment in expected:
        assert fragment in lines[0], lines[0]
    assert not (tpctl.cwd / "out").exists()  # nothing ran


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_recipes_fails_naming_a_missed_band_and_a_missed_equality(tpctl):
    config_dir = tpctl.cwd / "conf"
    write_recipe(config_dir, "reference")
    # A band no model reaches in two steps.
    write_recipe(config_dir, "broken-band", band="[0.0, 0.01]")
    # Another seed is another run: its curve cannot equal the reference's.
    write_recipe(config_dir, "broken-equal", seed=1, extra="equals: reference\nrel_tol: 1.0e-4\n")
    write_recipe(config_dir, "good-equal", extra="equals: reference\n")
    out = tpctl.cwd / "out"
    # Two at a time: each recipe is still checked after the one it equals.
    result = tpctl.run(["check-recipes", "--fast", "--jobs", "2", "--config-dir", str(config_dir), "--out", str(out),
                        "broken-band", "broken-equal", "good-equal"], timeout=280)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "broken-band: MISSED: final loss" in result.stdout and "outside [0, 0.01]" in result.stdout
    assert "broken-equal: MISSED: step " in result.stdout and "vs reference" in result.stdout
    assert "good-equal: ok" in result.stdout and "= reference within 0.0e+00" in result.stdout
    assert "reference: ok" in result.stdout
    assert result.stdout.index("reference: ok") < min(result.stdout.index(f"{n}:") for n in ("broken-equal", "good-equal"))
    assert result.stderr.strip().splitlines()[-1] == "tpctl: error: check-recipes: 2 of 4 recipes missed: broken-band, broken-equal"
    # The fast form ran: two steps, each logged.
    assert len((out / "reference" / "metrics.jsonl").read_text().splitlines()) == 2
    assert tpctl.leftover_pids() == []


def test_a_recipe_s_peak_memory_per_rank_is_checked_against_its_band(tmp_path):
    """recipe.peak_mib: the largest rank's measured peak must land inside
    (the long-sequence pair: cp=4 under the budget its reference exceeds)."""
    from tpctl.commands.check_recipes import RecipeError, check

    planned = recipe_runs(["gpt-tiny-long-cp4"], True, None)
    assert set(planned) == {"gpt-tiny-long-cp4", "gpt-tiny-long-none"}
    cfg = planned["gpt-tiny-long-cp4"][1]
    curve = [{"step": 1, "loss": 5.4}]
    curves = {"gpt-tiny-long-cp4": curve, "gpt-tiny-long-none": curve}
    budget = cfg.recipe.peak_mib[1]
    assert check("gpt-tiny-long-cp4", cfg, curves, True, int((budget - 1) * 2**20)) == []
    over = check("gpt-tiny-long-cp4", cfg, curves, True, int((budget + 1) * 2**20))
    assert over == [f"peak memory per rank {budget + 1:.1f} MiB outside [0, {budget:g}]"]
    assert check("gpt-tiny-long-cp4", cfg, curves, True, None)[0].startswith("peak memory per rank nan MiB")
    reference = planned["gpt-tiny-long-none"][1]
    assert check("gpt-tiny-long-none", reference, curves, True, int((budget - 1) * 2**20))  # it must not fit
    write_recipe(tmp_path, "upside-down", extra="peak_mib: [2.0, 1.0]\n")
    with pytest.raises(RecipeError, match=r"invalid config: recipe.peak_mib=\[2.0, 1.0\]: expected \[low, high\]"):
        recipe_runs(["upside-down"], False, str(tmp_path))
