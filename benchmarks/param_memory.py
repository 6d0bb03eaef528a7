"""Parameter memory per rank of a model in every mode, against the layout's
theory (docs/DESIGN.md: 1/P in 1d, 1/q^2 in 2d and 2.5d, 1/q^3 in 3d).

    python benchmarks/param_memory.py                # gpt-small (GPT-2 124M)
    python benchmarks/param_memory.py --n-layer 24 --n-embd 1024 --n-head 16

The model is built on the meta device (shapes only) and rewritten by the real
code as each of the 8 ranks would rewrite it (one process, the ranks' meshes
without process groups: the planner's dry run), so this measures what a run
would allocate.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

WORLD = 8
# (mode, size, depth, dp, theory divisor)
MESHES = [("none", 1, 1, 8, 1), ("1d", 2, 1, 4, 2), ("1d", 4, 1, 2, 4),
          ("2d", 4, 1, 2, 4), ("2.5d", 8, 2, 1, 4), ("3d", 8, 1, 1, 8)]


def measure(mode: str, size: int, depth: int, dp: int, model_kwargs: dict) -> list[tuple[int, int]]:
    """(whole model's bytes, this rank's bytes) for each of the WORLD ranks."""
    import torch

    from tpctl.models import GPT
    from tpctl.parallel.layout import Layout
    from tpctl.parallel.parallelism import parallelism
    from tpctl.schema import ModelConfig

    out = []
    for rank in range(WORLD):
        with torch.device("meta"):  # shapes only: nothing is allocated
            model = GPT(ModelConfig(**model_kwargs))
            whole = sum(p.numel() * p.element_size() for p in model.parameters())
            parallelism(Layout(mode, size, depth, dp=dp), groups=False, rank=rank).rewrite(model)
        out.append((whole, sum(p.numel() * p.element_size() for p in model.parameters())))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab-size", type=int, default=50257)
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--n-head", type=int, default=12)
    parser.add_argument("--n-embd", type=int, default=768)
    parser.add_argument("--block-size", type=int, default=1024)
    args = parser.parse_args()
    model_kwargs = dict(vocab_size=args.vocab_size, n_layer=args.n_layer, n_head=args.n_head,
                        n_embd=args.n_embd, block_size=args.block_size)
    rows = [(m, measure(*m[:4], model_kwargs)) for m in MESHES]
    table = Table(title=f"parameter memory per rank (fp32), {model_kwargs}")
    for col in ("mode", "size", "whole model", "per rank (max)", "theory", "per rank / theory"):
        table.add_column(col, justify="right")
    for (mode, size, depth, _dp, divisor), results in rows:
        whole = results[0][0]
        per_rank = max(r[1] for r in results)
        theory = whole / divisor
        label = f"{mode} (d={depth})" if mode == "2.5d" else mode
        table.add_row(label, str(size), f"{whole / 2**20:.1f} MiB", f"{per_rank / 2**20:.1f} MiB",
                      f"{theory / 2**20:.1f} MiB", f"{per_rank / theory:.3f}")
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
