"""`tpctl inspect [overrides]`: what the rewrite would do to a model, with no
training and no workers.

The model is built on the meta device, its roles resolved (a plan, its
tp_plan, or traced from the forward) and every layer converted for rank 0 of
the chosen mode without a process group, keeping only shapes. One table row
per module with parameters or a role: the role and where it came from, the
layer it becomes, this rank's shard shapes and bytes, the pipeline stage
that holds it (pp > 1), and anything it cannot handle. Exit 2 (with the usual one-line error) when the mode cannot shard the
model, as `tpctl train` would refuse it.
"""

from __future__ import annotations

from tpctl.errors import EXIT_OK, ConfigError, fail
from tpctl.parallel.layout import Layout


def main(args: list[str]) -> int:
    if any(a in ("-h", "--help") for a in args):
        print("usage: tpctl inspect [Hydra overrides]   e.g. tpctl inspect model=hf model.arch=llama mode=3d size=8\n"
              "Shows each module's role, the layer it becomes, its shard shape and bytes per rank, and (unless\n"
              "train.verify_rewrite=false) runs the start-up verification on `size` CPU ranks: the largest\n"
              "difference of each distinct replaced module and block from the original; exit 2 if one differs.")
        return EXIT_OK
    from tpctl.config import compose_jobs, validate

    try:
        cfg = compose_jobs(args)[0]
        validate(cfg, model_check=False)
        rows, summary, problems = inspect_model(cfg)
    except ConfigError as e:
        return fail(e)
    refusal, checks = None, None
    if not problems and cfg.train.verify_rewrite and Layout.from_config(cfg).mode_class.rewrites:
        refusal, checks = verify_in_pool(cfg)
    _print(cfg, *_with_checks(rows, checks), summary)
    if problems:
        name, reason = next(iter(problems.items()))
        what = cfg.model.get("_target_") or cfg.model.get("pretrained") or cfg.model.arch
        return fail(f"invalid config: model={what!r}: mode={cfg.mode} size={cfg.size} cannot shard module {name}: {reason}")
    if refusal is not None:
        return fail(refusal)
    return EXIT_OK


def verify_in_pool(cfg) -> tuple:
    """(refusal line or None, the checks) of the start-up verification
    (parallel/verify/proof.py), run as training runs it: `size` ranks on CPU
    (gloo), one tensor-parallel group."""
    from tpctl.launch.pool import DistPool

    pool = DistPool(Layout.from_config(cfg).replace(dp=1).world, timeout_s=max(600.0, cfg.launcher.collective_timeout_s))
    try:
        return pool.run(_verify_rank, cfg)[0]
    finally:
        pool.close()


def _verify_rank(cfg) -> tuple:
    from tpctl.launch.pool import pooled_run
    from tpctl.parallel.verify.proof import RewriteRefused

    try:
        run = pooled_run(cfg, Layout.from_config(cfg).replace(dp=1), verify=True, step=False)
        return None, run.verified.checks
    except RewriteRefused as e:
        return str(e), e.report.checks if e.report is not None else []


def _with_checks(rows: list, checks) -> tuple[list, dict]:
    """The table's rows with one row per block checked (before its first
    module), and {module or block: the verification's verdict}."""
    if checks is None:
        return rows, {}
    verdicts = {}
    for c in checks:
        text = c.note if c.note and c.diff == 0 else f"{c.diff:.1e}" + (f" ({c.note})" if c.note else "")
        if c.failed:
            text = f"[red]{text} > tolerance[/red]"
        for name in c.instances:
            verdicts[name] = text
    out = list(rows)
    for c in checks:
        if c.kind == "stage":  # the model's own forward before the first block, after the last
            end = "0" if c.name == "embedding" else "last"
            row = (c.instances[0], c.cls, "stage", f"({c.name}: the model's forward)", "", 0, "", end if rows and rows[0][7] else "")
            out.insert(0 if c.name == "embedding" else len(out), row)
        if c.kind != "block":
            continue
        for name in c.instances:
            at = next((i for i, r in enumerate(out) if r[0].startswith(name + ".")), len(out))
            out.insert(at, (name, c.cls, "block", "(its layers rewritten)", "", 0, "", out[at][7] if at < len(out) else ""))
    return out, verdicts


