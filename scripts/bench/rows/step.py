"""The first step under watch: a plain FSDP2 step, the same step under ``check_step``, and
under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, on the same model and batch (``workers/step.py``)."""

from __future__ import annotations

from bench.measure import marked, median, require, run_ranks
from bench.result import Line, Row
from bench.settings import Settings, shown, worker
from bench.text import fmt_s

GOAL = 1.30  # check_step / plain step
STEP_REPEATS = 2


def row_step(s: Settings) -> Row:
    shape = "a small Gemma3-shaped model (4 layers, hidden 256)" if s.quick else "Gemma3-1B-shaped"
    row = Row(
        "step",
        "first step under watch",
        f"one training step (forward, backward, SGD; 64 tokens per rank; {shape}, float32 "
        f"(bfloat16 has no fast CPU matmul), "
        f"FSDP2 per decoder layer and the root, 2 ranks, gloo): plain, under `check_step`, "
        f"and plain under TORCH_DISTRIBUTED_DEBUG=DETAIL ({shown(worker('step'))})",
    )
    # Two repeats of each, whatever --repeats says: a step of the 1B shape takes about a minute
    # on 2 cores, and the two jobs run 4 + 2 timed steps besides their warm-ups (and the one
    # step the watch's counts come from); the median of two is their mean.
    argv = [worker("step"), "--repeats", str(STEP_REPEATS)]
    if s.quick:
        argv.append("--quick")
    watched = run_ranks(argv, 2, timeout=1800)
    require(watched, [0, 0], "plain and check_step steps")
    detail = run_ranks(argv, 2, timeout=1800, TORCH_DISTRIBUTED_DEBUG="DETAIL")
    require(detail, [0, 0], "steps under TORCH_DISTRIBUTED_DEBUG=DETAIL")
    ours = sorted(marked(watched, "@bench "), key=lambda r: r["rank"])
    theirs = sorted(marked(detail, "@bench "), key=lambda r: r["rank"])
    row.raw = {"watched": ours, "detail": theirs}
    plain, checked = _slower(ours, "plain"), _slower(ours, "check_step")
    debug = _slower(theirs, "plain")
    ratio, debug_ratio = checked / plain, debug / plain
    counts = ours[0]
    per_collective = max(0.0, checked - plain) / max(counts["exchanges"], 1)
    slot = counts["channel_bytes"] // max(counts["exchanges"], 1)
    row.lines.append(
        Line(
            "check_step / plain step",
            f"{ratio:.2f}×",
            f"≤ {GOAL:.2f}×",
            ratio <= GOAL,
            f"check_step {fmt_s(checked)}, plain {fmt_s(plain)} ({counts['params']:,} parameters)",
            ratio,
        )
    )
    row.lines.append(
        Line(
            "check_step vs DETAIL",
            f"{checked / debug:.2f}× DETAIL's",
            "≤ 1.00×",
            checked <= debug,
            f"DETAIL {fmt_s(debug)} ({debug_ratio:.2f}× plain)",
            checked / debug,
        )
    )
    # A watched step faster than the plain one: the watch's cost is below this run's noise.
    cost = f"{1e6 * per_collective:.0f} µs" if checked > plain else "below the noise"
    row.lines.append(
        Line(
            "per collective",
            f"{cost}, {slot} B",
            "—",
            None,
            f"{counts['collectives']} collectives, {counts['exchanges']} exchanges (one more: the "
            f"end of the step), {counts['channel_bytes']} B sent by each rank on the side channel; "
            f"time inside the watch on rank 0 {fmt_s(counts['watch_seconds'])} (waits for the "
            "slower rank included)",
            per_collective,
        )
    )
    row.notes.append(
        f"Median over {STEP_REPEATS} repeats of the slower rank's time; plain and watched steps "
        "alternate in one job, DETAIL runs in a second job (it must be set before the process "
        "group starts). "
        "The per-collective cost is (check_step − plain) / exchanges: the descriptor exchange, "
        "the dispatch mode on every op, the NaN scan and the report's gathers together."
    )
    return row


def _slower(records: list[dict], variant: str) -> float:
    """The median over repeats of the slower rank's seconds."""
    runs = zip(*(r["seconds"][variant] for r in records), strict=True)
    return median([max(run) for run in runs])
