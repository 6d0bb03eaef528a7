"""Helpers for tests that run `tpctl` as a real subprocess.

Every process a test starts carries a unique marker in its environment (the
workers inherit it), so a test can find any process it left behind, however
it was reparented, by scanning /proc.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MARKER_VAR = "TPCTL_TEST_MARKER"


def default_sigint() -> None:
    """A child's SIGINT back to the default before it execs (`preexec_fn`):
    started from a non-interactive shell's background job or under nohup,
    this test process ignores SIGINT and every child would inherit that
    (tpctl rightly keeps an inherited ignore), so a test's Ctrl-C would do
    nothing. A test that interrupts a process starts it with this."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@dataclass
class Tpctl:
    """Runs `python -m tpctl.cli ARGS` in `cwd` with a marked environment."""

    cwd: Path
    marker: str
    extra_env: dict

    def env(self) -> dict:
        env = dict(os.environ)
        env.update(self.extra_env)
        env[MARKER_VAR] = self.marker
        # Workers must find tests.fake_worker; the parent runs from tmp dirs.
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env.setdefault("OMP_NUM_THREADS", "1")
        return env

    def command(self, args: list[str]) -> list[str]:
        return [sys.executable, "-m", "tpctl.cli", *args]

    def run(self, args: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(args), cwd=self.cwd, env=self.env(), capture_output=True, text=True, timeout=timeout)

    def start(self, args: list[str]) -> subprocess.Popen:
        return subprocess.Popen(self.command(args), cwd=self.cwd, env=self.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, preexec_fn=default_sigint)

    def leftover_pids(self, wait_s: float = 5.0) -> list[int]:
        """Processes still alive with this test's marker, after up to wait_s."""
        deadline = time.monotonic() + wait_s
        while True:
            pids = marked_pids(self.marker)
            if not pids or time.monotonic() > deadline:
                return pids
            time.sleep(0.1)

    def kill_leftovers(self) -> None:
        for pid in marked_pids(self.marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def marked_pids(marker: str) -> list[int]:
    needle = f"{MARKER_VAR}={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":  # a zombie has exited; its parent just has not reaped it
                    found.append(int(entry.name))
        except (OSError, IndexError):
            continue
    return found


def new_marker() -> str:
    return uuid.uuid4().hex


@pytest.fixture
def tpctl(tmp_path):
    """A Tpctl runner in tmp_path; kills whatever the test left behind."""
    runner = Tpctl(cwd=tmp_path, marker=new_marker(), extra_env={})
    yield runner
    runner.kill_leftovers()


def tiny_gpt2_directory(tmp_path_factory, n_positions: int = 16) -> Path:
    """A randomly initialised one-layer GPT-2 saved as a Hugging Face
    directory (no download): what `model.pretrained=`, `generate` and
    `export` read."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=256, n_embd=16, n_layer=1, n_head=2, n_positions=n_positions,
                                     bos_token_id=None, eos_token_id=None, pad_token_id=None)
    directory = tmp_path_factory.mktemp("gpt2")
    transformers.GPT2LMHeadModel(config).save_pretrained(directory)
    return directory
