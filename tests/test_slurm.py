"""launcher=slurm without a Slurm cluster: the submission is rendered and
checked (`--dry-run`), and the per-node entry point is run as a Slurm task
would run it (Slurm's environment variables set by hand, a stand-in worker)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from cli_support import REPO, tpctl, scaled  # noqa: F401  (fixture)
from tpctl.config import compose_jobs, load_worker_config
from tpctl.launch.local import free_port
from tpctl.launch.slurm import dry_run, executor_parameters, node_settings

HAVE_SUBMITIT = importlib.util.find_spec("submitit") is not None
SLURM = ["launcher=slurm", "launcher.nnodes=2", "launcher.partition=gpu", "launcher.gpus_per_node=4",
         "launcher.time_min=90", "device=cuda", "mode=3d", "size=8", "launcher.setup=[module load cuda]"]


def test_parameters_map_the_config_to_sbatch_options():
    cfg = compose_jobs(SLURM)[0]
    assert executor_parameters(cfg) == {"job_name": "tpctl-3d-8", "nodes": 2, "ntasks_per_node": 1, "time": 90,
                                        "partition": "gpu", "gpus_per_node": 4, "setup": ["module load cuda"]}


@pytest.mark.timeout(60)
def test_dry_run_prints_the_submission_and_submits_nothing(tpctl):
    run_dir = tpctl.cwd / "run"
    result = tpctl.run(["train", "--dry-run", *SLURM, f"hydra.run.dir={run_dir}"])
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith(f"tpctl: dry run: would submit to Slurm (nothing submitted); the job reads {run_dir}/config.yaml")
    assert '"nodes": 2' in out and '"gpus_per_node": 4' in out
    assert f"each of the 2 tasks calls: tpctl.launch.slurm.run_node('{run_dir}/config.yaml') -> 4 workers" in out
    if HAVE_SUBMITIT:
        for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=4",
                     "#SBATCH --partition=gpu", "#SBATCH --time=90", "module load cuda"):
            assert line in out, line
        assert "srun" in out and "-m submitit.core._submit" in out
    else:
        assert "install submitit to see the sbatch script" in out
    # The config the job would read is there; nothing else happened.
    assert load_worker_config(run_dir / "config.yaml").launcher.name == "slurm"
    assert not (run_dir / "slurm").exists()
    assert tpctl.leftover_pids(wait_s=0) == []


def test_dry_run_without_submitit_still_renders_the_parameters(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "submitit", None)  # import submitit -> ImportError
    monkeypatch.setitem(sys.modules, "submitit.slurm.slurm", None)
    text = dry_run(compose_jobs(SLURM)[0], tmp_path)
    assert '"nodes": 2' in text and "install submitit" in text


@pytest.mark.timeout(60)
def test_gpus_per_node_must_match_the_workers_per_node(tpctl):
    result = tpctl.run(["train", "--dry-run", *SLURM, "launcher.gpus_per_node=2"])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "tpctl: error: invalid config: launcher.gpus_per_node=2: device=cuda runs one worker per GPU: expected size*pp*dp/nnodes=4"]


def test_each_node_takes_its_place_from_slurm():
    cfg = compose_jobs(SLURM)[0]
    node_settings(cfg, 1, ["gpu-a17", "gpu-a18"], "4242")
    assert (cfg.launcher.node_rank, cfg.launcher.rdzv_endpoint, cfg.launcher.rdzv_id) == (1, "gpu-a17:29500", "slurm-4242")


@pytest.mark.skipif(not HAVE_SUBMITIT, reason="submitit not installed (pip install 'tpctl[slurm]')")
@pytest.mark.timeout(120)
def test_a_slurm_task_launches_its_nodes_workers(tpctl, tmp_path):
    # One node, as Slurm would start its task: the job's environment, then run_node.
    run_dir = tmp_path / "run"
    result = tpctl.run(["train", "--dry-run", "launcher=slurm", "mode=1d", "size=2", "data=synthetic",
                        f"launcher.master_port={free_port('127.0.0.1')}", f"hydra.run.dir={run_dir}"])
    assert result.returncode == 0, result.stderr
    env = tpctl.env()
    env.update(SUBMITIT_EXECUTOR="slurm", SLURM_JOB_ID="4242", SLURM_NODEID="0", SLURM_JOB_NODELIST="localhost",
               SLURM_JOB_NUM_NODES="1", SLURM_NTASKS="1", SLURM_PROCID="0", SLURM_LOCALID="0",
               TPCTL_WORKER_MODULE="tests.fake_worker")
    node = subprocess.run([sys.executable, "-c", f"from tpctl.launch.slurm import run_node; run_node({str(run_dir / 'config.yaml')!r})"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=scaled(100))
    assert node.returncode == 0, node.stderr
    assert sorted(p.name for p in run_dir.glob("fake_worker_rank*.pid")) == ["fake_worker_rank0.pid", "fake_worker_rank1.pid"]
    assert tpctl.leftover_pids() == []


@pytest.mark.skipif(not HAVE_SUBMITIT, reason="submitit not installed (pip install 'tpctl[slurm]')")
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_submitit_runs_the_slurm_path_end_to_end_without_a_cluster(tpctl, tmp_path):
    # What `launcher=slurm` submits (run_node on the config the dry run
    # wrote), handed to submitit's local executor instead of sbatch: the
    # job environment, the node's place, the launcher, real workers training.
    import json

    import submitit

    run_dir = tmp_path / "run"
    result = tpctl.run(["train", "--dry-run", "launcher=slurm", "mode=1d", "size=2", "data=synthetic", "train.steps=2",
                        f"launcher.master_port={free_port('127.0.0.1')}",
                        f"hydra.run.dir={run_dir}"])
    assert result.returncode == 0, result.stderr
    executor = submitit.LocalExecutor(folder=str(tmp_path / "submitit"))
    executor.update_parameters(timeout_min=round(scaled(4 * 60) / 60))
    from tpctl.launch.slurm import run_node

    job = executor.submit(run_node, str(run_dir / "config.yaml"))
    try:
        job.result()
    finally:
        if not job.done():
            job.cancel()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["mode"] == "1d", summary
    assert sorted(p.name for p in (run_dir / "logs").glob("rank*.log")) == ["rank0.log", "rank1.log"]
