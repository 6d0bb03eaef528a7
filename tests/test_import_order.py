"""parallel/ reads as its components, in one order (docs/ARCHITECTURE.md,
"parallel/"): the foundation (layout, geometry, mesh, comm, shard,
registry, dropout) imports nothing else of parallel/; roles/ (what a
model's modules are) only the foundation; the components (tensor/,
pipeline/, data_parallel/, context/) the foundation and roles/, never each
other; verify/ (the start-up proof of the tensor rewrite) those and
tensor/; parallelism.py composes them all. Every import counts, a function's
own as well as a module's: a lazy import is still a dependency. No module
imports, through any chain, itself."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "tpctl"
PARALLEL = "tpctl.parallel"
FOUNDATION = "foundation"
COMPONENTS = ("tensor", "pipeline", "data_parallel", "context")
# What each part may import besides itself.
ALLOWED = {
    FOUNDATION: set(),
    "roles": {FOUNDATION},
    **{c: {FOUNDATION, "roles"} for c in COMPONENTS},
    "verify": {FOUNDATION, "roles", "tensor"},
    "parallelism": {FOUNDATION, "roles", *COMPONENTS, "verify"},
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in (PACKAGE / "parallel").rglob("*.py")}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of parallel/ that `name` imports (anywhere in it)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            # `from pkg import mod` imports the module pkg.mod where there is one.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in known and t != name}
    return found


def _part(module: str) -> str:
    rest = module[len(PARALLEL) + 1:].split(".") if module != PARALLEL else [""]
    if rest[0] in ALLOWED:
        return rest[0]
    return FOUNDATION


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def test_parts_import_only_what_lies_below_them():
    wrong = sorted(f"{m} ({_part(m)}) imports {t} ({_part(t)})" for m, targets in _graph().items() for t in targets
                   if _part(t) != _part(m) and _part(t) not in ALLOWED[_part(m)])
    assert not wrong, "\n".join(wrong)


def test_no_module_imports_itself_through_a_chain():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt):] + [node, nxt]) if nxt in path else f"{node} -> {nxt}")
            elif nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "\n".join(cycles)


@pytest.mark.parametrize("part", sorted(ALLOWED))
def test_every_part_has_modules(part):
    """The table above names the tree as it is (a part renamed or moved
    would otherwise pass the two tests above by holding nothing)."""
    assert any(_part(m) == part for m in _modules())
