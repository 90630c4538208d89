"""Running the variants and summarising what they measured, the same way for every row."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from bench.settings import ENV, REPO, Settings, worker
from fsdpcheck.children.launch import LaunchResult, launch  # torch-free

if TYPE_CHECKING:
    from bench.result import Row


def rotated(items: Sequence[str], turn: int) -> list[str]:
    """``items`` starting at ``turn``; with three or more, every other turn backwards: each
    variant runs first in turn, and not always right after the same other one, as it would in
    a rotation alone (the job before leaves memory, caches and the scheduler in its own state).
    Two alternate: reversing their rotation would put the same one first every turn."""
    k = turn % len(items)
    order = [*items[k:], *items[:k]]
    return order[::-1] if turn % 2 and len(items) > 2 else order


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def paired_ratio(numerators: Sequence[float], denominators: Sequence[float]) -> float:
    """The median of ``numerators[i] / denominators[i]``: each ratio between two runs made
    one right after the other (a round), so the host's slower and faster minutes, which move
    every run of a round alike, cancel out of it as they do not out of a ratio of medians."""
    return median([a / b for a, b in zip(numerators, denominators, strict=True)])


def run_ranks(argv: list[str], n: int, timeout: float = 600.0, **env: str) -> LaunchResult:
    return launch(argv, n, env={**ENV, **env}, timeout=timeout, cwd=str(REPO))


def run_worker(name: str, *argv: str, timeout: float | None = None) -> subprocess.CompletedProcess:
    """``workers/<name>.py`` as one plain process (no rank), with the ranks' environment."""
    return subprocess.run(
        [sys.executable, worker(name), *argv],
        capture_output=True, text=True, env={**os.environ, **ENV}, cwd=str(REPO), timeout=timeout,
    )  # fmt: skip


def marked(result: LaunchResult, mark: str, stream: str = "stdout") -> list[dict]:
    """The ``mark {json}`` lines every rank printed, in rank order."""
    found = []
    for rank in result.ranks:
        text = rank.stdout if stream == "stdout" else rank.stderr
        found += [json.loads(ln[len(mark) :]) for ln in text.splitlines() if ln.startswith(mark)]
    return found


def require(result: LaunchResult, codes: Sequence[int | None], what: str) -> None:
    if result.codes != list(codes):
        tail = (result.output(0) + result.output(len(result.ranks) - 1))[-3000:]
        raise RuntimeError(f"{what}: exit codes {result.codes}, expected {list(codes)}\n{tail}")


def loglog_slope(points: dict[int, float]) -> float | None:
    """Least-squares slope of log(value) over log(key): the exponent of a power law; None with
    fewer than two distinct keys."""
    xs = [math.log(k) for k in points]
    ys = [math.log(max(v, 1e-12)) for v in points.values()]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else None


def spans_to_seconds(records: list[dict]) -> dict[str, list[float]]:
    """Per method and repeat: the latest rank's end minus the earliest rank's start (every rank
    reads the same monotonic clock), so no closing barrier is timed."""
    out: dict[str, list[float]] = {}
    for method, first in records[0]["spans"].items():
        out[method] = [
            max(r["spans"][method][i][1] for r in records)
            - min(r["spans"][method][i][0] for r in records)
            for i in range(len(first))
        ]
    return out


def audit_runs(
    variants: dict[str, list[str]], rounds: int, row: Row, s: Settings, label: str
) -> dict[str, dict[str, list]]:
    """Each variant (argv after workers/rss.py) as 2 ranks, ``rounds`` times, rotating; wall,
    peak RSS and CPU of the busier rank, and rank 0's JSON report where the argv writes one."""
    figures: dict[str, dict[str, list]] = {
        v: {"wall": [], "rss": [], "cpu": [], "report": []} for v in variants
    }
    for attempt in range(rounds):
        for variant in rotated(list(variants), attempt):
            report = s.scratch / f"{label}-{variant}.json"
            report.unlink(missing_ok=True)
            argv = [worker("rss"), *variants[variant]]
            if "fsdpcheck" in argv and "audit" in argv:
                argv += ["--json", str(report)]
            result = run_ranks(argv, 2)
            require(result, [0, 0], f"{variant} ({label})")
            usage = marked(result, "@rss ", "stderr")
            figures[variant]["wall"].append(result.elapsed)
            figures[variant]["rss"].append(max(u["maxrss"] for u in usage))
            figures[variant]["cpu"].append(max(u["cpu"] for u in usage))
            if report.exists():
                data = json.loads(report.read_text())
                figures[variant]["report"].append(
                    {"timings": data.get("timings"), "model": data.get("model"),
                     "verify": data.get("verify"), "load": data.get("load")}
                )  # fmt: skip
    row.raw[label] = figures
    return figures
