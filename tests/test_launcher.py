"""The launcher with a stand-in worker (tests/fake_worker.py): success, a rank
that raises, and Ctrl-C. No test may leave a process behind."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from cli_support import REPO, tpctl, scaled  # noqa: F401  (fixture)
from tpctl.config import compose_jobs
from tpctl.launch.local import launch


def fake_run_args(run_dir: Path, *overrides: str) -> list[str]:
    return ["train", *overrides, "data=synthetic", f"hydra.run.dir={run_dir}"]


def pid_files(run_dir: Path) -> list[Path]:
    return sorted(run_dir.glob("fake_worker_rank*.pid"))


def assert_dead(pids: list[int]) -> None:
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:1], pid


# Workers fork from a warm server (the default on CPU: launch/warm.py) or
# start as fresh interpreters (CUDA's): the launcher's contract is the same.
START_METHODS = ["forkserver", "spawn"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", START_METHODS)
def test_launch_runs_size_times_dp_workers(tmp_path, monkeypatch, method):
    monkeypatch.syspath_prepend(str(REPO))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cfg = compose_jobs(["mode=1d", "size=2", "dp=2", f"launcher.start_method={method}"])[0]
    OmegaConf.save(cfg, tmp_path / "config.yaml")
    assert launch(cfg, tmp_path, worker_module="tests.fake_worker") == 0
    assert [p.name for p in pid_files(tmp_path)] == [f"fake_worker_rank{r}.pid" for r in range(4)]


@pytest.mark.timeout(120)
def test_the_fork_server_is_a_fork_of_the_launcher_and_workers_get_their_threads(tpctl):
    """`tpctl train` validates on one thread and forks its warm server from
    itself (launch/warm.py allow_fork_start): no second interpreter imports
    torch; each worker still runs the OMP_NUM_THREADS threads a fresh
    interpreter would."""
    tpctl.extra_env.update(TPCTL_WORKER_MODULE="tests.fake_worker", OMP_NUM_THREADS="2")
    run_dir = tpctl.cwd / "run"
    result = tpctl.run(fake_run_args(run_dir, "mode=1d", "size=2"), timeout=100)
    assert result.returncode == 0, result.stderr
    for rank in range(2):
        seen = json.loads((run_dir / f"fake_worker_rank{rank}.json").read_text())
        assert seen["threads"] == 2, seen
        assert seen["server"] == seen["launcher"] and "multiprocessing.forkserver" not in seen["server"], seen


def test_where_threads_cannot_be_counted_the_server_is_not_forked(monkeypatch):
    """Without /proc (not Linux) nothing tells whether a fork is safe: the
    server starts as a fresh interpreter."""
    from tpctl.launch import warm

    monkeypatch.setattr(warm, "_FORK_SAFE_THREADS", frozenset())
    monkeypatch.setattr(warm, "_threads", lambda: None)
    assert warm._fork_server(None) is False


@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", START_METHODS)
def test_failing_rank_is_named_and_the_others_are_stopped(tpctl, method):
    # Rank 1 raises; the others would sleep a minute if nobody stopped them.
    # Rank 1 raises once every rank runs (however fast or slow they start);
    # the others would sleep far longer than the test may take.
    tpctl.extra_env.update(TPCTL_WORKER_MODULE="tests.fake_worker", FAKE_WORKER_FAIL_RANK="1", FAKE_WORKER_SLEEP="600")
    run_dir = tpctl.cwd / "run"
    result = tpctl.run(fake_run_args(run_dir, "mode=1d", "size=2", "dp=2", f"launcher.start_method={method}"), timeout=150)

    assert result.returncode == 1, result.stderr
    assert "tpctl: error: rank 1: RuntimeError: fake failure on rank 1" in result.stderr
    assert "tpctl: stopped the other ranks: 0, 2, 3" in result.stderr
    assert f"tpctl: error: training failed in {run_dir}" in result.stderr
    assert len(pid_files(run_dir)) == 4
    assert_dead([int(p.read_text()) for p in pid_files(run_dir)])
    assert tpctl.leftover_pids() == []


@pytest.mark.timeout(90)
def test_ctrl_c_stops_every_worker_and_exits_130(tpctl):
    tpctl.extra_env.update(TPCTL_WORKER_MODULE="tests.fake_worker", FAKE_WORKER_SLEEP="60")
    run_dir = tpctl.cwd / "run"
    proc = tpctl.start(fake_run_args(run_dir, "mode=1d", "size=2"))
    try:
        deadline = time.monotonic() + scaled(40)
        while len(pid_files(run_dir)) < 2:  # every worker is running
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGINT)  # what Ctrl-C sends to the launcher
        _, stderr = proc.communicate(timeout=scaled(40))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr
    assert "interrupted by SIGINT" in stderr
    assert_dead([int(p.read_text()) for p in pid_files(run_dir)])
    assert tpctl.leftover_pids() == []


@pytest.mark.timeout(120)
def test_a_failed_job_of_a_multirun_does_not_stop_the_others(tpctl):
    # Only the size=2 job has a rank 1 to fail; the size=1 job trains.
    tpctl.extra_env.update(TPCTL_WORKER_MODULE="tests.fake_worker", FAKE_WORKER_FAIL_RANK="1")
    sweep = tpctl.cwd / "sweep"
    result = tpctl.run(["train", "-m", "mode=1d", "size=2,1", "data=synthetic", f"hydra.sweep.dir={sweep}"], timeout=100)
    assert result.returncode == 1, result.stderr
    assert "tpctl: error: rank 1: RuntimeError: fake failure on rank 1" in result.stderr
    assert f"tpctl: error: training failed in {sweep / '0'}" in result.stderr
    assert len(pid_files(sweep / "0")) == 2 and len(pid_files(sweep / "1")) == 1
    assert tpctl.leftover_pids() == []


def test_a_rank_records_the_status_of_what_it_raised_before_its_error_file(tmp_path, monkeypatch):
    """The agent may stop a rank the moment another has left: a refusal
    every rank raises must read as a refusal (exit 2) from whichever rank
    the launcher looks at, so its status is on disk before @record writes
    the error file (the launcher once read a stopped rank's error file
    alone as exit 1, and a wrong rewrite came out as a failed run)."""
    from tpctl.errors import ConfigError
    from tpctl.launch.worker import EXIT_RECORD, status_first
    from tpctl.parallel.context.split import ContextRefused
    from tpctl.parallel.verify.proof import RewriteRefused

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    for error, status in ((RewriteRefused("differs"), 2), (ContextRefused("a mask"), 2),
                          (ConfigError("k", 1, "2"), 2), (RuntimeError("boom"), 1)):
        def run(argv, error=error):
            raise error

        with pytest.raises(type(error)):
            status_first(run)([])
        assert (tmp_path / EXIT_RECORD).read_text().split()[-1] == str(status), error


def test_the_ranks_torch_does_not_report_are_read_from_what_each_left(tmp_path):
    """Warm starts: torch's function context reports only the first rank
    that failed (here local rank 1 of a node whose ranks start at 4). Each
    other rank's folder says the rest: an exit status it recorded, an error
    file alone (exit 1: a rank records the status of what it raised before
    the error file, worker.status_first), its work marked complete (no
    failure), or nothing (stopped by the agent)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from tpctl.launch.local import all_failures
    from tpctl.launch.worker import DONE_MARKER, EXIT_RECORD

    attempt = tmp_path / "run" / "attempt_0"
    for local in range(6):
        (attempt / str(local)).mkdir(parents=True)
    error = {"message": {"message": "RewriteRefused: differs", "extraInfo": {"timestamp": "0"}}}
    (attempt / "1" / "error.json").write_text(json.dumps(error))
    first = ProcessFailure(local_rank=1, pid=101, exitcode=2, error_file=str(attempt / "1" / "error.json"))
    (attempt / "0" / EXIT_RECORD).write_text("4 100 2")        # refused too
    (attempt / "2" / "error.json").write_text(json.dumps(error))  # raised, recorded by @record only
    (attempt / "3" / DONE_MARKER).write_text("103")           # finished
    (attempt / "4" / EXIT_RECORD).write_text("8 104 0")       # left with 0
    # local 5: nothing -- the agent stopped it
    failures = all_failures({5: first})
    assert sorted(failures) == [4, 5, 6, 9]
    assert (failures[4].exitcode, failures[4].pid) == (2, 100)
    assert failures[5] is first
    assert failures[6].exitcode == 1 and "differs" in str(failures[6].message)
    assert failures[9].exitcode == -signal.SIGTERM
    assert all_failures({}) == {}
