"""A load generator for checking the suite's timeouts on a busy machine:
`python tests/busy_load.py 16 --seconds 3600` keeps 16 processes busy-looping
(pure Python, one core each when they get one) until the time is up or it is
interrupted (Ctrl-C, SIGTERM), then ends them all. The suite's timeouts scale
with the slowness measured under such a load (cli_support.scaled; the rule in
docs/guide/testing.md), e.g.

    python tests/busy_load.py 16 --seconds 3000 &
    .venv/bin/python -m pytest -q -n 2 tests/test_launcher.py tests/test_multinode.py
    kill %1
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import sys
import time


def _spin(parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the generator ends its children itself
    n = 0
    while True:
        for _ in range(1_000_000):
            n += 1
        if os.getppid() != parent:  # the generator died without ending us
            return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("processes", type=int, nargs="?", default=16)
    parser.add_argument("--seconds", type=float, default=3600.0, help="end after this long (default 3600)")
    args = parser.parse_args(argv)
    procs = [mp.Process(target=_spin, args=(os.getpid(),), daemon=True) for _ in range(args.processes)]
    for p in procs:
        p.start()
    print(f"busy_load: {args.processes} busy processes for up to {args.seconds:.0f} s (pid {os.getpid()})", flush=True)

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        time.sleep(args.seconds)
    except KeyboardInterrupt:
        pass
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
