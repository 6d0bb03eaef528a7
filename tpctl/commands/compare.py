"""The comparison a sweep (`tpctl train -m ...`) leaves in its sweep dir:
comparison.json (every job, its numbers) and comparison.md (the same as a
table), read from each job's summary.json (written by rank 0 of the run).

Per job: its layout (mode, size, pp, dp, ZeRO stage), final loss (and its
relative difference from the first job that trained: modes of one
experiment must agree), tokens/s, bytes handed to collectives per step
(rank 0), parameter, gradient and AdamW bytes and peak memory of the
largest rank, and with pipeline stages the measured bubble. Skipped and
failed jobs are listed with their reason.
"""

from __future__ import annotations

import json
from pathlib import Path

MIB = 2**20


def job_row(job: dict) -> dict:
    """One job's numbers; None where the run left none."""
    row = {"job": job["job"], "overrides": " ".join(job["overrides"]), "status": job["status"],
           "reason": job.get("reason"), "run_dir": job["run_dir"]}
    summary_path = Path(job["run_dir"]) / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    if job["status"] == "ok" and not summary:
        row.update(status="failed", reason="no summary.json")
    for key in ("mode", "size", "dp", "pp", "zero", "steps", "first_loss", "final_loss", "val_loss", "tokens_per_s",
                "comm_bytes_per_step", "comm_wire_bytes_per_step", "pipeline_bubble"):
        row[key] = summary.get(key)
    # Per rank: the largest rank (older summaries hold rank 0's only).
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "peak_rss_bytes", "peak_cuda_bytes"):
        row[f"{key}_per_rank"] = summary.get(f"{key}_max_rank", summary.get(key))
    return row


def comparison(jobs: list[dict]) -> list[dict]:
    rows = [job_row(j) for j in jobs]
    reference = next((r for r in rows if r["status"] == "ok" and r["final_loss"] is not None), None)
    for r in rows:
        r["final_loss_rel_diff"] = None
        if reference is not None and r["final_loss"] is not None:
            r["final_loss_rel_diff"] = abs(r["final_loss"] - reference["final_loss"]) / abs(reference["final_loss"])
    return rows


def _fmt(value, spec: str, scale: float = 1.0) -> str:
    return "" if value is None else format(value / scale, spec)


def _split_overrides(rows: list[dict]) -> tuple[list[str], list[str]]:
    """(the overrides every job shares, each job's own): the table shows
    only what differs between jobs."""
    per_job = [r["overrides"].split() for r in rows]
    common = [o for o in per_job[0] if all(o in job for job in per_job)] if len(rows) > 1 else []
    return common, [" ".join(o for o in job if o not in common) for job in per_job]


def markdown(rows: list[dict]) -> str:
    ref = next((r["job"] for r in rows if r["final_loss_rel_diff"] == 0.0 and r["status"] == "ok"), None)
    memory = "peak CUDA MiB/rank" if any(r["peak_cuda_bytes_per_rank"] for r in rows) else "peak RSS MiB/rank"
    header = ["job", "overrides", "layout", "status", "final loss", f"vs job {ref}" if ref is not None else "rel. diff",
              "tokens/s", "comm MiB/step", "param MiB/rank", "grad MiB/rank", "AdamW MiB/rank", memory]
    stages = any(r["pipeline_bubble"] is not None for r in rows)
    if stages:  # the pipeline's measured idle fraction (summary.json pipeline_bubble)
        header.append("bubble")
    common, own = _split_overrides(rows)
    lines = [f"Every job: `{' '.join(common)}`\n" if common else "",
             "| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r, overrides in zip(rows, own):
        peak = r["peak_cuda_bytes_per_rank"] if memory.startswith("peak CUDA") else r["peak_rss_bytes_per_rank"]
        layout = (f"{r['mode']} ×{r['size']}" + "".join(f" {k} {r[k]}" for k in ("pp", "dp") if (r[k] or 1) > 1)
                  + (f" zero {r['zero']}" if r["zero"] else "") if r["mode"] else "")
        cells = [str(r["job"]), f"`{overrides}`", layout, r["status"], _fmt(r["final_loss"], ".4f"),
                 _fmt(r["final_loss_rel_diff"], ".1e"), _fmt(r["tokens_per_s"], ",.0f"),
                 _fmt(r["comm_bytes_per_step"], ".2f", MIB), _fmt(r["param_bytes_per_rank"], ".3f", MIB),
                 _fmt(r["grad_bytes_per_rank"], ".3f", MIB), _fmt(r["optimizer_bytes_per_rank"], ".3f", MIB),
                 _fmt(peak, ".0f", MIB)] + ([_fmt(r["pipeline_bubble"], ".2f")] if stages else [])
        lines.append("| " + " | ".join(cells) + " |")
    notes = [f"- job {r['job']} (`{o}`) {r['status']}: {r['reason']}" for r, o in zip(rows, own) if r["status"] != "ok"]
    text = "\n".join(line for line in lines if line) + "\n"
    if notes:
        text += "\n" + "\n".join(notes) + "\n"
    text += ("\ncomm MiB/step: payload rank 0 hands to collectives per training step; "
             "param, grad (kept for the optimizer), AdamW and peak memory: the largest rank.\n")
    return text


def write_comparison(sweep_dir: str | Path, jobs: list[dict]) -> list[dict]:
    sweep_dir = Path(sweep_dir)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    rows = comparison(jobs)
    (sweep_dir / "comparison.json").write_text(json.dumps({"jobs": rows}, indent=1) + "\n")
    (sweep_dir / "comparison.md").write_text(markdown(rows))
    return rows
