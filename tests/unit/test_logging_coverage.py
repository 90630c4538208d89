"""No silent broad ``except``: every handler that catches ``Exception``, ``BaseException`` or
everything either re-raises (a bare ``raise``) or logs (``log.<level>(...)``), so that
``FSDPCHECK_LOG=debug`` shows every exception the package turned into a finding or a note."""

from __future__ import annotations

import ast
from pathlib import Path

import fsdpcheck

PACKAGE = Path(fsdpcheck.__file__).resolve().parent
BROAD = {"Exception", "BaseException"}

# (path under fsdpcheck/, enclosing function's qualified name): handlers that may stay silent,
# each with the reason logging is impossible there (e.g. inside the logging set-up itself).
# An entry that no longer matches a silent handler fails the test, so the list cannot go stale.
ALLOWED_SILENT: dict[tuple[str, str], str] = {}


def _catches_broadly(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    caught = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(t, ast.Name) and t.id in BROAD for t in caught)


def _accounts_for_it(handler: ast.ExceptHandler) -> bool:
    """A bare ``raise`` or a ``log.<method>(...)`` call anywhere in the handler's body."""
    for node in ast.walk(ast.Module(body=handler.body, type_ignores=[])):
        if isinstance(node, ast.Raise) and node.exc is None:
            return True
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "log"
        ):
            return True
    return False


def silent_handlers(source: str) -> list[tuple[str, int]]:
    """``(enclosing qualname, line)`` of each broad handler that neither re-raises nor logs."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, scope: tuple[str, ...]) -> None:
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                inner = (*scope, child.name)
            if (
                isinstance(child, ast.ExceptHandler)
                and _catches_broadly(child)
                and not _accounts_for_it(child)
            ):
                found.append((".".join(scope) or "<module>", child.lineno))
            visit(child, inner)

    visit(ast.parse(source), ())
    return found


def _package_sources() -> dict[str, str]:
    return {
        path.relative_to(PACKAGE).as_posix(): path.read_text(encoding="utf-8")
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def test_every_broad_except_logs_or_reraises():
    silent, matched = [], set()
    for rel, source in _package_sources().items():
        for qualname, line in silent_handlers(source):
            if (rel, qualname) in ALLOWED_SILENT:
                matched.add((rel, qualname))
            else:
                silent.append(f"fsdpcheck/{rel}:{line} (in {qualname})")
    assert not silent, (
        "broad except handlers that swallow in silence; add "
        '`log.debug("<what was tried>", exc_info=True)` (module-level '
        "`log = logging.getLogger(__name__)`):\n  " + "\n  ".join(silent)
    )
    stale = set(ALLOWED_SILENT) - matched
    assert not stale, f"ALLOWED_SILENT entries with no silent handler left: {sorted(stale)}"


def test_the_check_sees_a_silent_handler():
    source = """
def quiet():
    try:
        pass
    except (ValueError, Exception):
        return None

def bare():
    try:
        pass
    except:
        x = 1

def told():
    try:
        pass
    except Exception:
        log.debug("tried", exc_info=True)

def passed_on():
    try:
        pass
    except BaseException:
        cleanup()
        raise

def narrow():
    try:
        pass
    except ValueError:
        pass

def wrapped():
    try:
        pass
    except Exception as exc:
        raise RuntimeError("other") from exc
"""
    assert [name for name, _ in silent_handlers(source)] == ["quiet", "bare", "wrapped"]


def test_each_module_logs_under_its_own_name():
    """One logger per module, named after it, so ``FSDPCHECK_LOG`` output says where."""
    wrong = []
    for rel, source in _package_sources().items():
        for node in ast.parse(source).body:
            if not (
                isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "log" for t in node.targets)
            ):
                continue
            call = node.value
            ok = (
                isinstance(call, ast.Call)
                and ast.unparse(call.func) == "logging.getLogger"
                and [ast.unparse(a) for a in call.args] == ["__name__"]
            )
            if not ok:
                wrong.append(f"fsdpcheck/{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not wrong, "\n".join(wrong)
