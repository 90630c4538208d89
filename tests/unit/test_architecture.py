"""The package's import graph: no circle, and no import that runs back up the data flow."""

from __future__ import annotations

import ast
from pathlib import Path

import fsdpcheck

PACKAGE = Path(fsdpcheck.__file__).resolve().parent

# Lower layers never import higher ones. Within a layer, modules may import each other as long
# as no circle forms (checked separately).
LAYERS = {
    "fsdpcheck.vocab": 0,
    "fsdpcheck.text": 0,
    "fsdpcheck.errors": 1,
    "fsdpcheck.records": 1,
    "fsdpcheck.options": 1,
    "fsdpcheck.faults": 1,
    "fsdpcheck.process": 3,  # the command's own interpreter: log, re-exec, signals
    "fsdpcheck.output": 2,
    "fsdpcheck.model": 2,
    "fsdpcheck.distributed": 2,
    "fsdpcheck.checks": 2,
    "fsdpcheck.loader": 3,
    "fsdpcheck.pipeline": 3,  # one rank's stages, over model/ (resolve, build)
    "fsdpcheck.children": 4,
    "fsdpcheck.report": 5,
    "fsdpcheck.formats": 6,
    "fsdpcheck.offline": 6,
    "fsdpcheck.audit": 6,
    "fsdpcheck.step": 6,  # check_step and audit --step: the collective watch
    "fsdpcheck.console": 6,
    "fsdpcheck.integrations": 7,
    "fsdpcheck.cli": 8,
    "fsdpcheck.__main__": 9,
    "fsdpcheck": 9,  # the package's lazy API
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int:
    while module not in LAYERS:
        module = module.rpartition(".")[0]
        assert module, f"no layer assigned to {module!r}: add it to LAYERS"
    return LAYERS[module]


def imports(path: Path) -> set[str]:
    """Every fsdpcheck module ``path`` imports, at any depth (function-level imports too)."""
    found: set[str] = set()
    here = module_name(path)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("fsdpcheck"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("fsdpcheck"):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    found.add(
                        sub
                        if (PACKAGE.parent / (sub.replace(".", "/") + ".py")).exists()
                        else node.module
                    )
    found.discard(here)
    return found


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports(p) for p in PACKAGE.rglob("*.py")}


def test_no_import_runs_back_up_the_data_flow() -> None:
    upward = [
        f"{source} (layer {layer(source)}) imports {target} (layer {layer(target)})"
        for source, targets in graph().items()
        if source != "fsdpcheck"
        for target in sorted(targets)
        if layer(target) > layer(source)
    ]
    assert upward == []


def test_import_graph_has_no_circle() -> None:
    edges = graph()
    # A package's __init__ imports nothing here except the lazy API (strings), so modules
    # are the nodes; an edge to a package means its __init__.
    visiting, done, circles = set(), set(), []

    def visit(node: str, path: list[str]) -> None:
        if node in done:
            return
        if node in visiting:
            circles.append(" → ".join([*path[path.index(node) :], node]))
            return
        visiting.add(node)
        for target in sorted(edges.get(node, ())):
            visit(target, [*path, node])
        visiting.discard(node)
        done.add(node)

    for node in sorted(edges):
        visit(node, [])
    assert circles == []


def test_every_module_has_a_layer() -> None:
    for module in graph():
        layer(module)


def test_every_module_imports() -> None:
    """A name removed from one module and still imported by another fails here, in seconds."""
    import importlib

    optional = ("fsdpcheck.integrations.",)  # their frameworks are optional extras
    for module in sorted(graph()):
        if module.startswith(optional) or module == "fsdpcheck.__main__":
            continue
        importlib.import_module(module)