def inspect_model(cfg):
    """(rows, summary, problems) for cfg.model in cfg's layout, seen from
    rank 0: a dry run of the rewrite (Parallelism.rewrite, what build_run
    calls) on a process-group-free mesh. It reads the model before the
    rewrite as well, so it builds the model itself."""
    import math

    from tpctl.models import build_checked
    from tpctl.parallel.roles.mixers import MixerSplit, heads_split
    from tpctl.training.build import build_parallelism

    model = build_checked(cfg.model, cfg.seed)
    originals = dict(model.named_modules())
    layout = Layout.from_config(cfg)
    par = build_parallelism(cfg, layout, groups=False)
    stage_of = lambda name: None  # noqa: E731
    if par.pipeline is not None:  # where the stages are cut, in the model as it is
        from tpctl.parallel.pipeline.schedule import PipelineRefused

        try:
            par.pipeline.assign(model)
        except PipelineRefused as e:
            raise ConfigError(e.key, layout.pp if e.key == "pp" else type(model).__name__, str(e)) from None
        stage_of = par.pipeline.stage_of
    # Each module's own parameters as built: a rewrite in place (experts
    # run by their own forward, roles/experts.OwnSplit) leaves the module
    # holding its shards, which would count as the whole model's too.
    built = {name: list(m.named_parameters(recurse=False)) for name, m in originals.items()}
    done = par.rewrite(model, cfg.model.get("plan"), dry_run=True)
    model, plan, problems = done.model, done.plan, done.problems
    rewritten = {r.name: r for r in done.modules}
    rows, seen, whole, local = [], set(), 0, 0
    run_whole = [n for n, role in plan.roles.items() if role == "whole"]  # (parallel/roles/whole.py)
    indexers = [n for n, role in plan.roles.items() if role == "untrained"]
    split_mixers = {n for n in run_whole if heads_split(par.mode, plan.layouts.get(n))}  # (roles/mixers.py)
    for name, module in originals.items():
        own = built[name]
        record = rewritten.get(name)
        if not name or (record is None and not own and name not in problems):
            continue
        new = record.new if record is not None else module
        note = problems.get(name, "")
        shapes, nbytes = [], 0
        # (a module kept with its own forward may hold a shard now: OPT's position table)
        for (attr, original), (_, p) in zip(own, new.named_parameters(recurse=False)):
            first = id(original) not in seen
            seen.add(id(original))
            shapes.append(f"{attr} {tuple(p.shape)}" + ("" if first else " (tied)"))
            if first:
                nbytes += p.numel() * p.element_size()
                whole += math.prod(original.shape) * original.element_size()
        resized = any(p.shape != original.shape for (_, original), (_, p) in zip(own, new.named_parameters(recurse=False)))
        stage = stage_of(name)
        local += nbytes if stage in (None, 0) else 0
        inside = next((r for r in run_whole if name.startswith(r + ".")), None)
        untrained = next((r for r in indexers if name == r or name.startswith(r + ".")), None)
        role = record.role if record else ""
        if untrained is not None and not note:  # (roles/plan.py: `untrained`)
            note = ("held whole on every rank, fed whole rows: it returns indices, so no gradient reaches it"
                    if name == untrained else f"held whole, inside {untrained} (never trained)")
        if record is not None and record.role == "whole" and not note and name in split_mixers:
            role, note = "mixer (heads split)", plan.layouts[name].describe()
        elif record is not None and record.role == "whole" and not note:
            why = plan.whole.get(name)
            note = "run whole on every rank, on whole rows: no split fits it" + (f" ({why})" if why else "")
            layout = plan.layouts.get(name)
            if isinstance(layout, MixerSplit):  # a split by heads, which this layout does not use
                note += "; not split by heads: " + (layout.heads_problem(par.mode.own_forward_ways()) or "")
        elif inside is not None and not note:
            note = f"split by heads, inside {inside}" if inside in split_mixers else f"run whole, inside {inside}"
        if record is None and own and not note:
            note = _held_note(name, module, plan) or \
                ("kept whole (replicated)" if par.mode.replicated_activations else "no role")
        if name in plan.layouts and not note:  # a fused projection's parts, or a projection's heads (maybe shared)
            layout = plan.layouts[name]
            # (experts run by their own forward are split as measured: OwnSplit, no parts named)
            kind = "experts" if record is not None and record.role == "experts" else \
                "fused" if len(getattr(layout, "names", ())) > 1 else "heads"
            note = f"{kind}: {layout.describe()}"
            if layout.shares(par.mode.geo.head_split):
                note += f", key/value heads shared by {par.mode.geo.head_split // min(layout.units)} ranks"
        rows.append((name, type(module).__name__, role,
                     type(new).__name__ if new is not module else "(sharded in place)" if resized else "(unchanged)",
                     ", ".join(shapes), nbytes, note,
                     "" if par.pipeline is None else ("all" if stage is None else str(stage))))
    summary = {"roles from": {"inferred": "traced forward", "tp_plan": "the model's tp_plan", "plan": "model.plan"}[plan.source],
               "whole model": whole, "per rank": local, "heads": {k: (h.heads, h.kv_heads, h.head_dim) for k, h in plan.heads.items()}}
    layout = par.layout
    if layout.dp * layout.cp > 1 and not problems:  # what a replica holds between steps (parallel/data_parallel/zero.py; dp x cp replicas)
        from tpctl.parallel.data_parallel.zero import plan_of

        held = plan_of([model], layout.dp * layout.cp, layout.zero).held_numel()
        summary["held"] = {what: held[key] * 4 * (2 if what == "AdamW moments" else 1)
                           for what, key in (("parameters", "param"), ("gradients", "grad"), ("AdamW moments", "moment"))}
    return rows, summary, problems


