"""The package's import graph: no circle, and no import that runs back up the data flow."""

from __future__ import annotations

import ast
from pathlib import Path

import fsdpcheck

PACKAGE = Path(fsdpcheck.__file__).resolve().parent

# One layer per package, in the order data flows (docs/architecture.md): a module imports only
# from its own package or a lower layer. Within a package, modules may import each other as long
# as no circle forms (checked separately).
LAYERS = {
    "fsdpcheck.vocab": 0,
    "fsdpcheck.text": 1,
    "fsdpcheck.errors": 2,
    "fsdpcheck.records": 3,
    "fsdpcheck.options": 4,
    "fsdpcheck.faults": 5,
    "fsdpcheck.model": 6,  # resolve, build, wrap, fingerprint: one rank's model and its record
    "fsdpcheck.distributed": 7,  # launch, process groups, liveness, gather to rank 0
    "fsdpcheck.process": 8,  # the command's own interpreter: log, re-exec, signals
    "fsdpcheck.pipeline": 9,  # one rank's stages, over model/ (resolve, build)
    "fsdpcheck.checks": 10,  # analyse: gathered records in, findings out
    "fsdpcheck.loader": 11,  # load and verify
    "fsdpcheck.children": 12,  # probe, scan, every loader for real: child jobs
    "fsdpcheck.report": 13,
    "fsdpcheck.decision": 14,  # how a run ends on every rank: decide, give up
    "fsdpcheck.step": 15,  # check_step and audit --step: the collective watch
    "fsdpcheck.audit": 16,
    "fsdpcheck.script": 17,  # fsdpcheck run: a script under the audit's checks and the watch
    "fsdpcheck.console": 18,
    "fsdpcheck.output": 19,
    "fsdpcheck.formats": 20,
    "fsdpcheck.offline": 21,
    "fsdpcheck.integrations": 22,
    "fsdpcheck.cli": 23,
    "fsdpcheck.__main__": 24,
    "fsdpcheck": 25,  # the package's lazy API
}

# Where an fsdpcheck module may be imported inside a function: where a command is handed off,
# so that what the command needs (torch, transformers) is imported only when it runs. The
# package's lazy API (fsdpcheck/__init__.py) imports by name, with importlib.
LAZY_IMPORTS = {
    "fsdpcheck.cli": "each command imports its own work: --help and --version stay fast",
    "fsdpcheck.model.presets": "a preset's config class (torch) is imported when it is built, "
    "so that listing presets never imports torch",
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


def test_one_layer_per_package() -> None:
    shared = [layer for layer in LAYERS.values() if list(LAYERS.values()).count(layer) > 1]
    assert shared == []


def test_function_level_imports_only_where_a_command_is_handed_off() -> None:
    """A module imports the package's other modules at its top: an import hidden in a function
    hides its edge from a reader (and once hid circles from this file)."""
    hidden = [
        f"{module_name(path)}:{node.lineno}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if module_name(path) not in LAZY_IMPORTS
        for function in ast.walk(ast.parse(path.read_text()))
        if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef)
        for node in ast.walk(function)
        if _imports_fsdpcheck(node)
    ]
    assert hidden == []


def _imports_fsdpcheck(node: ast.AST) -> bool:
    if isinstance(node, ast.Import):
        return any(a.name.split(".")[0] == "fsdpcheck" for a in node.names)
    return isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "fsdpcheck"


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


def test_scripts_examples_and_tests_import_names_that_exist() -> None:
    """Code outside the package (the bench's workers, examples, test workers) imports moved
    names too, often inside functions a bench run reaches half an hour in: checked here."""
    import importlib

    root = PACKAGE.parent
    missing = []
    for folder in ("scripts", "examples", "tests"):
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module):
                    continue
                if not node.module.startswith("fsdpcheck") or node.module.startswith(
                    "fsdpcheck.integrations."  # their frameworks are optional extras
                ):
                    continue
                module = importlib.import_module(node.module)
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    if not hasattr(module, alias.name) and importlib.util.find_spec(sub) is None:
                        missing.append(f"{path.relative_to(root)}: {sub}")
    assert missing == []
