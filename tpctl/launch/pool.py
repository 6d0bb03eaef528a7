"""A pool of ranks with an initialised gloo process group, for tests.

Spawning processes and importing torch costs seconds per rank, so a test
module starts one pool and runs many functions on it, and the ranks of a
pool fork from one process that has imported torch (and what the pool's
owner had imported of transformers and tpctl) once: a rank then costs a
fork, not an interpreter importing torch (a pool of 8 spawned ranks spent
13 CPU-s starting). Every call has a hard timeout: a deadlocked collective
fails the call (and closes the pool) instead of hanging the suite; an
exception on any rank is re-raised naming the rank.
"""

from __future__ import annotations

import datetime
import os
import queue
import sys
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

from .local import free_port

# How often an idle rank looks whether the process that started it is alive.
PARENT_POLL_S = 2.0
# Imported once by a pool's zygote, before its ranks fork from it: what
# every rank imports (torch._dynamo too: torch's optimizers import it the
# first time one is built, ~2 CPU-s a rank otherwise), and (where the pool's
# owner has them loaded, as a test process has) the heavy modules the calls'
# functions import.
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "tpctl.launch.worker")
PRELOAD_IF_LOADED = ("transformers", "tpctl.training.build", "tpctl.training.loop", "tpctl.models",
                     "tpctl.parallel.parallelism", "tpctl.checkpoint")


def _zygote(world: int, port: int, tasks, results, timeout_s: float, owner: int, preload: tuple) -> None:
    """A pool's ranks, forked from this process once it has imported
    `preload` (single-threaded until then: nothing has run), and waited
    for. It dies with the pool's owner (PDEATHSIG), and the ranks with it;
    when a rank ends other than by the pool's close, the others are ended
    too (they would wait for it in their next collective)."""
    import importlib
    import signal

    from tpctl.errors import die_with_parent

    die_with_parent(signal.SIGKILL)
    if os.getppid() != owner:  # the owner died before the line above
        os._exit(1)
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception:  # the rank that needs it reports the error when its call imports it
            pass
    me, pids = os.getpid(), set()
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            try:
                _serve(rank, world, port, tasks[rank], results, timeout_s, me)
            finally:
                os._exit(1)  # (_serve leaves through worker.leave; never back into this loop)
        pids.add(pid)
    while pids:
        pid, status = os.wait()
        pids.discard(pid)
        if status != 0:
            for other in pids:
                os.kill(other, signal.SIGKILL)
    os._exit(0)


def _serve(rank: int, world: int, port: int, tasks, results, timeout_s: float, parent: int) -> None:
    import signal

    from tpctl.errors import die_with_parent

    # A rank dies with the process that started the pool, however that one
    # ends (SIGKILL, an interrupted pytest, os._exit: multiprocessing's exit
    # handler that terminates daemons runs in none of those). Linux signals
    # it; elsewhere, and should the parent have died before this line, the
    # idle rank sees itself reparented.
    die_with_parent(signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)
    import torch
    import torch.distributed as dist

    from .gloo import share_one_device

    torch.set_num_threads(1)
    share_one_device()  # one polling thread for the dozens of groups the calls make
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    while True:
        try:
            task = tasks.get(timeout=PARENT_POLL_S)
        except queue.Empty:
            if os.getppid() != parent:
                os._exit(1)
            continue
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # report everything; the pool decides
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()
    from .worker import leave

    leave(0)  # as a worker leaves: never through finalisation with gloo's threads alive


