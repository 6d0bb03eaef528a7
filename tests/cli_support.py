"""Helpers for tests that run `tpctl` as a real subprocess.

Every process a test starts carries a unique marker in its environment (the
workers inherit it), so a test can find any process it left behind, however
it was reparented, by scanning /proc.

Every timeout of the suite is written as the seconds it needs on an idle
machine and stretched by `scaled` with the machine's measured slowness (the
rule in docs/guide/testing.md): a busy machine gets the time it needs, and a
real hang still fails within TIMEOUT_CAP_S (10 minutes) or the test's own,
longer, timeout.
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

# The slowness factor, when set: this instead of measuring (>= 1; e.g. 1 to
# keep every timeout as written). A subprocess a test starts (Tpctl) gets the
# factor measured then, so its waits (tests/fake_worker.py) stretch alike.
SLOWNESS_VAR = "TPCTL_TEST_SLOWNESS"
# A stretched timeout never exceeds this (seconds; TPCTL_TEST_TIMEOUT_CAP_S),
# unless written longer: a hang fails within minutes however busy the machine.
TIMEOUT_CAP_S = float(os.environ.get("TPCTL_TEST_TIMEOUT_CAP_S", 600))
MAX_SLOWNESS = 10.0
# CPU seconds of _workload on the machine the timeouts were written on (2
# cores of a Xeon): a slower CPU is slower by its ratio to this.
REFERENCE_CPU_S = 0.022
REMEASURE_S = 10.0
_measured: list = []  # [(monotonic time, factor)]: the last measurement


def _workload() -> tuple[float, float]:
    """(wall, CPU) seconds of a fixed pure-Python loop (about 20 ms of one
    core): on a busy machine the wall time is the CPU time times the share of
    a core this process gets."""
    wall, cpu = time.perf_counter(), time.thread_time()
    total = 0
    for i in range(200_000):
        total += i * i % 7
    return time.perf_counter() - wall, time.thread_time() - cpu


def measure_slowness() -> float:
    """How many times slower than the reference machine at rest this machine
    runs now, in [1, MAX_SLOWNESS]: the larger of the measured one (_workload:
    wall over CPU time, times CPU time over REFERENCE_CPU_S where slower) and
    the 1-minute load average per core (which lags a load just started, and
    counts the suite's own ranks)."""
    wall, cpu = _workload()
    cpu = max(cpu, 1e-6)
    measured = max(1.0, wall / cpu) * max(1.0, cpu / REFERENCE_CPU_S)
    try:
        by_load = os.getloadavg()[0] / (len(os.sched_getaffinity(0)) or 1)
    except (OSError, AttributeError):
        by_load = 1.0
    return min(MAX_SLOWNESS, max(1.0, measured, by_load))


def slowness() -> float:
    """The factor every timeout of the suite is stretched by (scaled): the
    SLOWNESS_VAR environment variable when set, else measure_slowness(),
    measured again when the last measurement is older than REMEASURE_S (a
    load may start after the session does)."""
    fixed = os.environ.get(SLOWNESS_VAR)
    if fixed:
        return min(MAX_SLOWNESS, max(1.0, float(fixed)))
    now = time.monotonic()
    if not _measured or now - _measured[0][0] > REMEASURE_S:
        _measured[:] = [(now, measure_slowness())]
    return _measured[0][1]


def scaled(seconds: float) -> float:
    """`seconds` (what a wait needs on an idle machine) times slowness(), at
    most TIMEOUT_CAP_S (or `seconds` itself where that is longer)."""
    if seconds <= 0:
        return seconds
    return min(seconds * slowness(), max(seconds, TIMEOUT_CAP_S))


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
        env[SLOWNESS_VAR] = f"{slowness():.2f}"  # its own waits stretch as this test's do
        return env

    def command(self, args: list[str]) -> list[str]:
        return [sys.executable, "-m", "tpctl.cli", *args]

    # Whether run() may fork the command from the suite's fork server
    # (cli_server) instead of starting an interpreter: False for a runner
    # that tests the installed script itself.
    forked = True

    def run(self, args: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
        """`tpctl ARGS` to its end; `timeout`: seconds on an idle machine (scaled).
        Forked from the fork server where the command's environment allows
        (cli_server: PYTHONPATH as the server's), else a fresh interpreter."""
        env = self.env()
        if self.forked and _may_fork(env):
            return _fork_server().run(args, self.cwd, env, scaled(timeout))
        return subprocess.run(self.command(args), cwd=self.cwd, env=env, capture_output=True, text=True,
                              timeout=scaled(timeout))

    def start(self, args: list[str]) -> subprocess.Popen:
        return subprocess.Popen(self.command(args), cwd=self.cwd, env=self.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, preexec_fn=default_sigint)

    def leftover_pids(self, wait_s: float = 5.0) -> list[int]:
        """Processes still alive with this test's marker, after up to wait_s
        (on an idle machine: scaled)."""
        deadline = time.monotonic() + scaled(wait_s)
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


# Set to 0: every command a fresh interpreter (no fork server).
FORK_VAR = "TPCTL_TEST_FORK_CLI"


# Environment variables the server's preloaded modules read when imported
# (torch._inductor's config reads CXX, for one): a command that sets them
# otherwise than the server's environment runs as a fresh interpreter.
READ_AT_IMPORT = ("CXX", "CC", "TORCHINDUCTOR_", "TORCHDYNAMO_", "TORCH_COMPILE", "TORCH_LOGS", "OMP_NUM_THREADS")


def _may_fork(env: dict) -> bool:
    """Whether a command with environment `env` may fork from the fork
    server: allowed (FORK_VAR), its PYTHONPATH the server's, and what the
    server's modules read at import the same as the server read it."""
    if os.environ.get(FORK_VAR, "1") == "0" or env.get("PYTHONPATH") != _server_pythonpath():
        return False
    server = _server_env()
    return all(env.get(k) == server.get(k) for k in {*env, *server} if k.startswith(READ_AT_IMPORT))


def _server_env(_cache: list = []) -> dict:  # noqa: B006 (the cache: one environment per test process)
    """The environment the fork server starts (and any restart of it)
    with: this test process's when first asked, so that a variable a test
    sets later in os.environ is told apart from what the server read."""
    if not _cache:
        env = dict(os.environ, PYTHONPATH=_server_pythonpath())
        env.setdefault("OMP_NUM_THREADS", "1")
        _cache.append(env)
    return dict(_cache[0])


def run_script(script: Path, args: list[str], cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """`python SCRIPT ARGS` to its end (`timeout`: seconds, not scaled here),
    forked from the fork server where `env` allows it (its PYTHONPATH the
    server's): a fresh interpreter would import torch first (~2 CPU-s a
    script). Else, or with FORK_VAR=0, a fresh interpreter leading its own
    session; on a timeout the session is killed (with the ranks it
    started) and subprocess.TimeoutExpired raised, as the fork's is."""
    if _may_fork(env):
        return _fork_server().run(args, cwd, env, timeout, script=str(script))
    proc = subprocess.Popen([sys.executable, str(script), *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(proc.args, timeout, out, err) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _server_pythonpath() -> str:
    return os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)


class ForkServer:
    """This test process's client of tests/cli_server.py (see there: why,
    and what differs from a fresh interpreter). Started on first use; it
    dies with this process."""

    def __init__(self):
        env = _server_env()
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.cli_server", str(os.getpid())], cwd=REPO, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._pending = b""
        if "ready" not in self._reply(time.monotonic() + scaled(120)):
            raise RuntimeError("the tpctl fork server (tests/cli_server.py) did not start")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _reply(self, deadline: float) -> dict:
        """The server's next line; TimeoutError past `deadline`, EOFError
        if it died."""
        import json
        import select

        fd = self.proc.stdout.fileno()
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, 65536)
            if not chunk:
                raise EOFError("the tpctl fork server (tests/cli_server.py) died")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def run(self, args: list[str], cwd: Path, env: dict, timeout: float,
            script: str | None = None) -> subprocess.CompletedProcess:
        """`tpctl ARGS`, or `python SCRIPT ARGS` with `script`, forked."""
        import json
        import tempfile

        with tempfile.TemporaryDirectory(prefix="tpctl-cli-") as tmp:
            out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
            umask = os.umask(0)
            os.umask(umask)
            request = {"argv": list(args), "cwd": str(cwd), "env": env, "umask": umask, "out": str(out), "err": str(err)}
            if script is not None:
                request["script"] = script
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            deadline = time.monotonic() + timeout
            pid = self._reply(time.monotonic() + scaled(60))["pid"]
            try:
                status = self._reply(deadline)["status"]
            except TimeoutError:
                with __import__("contextlib").suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)  # the command leads its own session
                self._reply(time.monotonic() + scaled(60))
                raise subprocess.TimeoutExpired(args, timeout, out.read_text(errors="replace"),
                                                err.read_text(errors="replace")) from None
            return subprocess.CompletedProcess([script or "tpctl", *args], status, out.read_text(errors="replace"),
                                               err.read_text(errors="replace"))


_server: list = []


def _fork_server() -> ForkServer:
    if not _server or not _server[0].alive():
        _server[:] = [ForkServer()]
    return _server[0]


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
