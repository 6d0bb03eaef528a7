"""The race a finished gloo rank used to lose at exit, made likely on purpose.

    python tests/teardown_race.py ROUNDS [--without-fix]

Each round forks two gloo ranks from this process (torch is imported once,
here). Every rank pins itself to one core and starves its gloo threads
(SCHED_IDLE: they run only when nothing else wants that core); rank 0 comes
late to the final synchronous all-reduce, so rank 1 leaves it at once,
while the gloo thread that ran it still holds its tensors (it lets go of
them after the caller has returned). Both import
torch.distributed.nn.functional after the group exists, as DCP makes every
worker do: it keeps the world group, and its threads, alive after
destroy_process_group. Then each rank ends as tpctl's workers do,
`tpctl.launch.worker.leave(0)`, or with --without-fix as a Python program
normally does, through interpreter finalisation: there the starved thread
asks for the GIL to drop a tensor, Python ends it with pthread_exit, and the
unwinding through gloo's noexcept destructor aborts the process
("terminate called without an active exception", SIGABRT).

Prints one line per round whose ranks did not both exit 0 and a last line
`rounds R, failed F`; exits 1 when any failed. tests/test_teardown.py runs
it; see launch/worker.py, `leave`.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # no BLAS threads in the process that forks
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tpctl.launch.local import free_port  # noqa: E402
from tpctl.launch.worker import leave  # noqa: E402


def starve_gloo_threads(core: int) -> None:
    """This process on `core`, every thread but the main one SCHED_IDLE."""
    for tid in map(int, os.listdir("/proc/self/task")):
        os.sched_setaffinity(tid, {core})
        if tid != os.getpid():
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))


def rank_main(rank: int, port: int, core: int, fixed: bool) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    import torch.distributed.nn.functional  # noqa: F401  (captures the world group, as DCP's import does)

    starve_gloo_threads(core)
    dist.all_reduce(torch.ones(1000))
    if rank == 0:
        time.sleep(0.2)
    dist.all_reduce(torch.ones(8))  # the last collective; its tensor is dropped at once
    dist.destroy_process_group()
    if fixed:
        leave(0)
    sys.exit(0)  # finalisation: the race


def main(argv: list[str]) -> int:
    rounds, fixed = int(argv[0]), "--without-fix" not in argv
    core = min(os.sched_getaffinity(0))
    failed = 0
    for round_ in range(rounds):
        port = free_port("127.0.0.1")
        pids = []
        for rank in range(2):
            pid = os.fork()
            if pid == 0:
                rank_main(rank, port, core, fixed)  # never returns
            pids.append(pid)
        codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
        if any(codes):
            failed += 1
            print(f"round {round_}: exit statuses {codes} (negative: killed by that signal)", flush=True)
    print(f"rounds {rounds}, failed {failed}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
