"""Time to verdict: the audit on 2 divergent ranks, against a naive loader (measured) and NCCL's
watchdog timeout (an estimate: a documented constant, never run here)."""

from __future__ import annotations

from bench.measure import median, require, run_ranks
from bench.result import Line, Row
from bench.settings import ENV, NAIVE, NCCL_TIMEOUT_S, REPO, Settings, shown
from bench.text import fmt_s
from fsdpcheck.children.launch import launch  # torch-free


def row_verdict(s: Settings) -> Row:
    row = Row(
        "verdict",
        "time to verdict",
        "`audit --model hazard --vary-hash-seed`, 2 divergent ranks, vs a naive loader "
        f"({shown(NAIVE)}, measured) and vs NCCL's watchdog ({NCCL_TIMEOUT_S:.0f} s, torch's "
        "documented default collective timeout: not measured, no GPU here)",
    )
    walls = []
    for _ in range(s.repeats):
        argv = ["-m", "fsdpcheck", "audit", "--model", "hazard", "--vary-hash-seed"]
        result = run_ranks(argv, 2)
        require(result, [1, 1], "audit --vary-hash-seed")  # findings, on every rank
        walls.append(result.elapsed)
    wall = median(walls)
    row.raw = {"seconds": walls}
    row.lines.append(
        Line(
            "audit, gloo: measured",
            fmt_s(wall),
            "—",
            None,
            f"audit {fmt_s(wall)} to exit code 1 (findings) on both ranks, launch to exit",
            wall,
        )
    )
    row.lines.append(_naive(walls, s, row))
    row.lines.append(watchdog_estimate(wall))
    row.notes.append(
        "On gloo the naive loader does not hang: the rank that receives a differently sized "
        "tensor aborts within seconds of the mismatched broadcast (SIGABRT, an uncatchable "
        "C++ abort, no report), and its peer then fails on the closed connection. Its wall "
        "time is mostly interpreter start-up and building the model, like the audit's. The "
        "audit takes about as long and ends with a report naming the divergent buffers; on "
        "NCCL the naive loader would wait for the watchdog instead."
    )
    return row


def _naive(walls_audit: list[float], s: Settings, row: Row) -> Line:
    """The naive loader, measured: on gloo the receiving rank aborts."""
    walls, codes = [], []
    for _ in range(s.repeats):
        result = launch(
            [str(NAIVE)], 2, env=ENV, timeout=300.0, cwd=str(REPO),
            rank_env=lambda r: {"PYTHONHASHSEED": str(r)},
        )  # fmt: skip
        walls.append(result.elapsed)
        codes.append(result.codes)
    aborted = any(-6 in c for c in codes)
    row.raw["naive"] = {"seconds": walls, "codes": codes}
    return Line(
        "naive loader (named_buffers order), gloo: measured",
        fmt_s(median(walls)),
        "—",
        None,
        f"exit codes {codes[0]} (-6: SIGABRT, gloo's `op.preamble.length <= op.nbytes`"
        f"{'' if aborted else '; no abort seen'}); the audit {fmt_s(median(walls_audit))} "
        "ends with a named verdict instead of a crash",
        median(walls),
    )


def watchdog_estimate(wall: float) -> Line:
    """A documented constant over the measured audit: an estimate, so informational, never a
    goal met (nothing was run on NCCL; the figure only says how much sooner a verdict comes)."""
    ratio = NCCL_TIMEOUT_S / wall
    return Line(
        f"estimate: {NCCL_TIMEOUT_S:.0f} s (NCCL watchdog default, documented) / audit wall",
        f"{ratio:.0f}× (estimate)",
        "—",
        None,
        f"the {NCCL_TIMEOUT_S:.0f} s is torch's documented default NCCL timeout, what a naive "
        "loader whose broadcasts mismatch in size waits on NCCL; it is not a measurement, so "
        "no goal is claimed for it",
        ratio,
    )
