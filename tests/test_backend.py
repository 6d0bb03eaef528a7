"""launcher.backend and train.compile on the command line: a bad value, a
backend that cannot drive the device, a machine without CUDA, a missing or
failing compiler: exit 2 with one line, before any worker starts; and
train.compile=auto falling back to eager."""

from __future__ import annotations

import pytest
import torch

from cli_support import tpctl  # noqa: F401 (fixture)

NO_CUDA = not torch.cuda.is_available()

BAD = [
    (["launcher.backend=mpi"], {}, "launcher.backend='mpi'", "expected one of"),
    (["launcher.backend=nccl"], {}, "launcher.backend='nccl'", "NCCL runs on CUDA devices only"),
    (["train.compile=maybe"], {}, "train.compile='maybe'", "expected one of"),
    # A compiler that is not there: refused without compiling anything.
    (["train.compile=true"], {"CXX": "/nonexistent/g++"}, "train.compile='true'", "none is on PATH"),
]
if NO_CUDA:
    BAD += [(["device=cuda"], {}, "device='cuda'", "no CUDA device"),
            (["device=cuda", "launcher.backend=gloo"], {}, "device='cuda'", "no CUDA device")]


def _one_line_exit_2(tpctl, overrides, env, key_value, valid, run_dir_may_exist=False):
    tpctl.extra_env.update(env, TPCTL_WORKER_MODULE="tests.fake_worker")
    run_dir = tpctl.cwd / "run"
    result = tpctl.run(["train", *overrides, f"hydra.run.dir={run_dir}"], timeout=240)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"tpctl: error: invalid config: {key_value}: "), lines[0]
    assert valid in lines[0], lines[0]
    assert run_dir_may_exist or not run_dir.exists()
    assert not list(tpctl.cwd.rglob("fake_worker_rank*.pid")), "a worker started"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("overrides,env,key_value,valid", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_backend_or_compile_exits_2_with_one_line(tpctl, overrides, env, key_value, valid):
    _one_line_exit_2(tpctl, overrides, env, key_value, valid)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_compiler_that_fails_is_refused_before_workers(tpctl):
    """A C++ compiler that is there but fails (/bin/false): the launcher's
    probe compiles a tiny function first and stops with one line."""
    _one_line_exit_2(tpctl, ["train.compile=true"], {"CXX": "/bin/false"}, "train.compile='true'",
                     "InvalidCxxCompiler", run_dir_may_exist=True)


def test_auto_falls_back_to_eager_in_one_line(monkeypatch):
    from tpctl.training.compile import compile_model

    monkeypatch.setenv("CXX", "/nonexistent/g++")
    said = []
    model = torch.nn.Linear(2, 2)
    assert compile_model(model, "auto", "cpu", said.append) is False
    assert len(said) == 1 and said[0].startswith("tpctl: train.compile=auto: ") and "training eagerly" in said[0]
    assert getattr(model, "_compiled_call_impl", None) is None


def test_backend_auto_resolves_by_device():
    from tpctl.launch.worker import resolve_backend

    assert resolve_backend("auto", "cuda") == "nccl"
    assert resolve_backend("auto", "cpu") == "gloo"
    assert resolve_backend("gloo", "cuda") == "gloo"
