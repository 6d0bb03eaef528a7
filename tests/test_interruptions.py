"""Interrupted commands stop within seconds with one line and the
contract's status (128 + the signal), leaving no temporary files; what a
killed run left is cleaned by the next one."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_support import default_sigint, marked_pids, tiny_gpt2_directory, tpctl, scaled  # noqa: F401  (fixture)
from tpctl.data import prepare as corpus


def _big_sources(d: Path, files: int = 8) -> Path:
    """`files` jsonl files of 10 MB each: seconds of tokenising, so a signal
    sent once the temporary output dir exists arrives mid-run."""
    d.mkdir()
    line = json.dumps({"text": "a line of words to tokenise " * 40}) + "\n"
    block = line * (10_000_000 // len(line))
    for k in range(files):
        (d / f"{k:02d}.jsonl").write_text(block)
    return d


def _interrupt_prepare(tpctl, tmp_path: Path, sig: int, group: bool, workers: int, when: str) -> tuple[int, str, float]:
    """Signal a prepare-data run once its temporary dir exists (`when`
    "start") or once it has written tokens ("mid")."""
    src = _big_sources(tmp_path / "src")
    proc = subprocess.Popen(tpctl.command(["prepare-data", str(src), f"out={tmp_path / 'out'}", "tokenizer=bytes",
                                           f"workers={workers}"]),
                            cwd=tmp_path, env=tpctl.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,  # its own process group, as a terminal's job
                            preexec_fn=default_sigint)  # and Ctrl-C's default, however this suite was started
    try:
        deadline = time.monotonic() + scaled(120)
        while not list(tmp_path.glob(".out.*.tmp" + ("/train-*.bin" if when == "mid" else ""))):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        (os.killpg if group else os.kill)(proc.pid, sig)
        sent = time.monotonic()
        _, err = proc.communicate(timeout=scaled(60))
        return proc.returncode, err, time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig, group, workers, when", [
    (signal.SIGINT, True, 1, "mid"), (signal.SIGINT, True, 2, "mid"), (signal.SIGINT, True, 2, "start"),
    (signal.SIGTERM, False, 2, "mid"), (signal.SIGTERM, True, 2, "mid")],
    ids=["ctrl-c-1-worker", "ctrl-c-2-workers", "ctrl-c-at-start", "sigterm-to-the-pid", "sigterm-to-the-group"])
def test_an_interrupted_prepare_data_stops_in_seconds_with_one_line_and_no_temporary_files(tpctl, tmp_path, sig,
                                                                                          group, workers, when):
    status, err, seconds = _interrupt_prepare(tpctl, tmp_path, sig, group, workers, when)
    name = signal.Signals(sig).name
    assert status == 128 + sig, err
    assert err.splitlines() == [f"tpctl: prepare-data interrupted by {name}; out={tmp_path / 'out'} is as it was"]
    assert seconds < scaled(30)
    assert not list(tmp_path.glob(".out.*")) and not (tmp_path / "out").exists(), [list(p.iterdir()) for p in tmp_path.glob(".out.*")]
    assert tpctl.leftover_pids() == []


def test_a_child_started_to_be_interrupted_gets_ctrl_c_even_if_the_suite_ignores_it():
    saved = signal.signal(signal.SIGINT, signal.SIG_IGN)  # this process, as under nohup or a script's `(make test &)`
    try:
        probe = "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
        inherited, reset = (subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=scaled(60),
                                           **options).stdout.strip() for options in ({}, {"preexec_fn": default_sigint}))
    finally:
        signal.signal(signal.SIGINT, saved)
    assert (inherited, reset) == ("False", "True")


def test_the_temporary_dirs_of_killed_runs_are_removed_by_the_next_run_and_a_live_one_is_kept(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("some text\n")
    out = tmp_path / "out"
    killed = tmp_path / ".out.k1ll3d.tmp"  # locked by a process that died: the lock is free
    killed.mkdir()
    (killed / ".writing").touch()
    (killed / "train-000000.bin").write_bytes(b"\0" * 100)
    older = tmp_path / ".out.0ld3r.tmp"  # from before runs locked theirs, long ago
    older.mkdir()
    os.utime(older, (time.time() - 3600, time.time() - 3600))
    live = tmp_path / ".out.l1v3.tmp"  # a run writing now (here: this process holds its lock)
    live.mkdir()
    fd = os.open(live / ".writing", os.O_WRONLY | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    fresh = tmp_path / ".out.fr3sh.tmp"  # made an instant ago, not locked yet
    fresh.mkdir()
    try:
        corpus.prepare([str(src)], out, "bytes")
        assert sorted(p.name for p in tmp_path.glob(".out.*")) == [fresh.name, live.name]
    finally:
        os.close(fd)
    assert corpus.remove_stale_tmp(out) == [live]  # its holder is gone


def test_prepare_data_respects_the_umask(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("some text\n" * 10)
    old = os.umask(0o027)
    try:
        corpus.prepare([str(src)], tmp_path / "out", "bytes")
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in [tmp_path / "out", *(tmp_path / "out").iterdir()]}
    assert modes.pop("out") == 0o750 and set(modes.values()) == {0o640}, modes


def _ctrl_c(tpctl, args: list[str], when) -> tuple[int, str]:
    """Run `tpctl ARGS` as a terminal's job, send SIGINT to its process
    group once `when(pid)` is true: (exit status, stderr)."""
    proc = subprocess.Popen(tpctl.command(args), cwd=tpctl.cwd, env=tpctl.env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=default_sigint)
    try:
        deadline = time.monotonic() + scaled(180)
        while not when(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=scaled(90))
        return proc.returncode, err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _loading_torch(pid: int) -> bool:
    """The command's own process is importing torch (its libraries mapped):
    started, and not yet at its workers."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _after(seconds: float):
    start = time.monotonic()
    return lambda pid: time.monotonic() - start > seconds


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    return tiny_gpt2_directory(tmp_path_factory, n_positions=512)


@pytest.mark.timeout(300)
def test_ctrl_c_while_a_command_starts_is_one_line_and_130(tpctl, pretrained):
    # While torch is being loaded by the command itself (then the config, the
    # model): not a fixed delay, which a busy or a fast machine overshoots.
    generate = ["generate", str(pretrained), "prompt=def ", "max_new_tokens=400", "temperature=0", "mode=1d", "size=2"]
    status, err = _ctrl_c(tpctl, generate, _loading_torch)
    assert (status, err.splitlines()) == (130, ["tpctl: generate interrupted by SIGINT"]), err
    status, err = _ctrl_c(tpctl, ["train", "data=synthetic", f"hydra.run.dir={tpctl.cwd / 'run'}"], _loading_torch)
    assert (status, err.splitlines()) == (130, ["tpctl: train interrupted by SIGINT"]), err
    # Once the workers run (they import torch, load the model, decode): the
    # launcher's line; it forwards the SIGINT to them (their own sessions).
    started: list = []

    def workers_started(pid: int) -> bool:
        if not started and len(marked_pids(tpctl.marker)) >= 3:
            started.append(time.monotonic())
        return bool(started) and time.monotonic() - started[0] > 2

    status, err = _ctrl_c(tpctl, generate, workers_started)
    assert status == 130 and len(err.splitlines()) == 1 and "interrupted by SIGINT" in err, err
    assert tpctl.leftover_pids() == []
