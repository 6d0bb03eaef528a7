"""The `tpctl` command line.

    tpctl train [Hydra overrides] [-m] [--cfg job] [--dry-run] [--help] [hydra.run.dir=PATH]
    tpctl recipes | check-recipes    (tpctl/recipes.py, tpctl/check_recipes.py)

The flow of `tpctl train` (DESIGN.md, section 2), one call per arrow:
  compose every job of the command line and validate it   (`_check_jobs`)
  → Hydra runs each job: write the resolved config.yaml into its run dir,
    prepare the data once, start the workers              (`_train_job`)
  →   plan     per-rank memory, FLOPs, bytes/calls per collective and predicted step time of every split:
             tpctl plan model=gpt-small world=64 hardware=h100 [--json]
  bench    run modes side by side on one model and world (with PyTorch's own TP as a baseline):
             tpctl bench model=gpt-tiny size=4 modes=[1d,dtensor,2d]

exit status: 0 trained, 1 training failed, 2 bad config or usage,
    130 interrupted (Ctrl-C).
Every config error is found before Hydra creates a run dir and before any
worker starts, and is printed as one line: `tpctl: error: <message>`.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

from .config import (CONFIG_DIR, CONFIG_NAME, check_writable_dir, compose_jobs, load_worker_config, register_configs,
                     run_dir_setting, validate)
from .errors import ConfigError

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

USAGE = """\
usage: tpctl <command> [arguments]

