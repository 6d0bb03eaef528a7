"""Multi-node launch: two "nodes" on this machine, i.e. two `tpctl train`
processes meeting at a loopback c10d rendezvous, each starting half the
workers. The job must train exactly as one node does, and one node's death
must end the other (exit 1, naming what happened) instead of hanging it.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from cli_support import tpctl, scaled  # noqa: F401  (fixture)
from tpctl.config import compose_jobs
from tpctl.launch.local import free_port, node_layout

COMMON = ["data=synthetic", "train.log_every=1", "train.eval_every=0", "train.progress=false", "seed=0"]


def node_args(run_dir: Path, port: int, node_rank: int, *overrides: str) -> list[str]:
    return ["train", *overrides, *COMMON, "launcher.nnodes=2", f"launcher.node_rank={node_rank}",
            f"launcher.rdzv_endpoint=127.0.0.1:{port}", f"launcher.rdzv_timeout_s={round(scaled(120))}", f"hydra.run.dir={run_dir}"]


def curve(*run_dirs: Path) -> list[dict]:
    """The metrics of a job: written by rank 0, on whichever node holds it."""
    found = [d / "metrics.jsonl" for d in run_dirs if (d / "metrics.jsonl").exists()]
    assert len(found) == 1, found
    return [json.loads(line) for line in found[0].read_text().splitlines()]


@pytest.mark.parametrize("per_node,size,dp,expected", [
    (4, 4, 2, "1 whole tensor-parallel group(s) of 4; only data-parallel traffic crosses nodes"),
    (2, 4, 1, "a tensor-parallel group (size=4) spans 2 nodes"),
    (3, 2, 3, "3 does not divide by size=2, so some tensor-parallel groups span two nodes"),
])
def test_node_layout_says_whether_a_tensor_parallel_group_fits_in_a_node(per_node, size, dp, expected):
    nnodes = size * dp // per_node
    cfg = OmegaConf.create({"size": size, "dp": dp, "launcher": {"nnodes": nnodes, "node_rank": 0}})
    assert expected in node_layout(cfg)


def test_multi_node_settings_are_validated():
    from tpctl.config import validate
    from tpctl.errors import ConfigError

    for overrides, key in ((["launcher.nnodes=3", "mode=2d", "size=4"], "launcher.nnodes"),
                           (["launcher.nnodes=2", "mode=1d", "size=2"], "launcher.rdzv_endpoint"),
                           (["launcher.nnodes=2", "launcher.node_rank=2", "mode=1d", "size=2",
                             "launcher.rdzv_endpoint=h:1"], "launcher.node_rank"),
                           (["launcher.nnodes=2", "mode=1d", "size=2", "launcher.rdzv_endpoint=h"], "launcher.rdzv_endpoint")):
        with pytest.raises(ConfigError) as e:
            validate(compose_jobs(overrides)[0])
        assert e.value.key == key, (overrides, str(e.value))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_nodes_on_loopback_train_exactly_like_one_node(tpctl):
    layout = ["mode=2d", "size=4", "train.steps=4"]
    single = tpctl.cwd / "single"
    one = tpctl.run(["train", *layout, *COMMON, f"hydra.run.dir={single}"], timeout=180)
    assert one.returncode == 0, one.stderr

    port = free_port("127.0.0.1")
    dirs = [tpctl.cwd / "node0", tpctl.cwd / "node1"]
    nodes = [tpctl.start(node_args(dirs[k], port, k, *layout)) for k in (0, 1)]
    outputs = [p.communicate(timeout=scaled(200)) for p in nodes]
    for p, (out, err) in zip(nodes, outputs):  # (both nodes' errors: one's failure may be the other's cause)
        assert p.returncode == 0, "\n".join(f"node {k}: {e[-2000:]}" for k, (_, e) in enumerate(outputs))
    # 2 workers per node, size=4: the tensor-parallel group spans both, and tpctl says so.
    assert "tpctl: node 1 of 2: 2 workers: a tensor-parallel group (size=4) spans 2 nodes" in outputs[1][1]
    # Each node ran its own two ranks.
    ranks = sorted(p.name for d in dirs for p in (d / "logs").glob("rank*.log"))
    assert ranks == ["rank0.log", "rank1.log", "rank2.log", "rank3.log"]

    reference, got = curve(single), curve(*dirs)
    assert [r["step"] for r in got] == [r["step"] for r in reference] == [1, 2, 3, 4]
    for a, b in zip(got, reference):
        # The same ranks in the same layout: the same arithmetic, bit for bit.
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"], (a, b)
    assert tpctl.leftover_pids() == []


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("dying", [1, 0], ids=["worker-node-dies", "rendezvous-host-dies"])
def test_one_nodes_death_ends_the_other_with_exit_1(tpctl, dying):
    timeout_s = round(scaled(60))  # (start-up's collectives run under it too: 30 s was too short on a loaded machine)
    port = free_port("127.0.0.1")
    dirs = [tpctl.cwd / "node0", tpctl.cwd / "node1"]
    # One worker per node is enough to lose a peer, and starts fastest.
    args = ["mode=1d", "size=2", "train.steps=100000", f"launcher.collective_timeout_s={timeout_s}"]
    nodes = [tpctl.start(node_args(dirs[k], port, k, *args)) for k in (0, 1)]
    survivor = 1 - dying
    try:
        deadline = time.monotonic() + scaled(240)
        while not any((d / "metrics.jsonl").exists() and (d / "metrics.jsonl").read_text() for d in dirs):
            assert all(p.poll() is None for p in nodes) and time.monotonic() < deadline, "training never started"
            time.sleep(0.5)
        nodes[dying].send_signal(signal.SIGKILL)  # its tpctl dies; its workers follow (PDEATHSIG)
        killed_at = time.monotonic()
        _, err = nodes[survivor].communicate(timeout=timeout_s + scaled(60))
        elapsed = time.monotonic() - killed_at
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert nodes[survivor].returncode == 1, err[-3000:]
    # Within the collective timeout, plus the survivor's teardown (seconds;
    # more on a loaded machine, where a lost peer may only show as the timeout).
    assert elapsed < timeout_s + scaled(20), f"node {survivor} took {elapsed:.0f}s to notice"
    lines = [line for line in err.splitlines() if line.startswith("tpctl:")]
    # Either its workers lose their peer first, or (when node 0, the
    # rendezvous host, died) its agent loses the rendezvous first.
    lost_peer = any(line.startswith("tpctl: error: rank ") for line in lines)
    if lost_peer:
        assert "tpctl: a rank lost its connection to a peer: another rank, or another node's tpctl, died first (see its logs)" in lines
    else:
        assert dying == 0, lines
        assert any(line.startswith(f"tpctl: error: node 1 of 2: lost the rendezvous at 127.0.0.1:{port}") for line in lines), lines
    assert lines[-1] == f"tpctl: error: training failed in {dirs[survivor]}"
    assert tpctl.leftover_pids() == []
