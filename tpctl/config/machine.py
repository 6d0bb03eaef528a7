"""What the launcher, the nodes and the devices must offer a run: checked
on the machine that starts it, before any worker does."""

from __future__ import annotations

from typing import Any

from tpctl.errors import ConfigError
from tpctl.parallel.layout import Layout

from .messages import check_at_least, check_choice

LAUNCHERS = ("local", "slurm")
BACKENDS = ("auto", "nccl", "gloo")
START_METHODS = ("auto", "forkserver", "spawn")


def check_backend(cfg: Any) -> None:
    """launcher.backend against the device, and the CUDA devices it needs:
    nccl one GPU per rank, gloo at least one GPU (ranks may share it)."""
    backend = cfg.launcher.get("backend", "auto")
    check_choice("launcher.backend", backend, BACKENDS)
    if backend == "nccl" and cfg.device != "cuda":
        raise ConfigError("launcher.backend", backend, f"NCCL runs on CUDA devices only: with device={cfg.device} use launcher.backend=gloo (or auto)")
    if cfg.device != "cuda" or cfg.launcher.name != "local":  # Slurm's nodes are checked by gpus_per_node
        return
    # torch is imported only here: a CPU config check stays fast.
    import torch

    world = Layout.from_config(cfg).world // cfg.launcher.nnodes  # this node's share
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have == 0:
        raise ConfigError("device", "cuda", "this machine has no CUDA device (torch.cuda.is_available() is False"
                          f"{'; torch ' + torch.__version__ + ' is a CPU build' if torch.version.cuda is None else ''}): use device=cpu")
    if backend != "gloo" and have < world:
        raise ConfigError("device", "cuda", f"size*pp*dp/nnodes={world} ranks need {world} CUDA devices with NCCL, this machine has {have}: "
                          "use launcher.backend=gloo to let ranks share a GPU (for testing), or device=cpu")


def check_compile(cfg: Any) -> None:
    from tpctl.training.compile import COMPILE_SETTINGS, compile_setting, compiler_problem

    setting = compile_setting(cfg)
    check_choice("train.compile", setting, COMPILE_SETTINGS)
    if setting == "true":

        problem = compiler_problem(cfg.device)
        if problem:
            raise ConfigError("train.compile", "true", f"{problem}: use train.compile=false, or auto to fall back to eager")


def check_nodes(cfg: Any) -> None:
    """ConfigError for a launcher or multi-node setting that cannot work."""
    lc, world = cfg.launcher, Layout.from_config(cfg).world
    if lc.name not in LAUNCHERS:
        raise ConfigError("launcher.name", lc.name, f"expected one of {', '.join(LAUNCHERS)} (launcher=local or launcher=slurm)")
    if lc.nnodes < 1:
        raise ConfigError("launcher.nnodes", lc.nnodes, "expected a positive number of nodes")
    if world % lc.nnodes:
        raise ConfigError("launcher.nnodes", lc.nnodes,
                          f"every node runs the same number of workers: size*pp*dp={world} must divide by nnodes")
    if not 0 <= lc.node_rank < lc.nnodes:
        raise ConfigError("launcher.node_rank", lc.node_rank, f"expected 0 <= node_rank < launcher.nnodes={lc.nnodes}")
    if lc.name == "slurm":
        if cfg.device == "cuda" and lc.gpus_per_node != world // lc.nnodes:
            raise ConfigError("launcher.gpus_per_node", lc.gpus_per_node,
                              f"device=cuda runs one worker per GPU: expected size*pp*dp/nnodes={world // lc.nnodes}")
        if lc.time_min < 1:
            raise ConfigError("launcher.time_min", lc.time_min, "expected a positive number of minutes")
        return  # Slurm tells each node its rank and the rendezvous host
    if lc.nnodes > 1 and not lc.rdzv_endpoint:
        raise ConfigError("launcher.rdzv_endpoint", lc.rdzv_endpoint,
                          "several nodes meet at node 0: expected HOST:PORT, reachable from every node")
    if lc.rdzv_endpoint:
        host, _, port = lc.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError("launcher.rdzv_endpoint", lc.rdzv_endpoint, "expected HOST:PORT, e.g. node0.cluster:29500")
        import socket

        try:
            socket.getaddrinfo(host, int(port))
        except (OSError, UnicodeError) as e:
            raise ConfigError("launcher.rdzv_endpoint", lc.rdzv_endpoint,
                              f"the host {host!r} does not resolve here ({getattr(e, 'strerror', None) or e})") from None
    if lc.rdzv_timeout_s < 1:
        raise ConfigError("launcher.rdzv_timeout_s", lc.rdzv_timeout_s, "expected a value >= 1")


def check_launcher(launcher: Any) -> None:
    import socket

    check_at_least("launcher.max_restarts", launcher.max_restarts, 0)
    check_choice("launcher.start_method", launcher.get("start_method", "auto"), START_METHODS)
    check_at_least("launcher.collective_timeout_s", launcher.collective_timeout_s, 1)
    if not launcher.monitor_interval_s > 0:
        raise ConfigError("launcher.monitor_interval_s", launcher.monitor_interval_s, "expected a positive number of seconds")
    try:
        socket.getaddrinfo(launcher.master_addr, None)
    except (OSError, UnicodeError) as e:
        raise ConfigError("launcher.master_addr", launcher.master_addr, f"not a host name or address this machine resolves ({e})") from None
    port = launcher.master_port
    if not 0 <= port <= 65535:
        raise ConfigError("launcher.master_port", port, "expected a TCP port 1..65535, or 0 to pick a free one")
    if port:
        # torchrun's rendezvous store listens there: it must be free now.
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((launcher.master_addr, port))
            except OSError as e:
                raise ConfigError("launcher.master_port", port, f"cannot listen there ({e.strerror}): choose a free port, or 0 to pick one") from None


