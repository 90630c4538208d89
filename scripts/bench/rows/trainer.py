"""The default audit against a trainer's start on the same checkpoint (``workers/trainer.py``)."""

from __future__ import annotations

from bench.measure import audit_runs, median, run_worker
from bench.result import Line, Row
from bench.settings import Settings, shown, worker
from bench.text import fmt_mib, fmt_s, plural

GOAL = 1.10  # audit / trainer start, wall and peak RSS


def row_trainer(s: Settings) -> Row:
    row = Row(
        "trainer",
        "default audit vs trainer start",
        "`audit --model CKPT` (default: `--init rank0`, load, verify) vs a trainer-start job "
        "(rank 0 `from_pretrained`, others meta, `fully_shard`, DCP broadcast load, sorted "
        f"buffer broadcast: {shown(worker('trainer'))}); Llama-shaped 267M bfloat16 "
        "checkpoint, 2 ranks",
    )
    ckpt = s.scratch / "llama-267m"
    made = run_worker("trainer", "--make-checkpoint", str(ckpt))
    if made.returncode:
        raise RuntimeError(f"making the checkpoint failed: {made.stderr[-2000:]}")
    variants = {
        "trainer": [worker("trainer"), "--model", str(ckpt)],
        "audit": ["-m", "fsdpcheck", "audit", "--model", str(ckpt)],
    }
    rounds = s.repeats + (0 if s.quick else 1)
    figures = audit_runs(variants, rounds, row, s, "llama-267m")
    if not s.quick:
        for f in figures.values():
            for key in f:
                f[key] = f[key][1:]  # the warm-up round: page cache, .pyc files
    trainer, audit = figures["trainer"], figures["audit"]
    wall = median(audit["wall"]) / median(trainer["wall"])
    peak = median(audit["rss"]) / median(trainer["rss"])
    timings = {
        k: median([r["timings"].get(k, 0.0) for r in audit["report"]])
        for k in ("build", "gather", "load", "verify")
    }
    row.lines.append(
        Line(
            "wall",
            f"{wall:.2f}×",
            f"≤ {GOAL:.2f}×",
            wall <= GOAL,
            f"audit {fmt_s(median(audit['wall']))}, trainer {fmt_s(median(trainer['wall']))}; "
            f"best runs {fmt_s(min(audit['wall']))} vs {fmt_s(min(trainer['wall']))} "
            f"({min(audit['wall']) / min(trainer['wall']):.2f}×); CPU time of the busier rank "
            f"{fmt_s(median(audit['cpu']))} vs {fmt_s(median(trainer['cpu']))}; audit stages "
            "on rank 0: " + ", ".join(f"{k} {fmt_s(v)}" for k, v in timings.items()),
            wall,
        )
    )
    row.lines.append(
        Line(
            "peak RSS per process",
            f"{peak:.2f}×",
            f"≤ {GOAL:.2f}×",
            peak <= GOAL,
            f"audit {fmt_mib(median(audit['rss']))}, trainer {fmt_mib(median(trainer['rss']))}",
            peak,
        )
    )
    row.notes.append(
        f"Median of {plural(len(audit['wall']), 'repeat')}"
        + ("" if s.quick else " after one warm-up round")
        + ", the two in alternating order. The audit does everything the trainer does (its "
        "loader in place of DCP's), plus fingerprints, the gather, the analysis, verify and "
        "the report; the trainer job is the floor."
    )
    return row
