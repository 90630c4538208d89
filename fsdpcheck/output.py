"""Files fsdpcheck writes: atomically, readable by CI artifact collectors."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from fsdpcheck.records import to_dict


def write_json(record: Any, path: Path) -> None:
    """Write any record as indented JSON, atomically, so a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the file from CI artifact collectors
        with os.fdopen(fd, "w") as out:
            json.dump(to_dict(record), out, indent=2)
            out.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text(text: str, path: str | Path) -> None:
    """Write ``text`` (UTF-8) atomically, like :func:`write_json`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
