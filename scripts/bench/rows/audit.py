"""The audit's overhead: ``audit --init meta`` against a bare job that builds and shards alike."""

from __future__ import annotations

import json

from bench.measure import marked, median, require, rotated, run_ranks
from bench.result import Line, Row
from bench.settings import Settings, worker
from bench.shapes import LLAMA_70B
from bench.text import fmt_mib, fmt_s, plural

GOAL = 1.10  # the audit may cost at most 10 % over the bare job


def row_audit(s: Settings) -> Row:
    row = Row(
        "audit",
        "audit overhead",
        "`audit --init meta` vs a bare job (import, build on meta, fully_shard, exit), 2 ranks",
    )
    llama = s.scratch / "llama-70b-shaped"
    llama.mkdir(exist_ok=True)
    (llama / "config.json").write_text(json.dumps(LLAMA_70B, indent=2))
    models = {"tiny-gemma4": "tiny-gemma4", "Llama-70B-shaped (meta)": str(llama)}
    for label, model in models.items():
        figures = _measure(model, label, s)
        row.raw[label] = figures
        row.lines += _lines(label, figures["audit"], figures["bare"])
    row.notes.append(
        f"Median of {plural(s.noisy_repeats, 'repeat')}"
        + ("" if s.quick else " after one warm-up round")
        + ", the two variants in alternating order. "
        "Wall: from starting both ranks to the last one exiting (fsdpcheck.children.launch), "
        "interpreter start-up and imports included, the same for both. Peak RSS: `ru_maxrss` of "
        "each rank "
        "process (scripts/bench/workers/rss.py wraps both alike), the larger of the two ranks. "
        "CPU time: user + system time of the busier rank process, which other work on the "
        "machine stretches far less than wall time."
    )
    if any(line.met is False for line in row.lines):
        row.notes.append(
            "Where the wall ratio misses 1.10×: the audit's own stages (fingerprint, gather, "
            "analyse, render) take tens of milliseconds (cProfile of rank 0: gather 0.3 s, of "
            "which nearly all is waiting for the other rank to finish building; fingerprints and "
            "rendering under 0.05 s); both jobs spend most of their time importing torch and "
            "transformers and building the model. The audit also imports typer and rich and "
            "creates its gloo side channel. The CPU-time ratio above is the cost; on 2 cores "
            "shared with other processes (load average above 1 means ranks wait for a core) "
            "every extra CPU-second of the audit can cost more than a second of wall time."
        )
    return row


def _measure(model: str, label: str, s: Settings) -> dict[str, dict[str, list]]:
    """Wall, peak RSS and CPU of both variants on ``model``, rotating, after a warm-up round."""
    rss = [worker("rss")]
    variants = {
        "bare": [*rss, worker("bare"), "--model", model],
        "audit": [*rss, "-m", "fsdpcheck", "audit", "--model", model, "--init", "meta"],
    }
    figures: dict[str, dict[str, list]] = {v: {"wall": [], "rss": [], "cpu": []} for v in variants}
    for attempt in range(s.noisy_repeats + (0 if s.quick else 1)):
        for variant in rotated(list(variants), attempt):
            result = run_ranks(variants[variant], 2)
            require(result, [0, 0], f"{variant} {label}")
            usage = marked(result, "@rss ", "stderr")
            if attempt == 0 and not s.quick:
                continue  # warm-up: page cache, .pyc files
            figures[variant]["wall"].append(result.elapsed)
            figures[variant]["rss"].append(max(u["maxrss"] for u in usage))
            figures[variant]["cpu"].append(max(u["cpu"] for u in usage))
    return figures


def _lines(label: str, audit: dict[str, list], bare: dict[str, list]) -> list[Line]:
    wall = median(audit["wall"]) / median(bare["wall"])
    peak = median(audit["rss"]) / median(bare["rss"])
    return [
        Line(
            f"{label}: wall",
            f"{wall:.2f}×",
            f"≤ {GOAL:.2f}×",
            wall <= GOAL,
            f"audit {fmt_s(median(audit['wall']))}, bare {fmt_s(median(bare['wall']))}; "
            f"best runs {fmt_s(min(audit['wall']))} vs {fmt_s(min(bare['wall']))} "
            f"({min(audit['wall']) / min(bare['wall']):.2f}×); CPU time per process "
            f"{fmt_s(median(audit['cpu']))} vs {fmt_s(median(bare['cpu']))} "
            f"({median(audit['cpu']) / median(bare['cpu']):.2f}×)",
            wall,
        ),
        Line(
            f"{label}: peak RSS per process",
            f"{peak:.2f}×",
            f"≤ {GOAL:.2f}×",
            peak <= GOAL,
            f"audit {fmt_mib(median(audit['rss']))}, bare {fmt_mib(median(bare['rss']))}",
            peak,
        ),
    ]