commands:
  train    train a model with tensor parallelism; arguments are Hydra overrides:
             tpctl train mode=2d size=4 model=gpt-tiny train.steps=100
             tpctl train -m mode=1d size=2,4        (one run per value)
             tpctl train --cfg job                  (print the config, run nothing)
             tpctl train --help                     (groups, options and flags)
             tpctl train --dry-run launcher=slurm launcher.nnodes=2 ...  (print the submission)
  inspect  what the rewrite does to a model in a mode (roles, layers, shard shapes), no training:
             tpctl inspect model=hf model.arch=llama mode=3d size=8
  export   write a checkpoint's full weights (safetensors; a from_pretrained directory for model=hf):
             tpctl export outputs/.../checkpoints/step_200 model.safetensors
  recipes  list the named experiments in recipes/ (tpctl train recipe=NAME [overrides])
  check-recipes [--fast] [NAME...]
           run recipes and check their loss bands and equalities (--fast: CI's short form)
  plan     per-rank memory, FLOPs, bytes/calls per collective and predicted step time of every split:
             tpctl plan model=gpt-small world=64 hardware=h100 [--json]
  bench    run modes side by side on one model and world (with PyTorch's own TP as a baseline):
             tpctl bench model=gpt-tiny size=4 modes=[1d,dtensor,2d]
  report   PNG plots (loss, tokens/s, comm bytes/step) of run dirs:
             tpctl report outputs/2026-01-01/12-00-00 ... [--out DIR]

exit status: 0 trained, 1 training failed, 2 bad config or usage, 130 interrupted
"""

# The other commands: name -> module with `main(args) -> int`.
COMMANDS = {
    "inspect": "tpctl.inspect",
    "export": "tpctl.export",
    "recipes": "tpctl.recipes",
    "check-recipes": "tpctl.check_recipes",
    "plan": "tpctl.plan",
    "bench": "tpctl.bench",
    "report": "tpctl.report",
}

# Run dirs of the jobs whose training failed (a multirun goes on to its other jobs).
_failed_runs: list[Path] = []
# `tpctl train --dry-run`: write each job's config.yaml, print its launch or
# Slurm submission, start nothing.
_dry_run = False
# Every job of a multirun, in order, for its comparison (tpctl/compare.py):
# {"job": n, "overrides": [...], "run_dir": path, "status": ok|failed|skipped, "reason": ...}
_sweep_jobs: list[dict] = []


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(USAGE, file=sys.stderr, end="")
        sys.exit(EXIT_USAGE)
    command, rest = args[0], args[1:]
    if command in ("-h", "--help", "help"):
        print(USAGE, end="")
        sys.exit(EXIT_OK)
    if command == "train":
        sys.exit(train(rest))
    if command in COMMANDS:
        import importlib

        sys.exit(importlib.import_module(COMMANDS[command]).main(rest))
    sys.exit(_usage_error(f"unknown command {command!r}; expected one of: {', '.join(['train', *COMMANDS])} (see tpctl --help)"))


def train(args: list[str]) -> int:
    """`tpctl train ARGS`: check every job, then hand ARGS to Hydra."""
    from hydra._internal.utils import get_args_parser

    global _dry_run
    # tpctl's own flag (Hydra's parser does not know it): print what would be
    # launched or submitted, start nothing.
    _dry_run = "--dry-run" in args
    args = [a for a in args if a != "--dry-run"]

    parser = get_args_parser()  # Hydra's own flags, so nothing differs
    parser.error = lambda message: sys.exit(_usage_error(f"tpctl train: {message} (see tpctl train --help)"))
    flags = parser.parse_args(args)
    if flags.config_path:
        return _usage_error("--config-path/-cp is not supported; add a config directory with --config-dir/-cd")
    informational = flags.help or flags.hydra_help or flags.shell_completion or flags.info
    if not informational:
        status = _check_jobs(flags.overrides, flags.multirun, flags.config_name or CONFIG_NAME, flags.config_dir, validate_values=not flags.cfg)
        if status != EXIT_OK:
            return status

    _failed_runs.clear()
    _sweep_jobs.clear()
    sys.argv = ["tpctl train", *args]  # Hydra parses sys.argv
    _run_hydra()
    if _sweep_jobs:
        from .compare import write_comparison

        sweep_dir = Path(_sweep_jobs[0]["sweep_dir"])
        write_comparison(sweep_dir, _sweep_jobs)
        print(f"tpctl: compared {len(_sweep_jobs)} jobs in {sweep_dir / 'comparison.md'}")
    if _failed_runs:
        print(f"tpctl: error: training failed in {', '.join(map(str, _failed_runs))}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _check_jobs(overrides: list[str], multirun: bool, config_name: str, config_dir: str | None, validate_values: bool) -> int:
    """Compose and validate every job before Hydra creates any run dir.
    `--cfg` only prints a config, so it needs composition, not valid values.

    A sweep crosses values, and some combinations are invalid (mode=2d
    size=8): those jobs are skipped with one line each and the others run
    (Hydra still numbers them; `_train_job` skips them). A job that does not
    compose (a misspelt key) fails the whole command, as does a sweep with no
    valid job at all."""
    try:
        jobs = compose_jobs(overrides, multirun, config_name, config_dir)
        if validate_values:  # else Hydra fails with a traceback creating it
            check_writable_dir(*run_dir_setting(overrides, multirun, config_name, config_dir))
    except ConfigError as e:
        return _config_error(e)
    if not validate_values:
        return EXIT_OK
    errors = []
    for cfg in jobs:
        try:
            validate(cfg)
            errors.append(None)
        except ConfigError as e:
            errors.append(e)
    if all(errors):  # nothing would run: the first reason, as for one job
        return _config_error(errors[0])
    for job, (cfg, error) in enumerate(zip(jobs, errors)):
        if error is not None:
            print(f"tpctl: skipping job {job} ({_layout(cfg)}): {error}", file=sys.stderr)
    return EXIT_OK


def _layout(cfg) -> str:
    return f"mode={cfg.mode} size={cfg.size}" + (f" depth={cfg.depth}" if cfg.depth != 1 else "") + (f" dp={cfg.dp}" if cfg.dp != 1 else "")


def _run_hydra() -> None:
    import hydra

    register_configs()
    hydra.main(config_path=str(CONFIG_DIR), config_name=CONFIG_NAME, version_base="1.3")(_train_job)()


def _train_job(cfg) -> None:
    """One Hydra job: config.yaml → data → workers."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    from .launcher import launch

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    job = None
    if hydra_cfg.mode == RunMode.MULTIRUN:
        job = {"job": hydra_cfg.job.num, "overrides": list(hydra_cfg.overrides.task), "run_dir": str(run_dir),
               "sweep_dir": hydra_cfg.sweep.dir, "status": "ok", "reason": None}
        _sweep_jobs.append(job)
        try:
            validate(cfg)
        except ConfigError as e:  # `_check_jobs` said so already, one line
            job.update(status="skipped", reason=str(e))
            return
    try:
        validate(cfg)  # already checked; this is the config Hydra actually runs
        # The run dir records which recipe it ran (the file name is its name).
        cfg.recipe.name = HydraConfig.get().runtime.choices.get("recipe")
        config_path = run_dir / "config.yaml"
        OmegaConf.save(OmegaConf.to_container(cfg, resolve=True), config_path)
        # From here on, the parent sees exactly what every worker will read.
        run_cfg = load_worker_config(config_path)
        from .data import prepare_data  # imported late: config checks never need it

        prepare_data(run_cfg)  # builds the tokenised corpus cache once, here
    except ConfigError as e:
        sys.exit(_config_error(e))
    except Exception as e:
        traceback.print_exc()
        print(f"tpctl: error: preparing the run failed: {e}", file=sys.stderr)
        _failed_runs.append(run_dir)
        if job is not None:
            job.update(status="failed", reason=f"preparing the run failed: {e}")
        return

    try:
        _check_resume(run_cfg, run_dir)
    except ConfigError as e:
        sys.exit(_config_error(e))
    if run_cfg.launcher.name == "slurm":
        from . import slurm

        if _dry_run:
            print(slurm.dry_run(run_cfg, run_dir))
            return
        status = slurm.submit(run_cfg, run_dir)
    elif _dry_run:
        lc = run_cfg.launcher
        print(f"tpctl: dry run: would start {run_cfg.size * run_cfg.dp // lc.nnodes} workers here "
              f"(node {lc.node_rank} of {lc.nnodes}) reading {run_dir / 'config.yaml'}; nothing started")
        return
    else:
        status = launch(run_cfg, run_dir)
    if status > 128:  # interrupted: stop here, and stop a multirun too
        sys.exit(status)
    if status != EXIT_OK:
        _failed_runs.append(run_dir)
        if job is not None:
            job.update(status="failed", reason=f"exit status {status}")


def _check_resume(cfg, run_dir: Path) -> None:
    """train.resume=auto needs the run dir: check here, before any worker,
    that its newest valid checkpoint is of this model (warning about each
    invalid one passed over)."""
    if cfg.train.resume is None:
        return
    from .checkpoint import CheckpointError, resolve_resume

    try:
        found = resolve_resume(cfg, run_dir)
    except CheckpointError as e:
        raise ConfigError("train.resume", cfg.train.resume, str(e)) from None
    if found is None and cfg.train.resume == "auto":
        print(f"tpctl: no checkpoint in {run_dir / 'checkpoints'}; starting fresh", file=sys.stderr)
    elif found is not None:
        from .checkpoint import config_changes

        changes = config_changes(found[1], cfg)
        if changes:  # allowed, but the curve will not be the uninterrupted one
            print(f"tpctl: note: resuming {found[0]} with other settings: {'; '.join(changes)}", file=sys.stderr)


def _config_error(error: ConfigError) -> int:
    print(f"tpctl: error: {error}", file=sys.stderr)
    return EXIT_USAGE


def _usage_error(message: str) -> int:
    print(f"tpctl: error: {message}", file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
    main()
