"""The oldest supported torch (pyproject's `torch>=`) and what tpctl asks of
it: every API newer than that floor is reached by feature detection.

LaunchConfig grows keywords from release to release (torch 2.11 has no
`shutdown_timeout`): the launcher is driven here against a stand-in with the
floor's fields, and must start its workers all the same."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Optional

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _floor() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    return re.search(r'"torch>=([0-9.]+)"', text).group(1)


@dataclasses.dataclass
class FloorLaunchConfig:
    """torch.distributed.launcher.api.LaunchConfig as torch 2.5 (the floor)
    defines it: no shutdown_timeout, no signals_to_handle, no numa_options."""
    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    logs_specs: Any = None
    run_id: str = ""
    role: str = "default_role"
    rdzv_endpoint: str = ""
    rdzv_backend: str = "etcd"
    rdzv_configs: dict = dataclasses.field(default_factory=dict)
    rdzv_timeout: int = -1
    max_restarts: int = 3
    monitor_interval: float = 0.1
    start_method: str = "spawn"
    log_line_prefix_template: Optional[str] = None
    metrics_cfg: dict = dataclasses.field(default_factory=dict)
    local_addr: Optional[str] = None


def test_the_floor_is_stated_in_pyproject_and_readme():
    floor = _floor()
    assert floor == "2.5"
    assert f"torch {floor}" in (ROOT / "README.md").read_text()


def test_launcher_starts_workers_with_the_floors_launch_config(monkeypatch, tmp_path):
    import torch.distributed.launcher.api as api

    from tpctl.config import default_config
    from tpctl.launch import local

    started = []

    def fake_elastic_launch(config, entrypoint):
        started.append(config)
        return lambda *args: {0: None}

    monkeypatch.setattr(api, "LaunchConfig", FloorLaunchConfig)
    monkeypatch.setattr(api, "elastic_launch", fake_elastic_launch)
    monkeypatch.setenv(local.WORKER_MODULE_ENV, "tests.fake_worker")
    cfg = default_config()
    assert local.launch(cfg, tmp_path) == 0
    (config,) = started
    assert isinstance(config, FloorLaunchConfig) and config.nproc_per_node == cfg.size * cfg.dp


def test_newer_keywords_are_passed_where_torch_has_them(tmp_path):
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    from tpctl.config import default_config
    from tpctl.launch.local import SHUTDOWN_TIMEOUT_S, accepted, launch_config

    config = launch_config(LaunchConfig, DefaultLogsSpecs, default_config(), str(tmp_path), 1, "127.0.0.1:1", "x")
    if "shutdown_timeout" in accepted(LaunchConfig, shutdown_timeout=1):
        assert config.shutdown_timeout == SHUTDOWN_TIMEOUT_S
    assert accepted(FloorLaunchConfig, shutdown_timeout=1, max_restarts=2) == {"max_restarts": 2}
    assert accepted(lambda **kw: None, anything=1) == {"anything": 1}


def test_comm_falls_back_to_the_floors_collective_names():
    """torch 2.10 renamed all_gather_into_tensor / reduce_scatter_tensor; the
    floor has only the old names, which comm uses when the new are absent."""
    import torch.distributed as dist

    from tpctl.parallel import comm

    expected = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    assert comm._all_gather_tensor is expected
    assert hasattr(dist, "all_gather_into_tensor") and hasattr(dist, "reduce_scatter_tensor")


@pytest.mark.parametrize("module, names", [
    ("torch.distributed.tensor", ["DTensor", "Replicate", "Shard"]),  # public since 2.5
    ("torch.distributed.checkpoint.metadata", ["StorageMeta"]),  # 2.4
    ("torch", ["get_autocast_dtype", "compile"]),  # get_autocast_dtype(device): 2.4
])
def test_apis_the_floor_has_are_there(module, names):
    import importlib

    mod = importlib.import_module(module)
    for name in names:
        assert hasattr(mod, name), f"{module}.{name}"
