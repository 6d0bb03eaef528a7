"""Nothing lost, nothing cryptic (issue 16): one owner per run dir, one line
per failed rank, checkpoints that never rotate away the good one, the
non-finite loss policy, config-like failures found before any worker, and
rendezvous problems named. Fast in-process tests first; the few end-to-end
runs are marked slow."""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from cli_support import tpctl, scaled  # noqa: F401  (fixture)
from tpctl.config import compose_jobs, validate
from tpctl.errors import ConfigError
from tpctl.launch.run_lock import RunDirBusy, RunDirLock, probe
from tpctl import checkpoint as ckpt
from tpctl.checkpoint.manifest import _sha256

TESTS = Path(__file__).resolve().parent


# --------------------------------------------------------------------------
# One owner per run dir
# --------------------------------------------------------------------------


def _hold_lock(run_dir: Path) -> subprocess.Popen:
    """Another process holding the run dir's lock until killed."""
    code = ("import sys, time; from tpctl.launch.run_lock import RunDirLock; "
            "lock = RunDirLock(sys.argv[1]); print('held', flush=True); time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(TESTS.parent)})
    assert holder.stdout.readline().strip() == "held"
    return holder


@pytest.mark.timeout(60)
def test_a_locked_run_dir_names_its_holder_and_is_free_once_the_holder_dies(tmp_path):
    run_dir = tmp_path / "run"
    probe(run_dir)  # nothing there: free, and nothing is created
    assert not run_dir.exists()
    holder = _hold_lock(run_dir)
    try:
        for attempt in (lambda: probe(run_dir), lambda: RunDirLock(run_dir)):
            with pytest.raises(RunDirBusy) as e:
                attempt()
            assert f"pid {holder.pid} holds .lock" in str(e.value) and str(run_dir) in str(e.value)
        # Another node of a multi-node run locks its own file.
        RunDirLock(run_dir, node_rank=1).release()
    finally:
        holder.kill()  # SIGKILL: no cleanup code runs; the kernel drops the lock
        holder.wait()
    with RunDirLock(run_dir) as lock:
        assert (run_dir / ".lock").read_text().strip() == str(os.getpid())
        with pytest.raises(RunDirBusy):  # one owner, even within one process
            RunDirLock(run_dir)
    assert lock.fd is None


# --------------------------------------------------------------------------
# Worker failures become one line
# --------------------------------------------------------------------------


def _failure(exitcode: int, message, signal_name: str = ""):
    return SimpleNamespace(exitcode=exitcode, message=message, signal_name=lambda: signal_name)


def test_each_failed_rank_is_one_line_with_the_exception_type_and_the_root_cause(capsys, tmp_path):
    from tpctl.launch.local import report_failures

    enospc = "OSError: [Errno 28] No space left on device: '/run/checkpoints/.tmp_step_4/__1_0.distcp'"
    report_failures({
        0: _failure(1, {"message": "PermissionError: [Errno 13] Permission denied: '/x'\nmore", "extraInfo": {}}),
        1: _failure(1, {"message": enospc, "extraInfo": {}}),
        2: _failure(1, {"message": enospc, "extraInfo": {}}),
        3: _failure(1, ""),  # exited without raising
        4: _failure(-signal.SIGTERM, None, "SIGTERM"),
    }, tmp_path)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "tpctl: error: rank 0: PermissionError: [Errno 13] Permission denied: '/x'",
        f"tpctl: error: rank 1: {enospc} (ranks 2 too)",
        "tpctl: error: rank 3: exited with code 1 before reporting an exception (see its log and output)",
        "tpctl: stopped the other ranks: 4",
        f"tpctl: the tracebacks are in {tmp_path / 'logs'}/rank<r>.log",
    ]
    assert not any("no error recorded" in line for line in lines)


def test_the_lost_peer_message_keeps_the_whole_address():
    from tpctl.launch.worker import LOST_PEER

    text = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:41523. More"
    assert LOST_PEER.search(text).group(0) == "Connection closed by peer [127.0.0.1]:41523"