class DistPool:
    def __init__(self, world_size: int, timeout_s: float = 120.0):
        self.world_size, self.timeout_s = world_size, timeout_s
        self._closed = False
        ctx = mp.get_context("spawn")
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        port = free_port("127.0.0.1")
        preload = PRELOAD + tuple(name for name in PRELOAD_IF_LOADED if name in sys.modules)
        self._zygote = ctx.Process(target=_zygote, daemon=True,
                                   args=(world_size, port, self._tasks, self._results, timeout_s, os.getpid(), preload))
        self._zygote.start()

    def run(self, fn: Callable, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        """Run fn(*args, **kwargs) on every rank; return the results by rank."""
        for q in self._tasks:
            q.put((fn, args, kwargs))
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        out: dict[int, Any] = {}
        failures = []
        while len(out) + len(failures) < self.world_size:
            remaining = deadline - time.monotonic()
            try:
                rank, ok, value = self._results.get(timeout=max(remaining, 0.01))
            except queue.Empty:
                missing = sorted(set(range(self.world_size)) - set(out) - {r for r, _ in failures})
                # Ranks stuck in a collective would answer a later call.
                self.close()
                if failures:
                    break
                raise TimeoutError(f"{fn.__name__}: ranks {missing} did not finish within {timeout_s or self.timeout_s}s") from None
            if ok:
                out[rank] = value
            else:
                failures.append((rank, value))
                # The others may now wait forever in a collective.
                deadline = min(deadline, time.monotonic() + 10)
        if failures:
            rank, tb = sorted(failures)[0]
            raise RuntimeError(f"{fn.__name__} failed on rank {rank}:\n{tb}")
        return [out[r] for r in range(self.world_size)]

    def release_groups(self) -> None:
        """Destroy every process group the calls made but the world's: a pool
        that serves many test modules would gather thousands."""
        self.run(_release_groups)

    def alive(self) -> bool:
        """Every rank still serves (close() was not called, none died: the
        zygote ends the others and itself when one dies)."""
        return not self._closed and self._zygote.is_alive()

    def close(self) -> None:
        self._closed = True
        for q in self._tasks:
            try:
                q.put(None)
            except Exception:
                pass
        # One grace period for all ranks (a rank that compiled may take long
        # to tear down its process group), then kill what is left: the
        # zygote, whose death kills the ranks (PDEATHSIG).
        self._zygote.join(timeout=5)
        if self._zygote.is_alive():
            self._zygote.kill()
            self._zygote.join(timeout=5)


_meshes: dict = {}  # per rank process: the process groups of a mesh are built once


def _release_groups() -> None:
    """Destroy every process group but the world's (each holds a gloo
    thread polling its sockets: hundreds of them load a small machine), and
    forget the meshes built on them."""
    import gc

    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    _meshes.clear()
    for group in list(distributed_c10d._world.pg_map):
        if group is not dist.group.WORLD:
            dist.destroy_process_group(group)
    gc.collect()


def parallelism_of(layout, bucket_bytes: int | None = None, pipeline=None):
    """The Parallelism of `layout` (a parallel.layout.Layout) on a pool
    rank: its process groups are made once per process (on first use), the
    mode and data-parallel objects, which a model's rewrite and training
    step fill in, anew for each call. `pipeline` (a stages.PipelineSpec,
    with pp > 1): the schedule of a fresh pipeline (a pipeline holds one
    model's stage)."""
    from tpctl.parallel.mesh import build_mesh
    from tpctl.parallel.parallelism import parallelism

    if layout not in _meshes:
        _meshes[layout] = build_mesh(layout, seed=0)
    return parallelism(layout, pipeline=pipeline, mesh=_meshes[layout], bucket_bytes=bucket_bytes)


def pooled_run(cfg, layout=None, bucket_bytes: int | None = None, pipeline=None, **options):
    """training.build.build_run on a pool rank: the run of `cfg` in `layout`
    (default: the config's) on this process's reused groups
    (`parallelism_of`); `pipeline`: the schedule with pp > 1 (default: the
    config's, as a worker's); `options` are build_run's (verify, step,
    lazy, schedule)."""
    from tpctl.parallel.pipeline.stages import pipeline_of
    from tpctl.parallel.layout import Layout
    from tpctl.training.build import build_run

    layout = layout or Layout.from_config(cfg)
    return build_run(cfg, parallelism_of(layout, bucket_bytes, pipeline or pipeline_of(layout, cfg)), **options)
