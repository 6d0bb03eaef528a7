"""`tpctl train`: compose, check, and run a training job (or a sweep of them).

    tpctl train [Hydra overrides] [-m] [--cfg job] [--dry-run] [--check] [--help] [hydra.run.dir=PATH]

The flow (docs/DESIGN.md, section 2), one call per arrow:
  compose every job of the command line and validate it, then check its
    predicted peak memory per rank fits                    (`_check_jobs`;
    `--check` prints that table and stops there: cost/memory_check.py)
  → Hydra runs each job: write the resolved config.yaml into its run dir,
    prepare the data once, start the workers              (`TrainRun.train_job`)
  → the launcher waits for the workers and reports the failed rank.
Every config error is found before Hydra creates a run dir and before any
worker starts, and is printed as one line: `tpctl: error: <message>`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from tpctl.config import (CONFIG_DIR, CONFIG_NAME, check_writable_dir, compose_jobs, compose_run, load_worker_config,
                          register_configs, run_dir_setting, validate)
from tpctl.errors import ConfigError, EXIT_FAILED, EXIT_OK, EXIT_USAGE, error, fail, one_line
from tpctl.parallel.layout import Layout
from tpctl.launch.run_lock import RunDirBusy, RunDirLock, probe

from .auto_layout import resolve_overrides, wants_auto



def main(args: list[str]) -> int:
    """`tpctl train ARGS`: check every job, then hand ARGS to Hydra."""
    from hydra._internal.utils import get_args_parser

    from tpctl.launch.warm import allow_fork_start

    allow_fork_start()  # before validation runs a tensor op

    # tpctl's own flag (Hydra's parser does not know it): print what would be
    # launched or submitted, start nothing.
    run = TrainRun(dry_run="--dry-run" in args)
    # --check: validate as train does, print each rank's predicted peak
    # memory beside what it has, start nothing (exit 2 where it will not fit).
    check_only = "--check" in args
    args = [a for a in args if a not in ("--dry-run", "--check")]

    parser = get_args_parser()  # Hydra's own flags, so nothing differs
    parser.error = lambda message: sys.exit(fail(f"tpctl train: {message} (see tpctl train --help)"))
    flags = parser.parse_args(args)
    if flags.config_path:
        return fail("--config-path/-cp is not supported; add a config directory with --config-dir/-cd")
    informational = flags.help or flags.hydra_help or flags.shell_completion or flags.info
    owner = None
    if not informational:
        config_name = flags.config_name or CONFIG_NAME
        if wants_auto(flags.overrides):
            try:
                picked = resolve_overrides(flags.overrides, flags.multirun, config_name, flags.config_dir)
            except ConfigError as e:
                return fail(str(e))
            args = [a for a in args if a not in flags.overrides] + picked
            flags.overrides = picked
        checked = _check_jobs(flags.overrides, flags.multirun, config_name, flags.config_dir,
                              validate_values=not flags.cfg, dry_run=run.dry_run, show_memory=check_only)
        if checked.status != EXIT_OK or check_only:
            return checked.status
        if not flags.cfg:
            try:
                owner, args = _own_run_dir(args, flags.overrides, checked.run_dir, checked.node_rank)
            except RunDirBusy as e:
                return fail(str(e))

    sys.argv = ["tpctl train", *args]  # Hydra parses sys.argv
    try:
        run.run_hydra()
    finally:
        if owner is not None:
            owner.release()
    if run.sweep_jobs:
        from .compare import write_comparison

        sweep_dir = Path(run.sweep_jobs[0]["sweep_dir"])
        write_comparison(sweep_dir, run.sweep_jobs)
        print(f"tpctl: compared {len(run.sweep_jobs)} jobs in {sweep_dir / 'comparison.md'}")
    if run.failed_runs:
        return fail(f"training failed in {', '.join(map(str, run.failed_runs))}", EXIT_FAILED)
    if run.refused_runs:  # the launcher has printed the one line
        return EXIT_USAGE
    return EXIT_OK


def _own_run_dir(args: list[str], overrides: list[str], setting: tuple[str, str], node_rank: int):
    """(the lock of the dir Hydra will write into, the args that pin Hydra to
    it). One command owns a run dir (a sweep dir for -m) from before its
    first file until it exits (launch/run_lock.py). The default dir holds
    the time (${now:...}): pinned as composed by `_check_jobs`, so the dir
    Hydra creates is the one checked and locked."""
    key, run_dir = setting
    lock = RunDirLock(run_dir, node_rank)
    if not any(o.lstrip("+~").split("=", 1)[0] == key for o in overrides):
        quoted = run_dir.replace("\\", "\\\\").replace("'", "\\'")
        args = [*args, f"{key}='{quoted}'"]
    return lock, args


@dataclass
class _Checked:
    """What `_check_jobs` found: the exit status (EXIT_OK: go on), and for a
    run that goes on, where Hydra will write ((key, path)) and this node's rank."""

    status: int
    run_dir: tuple[str, str] | None = None
    node_rank: int = 0