def test_a_save_failure_is_named_by_its_root_cause():
    cause = OSError(28, "No space left on device", "/r/checkpoints/.tmp_step_4/__0_0.distcp")

    class DcpError(RuntimeError):  # DCP's CheckpointException: {rank: (exception, traceback)}
        failures = {1: (cause, None)}

    assert ckpt.root_cause(DcpError("CheckpointException ranks:dict_keys([1])")) == \
        "OSError [ENOSPC] No space left on device: /r/checkpoints/.tmp_step_4/__0_0.distcp"
    assert ckpt.root_cause(ValueError("bad\nsecond line")) == "ValueError: bad"


# --------------------------------------------------------------------------
# Checkpoints: verification and rotation
# --------------------------------------------------------------------------


def fake_checkpoint(path: Path, step: int, metadata=None, model=None) -> Path:
    """A checkpoint that verifies (manifest, hashes, DCP metadata) with no
    tensors in it; `metadata` replaces the DCP Metadata pickled in it."""
    from torch.distributed.checkpoint.metadata import Metadata

    path.mkdir(parents=True)
    meta = path / ".metadata"
    meta.write_bytes(pickle.dumps(Metadata(state_dict_metadata={}, storage_data={}) if metadata is None else metadata))
    manifest = {"format": ckpt.FORMAT, "step": step, "model": model or {}, "mode": "none", "size": 1, "dp": 1,
                "files": {".metadata": {"bytes": meta.stat().st_size, "sha256": _sha256(meta)}}}
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest))
    return path


def test_a_metadata_pickle_of_something_else_is_refused_by_verify(tmp_path):
    good = fake_checkpoint(tmp_path / "good", 1)
    assert ckpt.verify(good)["step"] == 1
    # The manifest's sha256 matches: only unpickling it tells.
    for payload in ({"not": "metadata"}, Path("/etc")):
        bad = fake_checkpoint(tmp_path / f"bad{len(list(tmp_path.iterdir()))}", 2, metadata=payload)
        with pytest.raises(ckpt.CheckpointError, match="metadata"):
            ckpt.verify(bad)


def test_a_bad_resume_path_is_a_config_error():
    cfg = compose_jobs(["mode=none", "data=synthetic"])[0]
    with pytest.raises(ConfigError) as e:
        cfg.train.resume = "/nonexistent/step_3"
        validate(cfg, model_check=False)
    assert e.value.key == "train.resume"


