"""`make lint` sees every Python file the project tracks.

Ruff's default ``exclude`` skips folders such as ``dist`` and ``build`` even inside a package it
is pointed at, so a module can drop out of the lint without anyone noticing (it happened to
``fsdpcheck/dist``). This compares ruff's own file list with the tracked files.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINTED = ("fsdpcheck", "tests", "scripts", "examples")  # what `make lint` passes to ruff


def _ruff() -> list[str]:
    beside = Path(sys.executable).with_name("ruff")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("ruff")
    if found is None:
        pytest.fail("ruff is not installed: `make install` installs it with the dev extras")
    return [found]


def _tracked_python_files() -> set[Path]:
    if (ROOT / ".git").exists() and shutil.which("git"):
        out = subprocess.run(
            ["git", "ls-files", "--", *(f"{d}/*.py" for d in LINTED)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return {(ROOT / line).resolve() for line in out.splitlines() if line}
    return {p.resolve() for d in LINTED for p in (ROOT / d).rglob("*.py")}


def test_ruff_lints_every_tracked_python_file() -> None:
    listed = subprocess.run(
        [*_ruff(), "check", "--show-files", *LINTED],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    seen = {Path(line.strip()).resolve() for line in listed.splitlines() if line.endswith(".py")}
    missed = sorted(str(p.relative_to(ROOT)) for p in _tracked_python_files() - seen)
    assert missed == [], f"ruff skips these tracked files (check its exclude): {missed}"


def test_test_modules_have_unique_names() -> None:
    # The test folders are no packages: pytest imports each test file by its base name, so two
    # tests/<tier>/test_x.py stop collection of the whole suite ("import file mismatch"); a
    # checkout with the first one's __pycache__ hides it, a clean clone does not.
    seen: dict[str, Path] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        assert path.name not in seen, f"{path} and {seen[path.name]} share a module name"
        seen[path.name] = path
