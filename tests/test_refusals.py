"""Bad input and a hostile environment, each answered by the contract's exit
status and one line naming the cause: a disk that fills during a
checkpoint, a rendezvous endpoint that never answers, a launcher killed
while its workers start, floats fp32 cannot hold, a prompt longer than the
model, files others cannot read, and the small messages around them."""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_support import REPO, marked_pids, tpctl, scaled  # noqa: F401  (fixture)
from conftest import LAYOUTS, build_trainer, tiny_config
from tpctl.errors import LAUNCHER_PID_ENV


# --------------------------------------------------------------------------
# A disk that fills during a checkpoint
# --------------------------------------------------------------------------


def _trained(layout: str):
    """(the Trainer after one step, the mode) of a tiny GPT in `layout`."""

    cfg = LAYOUTS[layout].write_to(tiny_config(1))
    trainer = build_trainer(cfg, LAYOUTS[layout], pooled=False, lazy=False)
    trainer.train_step(0)
    return trainer, trainer.par


def _save_with_a_file_limit(run_dir: str, limit: int) -> str:
    """Save with rank 0's files limited to `limit` bytes (the kernel
    refuses what goes past it, as a full disk does): the error each rank
    raises."""
    from tpctl import checkpoint

    trainer, tp = _trained("1d-2-dp4")
    saved = resource.getrlimit(resource.RLIMIT_FSIZE)
    if tp.mesh.rank == 0:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, saved[1]))
    try:
        checkpoint.save(Path(run_dir) / "checkpoints", 1, trainer.model, trainer.optimizer, tp, trainer.cfg)
    except checkpoint.CheckpointError as e:
        return str(e)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, saved)
    return "saved"


def test_a_write_refused_inside_a_tensor_is_named_by_its_errno_on_every_rank(pool, tmp_path):
    # 20 KB: the first tensors fit, then torch.save's write fails mid-tensor
    # and raises a RuntimeError ("unexpected pos") over the OSError; DCP
    # gathers it pickled, without that OSError.
    errors = pool.run(_save_with_a_file_limit, str(tmp_path), 20_000)
    assert len(set(errors)) == 1, errors
    assert errors[0].startswith(f"checkpoint step 1 not written to {tmp_path / 'checkpoints'}: OSError [EFBIG] "
                                "File too large"), errors[0]
    assert not list((tmp_path / "checkpoints").glob(".tmp_*"))


def _needed_and_written(run_dir: str) -> tuple[int, int]:
    import torch.distributed as dist

    from tpctl import checkpoint
    from tpctl.checkpoint.manifest import _written_bytes

    trainer, tp = _trained("2d-4-dp2")
    need = [0] * tp.mesh.world_size
    entries = checkpoint.state_entries(trainer.model, trainer.optimizer, tp, 1, 0.0)
    dist.all_gather_object(need, checkpoint.bytes_to_write(entries))
    path = checkpoint.save(Path(run_dir), 1, trainer.model, trainer.optimizer, tp, trainer.cfg)
    return sum(need) + checkpoint.MANIFEST_ALLOWANCE, _written_bytes(path)


def test_the_free_space_a_save_asks_for_is_what_the_checkpoint_takes(pool, tmp_path):
    need, written = pool.run(_needed_and_written, str(tmp_path))[0]
    # Never less than the truth (the check would pass and the write fail),
    # and not far above it (a save that fits would be refused).
    assert written <= need <= 1.1 * written, (need, written)


# --------------------------------------------------------------------------
# A launcher killed while its workers start
# --------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_workers_of_a_launcher_killed_while_they_import_end_with_it(tpctl):
    proc = tpctl.start(["train", "mode=1d", "size=2", "dp=2", "data=synthetic", f"hydra.run.dir={tpctl.cwd / 'run'}"])
    try:
        deadline = time.monotonic() + scaled(180)
        while len([p for p in marked_pids(tpctl.marker) if p != proc.pid]) < 4:  # every worker exists
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)  # no cleanup of its own: only the kernel can stop the workers now
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert tpctl.leftover_pids(wait_s=30) == []


def test_a_worker_whose_launcher_is_already_gone_does_not_start(tmp_path):
    env = {**os.environ, LAUNCHER_PID_ENV: str(os.getpid() + 1_000_000), "RANK": "3"}  # not its parent
    started = time.monotonic()
    worker = subprocess.run([sys.executable, "-m", "tpctl.launch.worker", str(tmp_path / "config.yaml")],
                            capture_output=True, text=True, env=env, timeout=scaled(60), cwd=REPO)
    assert worker.returncode == 128 + signal.SIGTERM, worker.stderr
    assert worker.stderr.splitlines() == [f"tpctl: rank 3: the launcher (pid {env[LAUNCHER_PID_ENV]}) is gone; "
                                          "not starting"]
    assert time.monotonic() - started < scaled(30)  # before torch: a few imports of the standard library


@pytest.mark.timeout(240)
def test_a_worker_whose_store_never_answers_ends_after_the_collective_timeout_and_is_named(tmp_path):
    from omegaconf import OmegaConf

    from tpctl.config import compose_jobs
    from tpctl.launch.local import failure_reason
    from tpctl.launch.worker import ALARM_REASON

    OmegaConf.save(compose_jobs(["mode=1d", "size=2", "launcher.collective_timeout_s=3"])[0], tmp_path / "config.yaml")
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        env = {**os.environ, "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(silent.getsockname()[1])}
        env.pop(LAUNCHER_PID_ENV, None)
        worker = subprocess.run([sys.executable, "-m", "tpctl.launch.worker", str(tmp_path / "config.yaml")],
                                capture_output=True, text=True, env=env, timeout=scaled(200), cwd=REPO)
    assert worker.returncode == -signal.SIGALRM, worker.stderr
    from types import SimpleNamespace

    assert failure_reason(SimpleNamespace(exitcode=-signal.SIGALRM, message="")) == ALARM_REASON


# --------------------------------------------------------------------------
# A prompt longer than the model
# --------------------------------------------------------------------------


def test_a_prompt_longer_than_the_model_is_named_with_its_length(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from tpctl.commands import generate

    config = transformers.GPT2Config(vocab_size=256, n_embd=16, n_layer=1, n_head=2, n_positions=16,
                                     bos_token_id=None, eos_token_id=None, pad_token_id=None)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    capsys.readouterr()  # save_pretrained's progress bar
    assert generate.main([str(tmp_path), "prompt=" + "x" * 20, "max_new_tokens=4"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"tpctl: error: invalid config: prompt='{'x' * 20}': 20 tokens, but the model has 16 positions for the "
        "prompt and the new tokens: expected a prompt of at most 15 tokens"]


# --------------------------------------------------------------------------
# Context parallelism on a model whose attention it cannot replace
# --------------------------------------------------------------------------


@pytest.mark.parametrize("overrides,named", [
    (["model=hf", "model.arch=falcon"], "attention module transformer.h.0.self_attention (FalconAttention) of model.arch=falcon"),
    (["model=custom", "model._target_=tests.custom_model.build"], "attention module stack.0.mixer (Mixer)"),
    (["model=mlp"], "model.arch=mlp has no attention module"),
])
def test_cp_on_a_model_it_cannot_split_is_refused_naming_the_attention_module(overrides, named):
    from tpctl.config import compose_jobs, validate
    from tpctl.errors import ConfigError

    cfg = compose_jobs([*overrides, "cp=2"])[0]
    with pytest.raises(ConfigError) as refused:
        validate(cfg)
    line = str(refused.value)
    assert line.startswith(f"invalid config: cp=2: {named}") and line.endswith("expected cp=1") and "\n" not in line
