"""`tpctl inspect [overrides]`: what the rewrite would do to a model, with no
training and no workers.

The model is built on the meta device, its roles resolved (a plan, its
tp_plan, or traced from the forward) and every layer converted for rank 0 of
the chosen mode without a process group, keeping only shapes. One table row
per module with parameters or a role: the role and where it came from, the
layer it becomes, this rank's shard shapes and bytes, and anything it cannot
handle. Exit 2 (with the usual one-line error) when the mode cannot shard the
model, as `tpctl train` would refuse it.
"""

from __future__ import annotations

import sys

from .errors import ConfigError

EXIT_OK, EXIT_USAGE = 0, 2


def main(args: list[str]) -> int:
    if any(a in ("-h", "--help") for a in args):
        print("usage: tpctl inspect [Hydra overrides]   e.g. tpctl inspect model=hf model.arch=llama mode=3d size=8\n"
              "Shows each module's role, the layer it becomes, its shard shape and bytes per rank.")
        return EXIT_OK
    from .config import compose_jobs, validate

    try:
        cfg = compose_jobs(args)[0]
        validate(cfg, model_check=False)
    except ConfigError as e:
        print(f"tpctl: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    rows, summary, problems = inspect_model(cfg)
    _print(cfg, rows, summary)
    if problems:
        name, reason = next(iter(problems.items()))
        what = cfg.model.get("_target_") or cfg.model.get("pretrained") or cfg.model.arch
        print(f"tpctl: error: invalid config: model={what!r}: mode={cfg.mode} size={cfg.size} cannot shard module {name}: {reason}",
              file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OK


def inspect_model(cfg):
    """(rows, summary, problems) for cfg.model in cfg's mode, seen from rank 0."""
    import math

    from .mesh import layout_mesh
    from .models import build_model, resolve_plan
    from .parallel import get_mode
    from .parallel.base import RewriteContext, check_plan

    model = build_model(cfg.model, cfg.seed, lazy=True)
    from .models.hf import linearize

    linearize(model)
    plan = resolve_plan(model, cfg.model.get("plan"))
    mode = get_mode(layout_mesh(cfg.mode, cfg.size, cfg.depth, cfg.dp), seq_parallel=cfg.seq_parallel)
    problems = check_plan(plan, model, mode.geo)
    ctx = RewriteContext(mode.mesh, shapes_only=True)
    mode.prepare(model, plan)
    rows, seen, whole, local = [], set(), 0, 0
    for name, module in model.named_modules():
        own = list(module.named_parameters(recurse=False))
        role = plan.roles.get(name)
        if not name or (role is None and not own and name not in problems):
            continue
        new, note = module, problems.get(name, "")
        if role is not None and name not in problems:
            ctx.name = name
            new = mode.convert(role, module, ctx)
        shapes, nbytes = [], 0
        for (attr, original), (_, p) in zip(own, new.named_parameters(recurse=False)) if new is not module else \
                ((o, o) for o in own):
            first = id(original) not in seen
            seen.add(id(original))
            shapes.append(f"{attr} {tuple(p.shape)}" + ("" if first else " (tied)"))
            if first:
                nbytes += p.numel() * p.element_size()
                whole += math.prod(original.shape) * original.element_size()
        local += nbytes
        if role is None and own and not note:
            note = "kept whole (replicated)" if mode.name in ("none", "1d") else "no role"
        rows.append((name, type(module).__name__, role or "", type(new).__name__ if new is not module else "(unchanged)",
                     ", ".join(shapes), nbytes, note))
    summary = {"roles from": {"inferred": "traced forward", "tp_plan": "the model's tp_plan", "plan": "model.plan"}[plan.source],
               "whole model": whole, "per rank": local, "heads": {k: (h.heads, h.kv_heads, h.head_dim) for k, h in plan.heads.items()}}
    return rows, summary, problems


def _print(cfg, rows, summary) -> None:
    from rich.console import Console
    from rich.table import Table

    what = cfg.model.get("_target_") or cfg.model.get("pretrained") or cfg.model.arch
    mib = lambda n: f"{n / 2**20:,.2f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"  # noqa: E731
    title = (f"{what}: mode={cfg.mode} size={cfg.size}" + (f" depth={cfg.depth}" if cfg.mode == "2.5d" else "")
             + (" seq_parallel" if cfg.seq_parallel else "") + f" -- rank 0, roles from {summary['roles from']}")
    table = Table(title=title, caption=f"parameters: {mib(summary['whole model'])} whole, {mib(summary['per rank'])} on rank 0 "
                  f"({summary['whole model'] / max(summary['per rank'], 1):.2f}x less)")
    for column in ("module", "type", "role", "becomes", "shard shape on rank 0", "bytes", "note"):
        table.add_column(column, overflow="fold", justify="right" if column == "bytes" else "left")
    for name, kind, role, becomes, shapes, nbytes, note in rows:
        table.add_row(name, kind, role, becomes, shapes, mib(nbytes) if nbytes else "", f"[red]{note}[/red]" if note and note != "kept whole (replicated)" else note)
    Console(width=max(160, Console().width)).print(table)