# Notes that say how a module is held, not a problem (not shown in red).
PLAIN_NOTES = ("fused:", "heads:", "mixer (heads split)", "split by heads", "its ", "never read", "never trained")


def _held_note(name: str, module, plan) -> str:
    """What a module with no role holding parameters of its own holds: a
    child's parameter under its own name too (BERT's LM head's `bias`, its
    decoder's: sharded with it), parameters its forward never reads
    (RolePlan.unread), or a frozen table (RolePlan.frozen); "" for none."""
    own = [(a, p) for a, p in module._parameters.items() if p is not None]
    children = {id(p): f"{c}.{a}" for c, child in module.named_children() for a, p in child.named_parameters()}
    if own and all(id(p) in children for _, p in own):
        return "; ".join(f"its {a} is {name}.{children[id(p)]} (tied: held as that is)" for a, p in own)
    if own and all(f"{name}.{a}" in plan.unread for a, _ in own):
        return "never read by its forward: kept whole, never trained (as in mode=none)"
    if own and all(f"{name}.{a}" in plan.frozen for a, _ in own):
        return "never trained (frozen), not as wide as the stream: kept whole"
    return ""


def _print(cfg, rows, verdicts: dict, summary) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    what = cfg.model.get("_target_") or cfg.model.get("pretrained") or cfg.model.arch
    mib = lambda n: f"{n / 2**20:,.2f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"  # noqa: E731
    layout = Layout.from_config(cfg)
    title = f"{what}: mode={layout.label()} -- rank 0, roles from {summary['roles from']}"
    held = " (pipeline stage 0)" if layout.pp > 1 else ""
    caption = (f"parameters: {mib(summary['whole model'])} whole, {mib(summary['per rank'])} on rank 0{held} "
               f"({summary['whole model'] / max(summary['per rank'], 1):.2f}x less)")
    if "held" in summary:
        replicas = f"dp={layout.dp}" + (f" x cp={layout.cp}" if layout.cp > 1 else "")
        caption += (f"; rank 0 holds between steps with {replicas} zero={layout.zero}: "
                    + ", ".join(f"{what} {mib(n)}" for what, n in summary["held"].items()))
    if layout.pp > 1:
        from tpctl.config.pipeline import check_pipeline

        note = check_pipeline(layout, cfg).dropout_note(cfg.model.get("dropout") or 0)
        caption += f"; {note}" if note else ""
    table = Table(title=title, caption=caption)
    columns = ["module", "type", "role", "becomes", "shard shape on rank 0", "bytes", "note"]
    if layout.pp > 1:  # the pipeline rank that holds it ("all": every stage runs it)
        columns.insert(1, "stage")
    if verdicts:  # the start-up verification's largest difference, relative to the tensor's scale
        columns.insert(len(columns) - 1, "verified")
    for column in columns:
        table.add_column(column, overflow="fold", justify="right" if column == "bytes" else "left")
    for name, kind, role, becomes, shapes, nbytes, note, stage in rows:
        note = escape(note)  # a fused layout's "[q|k|v]" is not markup
        cells = [name, kind, role, becomes, shapes, mib(nbytes) if nbytes else "",
                 f"[red]{note}[/red]" if note and note != "kept whole (replicated)" and not note.startswith(PLAIN_NOTES)
                 else note]
        if layout.pp > 1:
            cells.insert(1, stage)
        if verdicts:
            cells.insert(len(cells) - 1, verdicts.get(name, ""))
        table.add_row(*cells)
    Console(width=max(160, Console().width)).print(table)
