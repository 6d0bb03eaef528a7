"""The package's shape (docs/ARCHITECTURE.md): every import inside tpctl/,
lazy ones in functions included, goes to the importing module's own layer or
a lower one, and no two modules of one layer import each other in a circle.
Inside parallel/ likewise its parts (PARTS): the foundation, roles/, the
components beside each other, verify/, parallelism.py on top."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "tpctl"

# Lowest first. A module's layer is its subpackage, or its own name at the top level.
LAYERS = [
    {"errors", "seeding", "schema", "atomic"},
    {"parallel"},
    {"models"},
    {"data"},
    {"checkpoint"},
    {"training"},
    {"config"},
    {"launch"},
    {"cost"},
    {"commands"},
    {"cli", "__init__"},
]


# parallel/'s parts and what each may import besides itself: the foundation
# (the top-level modules: layout, geometry, mesh, comm, shard, registry,
# dropout) nothing else of parallel/; roles/ (what a model's modules are) the
# foundation; the components (tensor/, pipeline/, data_parallel/, context/)
# the foundation and roles/, never each other; verify/ (the start-up proof of
# the tensor rewrite) those and tensor/; parallelism.py composes them all.
COMPONENTS = ("tensor", "pipeline", "data_parallel", "context")
PARTS = {
    "foundation": set(),
    "roles": {"foundation"},
    **{c: {"foundation", "roles"} for c in COMPONENTS},
    "verify": {"foundation", "roles", "tensor"},
    "parallelism": {"foundation", "roles", *COMPONENTS, "verify"},
}


def part_of(module: str) -> str:
    """The part of parallel/ that module tpctl.parallel.X... belongs to."""
    first = module.split(".")[2] if module.count(".") >= 2 else ""
    return first if first in PARTS else "foundation"


def layer_of(module: str) -> int:
    parts = module.split(".")[1:] or ["__init__"]
    return next(i for i, names in enumerate(LAYERS) if parts[0] in names)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """The tpctl modules `path` imports (a name imported from a package that
    is itself a module counts as that module)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "tpctl" or target.startswith("tpctl."):
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    is_module = (PACKAGE.parent / sub.replace(".", "/")).with_suffix(".py").exists() or \
                        (PACKAGE.parent / sub.replace(".", "/")).is_dir()
                    found.add(sub if is_module else target)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name == "tpctl" or a.name.startswith("tpctl.")}
    found.discard(name)
    return found


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in PACKAGE.rglob("*.py")}


def climbs(g: dict[str, set[str]]) -> list[str]:
    return [f"{m} (layer {layer_of(m)}) imports {d} (layer {layer_of(d)})"
            for m, deps in g.items() for d in deps if layer_of(d) > layer_of(m)]


def find_circle(g: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `g` (module -> modules it imports), or None."""
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for d in sorted(g.get(m, ())):
            if state.get(d) == 1:
                return path[path.index(d):] + [d]
            if state.get(d) is None and (found := visit(d, path + [d])):
                return found
        state[m] = 2
        return None

    return next((c for m in sorted(g) if state.get(m) is None and (c := visit(m, [m]))), None)


def test_every_module_has_a_layer_and_every_import_exists():
    g = graph()
    for name, deps in g.items():
        layer_of(name)  # StopIteration for a module outside the map
        assert deps <= set(g), f"{name} imports {sorted(deps - set(g))}, which do not exist"


def test_no_import_climbs_to_a_higher_layer():
    assert not climbs(graph()), "\n".join(climbs(graph()))


def test_no_import_circle():
    circle = find_circle(graph())
    assert circle is None, "import circle: " + " -> ".join(circle)


def parallel_climbs(g: dict[str, set[str]]) -> list[str]:
    inside = {m: {d for d in deps if d.startswith("tpctl.parallel")} for m, deps in g.items()
              if m.startswith("tpctl.parallel")}
    return [f"{m} ({part_of(m)}) imports {d} ({part_of(d)})" for m, deps in inside.items() for d in deps
            if part_of(d) != part_of(m) and part_of(d) not in PARTS[part_of(m)]]


def test_parallel_parts_import_only_what_lies_below_them():
    wrong = parallel_climbs(graph())
    assert not wrong, "\n".join(wrong)


def test_parallel_parts_are_the_tree():
    """PARTS names parallel/ as it is: a part renamed or moved would pass
    the check above by holding nothing."""
    held = {part_of(m) for m in graph() if m.startswith("tpctl.parallel.")}
    assert held == set(PARTS), f"parts without modules: {set(PARTS) - held}"


def test_the_checks_see_what_they_look_for():
    assert climbs({"tpctl.parallel.mesh": {"tpctl.training.loop"}})
    assert not climbs({"tpctl.training.loop": {"tpctl.parallel.mesh"}})
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": set()}) is None
    assert parallel_climbs({"tpctl.parallel.tensor.mode": {"tpctl.parallel.pipeline.cut"}})
    assert parallel_climbs({"tpctl.parallel.layout": {"tpctl.parallel.roles.plan"}})
    assert not parallel_climbs({"tpctl.parallel.verify.proof": {"tpctl.parallel.tensor.rewrite"}})


def test_every_module_is_named_in_the_map():
    """docs/ARCHITECTURE.md names every module of the package (a newcomer's
    map that omits a module is wrong about where things live)."""
    text = (PACKAGE.parent / "docs" / "ARCHITECTURE.md").read_text()
    missing = [str(path.relative_to(PACKAGE)) for path in sorted(PACKAGE.rglob("*.py"))
               if path.name != "__init__.py" and f"`{path.name}`" not in text]
    assert not missing, f"docs/ARCHITECTURE.md does not name: {', '.join(missing)}"
