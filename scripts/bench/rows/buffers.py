"""Buffer broadcast: one broadcast per buffer vs ``broadcast_buffers`` vs the flat broadcast."""

from __future__ import annotations

from bench.measure import marked, median, require, run_ranks, spans_to_seconds
from bench.result import Line, Row
from bench.settings import Settings, worker
from bench.text import fmt_ms
from fsdpcheck.children.launch import usable_cores  # torch-free

BUFFERS = 200  # what workers/buffers.py builds
GOAL_VS_FLAT = 1.5  # validated / flat broadcast alone
GOAL_VS_PER_BUFFER = 5  # per-buffer / validated


def row_buffers(s: Settings) -> Row:
    row = Row(
        "buffers",
        "buffer broadcast",
        f"{BUFFERS} non-persistent buffers: one broadcast each vs `broadcast_buffers` "
        "(validated, coalesced)",
    )
    repeats = 5 if s.quick else 30
    # Several launches: a launch's processes can land badly on the cores for all its repeats.
    launches = 1 if s.quick else 3
    for world in (2, 4):
        times: dict[str, list[float]] = {}
        ratios = []
        for _ in range(launches):
            argv = [worker("buffers"), "--buffers", str(BUFFERS), "--repeats", str(repeats)]
            result = run_ranks(argv, world)
            require(result, [0] * world, f"buffers on {world} ranks")
            records = marked(result, "@bench ")
            assert all(r["equal_to_rank0"] for r in records), "buffers differ from rank 0's"
            launch_times = spans_to_seconds(records)
            ratios.append(median(launch_times["per-buffer"]) / median(launch_times["coalesced"]))
            for method, spans in launch_times.items():
                times.setdefault(method, []).extend(spans)
        row.raw[f"{world} ranks"] = {
            "times": times,
            "ratios_per_launch": ratios,
            "collectives": records[0]["collectives"],
            "inline": records[0]["inline"],
        }
        _add_world(row, world, times, ratios, records[0], launches, repeats)
    return row


def _add_world(
    row: Row,
    world: int,
    times: dict[str, list[float]],
    ratios: list[float],
    first: dict,
    launches: int,
    repeats: int,
) -> None:
    """The lines of ``world`` ranks, and the note that explains a validated path over 1.5×."""
    collectives = first["collectives"]["coalesced"]
    per, coalesced, flat, described, exchanged = (
        median(times[k]) for k in ("per-buffer", "coalesced", "flat-only", "describe", "exchange")
    )
    ratio = median(ratios)
    how = (
        "the layout check, the values riding with it"
        if first["inline"]
        else "the layout check + one flat broadcast per dtype"
    )
    row.lines.append(
        Line(
            f"{world} ranks: validated / flat broadcast alone",
            f"{coalesced / flat:.2f}×",
            f"≤ {GOAL_VS_FLAT}×",
            coalesced / flat <= GOAL_VS_FLAT,
            f"broadcast_buffers {fmt_ms(coalesced)}, flat broadcast alone {fmt_ms(flat)}",
            coalesced / flat,
        )
    )
    row.lines.append(
        Line(
            f"{world} ranks: per-buffer / validated",
            f"{ratio:.1f}×",
            f"≥ {GOAL_VS_PER_BUFFER}×",
            ratio >= GOAL_VS_PER_BUFFER,
            f"per-buffer {fmt_ms(per)} ({BUFFERS} collectives), broadcast_buffers "
            f"{fmt_ms(coalesced)} ({collectives}: {how}), flat broadcast alone {fmt_ms(flat)} "
            f"({per / flat:.1f}×); the median of {launches} "
            f"launch{'es' if launches > 1 else ''} of {repeats} repeats each, "
            f"{min(ratios):.1f}× to {max(ratios):.1f}×",
            ratio,
        )
    )
    if coalesced / flat <= GOAL_VS_FLAT:
        return
    check = coalesced - flat
    crowded = (
        f" With {world} ranks on {usable_cores()} cores every collective also waits for "
        "processes to be scheduled."
        if world > usable_cores()
        else ""
    )
    cost = (
        f"the safety check costs {fmt_ms(check)} here (the difference to the flat broadcast alone)"
        if check > 0.05e-3
        else "the safety check is within the noise of the flat broadcast alone here"
    )
    row.notes.append(
        f"{world} ranks: validated over {GOAL_VS_FLAT}× the flat broadcast alone. "
        f"`broadcast_buffers` makes {collectives} "
        f"collective(s) ({how}), the unvalidated flat broadcast one; {cost}. Its parts, "
        f"measured alone in the same launches: describing and digesting the {BUFFERS} buffers "
        f"{fmt_ms(described)} (every rank at once, no collective: a walk of the module "
        "tree, a (name, shape, dtype) per buffer, sorted, and a blake2b of the names, "
        "shapes and dtypes), and the check's round (`wire.span`: the digests' minima and "
        f"maxima up a tree, rank 0's packed values down it) {fmt_ms(exchanged)} where the flat "
        f"broadcast with its packing and unpacking takes {fmt_ms(flat)} (the messages are "
        "fixed-size, so the values travel padded to the inline capacity: a rank whose "
        "layout differs must still receive exactly what was sent, or gloo aborts). "
        "Profiled (cProfile, this script's model): what is left is Python work per "
        "buffer and torch's per-call overhead. The flat broadcast alone is "
        f"{per / flat:.1f}× faster than one broadcast per buffer in this run "
        f"({fmt_ms(per / BUFFERS)} per collective). The check is the floor of the validated "
        f"path: without it a rank with a different buffer set hangs or is silently "
        f"corrupted.{crowded}"
    )
