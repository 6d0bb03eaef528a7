"""A machine's profile for the planner's time model: peak rates, links and
memory per rank, read from configs/hardware/<name>.yaml (or written there by
`tpctl plan --calibrate`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tpctl.config import HARDWARE_DIR
from tpctl.errors import ConfigError


@dataclass
class Hardware:
    name: str
    peak_flops: float  # per rank, fp32 (what tpctl computes in today)
    efficiency: float  # achieved fraction of peak on these matmuls
    ranks_per_node: int
    intra_bw: float  # bytes/s per rank, inside a node
    intra_latency: float  # seconds per ring step
    inter_bw: float  # bytes/s per rank, across nodes
    inter_latency: float
    memory_bytes: float = 0.0  # per rank (device memory); 0: not checked
    # per rank: the process before any model (CPU: the interpreter, torch and
    # gloo, measured by --calibrate); added to layout=auto's predicted peak
    base_bytes: float = 0.0
    # per rank: the floor of a `tpctl train` worker, training a tpctl model
    # and a Hugging Face one (--calibrate: calibrate.train_floors). Lower
    # than base_bytes, which is a calibration pool's rank: that preloads
    # transformers whatever the model, a worker only imports it for a
    # Hugging Face model (~40 MiB on CPU). 0: base_bytes for both.
    train_base_bytes: float = 0.0
    train_base_bytes_hf: float = 0.0
    # CPU: glibc keeps freed blocks below its mmap threshold (which rises to
    # 32 MiB after the first large free) in its heap, so the blocks a step
    # makes and frees (activations, temporaries) peak this fraction above
    # their live bytes; fitted to the recipes' measured peaks
    # (benchmarks/check_accuracy.py). 0: none (a GPU's caching allocator).
    heap_slack: float = 0.0
    # seconds per block per micro-batch beside its FLOPs (CPU: the operators'
    # fixed cost, fitted by --calibrate); layout=auto adds it per rank's blocks
    block_overhead_s: float = 0.0
    cores: int = 0  # CPU profiles: ranks beyond this many share cores (0: one device per rank)
    # CPU profiles: the ranks the collectives were timed over (--calibrate's
    # world); their latency and bandwidth already hold that many ranks' turns
    comm_world: int = 0
    # a reduce-scatter's and an all-gather's measured time over the one the
    # latency and bandwidth above give it (--calibrate: gloo reduce-scatters
    # as an all-reduce); 1: as counted
    reduce_scatter_factor: float = 1.0
    all_gather_factor: float = 1.0
    peak_flops_bf16: float = 0.0  # per rank, dense bf16 (tensor cores); 0: unknown (bench's MFU at bf16)
    peak_flops_tf32: float = 0.0  # per rank, dense TF32 (train.tf32=true); 0: none (bench's MFU at fp32)
    note: str = ""

    def process_bytes(self, hf: bool) -> float:
        """The process's share of a `tpctl train` rank's peak (`hf`: the
        model is a Hugging Face family's)."""
        return (self.train_base_bytes_hf if hf else self.train_base_bytes) or self.base_bytes

    def kind_factor(self, kind: str) -> float:
        """How much longer a collective of `kind` takes than the latency and
        bandwidth give it (1 for the all-reduce they were fitted to)."""
        return {"reduce_scatter": self.reduce_scatter_factor, "all_gather": self.all_gather_factor}.get(kind, 1.0)

    def comm_turns(self, world: int) -> float:
        """How much slower a collective of `world` ranks runs than profiled:
        ranks beyond the cores take turns at every hop, beyond the turns
        the calibration's own ranks already took (comm_world)."""
        if not self.cores:
            return 1.0
        return max(1.0, world / self.cores) / max(1.0, self.comm_world / self.cores)


def load_hardware(name: str) -> Hardware:
    import yaml

    path = HARDWARE_DIR / f"{name}.yaml"
    if not path.exists():
        valid = ", ".join(sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml")))
        raise ConfigError("hardware", name, f"expected one of {valid}")
    raw = yaml.safe_load(path.read_text())
    fields = {f.name for f in dataclasses.fields(Hardware)}
    try:
        values = {k: (str(v) if k == "note" else int(v) if k in ("ranks_per_node", "cores", "comm_world") else float(v))
                  for k, v in raw.items() if k in fields and k != "name"}
        return Hardware(name=name, **values)
    except (TypeError, ValueError) as e:  # PyYAML reads 1.0e9 as text, hence float() above
        raise ConfigError("hardware", name, f"{path} needs numbers for {', '.join(sorted(fields - {'name', 'note'}))}: {e}") from None
