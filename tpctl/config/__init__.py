"""Config: the typed schema in Hydra's ConfigStore, composition of the jobs a
command line asks for, and validation — every error found before any worker
starts and reported as one `ConfigError` line (docs/DESIGN.md, sections 2 and 3).

Three entry points:
  * `compose_jobs(overrides, multirun)` (compose.py) composes every job of a
    command line with Hydra's Compose API and turns Hydra's errors into
    ConfigErrors;
  * `validate(cfg)` (validate.py) holds every refusal of a run config;
  * `load_worker_config(path)` (typed.py) reads a run dir's resolved
    config.yaml, typed, for the workers, which never run Hydra.
"""

from .compose import (CONFIG_DIR, CONFIG_NAME, HARDWARE_DIR, RECIPE_DIR, compose_jobs, compose_run, register_configs,
                      run_dir_setting)
from .layout_checks import check_layout, largest_grids
from .machine import check_backend
from .typed import default_config, load_worker_config, typed_model
from .validate import check_writable_dir, validate

__all__ = ["CONFIG_DIR", "CONFIG_NAME", "HARDWARE_DIR", "RECIPE_DIR", "check_backend", "check_layout", "check_writable_dir",
           "compose_jobs", "compose_run", "default_config", "largest_grids", "load_worker_config", "register_configs", "run_dir_setting",
           "typed_model", "validate"]
