"""The plan's predicted speed-up ratios between modes at 64 GPUs, beside the
ratios the 2D, 2.5D and 3D papers measured (their abstracts; sources below).

    python benchmarks/papers_vs_plan.py          # prints a markdown table

The papers' exact model shapes and batch sizes were not available to us (only
their abstracts were), so each row uses a stated stand-in: a GPT-style
Transformer, 24 layers, vocab 51200, seq 512, hidden 4096 for strong scaling
(the model fixed) and hidden 8192 for the weak-scaling point at 64 GPUs (the
model grown with the GPU count). Ratios are of predicted step time at equal
global batch on 64 ranks, dp = 1 (all 64 in one tensor-parallel group, as in
the papers' tensor-parallel comparisons).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tpctl.parallel.layout import Layout  # noqa: E402
from tpctl.cost.planner import _spans_nodes, load_hardware, model_shape, plan_split, predict, sent_s  # noqa: E402
from tpctl.schema import ModelConfig  # noqa: E402

SPLITS = {"1d": Layout("1d", 64), "2d": Layout("2d", 64), "2.5d": Layout("2.5d", 64, depth=4), "3d": Layout("3d", 64)}
SETUPS = {
    "strong": dict(n_embd=4096, batch=64),
    "weak": dict(n_embd=8192, batch=128),
}
# (paper, setup, faster mode, slower mode, measured ratio, where it is stated)
PAPERS = [
    ("Optimus / 2D (Xu et al. 2021, arXiv:2104.05343)", "not stated in the abstract", "2d", "1d", "1.48",
     "abstract: 'On 64 GPUs of TACC Frontera, Optimus achieves 1.48X speedup for training ... over Megatron'"),
    ("Tesseract / 2.5D (Wang et al. 2021, arXiv:2105.14500, ICPP'22)", "strong", "2.5d", "1d", "1.38",
     "abstract: 'speedups of 1.38x and 1.53x respectively with strong scaling' (vs 1-D, 2-D)"),
    ("Tesseract / 2.5D", "strong", "2.5d", "2d", "1.53", "same sentence"),
    ("Tesseract / 2.5D", "weak", "2.5d", "1d", "3.4 (max)", "abstract: '3.4/1.7 times throughput improvement compared to 1-D/2-D' (weak scaling)"),
    ("Tesseract / 2.5D", "weak", "2.5d", "2d", "1.7 (max)", "same sentence"),
    ("3D (Bian et al. 2021, arXiv:2105.14450)", "not stated in the abstract", "3d", "1d", "2.32",
     "abstract: 64 V100 GPUs, '2.32x and 1.57x speedup' over 1-D and 2-D"),
    ("3D", "not stated in the abstract", "3d", "2d", "1.57", "same sentence"),
]


@functools.lru_cache(maxsize=None)
def splits(setup: str) -> dict:
    """Each mode's split plan at 64 ranks (its dry run on the meta device:
    what does not depend on the hardware, made once per setup)."""
    s = SETUPS[setup]
    cfg = ModelConfig(arch="gpt", vocab_size=51200, n_layer=24, n_head=64, n_embd=s["n_embd"], block_size=512,
                      mlp_ratio=4, dropout=0.0, bias=True, tie_embeddings=True)
    shape = model_shape(cfg)
    return {name: plan_split(shape, layout, s["batch"], 512) for name, layout in SPLITS.items()}


def plans(setup: str, hardware: str) -> dict:
    """Each mode's predicted plan at 64 ranks on `hardware`."""
    hw = load_hardware(hardware)
    return {name: predict(dataclasses.replace(plan), hw) for name, plan in splits(setup).items()}


def terms(plan, hw) -> list[tuple[float, str]]:
    """Each collective's predicted seconds (latency + bytes at the slowest
    link its group spans), largest first, as `predict` adds them."""
    out = []
    for (kind, group), c in plan.comm.items():
        spans = _spans_nodes(plan.layout, group, hw.ranks_per_node)
        t = sent_s(plan.layout, kind, group, c.group_size, c.calls, c.wire_bytes, hw)
        out.append((t, f"{kind} {group} (p={c.group_size}, {c.calls} calls, {c.wire_bytes / 2**30:.1f} GiB, "
                       f"{'between nodes' if spans else 'in a node'})"))
    return sorted(out, reverse=True)


def explain(setup: str, hardware: str, ps: dict) -> None:
    """What makes the ratios: each mode's compute, exposed communication
    and largest collective; and 1d again with its tensor all-reduce given
    the node's whole network (inter_bw x ranks_per_node: a ring over 8
    nodes crosses each node's boundary once, on every NIC of the node,
    where the profile's inter_bw is one GPU's share)."""
    hw = load_hardware(hardware)
    print(f"\nWhat makes the ratios ({setup}, {hardware}; ms):")
    print("| mode | step | compute | exposed comm | largest collective | its ms |")
    print("|---|---|---|---|---|---|")
    for name, p in ps.items():
        t, what = terms(p, hw)[0]
        print(f"| {name} | {p.step_time_s * 1e3:,.0f} | {p.compute_s * 1e3:,.0f} | {p.comm_s * 1e3:,.0f} | {what} | {t * 1e3:,.0f} |")
    one = ps["1d"]
    tp = one.comm[("all_reduce", "tp")]
    node_bw = hw.inter_bw * hw.ranks_per_node
    faster = one.step_time_s - tp.wire_bytes / hw.inter_bw + tp.wire_bytes / min(node_bw, hw.intra_bw)
    print(f"\n1d with its tp all-reduce at the node's network ({min(node_bw, hw.intra_bw) / 1e9:.0f} GB/s instead of "
          f"{hw.inter_bw / 1e9:.0f}): {faster * 1e3:,.0f} ms; then " +
          ", ".join(f"{m}/1d {faster / ps[m].step_time_s:.2f}" for m in ("2d", "2.5d", "3d")))


def main() -> None:
    hws = ("v100", "a100", "h100")
    planned = {(setup, hw): plans(setup, hw) for setup in SETUPS for hw in hws}
    times = {key: {name: p.step_time_s for name, p in ps.items()} for key, ps in planned.items()}
    print("| paper | scaling | ratio | measured (paper) | " + " | ".join(f"plan, {hw}" for hw in hws) + " | source |")
    print("|---|---|---|---|" + "---|" * len(hws) + "---|")
    for paper, setup, fast, slow, measured, source in PAPERS:
        plan_setup = setup if setup in SETUPS else "strong"
        cells = []
        for hw in hws:
            t = times[(plan_setup, hw)]
            cells.append(f"{t[slow] / t[fast]:.2f}")
        label = setup if setup in SETUPS else f"{setup} (plan: strong)"
        print(f"| {paper} | {label} | {fast} vs {slow} | {measured} | " + " | ".join(cells) + f" | {source} |")
    print()
    print("Predicted step time (ms) of each mode at 64 ranks:")
    print("| setup | hardware | " + " | ".join(SPLITS) + " |")
    print("|---|---|" + "---|" * len(SPLITS))
    for (setup, hw), t in times.items():
        print(f"| {setup} (hidden {SETUPS[setup]['n_embd']}, batch {SETUPS[setup]['batch']}) | {hw} | "
              + " | ".join(f"{t[m] * 1e3:,.0f}" for m in SPLITS) + " |")
    for hw in ("v100", "h100"):
        explain("strong", hw, planned[("strong", hw)])


if __name__ == "__main__":
    main()