def _check_jobs(overrides: list[str], multirun: bool, config_name: str, config_dir: str | None, validate_values: bool,
                dry_run: bool = False, show_memory: bool = False) -> _Checked:
    """Compose and validate every job before Hydra creates any run dir, and
    refuse one whose predicted peak memory per rank will not fit
    (`show_memory`: print each job's table, --check). `--cfg` only prints a
    config, so it needs composition, not valid values.

    A sweep crosses values, and some combinations are invalid (mode=2d
    size=8): those jobs are skipped with one line each and the others run
    (Hydra still numbers them; `_train_job` skips them). A job that does not
    compose (a misspelt key) fails the whole command, as does a sweep with no
    valid job at all."""
    try:
        if validate_values and not multirun:  # one composition gives the job and its run dir
            jobs, run_dir = compose_run(overrides, config_name, config_dir)
        else:
            jobs = compose_jobs(overrides, multirun, config_name, config_dir)
        if validate_values:  # else Hydra fails with a traceback creating it
            if multirun:
                run_dir = run_dir_setting(overrides, multirun, config_name, config_dir)
            check_writable_dir(*run_dir)
    except ConfigError as e:
        return _Checked(fail(str(e)))
    if not validate_values:
        return _Checked(EXIT_OK)
    node_rank = int(jobs[0].launcher.node_rank) if jobs[0].launcher.nnodes > 1 else 0
    try:  # refused at once (before the slow checks) when another run owns the dir
        probe(run_dir[1], node_rank)
    except RunDirBusy as e:
        return _Checked(fail(str(e)))
    errors = []
    for cfg in jobs:
        try:
            built = validate(cfg)
        except ConfigError as e:
            errors.append(e)
            continue
        try:
            check_run_inputs(cfg, dry_run)
            check_memory(cfg, built, show_memory)
            errors.append(None)
        except ConfigError as e:
            errors.append(e)
        except Exception as e:  # e.g. the data cache cannot be written (ENOSPC): not the config's fault
            return _Checked(fail(f"preparing the data failed: {one_line(e)}", EXIT_FAILED))
    if all(errors):  # nothing would run: the first reason, as for one job
        return _Checked(fail(str(errors[0])))
    for job, (cfg, refusal) in enumerate(zip(jobs, errors)):
        if refusal is not None:
            print(f"tpctl: skipping job {job} (mode={Layout.from_config(cfg).label()}): {refusal}", file=sys.stderr)
    return _Checked(EXIT_OK, run_dir, node_rank)


def check_run_inputs(cfg, dry_run: bool) -> None:
    """ConfigError for what the config names but a worker would only find
    out on reading it: the data (an empty file, too few tokens: prepared
    here, so the workers find its cache) and the Slurm client."""
    if cfg.launcher.name == "slurm" and not dry_run:
        import importlib.util

        from tpctl.launch.slurm import SUBMITIT_MISSING

        if importlib.util.find_spec("submitit") is None:
            raise ConfigError("launcher.name", "slurm", SUBMITIT_MISSING + "; --dry-run shows the submission without it")
    from tpctl.data.corpora import prepare_data  # imported late: --cfg never needs it

    prepare_data(cfg)


def check_memory(cfg, built, show: bool = False) -> None:
    """ConfigError where a rank's predicted peak is above its memory
    (cost/memory_check.py: the planner's dry run on the meta device, of
    `built`, what validate returned); `show`: print the per-rank table first
    (--check). A model the planner cannot cost (a plugin mode without cost
    hooks) is not checked: --check says so."""
    from tpctl.cost.memory_check import predict, render

    found = predict(cfg, built=built)
    if show:
        print(render(found, cfg), flush=True)
    refusal = found.refusal(cfg)
    if refusal is not None:
        raise refusal


