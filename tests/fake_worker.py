"""A stand-in for tpctl.worker, selected with TPCTL_WORKER_MODULE=tests.fake_worker.

It follows the worker contract (argv[1] is the run dir's config.yaml, torchrun
sets RANK/WORLD_SIZE) without training anything, so the launcher can be
tested alone. Behaviour comes from environment variables:
  FAKE_WORKER_FAIL_RANK=r  rank r raises RuntimeError("fake failure on rank r")
  FAKE_WORKER_SLEEP=s      every other rank sleeps s seconds before finishing
  FAKE_WORKER_ABORT=r:when rank r aborts (SIGABRT) `before` or `after` marking
                           its work complete (tpctl.launch.worker.mark_done)
Rank 0 writes a summary.json with made-up numbers (for sweep comparisons).
Each rank writes <run dir>/fake_worker_rank<r>.json: its torch thread count and
its parent's (the fork server's) command line beside its grandparent's (the
launcher's).
Each rank writes its pid to <run dir>/fake_worker_rank<r>.pid first, so a test
can check afterwards that no worker is left alive.
"""

import json
import os
import sys
import time
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

# Its waits for the other ranks stretch as the test's timeouts do: by the
# slowness measured when the test started tpctl (cli_support.Tpctl sets it).
WAIT_S = min(60 * float(os.environ.get("TPCTL_TEST_SLOWNESS") or 1), 600)


@record
def main() -> None:
    run_dir = Path(sys.argv[1]).parent
    rank = int(os.environ["RANK"])
    (run_dir / f"fake_worker_rank{rank}.pid").write_text(str(os.getpid()))
    import torch

    server = os.getppid()
    launcher = int(Path(f"/proc/{server}/stat").read_text().rsplit(")", 1)[1].split()[1])
    cmdline = lambda pid: Path(f"/proc/{pid}/cmdline").read_text()  # noqa: E731
    (run_dir / f"fake_worker_rank{rank}.json").write_text(json.dumps(
        {"threads": torch.get_num_threads(), "server": cmdline(server), "launcher": cmdline(launcher)}))
    if os.environ.get("FAKE_WORKER_FAIL_RANK") == str(rank):
        # Fail only once every rank of this node is running, so there is
        # something to stop however fast or slow the machine starts them.
        world, deadline = int(os.environ["LOCAL_WORLD_SIZE"]), time.monotonic() + WAIT_S
        while len(list(run_dir.glob("fake_worker_rank*.pid"))) < world and time.monotonic() < deadline:
            time.sleep(0.05)
        raise RuntimeError(f"fake failure on rank {rank}")
    time.sleep(float(os.environ.get("FAKE_WORKER_SLEEP", "0")))
    if rank == 0:  # the run dir's summary, as tpctl.worker writes it (made-up numbers)
        world = int(os.environ["WORLD_SIZE"])
        summary = {"mode": "fake", "size": world, "dp": 1, "steps": 1, "first_loss": 5.0, "final_loss": 4.0,
                   "tokens_per_s": 1000.0 * world, "comm_bytes_per_step": 2.0**20 * world,
                   "param_bytes": 2.0**20 / world, "param_bytes_max_rank": 2.0**20 / world,
                   "peak_rss_bytes": 2.0**28, "peak_rss_bytes_max_rank": 2.0**28}
        (run_dir / "summary.json").write_text(json.dumps(summary))
    print(f"fake worker rank {rank} of {os.environ['WORLD_SIZE']} done", flush=True)


def run() -> None:
    from tpctl.launch.worker import mark_done

    abort_rank, _, when = os.environ.get("FAKE_WORKER_ABORT", "").partition(":")
    aborts = abort_rank == os.environ["RANK"]
    main()
    if aborts and when == "before":
        os.abort()
    mark_done()
    if aborts:
        # Once every rank of this node has marked its work complete: the
        # agent stops the ranks still running when one dies.
        from tpctl.launch.worker import DONE_MARKER

        attempt = Path(os.environ["TORCHELASTIC_ERROR_FILE"]).parent.parent
        deadline = time.monotonic() + WAIT_S
        while len(list(attempt.glob(f"*/{DONE_MARKER}"))) < int(os.environ["LOCAL_WORLD_SIZE"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.abort()


if __name__ == "__main__":
    run()
