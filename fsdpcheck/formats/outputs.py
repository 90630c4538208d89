"""Output files (``--json``, ``--junit``, ``--sarif``): checked before any work, written at the end.

A path that cannot be written is bad input found up front, not a traceback after the audit:
:func:`output_problem` tries what the final write will do (make the missing parent folders and
create a file next to the target) and removes what it made.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)


def output_problem(option: str, path: Path | str) -> str | None:
    """Why ``path`` (given as ``option``) cannot be written, or None when it can."""
    path = Path(path)
    if path.is_dir():
        return f"{option} {path} is a directory; pass a file path, e.g. {path / 'out'}"
    parent = path.parent if str(path.parent) else Path(".")
    missing = []
    existing = parent
    while not existing.exists():
        missing.append(existing)
        if existing.parent == existing:
            break
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        return f"{option} {path}: {existing} is a file, not a folder"
    made: list[Path] = []
    try:
        for folder in reversed(missing):
            folder.mkdir()
            made.append(folder)
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=".check")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        log.debug("%s %s is not writable", option, path, exc_info=True)
        return f"{option} {path} cannot be written ({exc.strerror or type(exc).__name__})"
    finally:
        for folder in reversed(made):
            try:
                folder.rmdir()
            except OSError:
                pass
    return None


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
