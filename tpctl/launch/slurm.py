"""`launcher=slurm`: submit a run to Slurm through submitit.

The job has `launcher.nnodes` Slurm tasks, one per node. Each runs
`run_node(<run dir>/config.yaml)`, which reads the node's place from Slurm
(submitit's JobEnvironment: node index, host names, job id) and calls the
same `launcher.launch` a local run uses, with launcher.node_rank = the node
index, rdzv_endpoint = <first host>:master_port and rdzv_id = the job id, so
the nodes meet at torchrun's c10d rendezvous as in a hand-started multi-node
run. The run dir must be on a file system every node sees (it holds the
config the workers read, their logs and the metrics).

`tpctl train --dry-run launcher=slurm ...` prints the submission (the
submitit parameters, and the sbatch script submitit would write when it is
installed) and submits nothing. submitit is an optional dependency:
`pip install 'tpctl[slurm]'`.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

from tpctl.parallel.layout import Layout
from tpctl.errors import EXIT_FAILED, fail

SUBMITIT_MISSING = "launcher=slurm submits through submitit, which is not installed: pip install 'tpctl[slurm]' (or pip install submitit)"


def executor_parameters(cfg: Any) -> dict:
    """submitit.SlurmExecutor parameters (each one an sbatch option)."""
    lc = cfg.launcher
    params = {
        "job_name": f"tpctl-{cfg.mode}-{cfg.size}x{cfg.dp}",
        "nodes": lc.nnodes,
        # One task per node: it is torchrun's agent, which starts the node's workers.
        "ntasks_per_node": 1,
        "time": lc.time_min,
        "partition": lc.partition,
        "gpus_per_node": lc.gpus_per_node or None,
        "cpus_per_task": lc.cpus_per_task,
        "account": lc.account,
        "qos": lc.qos,
        "setup": list(lc.setup) or None,
    }
    return {k: v for k, v in params.items() if v is not None}


def _executor(cfg: Any, run_dir: Path):
    try:
        import submitit
    except ImportError:
        return None
    executor = submitit.SlurmExecutor(folder=str(run_dir / "slurm"))
    executor.update_parameters(**executor_parameters(cfg))
    return executor


def sbatch_script(cfg: Any, run_dir: Path) -> str | None:
    """The sbatch script submitit would submit; None without submitit.
    Rendered by submitit's own function, as SlurmExecutor does, without the
    executor: that one insists on finding srun, which a dry run must not."""
    try:
        from submitit.slurm.slurm import _make_sbatch_string
    except ImportError:
        return None
    folder = Path(run_dir) / "slurm"
    # What each task runs: submitit's loader, which unpickles run_node.
    command = " ".join([shlex.quote(sys.executable), "-u -m submitit.core._submit", shlex.quote(str(folder))])
    return _make_sbatch_string(command=command, folder=folder, **executor_parameters(cfg))


def dry_run(cfg: Any, run_dir: Path) -> str:
    """The submission, as text: parameters, the call each node makes, and
    the sbatch script when submitit is installed."""
    run_dir = Path(run_dir)
    lines = [f"tpctl: dry run: would submit to Slurm (nothing submitted); the job reads {run_dir / 'config.yaml'}",
             "submitit.SlurmExecutor parameters: " + json.dumps(executor_parameters(cfg), sort_keys=True),
             f"each of the {cfg.launcher.nnodes} tasks calls: tpctl.launch.slurm.run_node({str(run_dir / 'config.yaml')!r}) -> "
             f"{Layout.from_config(cfg).world // cfg.launcher.nnodes} workers, rendezvous at <first node>:{cfg.launcher.master_port}"]
    script = sbatch_script(cfg, run_dir)
    if script is None:
        lines.append("(install submitit to see the sbatch script: pip install 'tpctl[slurm]')")
    else:
        lines += ["sbatch script:", script.rstrip()]
    return "\n".join(lines)


def submit(cfg: Any, run_dir: Path) -> int:
    """Submit the run; print the job id. 0 submitted, 1 submission failed."""
    try:
        executor = _executor(cfg, Path(run_dir))
        if executor is None:
            return fail(f"{SUBMITIT_MISSING}", EXIT_FAILED)
        job = executor.submit(run_node, str(Path(run_dir) / "config.yaml"))
    except Exception as e:  # no srun/sbatch here, or Slurm refusing: one line
        return fail(f"Slurm submission failed: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}", EXIT_FAILED)
    print(f"tpctl: submitted Slurm job {job.job_id} ({cfg.launcher.nnodes} nodes); its output: {Path(run_dir) / 'slurm'}")
    return 0


def node_settings(cfg: Any, node: int, hostnames: list[str], job_id: str) -> None:
    """Set this node's place in the job (in place)."""
    lc = cfg.launcher
    lc.node_rank = node
    lc.rdzv_endpoint = f"{hostnames[0]}:{lc.master_port or 29500}"
    lc.rdzv_id = f"slurm-{job_id}"


def run_node(config_path: str) -> None:
    """One Slurm task: launch this node's share of the workers."""
    import submitit

    from tpctl.config import load_worker_config
    from .local import launch

    env = submitit.JobEnvironment()
    cfg = load_worker_config(config_path)
    node_settings(cfg, env.node, list(env.hostnames), str(env.job_id))
    from .run_lock import RunDirLock

    # The submitting tpctl has exited: each node owns its share of the run dir now.
    with RunDirLock(Path(config_path).parent, env.node, wait_s=120):
        status = launch(cfg, Path(config_path).parent)
    if status != 0:
        raise SystemExit(status)
