"""Find, in Python source, the loops that iterate a ``set`` while registering tensors.

Iterating a set of strings follows the interpreter's hash seed, so tensors registered inside such
a loop come out of ``named_buffers()`` / ``named_parameters()`` in a per-process order (the
upstream transformers RoPE bug; see docs/facts.md, facts 1 and 4). This module only reads source: it
never imports or runs the code it looks at. Pure: text in, :class:`SetOrderSite` records out.

What counts as *iterating a set*: ``for x in set(...)``, ``list(set(...))``, ``tuple(set(...))``,
``frozenset(...)``, a set literal or set comprehension, or a name assigned one of those earlier in
the same function (``self.layer_types = list(set(config.layer_types))`` then ``for t in
self.layer_types``). ``sorted(set(...))`` is the fix and does not count. What counts as
*registering tensors*: ``register_buffer`` / ``register_parameter`` / ``add_module`` /
``register_module`` calls, assigning (``setattr`` or ``x[k] = ...``) an ``nn.Buffer`` /
``nn.Parameter``, or making one in a comprehension (``ParameterDict({k: nn.Parameter(...) for k
in set(...)})``). Loops that only read (building a mask dict in ``forward``) are not sites.
"""

from __future__ import annotations

import ast
import logging
import re
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_REGISTER_CALLS = {"register_buffer", "register_parameter", "add_module", "register_module"}
_TENSOR_CTORS = {"Buffer", "Parameter"}
_SET_WRAPPERS = {"list", "tuple", "iter", "enumerate", "reversed"}


@dataclass(frozen=True)
class SetOrderSite:
    """One loop over a set whose body registers tensors."""

    path: str
    line: int  # of the ``for`` (or the comprehension)
    column: int  # 1-based, as SARIF counts
    function: str  # qualified: ``Class.method``
    iterable: str  # the source of what is iterated, e.g. ``self.layer_types``
    origin_line: int  # where the set was made (== line when iterated directly)
    registers: str  # the first registering call, e.g. ``setattr(self, ..., nn.Buffer(...))``
    snippet: str  # the ``for`` line as written


# Text that any set expression needs: parsing is the slow part (about 50 ms per transformers
# modeling file), and fewer than one file in ten has any of these.
_MAYBE_SET = re.compile(r"\bset\(|\bfrozenset\(|\bin\s*\{|\s=\s*\{[^:{}*]+\}|\{[^:{}]*\bfor\b")


def find_sites(source: str, path: str = "<string>") -> tuple[SetOrderSite, ...]:
    """Every set-iterating, tensor-registering loop in ``source``; a syntax error gives none."""
    if not _MAYBE_SET.search(source):
        return ()
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError:
        log.debug("%s does not parse: no set-order sites", path, exc_info=True)
        return ()
    lines = source.splitlines()
    sites: list[SetOrderSite] = []
    for qualname, func in _functions(tree):
        sites.extend(_sites_in(func, qualname, path, lines))
    return tuple(sorted(sites, key=lambda s: (s.line, s.column)))


def find_sites_in_file(path: str | Path) -> tuple[SetOrderSite, ...]:
    try:
        source = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        log.debug("%s unreadable: no set-order sites", path, exc_info=True)
        return ()
    return find_sites(source, str(path))


def _functions(tree: ast.AST, prefix: str = ""):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield f"{prefix}{node.name}", node
            yield from _functions(node, f"{prefix}{node.name}.")


def _is_set_expr(node: ast.AST) -> bool:
    if isinstance(node, (ast.Set, ast.SetComp)):
        return True
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        if node.func.id in ("set", "frozenset"):
            return True
        if node.func.id in _SET_WRAPPERS and node.args:
            return _is_set_expr(node.args[0])
    return False


def _own_nodes(func: ast.AST):
    """The nodes of ``func``'s body, not descending into nested functions or classes."""
    stack = list(ast.iter_child_nodes(func))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(node))


def _set_names(func: ast.AST) -> dict[str, int]:
    """Names (``x``, ``self.x``) assigned a set expression in ``func``, with the first line."""
    names: dict[str, int] = {}
    for node in _own_nodes(func):
        if isinstance(node, ast.Assign) and _is_set_expr(node.value):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets = [node.target] if _is_set_expr(node.value) else []
        else:
            continue
        for target in targets:
            if isinstance(target, (ast.Name, ast.Attribute)):
                names.setdefault(ast.unparse(target), node.lineno)
    return names


def _set_origin(iterable: ast.AST, names: dict[str, int], before: int) -> int | None:
    """The line where ``iterable``'s set was made, or None when it is not a set."""
    if _is_set_expr(iterable):
        return iterable.lineno
    if isinstance(iterable, ast.Call) and isinstance(iterable.func, ast.Name):
        if iterable.func.id in _SET_WRAPPERS and iterable.args:
            return _set_origin(iterable.args[0], names, before)
        return None
    if isinstance(iterable, (ast.Name, ast.Attribute)):
        line = names.get(ast.unparse(iterable))
        return line if line is not None and line <= before else None
    return None


def _callee(call: ast.Call) -> str:
    func = call.func
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return ""


def _registers(nodes, *, building: bool = False) -> ast.AST | None:
    """The first node among ``nodes`` (and their children) that registers a tensor/module.

    ``building``: the nodes are a comprehension's element, whose container (a ``ParameterDict``,
    a module's attribute) holds what it makes: constructing a Parameter/Buffer there counts."""
    for top in nodes:
        for node in [top, *_own_nodes(top)]:
            if isinstance(node, ast.Call):
                name = _callee(node)
                if name in _REGISTER_CALLS or (building and name in _TENSOR_CTORS):
                    return node
                if name == "setattr" and len(node.args) == 3:
                    value = node.args[2]
                    if isinstance(value, ast.Call) and _callee(value) in _TENSOR_CTORS:
                        return node
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                if _callee(node.value) in _TENSOR_CTORS and any(
                    isinstance(t, (ast.Subscript, ast.Attribute)) for t in node.targets
                ):
                    return node
    return None


def _sites_in(func: ast.AST, qualname: str, path: str, lines: list[str]) -> list[SetOrderSite]:
    names = _set_names(func)
    sites = []
    for node in _own_nodes(func):
        if isinstance(node, (ast.For, ast.AsyncFor)):
            iterable, body = node.iter, node.body
        elif isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            iterable = node.generators[0].iter
            body = [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
        else:
            continue
        origin = _set_origin(iterable, names, node.lineno)
        if origin is None:
            continue
        registering = _registers(body, building=not isinstance(node, (ast.For, ast.AsyncFor)))
        if registering is None:
            continue
        sites.append(
            SetOrderSite(
                path=path,
                line=node.lineno,
                column=node.col_offset + 1,
                function=qualname,
                iterable=ast.unparse(iterable),
                origin_line=origin,
                registers=_short(ast.unparse(registering)),
                snippet=lines[node.lineno - 1].strip() if node.lineno <= len(lines) else "",
            )
        )
    return sites


def _short(text: str, limit: int = 100) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
