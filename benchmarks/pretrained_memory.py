"""Peak memory of loading a pretrained Hugging Face model: each rank reading
only its slices from the safetensors files (3d, size 8) against one process
loading the whole model.

    python benchmarks/pretrained_memory.py               # configs/model/llama-100m.yaml
    python benchmarks/pretrained_memory.py --mode 2d --size 4
    python benchmarks/pretrained_memory.py --tiny --mode 1d --size 2      # a smoke run

A random Llama of the config is saved once with save_pretrained (the setup;
not measured). Then, in fresh processes, peak RSS is taken after
imports (baseline) and after loading (VmHWM): `from_pretrained` in one process, and
tpctl's lazy build + parallelize on every rank of the mesh.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from tpctl.launch.pool import DistPool  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TINY = {"vocab_size": 256, "n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 32, "intermediate_size": 64,
        "block_size": 64}


def _rss() -> int:
    from tpctl.training.loop import peak_rss_bytes

    return peak_rss_bytes()


def _imports() -> None:
    """Everything either side imports, so that the baseline holds it."""
    import transformers.models.llama.modeling_llama  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401

    import tpctl.models  # noqa: F401
    import tpctl.parallel.tensor.modes.three_d  # noqa: F401


def load_whole(directory: str) -> tuple[int, int]:
    _imports()
    base = _rss()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory)
    # Touch every weight: a memory-mapped file's pages count once read, as
    # they are by the first forward.
    assert sum(float(p.detach().abs().sum()) for p in model.parameters()) > 0
    return base, _rss()


def load_sharded(directory: str, mode: str, size: int) -> tuple[int, int, int]:
    _imports()
    base = _rss()
    from omegaconf import OmegaConf

    import tpctl
    from tpctl.config import typed_model
    from tpctl.models import build_model

    cfg = typed_model(OmegaConf.create({"arch": "llama", "pretrained": directory}))
    model = tpctl.parallelize(build_model(cfg, seed=0, lazy=True), tpctl.init_parallel(mode=mode, size=size))
    assert sum(float(p.detach().abs().sum()) for p in model.parameters()) > 0
    return base, _rss(), sum(p.numel() * p.element_size() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs/model/llama-100m.yaml"))
    parser.add_argument("--mode", default="3d")
    parser.add_argument("--size", type=int, default=8)
    parser.add_argument("--tiny", action="store_true", help="the config's family, a few KiB wide (a smoke run)")
    args = parser.parse_args()

    import torch
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    from tpctl.config import typed_model
    from tpctl.models.hf import hf_config

    with tempfile.TemporaryDirectory() as tmp:
        model_cfg = OmegaConf.load(args.config)
        if args.tiny:
            model_cfg.update(TINY)
        config = hf_config(typed_model(model_cfg))
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        n_params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(tmp, safe_serialization=True)
        del model

        whole_pool = DistPool(1, timeout_s=600)
        try:
            base_w, peak_w = whole_pool.run(load_whole, tmp)[0]
        finally:
            whole_pool.close()
        pool = DistPool(args.size, timeout_s=600)
        try:
            sharded = pool.run(load_sharded, tmp, args.mode, args.size)
        finally:
            pool.close()

    mib = lambda n: f"{n / 2**20:,.0f} MiB"  # noqa: E731
    table = Table(title=f"Loading a pretrained Llama of {n_params / 1e6:.0f}M parameters ({n_params * 4 / 2**20:,.0f} MiB fp32)")
    for col in ("who", "peak RSS", "after imports", "loading added", "parameters held"):
        table.add_column(col, justify="right")
    table.add_row("from_pretrained, 1 process", mib(peak_w), mib(base_w), mib(peak_w - base_w), mib(n_params * 4))
    worst = max(sharded, key=lambda r: r[1] - r[0])
    table.add_row(f"tpctl {args.mode} size {args.size}, worst rank", mib(worst[1]), mib(worst[0]), mib(worst[1] - worst[0]), mib(worst[2]))
    mean_peak = sum(r[1] for r in sharded) / len(sharded)
    table.add_row(f"tpctl {args.mode} size {args.size}, mean of ranks", mib(mean_peak), "", "", "")
    Console(width=120).print(table)
    print(f"peak RSS ratio (whole / worst rank): {peak_w / worst[1]:.2f}x; "
          f"memory added by loading: {(peak_w - base_w) / max(worst[1] - worst[0], 1):.1f}x less per rank")


if __name__ == "__main__":
    main()
