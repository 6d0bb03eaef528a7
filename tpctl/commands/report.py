"""`tpctl report RUN_DIR... [--out DIR]`: plots of finished (or running) runs.

Reads each run dir's `metrics.jsonl` (loss and val_loss, tokens/s against
step), `summary.json` when the run finished (collective bytes per step) and
`config.yaml` (the label: mode, size, dp, depth, precision, ...), and writes
PNGs with matplotlib (an optional dependency: pip install 'tpctl[report]'):

    DIR/loss.png         loss against step, one line per run (val_loss dashed)
    DIR/tokens_per_s.png throughput against step
    DIR/comm_bytes.png   payload handed to collectives per step, one bar per run
    DIR/report.png       the three side by side

Exit status: 0 written, 2 bad usage (no such run dir, no metrics, matplotlib
missing), with one line saying what is wrong.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from tpctl.parallel.layout import Layout

from .run_dir import read_metrics, read_summary
from tpctl.errors import EXIT_OK, TpctlError, fail



class ReportError(TpctlError):
    """Bad input: printed as one line, exit 2."""


@dataclass
class Run:
    path: Path
    label: str
    metrics: list[dict]
    summary: Optional[dict] = None
    config: dict = field(default_factory=dict)


def label_of(config: dict) -> str:
    """'2.5d size=8 depth=2 dp=2 bf16 ckpt': what tells runs apart."""
    parts = [Layout.from_config(config).label()]
    if config.get("precision", "fp32") != "fp32":
        parts.append(config["precision"])
    if (config.get("train") or {}).get("activation_checkpointing"):
        parts.append("ckpt")
    return " ".join(parts)


def load_run(path: Path) -> Run:
    if not path.is_dir():
        raise ReportError(f"{path}: no such run dir")
    metrics_path = path / "metrics.jsonl"
    if not metrics_path.is_file():
        raise ReportError(f"{path}: no metrics.jsonl (is it a tpctl run dir?)")
    try:
        metrics = read_metrics(path)
    except ValueError as e:
        raise ReportError(str(e)) from None
    if not metrics:
        raise ReportError(f"{metrics_path}: no logged steps yet")
    config = {}
    if (path / "config.yaml").is_file():
        from omegaconf import OmegaConf

        config = OmegaConf.to_container(OmegaConf.load(path / "config.yaml"))
    summary = read_summary(path)
    return Run(path, label_of(config) if config else path.name, metrics, summary, config)


def _unique_labels(runs: list[Run]) -> None:
    """Runs with the same label (same mode, another model or seed) get
    their run dir's name appended."""
    seen: dict[str, int] = {}
    for run in runs:
        seen[run.label] = seen.get(run.label, 0) + 1
    for run in runs:
        if seen[run.label] > 1:
            run.label = f"{run.label} ({run.path.name})"


def _plot_loss(ax, runs: list[Run]) -> None:
    for run in runs:
        line, = ax.plot([m["step"] for m in run.metrics], [m["loss"] for m in run.metrics], label=run.label)
        val = [(m["step"], m["val_loss"]) for m in run.metrics if m.get("val_loss") is not None]
        if val:
            ax.plot(*zip(*val), linestyle="--", marker="o", markersize=3, color=line.get_color(),
                    label=f"{run.label} (val)")
    ax.set(xlabel="step", ylabel="loss", title="loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def _plot_throughput(ax, runs: list[Run]) -> None:
    for run in runs:
        ax.plot([m["step"] for m in run.metrics], [m["tokens_per_s"] for m in run.metrics], label=run.label)
    ax.set(xlabel="step", ylabel="tokens/s", title="throughput")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def _plot_comm(ax, runs: list[Run]) -> None:
    finished = [r for r in runs if r.summary and "comm_bytes_per_step" in r.summary]
    labels = [r.label for r in finished]
    mib = [r.summary["comm_bytes_per_step"] / 2**20 for r in finished]
    bars = ax.bar(range(len(finished)), mib, color=[f"C{runs.index(r)}" for r in finished])
    ax.bar_label(bars, fmt="%.2f", fontsize="small")
    ax.set_xticks(range(len(finished)), labels, rotation=30, ha="right", fontsize="small")
    ax.set(ylabel="MiB per step (rank 0)", title="collective payload per step")
    if not finished:
        ax.text(0.5, 0.5, "no summary.json yet", ha="center", va="center", transform=ax.transAxes)
    ax.grid(alpha=0.3, axis="y")


PLOTS = {"loss": _plot_loss, "tokens_per_s": _plot_throughput, "comm_bytes": _plot_comm}


def write_report(runs: list[Run], out: Path) -> list[Path]:
    """Write the PNGs; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, plot in PLOTS.items():
        fig, ax = plt.subplots(figsize=(7, 4.5), layout="constrained")
        plot(ax, runs)
        fig.savefig(out / f"{name}.png", dpi=110)
        plt.close(fig)
        written.append(out / f"{name}.png")
    fig, axes = plt.subplots(1, 3, figsize=(19, 5.5), layout="constrained")
    for ax, plot in zip(axes, PLOTS.values()):
        plot(ax, runs)
    fig.suptitle(f"tpctl report: {len(runs)} run{'s' * (len(runs) != 1)}")
    fig.savefig(out / "report.png", dpi=100)
    plt.close(fig)
    written.append(out / "report.png")
    return written


def main(args: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tpctl report", description="Plot the metrics of tpctl run dirs as PNGs.")
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="run dirs of tpctl train")
    parser.add_argument("--out", type=Path, default=Path("report"), help="directory for the PNGs (default: ./report)")
    parser.error = lambda message: sys.exit(fail(f"tpctl report: {message} (see tpctl report --help)"))
    flags = parser.parse_args(args)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return fail("tpctl report needs matplotlib: pip install 'tpctl[report]' (or pip install matplotlib)")
    try:
        runs = [load_run(path) for path in flags.run_dirs]
    except ReportError as e:
        return fail(str(e))
    _unique_labels(runs)
    for path in write_report(runs, flags.out):
        print(path)
    return EXIT_OK


