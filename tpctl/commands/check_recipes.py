"""`tpctl check-recipes [--fast] [NAME...]`: run recipes and check what they
must reach (their `recipe:` block, tpctl.schema.RecipeConfig):

  * the final training loss inside the band `final_loss` (`fast_final_loss`
    for the short form that `--fast` runs: the recipe's `fast` overrides);
  * the loss curve, step by step, equal to the curve of the recipe named by
    `equals` within `rel_tol` (relative);
  * the peak resident memory of the largest rank inside `peak_mib`.

Every recipe (and every recipe one of them `equals`) is composed and
validated before any runs: a bad key or value exits 2 with one line naming
the recipe file. Each run is a real `tpctl train recipe=NAME` subprocess
(log every step, so whole curves are compared) in <out>/<name>/, its output
in <out>/<name>.log. Exit 0 when every recipe met its goals, 1 naming each
one that missed (or failed to train), 2 for a bad recipe or usage.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

from tpctl.errors import ConfigError, EXIT_FAILED, EXIT_OK, EXIT_USAGE, TpctlError, fail
from .recipes import compose_recipe, recipe_names, recipe_path
from .run_dir import read_metrics, read_summary, train_command

# A recipe run that takes longer than this is a miss (a hang must not hang CI).
RUN_TIMEOUT_S = {"fast": 300, "full": 3600}


class RecipeError(TpctlError):
    """A recipe that cannot run: (file, one-line reason)."""


def _fast_overrides(name: str, config_dir: str | None) -> list[str]:
    return list(compose_recipe(name, config_dir=config_dir).recipe.fast)


def recipe_runs(names: list[str], fast: bool, config_dir: str | None) -> dict[str, tuple[list[str], object]]:
    """{name: (overrides, composed config)} for `names` and every recipe they
    `equals`, each checked as `tpctl train` would check it."""
    from tpctl.config import validate

    planned: dict[str, tuple[list[str], object]] = {}
    todo = list(names)
    while todo:
        name = todo.pop(0)
        if name in planned:
            continue
        where = recipe_path(name, config_dir)
        try:
            overrides = _fast_overrides(name, config_dir) if fast else []
            cfg = compose_recipe(name, overrides, config_dir)
            validate(cfg)
        except ConfigError as e:
            raise RecipeError(f"{where}: {e}") from None
        r = cfg.recipe
        band = r.fast_final_loss if fast else r.final_loss
        band_key = "recipe.fast_final_loss" if fast else "recipe.final_loss"
        if fast and r.fast_final_loss is None and r.final_loss is not None:
            raise RecipeError(f"{where}: invalid config: recipe.fast_final_loss=None: "
                              "the short form needs its own band: expected [low, high]")
        for key, value in ((band_key, band), ("recipe.peak_mib", r.peak_mib)):
            if value is not None and (len(value) != 2 or not value[0] <= value[1]):
                raise RecipeError(f"{where}: invalid config: {key}={list(value)}: expected [low, high] with low <= high")
        if band is None and not r.equals:
            raise RecipeError(f"{where}: invalid config: recipe.final_loss=None: a recipe must reach something: "
                              "set recipe.final_loss: [low, high] or recipe.equals: <recipe>")
        if r.equals:
            known = recipe_names(config_dir)
            if r.equals not in known:
                raise RecipeError(f"{where}: invalid config: recipe.equals={r.equals!r}: no such recipe; available: {', '.join(known)}")
            if r.equals == name:
                raise RecipeError(f"{where}: invalid config: recipe.equals={r.equals!r}: a recipe cannot equal itself")
            if not r.rel_tol >= 0:
                raise RecipeError(f"{where}: invalid config: recipe.rel_tol={r.rel_tol}: expected a tolerance >= 0")
            todo.append(r.equals)
        planned[name] = (overrides, cfg)
    return planned


def run_order(planned: dict) -> list[str]:
    """Every recipe after the recipe it equals (depth first), else in name order."""
    order: list[str] = []
    visiting: set[str] = set()  # a cycle (a equals b equals a) stops here

    def visit(name: str) -> None:
        if name in order or name in visiting:
            return
        visiting.add(name)
        equals = planned[name][1].recipe.equals
        if equals:
            visit(equals)
        order.append(name)

    for name in sorted(planned):
        visit(name)
    return order


def run_recipe(name: str, overrides: list[str], out_dir: Path, config_dir: str | None, timeout_s: float) -> tuple[int, str]:
    """Train one recipe in its own process group; return (exit status, log tail)."""
    run_dir = out_dir / name
    log_path = out_dir / f"{name}.log"
    cmd = train_command([f"recipe={name}", *overrides, "train.log_every=1", "train.progress=false"], run_dir)
    if config_dir:
        cmd += ["--config-dir", str(config_dir)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            status = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            # Its own session: this stops the launcher and every worker it started.
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            log.write(f"\ncheck-recipes: killed after {timeout_s:.0f}s\n")
            status = -1
    tail = log_path.read_text().strip().splitlines()[-5:]
    return status, "\n".join(tail)


def _timed_run(name: str, overrides: list[str], out_dir: Path, config_dir: str | None, timeout_s: float):
    start = time.monotonic()
    status, tail = run_recipe(name, overrides, out_dir, config_dir, timeout_s)
    return status, tail, time.monotonic() - start


def read_curve(run_dir: Path) -> list[dict]:
    return read_metrics(run_dir)


def read_peak(run_dir: Path) -> int | None:
    """The largest rank's peak resident bytes, as the run's summary reports it."""
    summary = read_summary(run_dir) or {}
    return summary.get("peak_rss_bytes_max_rank")


def check(name: str, cfg, curves: dict[str, list[dict]], fast: bool, peak: int | None = None) -> list[str]:
    """What `name` missed (empty: it met every goal); `peak`: its largest
    rank's peak resident bytes."""
    r = cfg.recipe
    curve = curves[name]
    if not curve:
        return ["no metrics (the run failed)"]
    misses = []
    final = curve[-1]["loss"]
    band = r.fast_final_loss if fast else r.final_loss
    if band is not None and not (band[0] <= final <= band[1]):  # NaN fails too
        misses.append(f"final loss {final:.4f} outside [{band[0]:g}, {band[1]:g}]")
    if r.equals:
        ref = curves.get(r.equals) or []
        if not ref:
            misses.append(f"nothing to compare with: {r.equals} did not train")
        elif [x["step"] for x in ref] != [x["step"] for x in curve]:
            misses.append(f"its steps differ from {r.equals}'s ({len(curve)} vs {len(ref)} logged)")
        else:
            got, want = max(zip(curve, ref), key=lambda pair: _rel(pair[0]["loss"], pair[1]["loss"]))
            rel = _rel(got["loss"], want["loss"])
            if not rel <= r.rel_tol:
                misses.append(f"step {got['step']}: loss {got['loss']:.6f} vs {r.equals} {want['loss']:.6f} "
                              f"(relative {rel:.1e} > rel_tol {r.rel_tol:g})")
    if r.peak_mib is not None:
        mib = math.nan if peak is None else peak / 2**20
        if not r.peak_mib[0] <= mib <= r.peak_mib[1]:
            misses.append(f"peak memory per rank {mib:.1f} MiB outside [{r.peak_mib[0]:g}, {r.peak_mib[1]:g}]")
    return misses


