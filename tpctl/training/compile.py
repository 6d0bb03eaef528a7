"""train.compile: torch.compile the model's forward (false | true | auto).

The model is compiled in place (`nn.Module.compile`): its parameters, names
and checkpoints stay what they are. Collectives are not traced: every one of
them goes through tpctl.parallel.comm, whose entry points dynamo leaves to
eager (a graph break at each), so the bytes they count stay true; the
compiled pieces are the local math between them.

  * true: refused before any worker starts when the compiler is missing
    (`compiler_problem`) or cannot build a tiny function on the device
    (`probe`, run once by the launcher);
  * auto: each worker probes; where compiling fails it trains eagerly and
    rank 0 says so in one line.

Each rank's compile log (dynamo's steps, every graph break and recompile
with its reason) goes to <run dir>/logs/compile_rank<r>.log (`keep_log`),
not to the terminal. On CUDA the loss's chunks compile too, whatever this
setting (parallel/tensor/loss.py's CUDA policy: one fused kernel each).

Test hook: TPCTL_COMPILE_BACKEND names another torch.compile backend (e.g.
aot_eager: dynamo and AOT autograd without inductor's code generation).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable, Optional

BACKEND_ENV = "TPCTL_COMPILE_BACKEND"
COMPILE_SETTINGS = ("false", "true", "auto")


def compile_setting(cfg) -> str:
    """train.compile as one of COMPILE_SETTINGS (Hydra reads false/true as booleans)."""
    value = cfg.train.get("compile", False)
    return str(value).lower() if isinstance(value, (bool, str)) else repr(value)


def backend() -> str:
    return os.environ.get(BACKEND_ENV, "inductor")


def compiler_problem(device: str) -> Optional[str]:
    """Why torch.compile cannot work here (None: nothing known against it),
    without compiling anything: dynamo's Python support, and the tool
    inductor generates code with (a C++ compiler for CPU, Triton for CUDA)."""
    import torch

    if not hasattr(torch, "compile"):
        return f"torch {torch.__version__} has no torch.compile"
    try:
        import torch._dynamo

        if not torch._dynamo.is_dynamo_supported():
            return f"torch.compile does not support this Python ({'.'.join(map(str, __import__('sys').version_info[:3]))})"
    except Exception as e:  # is_dynamo_supported raises on some versions
        return f"torch.compile is not supported here: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    if backend() != "inductor":
        return None
    if device == "cpu":
        cxx = os.environ.get("CXX")
        candidates = [cxx] if cxx else ["g++", "c++", "clang++"]
        if not any(shutil.which(c) for c in candidates):
            return (f"inductor builds CPU code with a C++ compiler, and none is on PATH "
                    f"({'CXX=' + cxx if cxx else 'g++, c++, clang++'})")
    elif device == "cuda":
        import importlib.util

        if importlib.util.find_spec("triton") is None:
            return "inductor builds CUDA kernels with Triton, which is not installed (pip install triton)"
    return None


def probe(device: str) -> Optional[str]:
    """Compile and run a tiny forward and backward on `device`; None when it
    works, else the first line of the failure."""
    import torch

    def tiny(x, w):
        return torch.nn.functional.gelu(x @ w).sum()

    try:
        compiled = torch.compile(tiny, backend=backend())
        dev = torch.device(device)
        x = torch.randn(4, 8, device=dev)
        w = torch.randn(8, 8, device=dev, requires_grad=True)
        compiled(x, w).backward()
        torch._dynamo.reset()
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"torch.compile ({backend()}) failed on a tiny function: {type(e).__name__}: {first}"[:400]
    return None


def preflight(setting: str, device: str) -> Optional[str]:
    """train.compile=true: the reason it cannot work (the launcher refuses
    the run), or None."""
    if setting != "true":
        return None
    return compiler_problem(device) or probe(device)


def keep_log(path: Path) -> None:
    """torch.compile's log of this process into `path` only: dynamo's steps
    (INFO), graph breaks and recompiles with their reasons."""
    import logging

    import torch._logging

    path.parent.mkdir(parents=True, exist_ok=True)
    os.environ["TORCH_LOGS_OUT"] = str(path)  # where torch's own log setup adds a file handler
    torch._logging.set_logs(dynamo=logging.INFO, graph_breaks=True, recompiles=True)
    try:
        from torch._logging._internal import log_registry

        names = log_registry.get_log_qnames() | log_registry.get_artifact_log_qnames()
    except (ImportError, AttributeError):  # another torch's internals: the terminal keeps a copy
        return
    for name in names:  # the file, not the terminal: eight ranks' tracing would bury the run's lines
        logger = logging.getLogger(name)
        logger.handlers = [h for h in logger.handlers if type(h) is not logging.StreamHandler]


def compile_model(model, setting: str, device: str, say: Callable[[str], None], per_block: bool = False,
                  log_path: Optional[Path] = None) -> bool:
    """Compile `model` in place per train.compile `setting`; True if it is.

    per_block (a pipeline stage): compile each block of the stack instead
    of the model's forward, whose code around the blocks a stage runs
    with stand-ins and leaves early (parallel/pipeline/schedule.py): the blocks are
    nearly all of the compute, and the stage's hooks stay eager.
    log_path: where this rank's compile log goes (`keep_log`)."""
    if setting == "false":
        return False
    if setting == "auto":
        problem = compiler_problem(device) or probe(device)
        if problem:
            say(f"tpctl: train.compile=auto: {problem}; training eagerly")
            return False
    from tpctl.parallel import comm

    if log_path is not None:
        keep_log(log_path)
    comm.keep_collectives_eager()
    if per_block:
        import torch

        from tpctl.parallel.roles.plan import repeated_blocks

        for block in repeated_blocks(model).children():
            block.forward = torch.compile(block.forward, backend=backend())
        return True
    model.compile(backend=backend())
    return True
