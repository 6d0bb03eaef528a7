"""Reading a run dir's outputs (docs/DESIGN.md, section 3), and running
`tpctl train` as a subprocess into one: for the commands that compare runs
(check-recipes, report, a sweep's comparison), the benchmarks and the tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

from tpctl.parallel.layout import Layout


def layout_overrides(name: str) -> list[str]:
    """The `tpctl train` overrides of the layout named `name`
    (parallel.layout.Layout.parse: `2d-4-dp2`, `2.5d-8-d2`, `1d-2-sp`)."""
    return Layout.parse(name).overrides()


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """The logged steps of metrics.jsonl, in order; [] when there is none.
    A line that is not JSON raises ValueError naming the file and line."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not JSON ({e.msg})") from None
    return records


def read_summary(run_dir: str | os.PathLike) -> Optional[dict]:
    """summary.json (written by rank 0 when the run finished), or None."""
    path = Path(run_dir) / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else None


def train_command(overrides: list[str], run_dir: str | os.PathLike) -> list[str]:
    """The command line of `tpctl train OVERRIDES` into `run_dir`, with this
    interpreter (so that it runs the tpctl this process imports)."""
    return [sys.executable, "-m", "tpctl.cli", "train", *overrides, f"hydra.run.dir={run_dir}"]


def train_subprocess(overrides: list[str], run_dir: str | os.PathLike, timeout: Optional[float] = None,
                     env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """Run `tpctl train` to its end, output captured."""
    return subprocess.run(train_command(overrides, run_dir), capture_output=True, text=True, timeout=timeout, env=env)