def _rel(a: float, b: float) -> float:
    if math.isnan(a) or math.isnan(b):
        return math.inf
    return abs(a - b) / max(abs(b), 1e-12)


def _summary_line(name: str, cfg, curves: dict, seconds: float, peak: int | None) -> str:
    r, curve = cfg.recipe, curves[name]
    parts = [f"final loss {curve[-1]['loss']:.4f}"] if curve else []
    if r.equals and curves.get(r.equals) and len(curves[r.equals]) == len(curve):
        worst = max(_rel(a["loss"], b["loss"]) for a, b in zip(curve, curves[r.equals]))
        parts.append(f"= {r.equals} within {worst:.1e}")
    if r.peak_mib is not None and peak is not None:
        parts.append(f"peak {peak / 2**20:.0f} MiB per rank in [{r.peak_mib[0]:g}, {r.peak_mib[1]:g}]")
    return f"{name}: ok ({', '.join(parts)}; {seconds:.0f}s)"


def main(args: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tpctl check-recipes",
                                     description="Run recipes and check their loss bands and equalities.")
    parser.add_argument("names", nargs="*", help="recipes to check (default: all)")
    parser.add_argument("--fast", action="store_true", help="the short form of each recipe (its recipe.fast overrides), for CI")
    parser.add_argument("--config-dir", "-cd", help="a config dir whose recipe/*.yaml are recipes too")
    parser.add_argument("--out", help="where the runs go (default: outputs/check-recipes/<date>_<time>)")
    parser.add_argument("--jobs", "-j", type=int, default=1, metavar="N",
                        help="recipes trained at once (default 1); each is checked in order as its runs end")
    parser.error = lambda message: sys.exit(fail(f"tpctl check-recipes: {message}", EXIT_USAGE))
    flags = parser.parse_args(args)
    if flags.jobs < 1:
        return fail(f"tpctl check-recipes: --jobs {flags.jobs}: expected at least 1", EXIT_USAGE)

    known = recipe_names(flags.config_dir)
    for name in flags.names:
        if name not in known:
            return fail(f"invalid config: recipe={name!r}: no such recipe; available: {', '.join(known)}", EXIT_USAGE)
    bad: list[str] = []
    if flags.names:  # asked for by name: all or nothing
        try:
            planned = recipe_runs(flags.names, flags.fast, flags.config_dir)
        except RecipeError as e:
            return fail(str(e), EXIT_USAGE)
    else:  # every recipe: a broken file is named, and the others still run
        planned = {}
        for name in known:
            try:
                planned.update(recipe_runs([name], flags.fast, flags.config_dir))
            except RecipeError as e:
                fail(str(e), EXIT_USAGE)
                bad.append(name)
        if not planned:
            return EXIT_USAGE

    out_dir = Path(flags.out or Path("outputs", "check-recipes", datetime.now().strftime("%Y-%m-%d_%H-%M-%S")))
    out_dir.mkdir(parents=True, exist_ok=True)
    form = "fast" if flags.fast else "full"
    print(f"check-recipes: {len(planned)} recipes ({form} form) in {out_dir}", flush=True)
    curves: dict[str, list[dict]] = {}
    missed = {}
    order = run_order(planned)
    # The runs are independent processes (a recipe's equality only reads the
    # other's curve), so N of them train at once; each is checked, in order,
    # once it and the recipe it equals have ended.
    with ThreadPoolExecutor(max_workers=flags.jobs) as pool:
        runs = {name: pool.submit(_timed_run, name, planned[name][0], out_dir, flags.config_dir, RUN_TIMEOUT_S[form])
                for name in order}
        for name in order:
            status, tail, seconds = runs[name].result()
            curves[name] = read_curve(out_dir / name) if status == 0 else []
            peak = read_peak(out_dir / name) if status == 0 else None
            if status != 0:
                misses = [f"training exited {status} (see {out_dir / name}.log):\n{tail}"]
            else:
                misses = check(name, planned[name][1], curves, flags.fast, peak)
            if misses:
                missed[name] = misses
                print(f"{name}: MISSED: {'; '.join(misses)}", flush=True)
            else:
                print(_summary_line(name, planned[name][1], curves, seconds, peak), flush=True)
    if missed:
        fail(f"check-recipes: {len(missed)} of {len(planned)} recipes missed: {', '.join(missed)}", EXIT_FAILED)
    if bad:
        return fail(f"check-recipes: {len(bad)} recipe(s) could not be checked (see above): {', '.join(bad)}", EXIT_USAGE)
    if missed:
        return EXIT_FAILED
    print(f"check-recipes: all {len(planned)} recipes met their goals")
    return EXIT_OK