def _check_resume(cfg, run_dir: Path) -> None:
    """train.resume=auto needs the run dir: check here, before any worker,
    that its newest valid checkpoint is of this model (warning about each
    invalid one passed over)."""
    if cfg.train.resume is None:
        return
    from tpctl.checkpoint import CheckpointError, resolve_resume

    try:
        found = resolve_resume(cfg, run_dir)
    except CheckpointError as e:
        raise ConfigError("train.resume", cfg.train.resume, str(e)) from None
    if found is None and cfg.train.resume == "auto":
        print(f"tpctl: no checkpoint in {run_dir / 'checkpoints'}; starting fresh", file=sys.stderr)
    elif found is not None:
        from tpctl.checkpoint import config_changes

        changes = config_changes(found[1], cfg)
        if changes:  # allowed, but the curve will not be the uninterrupted one
            print(f"tpctl: note: resuming {found[0]} with other settings: {'; '.join(changes)}", file=sys.stderr)


class TrainRun:
    """What one `tpctl train` command line collects while Hydra runs its
    jobs (one, or one per point of a multirun sweep)."""

    def __init__(self, dry_run: bool):
        # --dry-run: write each job's config.yaml, print its launch or Slurm
        # submission, start nothing.
        self.dry_run = dry_run
        # Run dirs of the jobs whose training failed (a multirun goes on to its other jobs).
        self.failed_runs: list[Path] = []
        # Run dirs of the jobs whose workers refused to train (exit 2: the
        # start-up verification found the rewrite differs from the model).
        self.refused_runs: list[Path] = []
        # Every job of a multirun, in order, for its comparison (commands/compare.py):
        # {"job": n, "overrides": [...], "run_dir": path, "status": ok|failed|skipped, "reason": ...}
        self.sweep_jobs: list[dict] = []

    def run_hydra(self) -> None:
        import hydra

        register_configs()

        def train_job(cfg) -> None:  # Hydra inspects a plain function's signature
            self.train_job(cfg)

        hydra.main(config_path=str(CONFIG_DIR), config_name=CONFIG_NAME, version_base="1.3")(train_job)()


    def train_job(self, cfg) -> None:
        """One Hydra job: config.yaml → data → workers."""
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode
        from omegaconf import OmegaConf

        from tpctl.launch.local import launch

        hydra_cfg = HydraConfig.get()
        run_dir = Path(hydra_cfg.runtime.output_dir)
        job = None
        if hydra_cfg.mode == RunMode.MULTIRUN:
            job = {"job": hydra_cfg.job.num, "overrides": list(hydra_cfg.overrides.task), "run_dir": str(run_dir),
                   "sweep_dir": hydra_cfg.sweep.dir, "status": "ok", "reason": None}
            self.sweep_jobs.append(job)
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
            from tpctl.data.corpora import prepare_data  # imported late: config checks never need it

            prepare_data(run_cfg)  # builds the tokenised corpus cache once, here
            _check_compiler(run_cfg)
        except ConfigError as e:
            sys.exit(fail(str(e)))
        except Exception as e:  # not the config's fault (a full disk): one line
            error(f"preparing the run failed: {one_line(e)}")
            self.failed_runs.append(run_dir)
            if job is not None:
                job.update(status="failed", reason=f"preparing the run failed: {e}")
            return

        try:
            _check_resume(run_cfg, run_dir)
            c = run_cfg.checkpoint
            if c.every > 0 or c.at_end:  # else the first save would fail, mid-run
                check_writable_dir("hydra.run.dir", run_dir / "checkpoints")
        except ConfigError as e:
            sys.exit(fail(str(e)))
        if run_cfg.launcher.name == "slurm":
            from tpctl.launch import slurm

            if self.dry_run:
                print(slurm.dry_run(run_cfg, run_dir))
                return
            status = slurm.submit(run_cfg, run_dir)
        elif self.dry_run:
            lc = run_cfg.launcher
            print(f"tpctl: dry run: would start {Layout.from_config(run_cfg).world // lc.nnodes} workers here "
                  f"(node {lc.node_rank} of {lc.nnodes}) reading {run_dir / 'config.yaml'}; nothing started")
            return
        else:
            status = launch(run_cfg, run_dir)
        if status > 128:  # interrupted: stop here, and stop a multirun too
            sys.exit(status)
        if status != EXIT_OK:
            (self.refused_runs if status == EXIT_USAGE else self.failed_runs).append(run_dir)
            if job is not None:
                job.update(status="failed", reason=f"exit status {status}")


def _check_compiler(cfg) -> None:
    """train.compile=true: compile a tiny function on the device before any
    worker starts (a compiler that is there but fails is refused here)."""
    from tpctl.training.compile import compile_setting, preflight

    problem = preflight(compile_setting(cfg), cfg.device)
    if problem:
        raise ConfigError("train.compile", "true", f"{problem}: use train.compile=false, or auto to fall back to eager")