def test_rotation_counts_only_valid_checkpoints_and_keeps_the_newest_valid_one(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    for step in (3, 6, 9):
        fake_checkpoint(root / f"step_{step}", step)
    (root / "step_6" / ckpt.MANIFEST).write_text("{corrupt")  # the newest but one is corrupt
    assert ckpt.rotate(root, keep=2) == []  # 9 and 3 are the two valid ones
    assert [s for s, _ in ckpt.step_dirs(root)] == [9, 6, 3]
    # The warning reaches the terminal (rank 0's stderr), not only its log.
    warnings = capsys.readouterr().err.splitlines()
    assert len(warnings) == 1 and warnings[0].startswith(f"tpctl: warning: invalid checkpoint {root / 'step_6'} "), warnings

    (root / "step_9" / ckpt.MANIFEST).write_text("{corrupt")  # now only step_3 is valid
    assert ckpt.rotate(root, keep=1, warn=warnings.append) == []  # never the newest valid one
    assert (root / "step_3").is_dir()

    fake_checkpoint(root / "step_12", 12)
    # keep=1: step_12; what is older and invalid can never be resumed: gone too.
    assert ckpt.rotate(root, keep=1, warn=warnings.append) == [root / f"step_{s}" for s in (9, 6, 3)]
    assert [s for s, _ in ckpt.step_dirs(root)] == [12]
    assert ckpt.rotate(root, keep=0) == []


# --------------------------------------------------------------------------
# Config values, recipes, config-like failures found before any worker
# --------------------------------------------------------------------------


def _config_error(overrides: list[str], model_check: bool = False) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        validate(compose_jobs(["data=synthetic", *overrides])[0], model_check=model_check)
    return e.value


@pytest.mark.parametrize("override,key,fragment", [
    ("optim.lr=inf", "optim.lr", "finite"),
    ("optim.lr=nan", "optim.lr", "finite"),
    ("optim.weight_decay=-inf", "optim.weight_decay", "finite"),
    ("optim.lr=1e300", "optim.lr", "fp32 holds"),  # inf in each rank's AdamW, after the workers started
    ("optim.eps=1e-50", "optim.eps", "fp32 holds"),  # 0 in fp32
    ("seed=99999999999999999999", "seed", "[0, 2**63)"),
    ("seed=-1", "seed", "[0, 2**63)"),
    ("train.on_nonfinite=ignore", "train.on_nonfinite", "stop, skip"),
    ("launcher.nnodes=2 launcher.rdzv_endpoint=notahost.invalid:29500 mode=1d size=2", "launcher.rdzv_endpoint", "does not resolve"),
])
def test_bad_values_are_config_errors(override, key, fragment):
    error = _config_error(override.split())
    assert error.key == key and fragment in str(error), str(error)


def test_a_directory_that_is_no_tokenizer_is_a_config_error(tmp_path):
    pytest.importorskip("transformers")
    (tmp_path / "notes.txt").write_text("not a tokenizer")
    error = _config_error(["data=text", f"data.tokenizer={tmp_path}"])
    assert error.key == "data.tokenizer" and "not a Hugging Face tokenizer directory" in str(error)
    # What is missing is named (transformers' own message lists nothing).
    assert str(error).endswith("the directory holds no tokenizer (none of tokenizer.json, tokenizer_config.json, "
                               "tokenizer.model, vocab.json, vocab.txt, spiece.model; a tokenizer's save_pretrained "
                               "writes them)"), str(error)
    # prepare-data says the same.
    from tpctl.data import DataError
    from tpctl.data.tokenizer import load_tokenizer

    with pytest.raises(DataError, match=r"^tokenizer=.*: the directory holds no tokenizer \(none of tokenizer.json"):
        load_tokenizer(str(tmp_path))


def test_inputs_a_worker_would_fail_on_are_config_errors(tmp_path):
    import importlib.util

    from tpctl.commands.train import check_run_inputs

    empty = tmp_path / "empty.txt"
    empty.write_text("")
    cfg = compose_jobs(["data=text", f"data.path={empty}"])[0]
    validate(cfg, model_check=False)
    with pytest.raises(ConfigError) as e:
        check_run_inputs(cfg, dry_run=False)
    assert e.value.key == "data.path"
    if importlib.util.find_spec("submitit") is None:
        cfg = compose_jobs(["data=synthetic", "launcher=slurm"])[0]
        with pytest.raises(ConfigError, match="submitit"):
            check_run_inputs(cfg, dry_run=False)
        check_run_inputs(cfg, dry_run=True)  # a dry run renders without it


@pytest.mark.parametrize("target", ["os.getcwd", "nosuchmodule.build"])
def test_inspect_refuses_a_model_target_that_builds_no_model_in_one_line(capsys, target):
    from tpctl.commands import inspect_model

    assert inspect_model.main(["model=custom", f"model._target_={target}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"tpctl: error: invalid config: model._target_='{target}': "), err


@pytest.fixture
def recipe_dir(tmp_path):
    """-cd dir whose recipe/ holds a file that is not YAML, one that lists
    itself in its defaults, and a good one."""
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "broken.yaml").write_text("# @package _global_\nsize: [2\n")
    (tmp_path / "recipe" / "loop.yaml").write_text("# @package _global_\ndefaults:\n  - /recipe/loop\n  - _self_\nmode: 1d\n")
    (tmp_path / "recipe" / "fine.yaml").write_text(
        "# @package _global_\nmode: none\nrecipe:\n  description: fine\n  final_loss: [0, 10]\n")
    return tmp_path


def test_broken_recipe_files_are_named_in_one_line(recipe_dir):
    for name, fragment in (("broken", "not valid YAML at line 3"), ("loop", "its defaults list includes itself")):
        with pytest.raises(ConfigError) as e:
            compose_jobs([f"recipe={name}"], config_dir=str(recipe_dir))
        assert str(recipe_dir / "recipe" / f"{name}.yaml") in str(e.value) and fragment in str(e.value), str(e.value)


def test_recipes_and_check_recipes_still_work_for_the_other_recipes(recipe_dir, capsys):
    from tpctl.commands import check_recipes, recipes

    assert recipes.main(["-cd", str(recipe_dir)]) == 2
    out, err = capsys.readouterr()
    assert any(line.startswith("fine ") for line in out.splitlines())  # and the repo's own recipes
    assert len(out.splitlines()) > 1
    assert len(err.splitlines()) == 2 and "broken.yaml" in err and "loop.yaml" in err, err
    planned = check_recipes.recipe_runs(["fine"], fast=False, config_dir=str(recipe_dir))
    assert list(planned) == ["fine"]
    with pytest.raises(check_recipes.RecipeError, match="broken.yaml"):
        check_recipes.recipe_runs(["broken"], fast=False, config_dir=str(recipe_dir))


def test_plan_says_why_no_split_is_valid(capsys):
    from tpctl.commands import plan

    assert plan.main(["world=7", "model=gpt-small"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no split of 7 ranks is valid" in err[0] and "splits heads 7 ways" in err[0], err


def test_export_refuses_an_existing_out_unless_forced(tmp_path, capsys):
    from tpctl.commands import export

    step = fake_checkpoint(tmp_path / "step_1", 1, model={"arch": "gpt"})
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"precious")
    assert export.main([str(step), str(out)]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert out.read_bytes() == b"precious"
    assert export.main([str(step), str(out), "--force"]) == 0
    assert out.read_bytes() != b"precious"


# --------------------------------------------------------------------------
# Non-finite values and rendezvous reachability
# --------------------------------------------------------------------------


def test_metrics_records_stay_json():
    from tpctl.training.metrics import json_safe

    line = json.dumps(json_safe({"step": 3, "loss": math.nan, "grad_norm": math.inf, "lr": 1e-3}), allow_nan=False)
    assert json.loads(line) == {"step": 3, "loss": None, "grad_norm": None, "lr": 1e-3}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on return: nothing listens there


@pytest.mark.timeout(120)
def test_rendezvous_problems_are_named_within_the_timeout():
    from tpctl.launch.local import wait_for_rendezvous_host

    start = time.monotonic()
    refused = wait_for_rendezvous_host(f"127.0.0.1:{_closed_port()}", timeout_s=2)
    assert "within launcher.rdzv_timeout_s=2" in refused and "connection refused: is node 0" in refused
    assert 2 <= time.monotonic() - start < scaled(10)
    assert "does not resolve" in wait_for_rendezvous_host("notahost.invalid:29500", timeout_s=2)
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # node 0's rendezvous store
    assert wait_for_rendezvous_host(f"127.0.0.1:{store.port}", timeout_s=scaled(10)) is None
    with socket.socket() as server:  # something that accepts connections and never answers
        server.bind(("127.0.0.1", 0))
        server.listen()
        start = time.monotonic()
        silent = wait_for_rendezvous_host(f"127.0.0.1:{server.getsockname()[1]}", timeout_s=6)
        assert "accepts connections but does not answer as node 0's rendezvous store would within " \
               "launcher.rdzv_timeout_s=6" in silent
        assert time.monotonic() - start < scaled(60)  # 6 s, and a child's import of torch


# --------------------------------------------------------------------------
# End to end (slow): the CLI as a user runs it
# --------------------------------------------------------------------------

TINY = ["mode=1d", "size=2", "data=synthetic", "train.eval_every=0", "train.log_every=1", "train.progress=false",
        "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "train.batch_size=4", "train.seq_len=16"]
TIMING = ("tokens_per_s", "step_time_s")


def _records(run_dir: Path) -> list[dict]:
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line, parse_constant=refuse).items() if k not in TIMING} for line in lines]


def _checkpoint_bytes(run_dir: Path) -> dict[str, bytes]:
    """Each checkpoint's tensor files (the manifest and DCP metadata record
    when and where; the tensors are the run)."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted((run_dir / "checkpoints").glob("step_*/*.distcp"))}


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_second_run_on_a_busy_run_dir_exits_2_and_the_first_is_untouched(tpctl):
    args = ["train", *TINY, "train.steps=8", "checkpoint.every=2", "checkpoint.keep=0"]
    lone = tpctl.cwd / "lone"
    assert tpctl.run([*args, f"hydra.run.dir={lone}"], timeout=480).returncode == 0

    shared = tpctl.cwd / "shared"
    first = tpctl.start([*args, f"hydra.run.dir={shared}"])
    try:
        deadline = time.monotonic() + scaled(120)
        while not (shared / "config.yaml").exists():  # the first run owns the dir and has started
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.1)
        # What a refusal costs on this machine (start Python, compose the
        # config): the busy dir must be refused as fast, give or take 5 s.
        start = time.monotonic()
        assert tpctl.run(["train", "trian.steps=5"], timeout=120).returncode == 2
        baseline = time.monotonic() - start
        # Freeze the first launcher (the lock's holder; its workers train on)
        # so that however fast this machine, the second run meets it.
        os.kill(first.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            second = tpctl.run([*args, "seed=7", f"hydra.run.dir={shared}"], timeout=120)
            elapsed = time.monotonic() - start
        finally:
            os.kill(first.pid, signal.SIGCONT)
        out, err = first.communicate(timeout=scaled(480))
    finally:
        if first.poll() is None:
            first.kill()
    assert second.returncode == 2, second.stderr
    assert second.stderr.strip().splitlines() == [
        f"tpctl: error: run dir {shared} is in use by another tpctl run (pid {first.pid} holds .lock); "
        "wait for it to finish, or choose another hydra.run.dir"]
    assert elapsed < scaled(5) + 2 * baseline, (elapsed, baseline)
    assert first.returncode == 0, err
    assert (shared / "config.yaml").read_text() == (lone / "config.yaml").read_text()
    assert _records(shared) == _records(lone)
    assert _checkpoint_bytes(shared) == _checkpoint_bytes(lone) and len(_checkpoint_bytes(lone)) == 4 * 2
    assert tpctl.leftover_pids() == []


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint_and_resume_continues(tpctl):
    run_dir = tpctl.cwd / "run"
    args = ["train", *TINY, "checkpoint.every=2", "checkpoint.keep=1", f"hydra.run.dir={run_dir}"]
    assert tpctl.run([*args, "train.steps=2"], timeout=480).returncode == 0
    step_2 = run_dir / "checkpoints" / "step_2"
    ckpt.verify(step_2)

    # Files may not grow past 64 KiB (a checkpoint shard is larger; the
    # config, logs and metrics are not): the disk is "full" at the next save.
    limit = 64 * 1024
    full = subprocess.run(tpctl.command([*args, "train.steps=4", "train.resume=auto"]), cwd=tpctl.cwd, env=tpctl.env(),
                          capture_output=True, text=True, timeout=scaled(480),
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    assert full.returncode == 1, full.stderr
    errors = [line for line in full.stderr.splitlines() if line.startswith("tpctl: error: rank")]
    assert len(errors) == 1, full.stderr
    # Every rank fails its save alike; which one the launcher hears of first is a race.
    assert re.match(r"tpctl: error: rank \d+: CheckpointError: checkpoint step 4 not written to ", errors[0]) \
        and "OSError [EFBIG] File too large; the checkpoints written before are kept" in errors[0], errors
    assert "Traceback" not in full.stderr
    assert not list((run_dir / "checkpoints").glob(".tmp_*"))  # the failed save's temp dir is gone
    assert ckpt.verify(step_2)["step"] == 2
    assert "CheckpointError" in (run_dir / "logs" / "rank0.log").read_text()  # the traceback is kept there

    resumed = tpctl.run([*args, "train.steps=4", "train.resume=auto"], timeout=480)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {step_2}" in resumed.stdout
    assert [s for s, _ in ckpt.step_dirs(run_dir / "checkpoints")] == [4]
    assert tpctl.leftover_pids() == []


NAN_RUN = ["train", "mode=none", "model=custom", "model._target_=tests.nan_model.build", "+model.nan_at=3",
           "data=synthetic", "train.steps=4", "train.log_every=1", "train.eval_every=0", "train.progress=false",
           "checkpoint.every=1", "checkpoint.keep=0"]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_non_finite_loss_stops_the_run_naming_the_step_or_is_skipped(tpctl):
    stop = tpctl.cwd / "stop"
    result = tpctl.run([*NAN_RUN, f"hydra.run.dir={stop}"], timeout=480)
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("tpctl: error: rank")]
    assert errors == ["tpctl: error: rank 0: NonFiniteLoss: step 3: the loss is nan and the gradient norm nan "
                      "(train.on_nonfinite=stop; the checkpoints written before step 3 are kept)"]
    assert [s for s, _ in ckpt.step_dirs(stop / "checkpoints")] == [2, 1]
    ckpt.verify(stop / "checkpoints" / "step_2")
    assert [r["step"] for r in _records(stop)] == [1, 2]

    skip = tpctl.cwd / "skip"
    result = tpctl.run([*NAN_RUN, "train.on_nonfinite=skip", f"hydra.run.dir={skip}"], timeout=480)
    assert result.returncode == 0, result.stderr
    assert "tpctl: warning: step 3: the loss is nan" in result.stderr
    records = _records(skip)  # strict JSON: null, never NaN
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[2]["loss"] is None and records[2]["skipped"] is True
    assert all(math.isfinite(r["loss"]) for r in records if r["step"] != 3)
    assert json.loads((skip / "summary.json").read_text())["skipped_steps"] == 1
    assert tpctl.leftover_pids() == []


@pytest.mark.timeout(400)
def test_a_node_whose_node_0_is_missing_gives_up_after_the_rendezvous_timeout_in_one_line(tpctl):
    tpctl.extra_env["TPCTL_WORKER_MODULE"] = "tests.fake_worker"
    port = _closed_port()
    result = tpctl.run(["train", "mode=1d", "size=2", "data=synthetic", "launcher.nnodes=2", "launcher.node_rank=1",
                        f"launcher.rdzv_endpoint=127.0.0.1:{port}", "launcher.rdzv_timeout_s=3",
                        f"hydra.run.dir={tpctl.cwd / 'node1'}"], timeout=300)
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert errors[0] == (f"tpctl: error: node 1 of 2: cannot reach the rendezvous at 127.0.0.1:{port} within "
                         f"launcher.rdzv_timeout_s=3: connection refused: is node 0 (launcher.node_rank=0) running "
                         f"with launcher.rdzv_endpoint=127.0.0.1:{port}?"), result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.splitlines()) <= 4, result.stderr
    assert not list((tpctl.cwd / "node1").glob("fake_worker_rank*.pid"))  # no worker started
    assert tpctl.leftover_pids() == []


def test_two_recipes_that_include_each_other_are_named(recipe_dir):
    (recipe_dir / "recipe" / "ping.yaml").write_text("# @package _global_\ndefaults:\n  - /recipe/pong\n  - _self_\n")
    (recipe_dir / "recipe" / "pong.yaml").write_text("# @package _global_\ndefaults:\n  - ping\n  - _self_\n")
    with pytest.raises(ConfigError) as e:
        compose_jobs(["recipe=ping"], config_dir=str(recipe_dir))
    ping, pong = (str(recipe_dir / "recipe" / f"{n}.yaml") for n in ("ping", "pong"))
    assert str(e.value).endswith(f"the defaults lists include each other in a cycle: {ping} -> {pong} -> {ping}: "
                                 "remove one of those entries"), str(e.value)
