"""The command: parse the flags, run the chosen rows one by one, write the report and results."""

from __future__ import annotations

import argparse
import compileall
import json
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import bench
from bench.machine import load_average, machine
from bench.markdown import to_markdown
from bench.result import Row
from bench.rows import ROWS, RUNNERS
from bench.settings import HERE, REPO, REPORT, RESULTS, Settings, shown
from bench.store import merged, to_json
from bench.text import mark


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=shown(HERE), description=(bench.__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="1 repeat, smaller model")
    parser.add_argument("--only", action="append", choices=ROWS, help="run this row (repeatable)")
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (1 with --quick)")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"write benchmarks.md and results.json here (default for full runs: {shown(REPORT)} "
        f"and {shown(RESULTS)})",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help=f"keep the rows not run from {shown(RESULTS)} and write the default places (each "
        "row says when it was measured)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    repeats = args.repeats or (1 if args.quick else 3)
    report, results = _destinations(args)
    selected = [r for r in ROWS if not args.only or r in args.only]
    command = " ".join(shlex.quote(a) for a in [os.path.relpath(sys.executable, REPO), shown(HERE)])
    command = " ".join([command, *map(shlex.quote, argv if argv is not None else sys.argv[1:])])
    load_before = load_average()
    start = time.perf_counter()
    _byte_compile()
    with tempfile.TemporaryDirectory(prefix="fsdpcheck-bench-") as scratch:
        noisy = repeats if args.quick or args.repeats else max(repeats, 5)
        settings = Settings(args.quick, repeats, Path(scratch), noisy)
        rows = [_run(name, settings) for name in selected]
    meta = {
        "command": command.strip(),
        "make": not (args.quick or args.only or args.out or args.repeats),
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "seconds": round(time.perf_counter() - start, 1),
        "repeats": repeats,
        "quick": args.quick,
        "machine": machine(),
        "load_before": load_before,
        "load_after": load_average(),
    }
    if args.merge:
        run = {r.name for r in rows}
        rows = merged(rows, RESULTS)
        if kept := [r.name for r in rows if r.name not in run]:
            meta["command"] += (
                f" (rows {', '.join(kept)} kept from the previous {shown(RESULTS)}, each with "
                "the date it was measured)"
            )
            meta["make"] = False
    results.write_text(json.dumps(to_json(rows, meta), indent=2) + "\n")
    report.write_text(to_markdown(rows, meta))
    print(f"bench: wrote {report} and {results}", file=sys.stderr)
    return 1 if any(r.error for r in rows) else 0


def _byte_compile() -> None:
    """fsdpcheck's modules byte-compiled, as ``pip install`` leaves them: an editable install
    run under ``PYTHONDONTWRITEBYTECODE`` (set on some CI and sandbox machines) compiles every
    module from source in every process it starts, 0.3 s that no user's installed job pays."""
    compileall.compile_dir(REPO / "fsdpcheck", quiet=1)
    compileall.compile_dir(HERE, quiet=1)


def _destinations(args: argparse.Namespace) -> tuple[Path, Path]:
    """Where the report and the results go: the committed places for a full run (or
    ``--merge``), else ``--out`` or a fresh temporary directory, so a smoke run never replaces
    the committed figures."""
    out = args.out
    if out is None:
        partial = args.quick or args.only or args.repeats is not None and args.repeats < 3
        if not partial or args.merge:
            return REPORT, RESULTS
        out = Path(tempfile.mkdtemp(prefix="fsdpcheck-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    return out / "benchmarks.md", out / "results.json"


def _run(name: str, settings: Settings) -> Row:
    """One row, timed and dated; an exception becomes the row's error, so one broken row does
    not lose the others."""
    print(f"bench: {name} ...", file=sys.stderr, flush=True)
    began = time.perf_counter()
    start_wall, load = time.time(), load_average()
    try:
        row = RUNNERS[name](settings)
    except Exception as exc:  # one broken row must not lose the others
        row = Row(name, name, "", error=f"{type(exc).__name__}: {exc}")
    row.seconds = time.perf_counter() - began
    row.date, row.load = time.strftime("%Y-%m-%d %H:%M %Z", time.gmtime(start_wall)), load
    for line in row.lines:
        print(f"  {line.what}: {line.result} ({mark(line.met)}; goal {line.goal})", file=sys.stderr)
    if row.error:
        print(f"  error: {row.error[-2000:]}", file=sys.stderr)
    return row
