"""CLI start-up: ``fsdpcheck --help`` and ``fsdpcheck presets`` against the bare interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from bench.measure import median
from bench.result import Line, Row
from bench.settings import ENV, Settings
from bench.text import fmt_s

GOAL_S = 0.5


def row_cli(s: Settings) -> Row:
    row = Row("cli", "CLI start-up", "`fsdpcheck --help`, `fsdpcheck presets` (wall, one process)")
    exe = Path(sys.executable).with_name("fsdpcheck")
    base = [str(exe)] if exe.exists() else [sys.executable, "-m", "fsdpcheck"]
    commands = {
        "fsdpcheck --help": [*base, "--help"],
        "fsdpcheck presets": [*base, "presets"],
        "python -c pass (floor)": [sys.executable, "-c", "pass"],
    }
    times: dict[str, list[float]] = {k: [] for k in commands}
    for _ in range(max(3, 2 * s.repeats) + 1):
        for label, argv in commands.items():
            start = time.perf_counter()
            subprocess.run(argv, capture_output=True, check=True, env={**os.environ, **ENV})
            times[label].append(time.perf_counter() - start)
    for label in times:
        times[label] = times[label][1:]  # the first: cold page cache
    probe = "import sys, fsdpcheck.cli; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    heavy = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout
    row.raw = {"seconds": times, "heavy_modules_imported_by_cli": heavy.strip()}
    floor = median(times["python -c pass (floor)"])
    for label in ("fsdpcheck --help", "fsdpcheck presets"):
        value = median(times[label])
        row.lines.append(
            Line(
                label,
                fmt_s(value),
                f"≤ {GOAL_S} s",
                value <= GOAL_S,
                f"median of {len(times[label])}; interpreter alone {fmt_s(floor)}",
                value,
            )
        )
    row.notes.append(
        f"Importing `fsdpcheck.cli` loads neither torch nor transformers ({heavy.strip()} of "
        "them in sys.modules): the commands that need them import them when they run."
    )
    return row
