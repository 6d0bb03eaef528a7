"""Peak memory and time of the vocab-parallel cross entropy against
F.cross_entropy, on CPU, one rank (group of one: no communication).

    PYTHONPATH=. python benchmarks/loss_memory.py [rows] [vocab]

Peak: the highest sum of live bytes torch allocated while the loss's
forward and backward ran, from the profiler's allocation events (tracemalloc
does not see torch's allocator), beyond the logits block that exists before.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

from tpctl.cost.measure import peak_allocated_bytes as peak_bytes
from tpctl.parallel.tensor.loss import vocab_parallel_cross_entropy


def run(rows: int, vocab: int, dtype: torch.dtype, which: str) -> tuple[int, float]:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=g).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), generator=g)

    def step():
        if which == "tpctl":
            loss = vocab_parallel_cross_entropy(logits, targets, 0, vocab, None).mean()
        else:
            loss = F.cross_entropy(logits.float() if dtype != torch.float32 else logits, targets)
        loss.backward()
        logits.grad = None

    step()
    t0 = time.perf_counter()
    step()
    elapsed = time.perf_counter() - t0
    return peak_bytes(step), elapsed


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
    vocab = int(sys.argv[2]) if len(sys.argv) > 2 else 50257
    torch.set_num_threads(1)
    print(f"{rows} rows x vocab {vocab}; peak MiB beyond the logits, and ms for forward+backward")
    for dtype in (torch.float32, torch.bfloat16):
        block = rows * vocab * torch.empty((), dtype=dtype).element_size()
        for which in ("tpctl", "F.cross_entropy"):
            peak, seconds = run(rows, vocab, dtype, which)
            print(f"{str(dtype):15} {which:16} peak {peak / 2**20:8.1f} MiB ({peak / block:4.2f} x the logits block)  "
                  f"{seconds * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()
