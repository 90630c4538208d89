"""Output files (``--json``, ``--junit``, ``--sarif``): checked before any work, written at the end.

A path that cannot be written is bad input found up front, not a traceback after the audit:
:func:`output_problem` tries what the final write will do (make the missing parent folders and
create a file next to the target) and removes what it made.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from fsdpcheck.output import unwritable


def output_problem(option: str, path: Path | str) -> str | None:
    """Why ``path`` (given as ``option``) cannot be written, or None when it can."""
    path = Path(path)
    exc = unwritable(path)
    if exc is None:
        return None
    if isinstance(exc, IsADirectoryError) and path.is_dir():
        return f"{option} {path} is a directory; pass a file path, e.g. {path / 'out'}"
    if isinstance(exc, NotADirectoryError) and exc.filename == str(path):
        return f"{option} {path}: {exc.strerror}"
    return f"{option} {path} cannot be written ({exc.strerror or type(exc).__name__})"


def output_problems(outputs: Iterable[tuple[str, Path | None]]) -> list[str]:
    """The problems of every given output (``None`` paths are not asked for)."""
    problems = []
    for option, path in outputs:
        if path is not None:
            problem = output_problem(option, path)
            if problem is not None:
                problems.append(problem)
    return problems


def problems_paragraph(problems: list[str], *, distributed: bool = False) -> str:
    """One paragraph naming every path at fault and the fix (the caller names the rank)."""
    joined = "; ".join(problems)
    where = " on rank 0's host (rank 0 writes every output file)" if distributed else ""
    return f"{joined}. Nothing was run. Pass paths in a folder this user can write{where}."
