"""The `tpctl` command line.

    tpctl train [Hydra overrides] [-m] [--cfg job] [--help] [hydra.run.dir=PATH]

The flow of `tpctl train` (DESIGN.md, section 2), one call per arrow:
  compose every job of the command line and validate it   (`_check_jobs`)
  → Hydra runs each job: write the resolved config.yaml into its run dir,
    prepare the data once, start the workers              (`_train_job`)
  → exit status: 0 trained, 1 training failed, 2 bad config or usage,
    130 interrupted (Ctrl-C).
Every config error is found before Hydra creates a run dir and before any
worker starts, and is printed as one line: `tpctl: error: <message>`.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

from .config import CONFIG_DIR, CONFIG_NAME, compose_jobs, load_worker_config, register_configs, validate
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
  report   PNG plots (loss, tokens/s, comm bytes/step) of run dirs:
             tpctl report outputs/2026-01-01/12-00-00 ... [--out DIR]

exit status: 0 trained, 1 training failed, 2 bad config or usage, 130 interrupted
"""

# Commands living in their own module, tpctl/<module>.py, with main(args) -> int.
COMMANDS = {"report": "report"}

# Run dirs of the jobs whose training failed (a multirun goes on to its other jobs).
_failed_runs: list[Path] = []


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

        sys.exit(importlib.import_module(f"tpctl.{COMMANDS[command]}").main(rest))
    sys.exit(_usage_error(f"unknown command {command!r}; expected: {', '.join(['train', *COMMANDS])} (see tpctl --help)"))


def train(args: list[str]) -> int:
    """`tpctl train ARGS`: check every job, then hand ARGS to Hydra."""
    from hydra._internal.utils import get_args_parser

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
    sys.argv = ["tpctl train", *args]  # Hydra parses sys.argv
    _run_hydra()
    if _failed_runs:
        print(f"tpctl: error: training failed in {', '.join(map(str, _failed_runs))}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _check_jobs(overrides: list[str], multirun: bool, config_name: str, config_dir: str | None, validate_values: bool) -> int:
    """Compose and validate every job before Hydra creates any run dir.
    `--cfg` only prints a config, so it needs composition, not valid values."""
    try:
        for cfg in compose_jobs(overrides, multirun, config_name, config_dir):
            if validate_values:
                validate(cfg)
    except ConfigError as e:
        return _config_error(e)
    return EXIT_OK


def _run_hydra() -> None:
    import hydra

    register_configs()
    hydra.main(config_path=str(CONFIG_DIR), config_name=CONFIG_NAME, version_base="1.3")(_train_job)()


def _train_job(cfg) -> None:
    """One Hydra job: config.yaml → data → workers."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from .launcher import launch

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        validate(cfg)  # already checked; this is the config Hydra actually runs
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
        return

    status = launch(run_cfg, run_dir)
    if status > 128:  # interrupted: stop here, and stop a multirun too
        sys.exit(status)
    if status != EXIT_OK:
        _failed_runs.append(run_dir)


def _config_error(error: ConfigError) -> int:
    print(f"tpctl: error: {error}", file=sys.stderr)
    return EXIT_USAGE


def _usage_error(message: str) -> int:
    print(f"tpctl: error: {message}", file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
    main()
