"""A stand-in for tpctl.worker, selected with TPCTL_WORKER_MODULE=tests.fake_worker.

It follows the worker contract (argv[1] is the run dir's config.yaml, torchrun
sets RANK/WORLD_SIZE) without training anything, so the launcher can be
tested alone. Behaviour comes from environment variables:
  FAKE_WORKER_FAIL_RANK=r  rank r raises RuntimeError("fake failure on rank r")
  FAKE_WORKER_SLEEP=s      every other rank sleeps s seconds before finishing
Each rank writes its pid to <run dir>/fake_worker_rank<r>.pid first, so a test
can check afterwards that no worker is left alive.
"""

import os
import sys
import time
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    run_dir = Path(sys.argv[1]).parent
    rank = int(os.environ["RANK"])
    (run_dir / f"fake_worker_rank{rank}.pid").write_text(str(os.getpid()))
    if os.environ.get("FAKE_WORKER_FAIL_RANK") == str(rank):
        time.sleep(0.5)  # let the other ranks start, so there is something to stop
        raise RuntimeError(f"fake failure on rank {rank}")
    time.sleep(float(os.environ.get("FAKE_WORKER_SLEEP", "0")))
    print(f"fake worker rank {rank} of {os.environ['WORLD_SIZE']} done", flush=True)


if __name__ == "__main__":
    main()
