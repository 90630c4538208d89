"""The raw figures (results.json): written after every run, read back by ``--merge``."""

from __future__ import annotations

import json
from pathlib import Path

from bench.result import Line, Row
from bench.rows import ROWS

SCHEMA = "fsdpcheck.benchmarks/1"


def to_json(rows: list[Row], meta: dict) -> dict:
    return {
        "schema": SCHEMA,
        **meta,
        "rows": [
            {
                "row": r.name,
                "title": r.title,
                "compare": r.compare,
                "seconds": round(r.seconds, 1),
                "error": r.error,
                "date": r.date,
                "load": r.load,
                "lines": [vars(line) for line in r.lines],
                "notes": r.notes,
                "raw": r.raw,
            }
            for r in rows
        ],
    }


def merged(fresh: list[Row], previous: Path) -> list[Row]:
    """``fresh`` rows, and the previous run's rows for every other row, in ROWS order."""
    by_name = {r.name: r for r in fresh}
    if previous.exists():
        old = json.loads(previous.read_text())
        for r in old.get("rows", []):
            if r["row"] in by_name or r["row"] not in ROWS:
                continue
            by_name[r["row"]] = Row(
                r["row"], r["title"], r["compare"],
                lines=[Line(**line) for line in r["lines"]], notes=r["notes"], raw=r["raw"],
                seconds=r["seconds"], error=r["error"], date=r.get("date") or old.get("date"),
                load=r.get("load") or old.get("load_before"),
            )  # fmt: skip
    return [by_name[name] for name in ROWS if name in by_name]
