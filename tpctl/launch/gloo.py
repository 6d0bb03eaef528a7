"""One gloo transport device for every process group of a process.

torch gives each gloo process group a transport device of its own, and a
device runs a thread that wakes every 10 ms to look whether it should stop
(gloo's tcp Loop). A rank of a 3d or 2.5d mesh holds a dozen groups, a test
pool's rank that has served several meshes dozens: measured on 2 cores, 4
ranks holding 50 groups each spent 0.36 CPU-s per 10 s doing nothing (0.01
with one device), and on a loaded machine each wake-up costs more. Every
group of a process can share one device: its thread multiplexes the
sockets of all of them (gloo's pairs are keyed by the device's own sequence
numbers), and what crosses the wire is unchanged, so the numbers are too.
"""

from __future__ import annotations

import datetime
import os

_installed = False


def share_one_device() -> bool:
    """From now on, every gloo process group this process makes
    (init_process_group, new_group) runs on one device, made as torch makes
    its default (GLOO_SOCKET_IFNAME's interfaces, else the host's) and with
    torch's default of two worker threads per device. Call before the first
    group; True when installed (False on a torch whose gloo bindings lack
    the options, which then keeps its own behaviour)."""
    global _installed
    if _installed:
        return True
    from torch.distributed import distributed_c10d as c10d

    base = getattr(c10d, "ProcessGroupGloo", None)
    if base is None or not hasattr(base, "_Options") or not hasattr(base, "create_default_device"):
        return False
    names = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
    devices = [base.create_device(interface=n) for n in names] if names else [base.create_default_device()]

    class SharedDeviceGloo(base):
        """ProcessGroupGloo on the process's shared devices (the
        constructor signature c10d calls)."""

        def __init__(self, store, rank, size, timeout=datetime.timedelta(seconds=1800)):
            options = base._Options()
            options._timeout = timeout
            options._devices = devices
            options._threads = 2 * len(devices)
            super().__init__(store, rank, size, options)

    SharedDeviceGloo.__name__ = SharedDeviceGloo.__qualname__ = base.__name__
    c10d.ProcessGroupGloo = SharedDeviceGloo
    _installed = True
    return True
