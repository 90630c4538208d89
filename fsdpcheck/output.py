"""Files fsdpcheck writes (``--json``, ``--junit``, ``--sarif``, fingerprints): checked before
any work, so a path that cannot be written is bad input found up front, not a traceback after
the audit (:func:`output_problem` tries what the final write will do and removes what it
made); written atomically and readable by CI artifact collectors."""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fsdpcheck.records import to_dict

log = logging.getLogger(__name__)


def write_json(record: Any, path: str | Path) -> None:
    """Write any record as indented JSON, atomically (see :func:`write_text`)."""
    write_text(json.dumps(to_dict(record), indent=2) + "\n", path)


# Ranks that check and write paths in one new folder at once make it at once, and each check
# removes the folders it made: a folder that appears or vanishes under a check or a write is
# a sibling rank's doing, looked at again up to this many times.
_FOLDER_RACES = 5


def write_text(text: str, path: str | Path) -> None:
    """Write ``text`` (UTF-8) atomically, so a reader never sees half a file; makes the
    missing folders."""
    path = Path(path)
    for attempt in range(_FOLDER_RACES):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            break
        except FileNotFoundError:
            if attempt == _FOLDER_RACES - 1:
                raise
            log.debug("%s vanished under the write: made again", path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the file from CI artifact collectors
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def unwritable(path: str | Path) -> OSError | None:
    """Why :func:`write_text` to ``path`` would fail, or None when it would not: tries what the
    write will do (make the missing folders, create a file next to the target) and removes
    what it made. ``strerror`` says why in words."""
    for _ in range(_FOLDER_RACES):
        problem = _try_writing(Path(path))
        # A folder made or removed by a sibling rank's check between two looks: look again.
        if not isinstance(problem, (FileExistsError, FileNotFoundError)):
            return problem
    return problem


def _try_writing(path: Path) -> OSError | None:
    if path.is_dir():
        return IsADirectoryError(errno.EISDIR, "is a directory", str(path))
    parent = path.parent if str(path.parent) else Path(".")
    missing = []
    existing = parent
    while not existing.exists():
        missing.append(existing)
        if existing.parent == existing:
            break
        existing = existing.parent
    try:
        if not stat.S_ISDIR(existing.stat().st_mode):
            return NotADirectoryError(
                errno.ENOTDIR, f"{existing} is a file, not a folder", str(path)
            )
    except FileNotFoundError as exc:  # gone since it was seen (a sibling's check removed it)
        return exc
    made: list[Path] = []
    try:
        for folder in reversed(missing):
            try:
                folder.mkdir()
            except FileExistsError:
                if not folder.is_dir():  # gone again, or a file: the next look tells which
                    raise
                continue  # a sibling rank's check or write made it: not this one's to remove
            made.append(folder)
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=".check")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        log.debug("%s is not writable", path, exc_info=True)
        return exc
    finally:
        for folder in reversed(made):
            try:
                folder.rmdir()
            except OSError:
                log.debug("%s not removed", folder, exc_info=True)
    return None


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
