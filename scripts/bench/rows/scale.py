"""Scale, simulated: the gather, the layout check's slot exchange and failure diagnosis with up
to 256 lightweight ranks (threads on real gloo groups and a real TCPStore, no model)."""

from __future__ import annotations

import json

from bench.measure import loglog_slope, run_worker
from bench.result import Line, Row
from bench.settings import Settings, shown, worker
from bench.text import byte_size, fmt_ms, fmt_s

SLOPE_GOAL = 1.1  # rank 0's gather time grows at most linearly with the ranks
STORE_CALLS_PER_RANK = 8  # diagnosis: O(world) store calls in all
PAPER_WORLD = 4096  # the paper estimate's world size


def row_scale(s: Settings) -> Row:
    row = Row(
        "scale",
        "scale (simulated)",
        "`gather_records`, `exchange_slots` (the layout check's exchange) and failure diagnosis "
        "with many lightweight ranks: threads on real gloo groups and a real TCPStore, no model "
        f"({shown(worker('scale'))})",
    )
    gather_worlds = (2, 8, 64) if s.quick else (2, 8, 64, 256)
    slot_worlds = (2, 8) if s.quick else (2, 64, 256)
    diagnose_worlds = (64,) if s.quick else (64, 256)
    repeats = "3"
    gathered = {w: _scale("gather", "--world", str(w), "--repeats", repeats) for w in gather_worlds}
    slots = {w: _scale("slots", "--world", str(w), "--repeats", repeats) for w in slot_worlds}
    diagnosed = {w: _scale("diagnose", "--world", str(w)) for w in diagnose_worlds}
    row.raw = {"gather": gathered, "slots": slots, "diagnose": diagnosed}
    agree = {w: g["variants"]["agree"] for w, g in gathered.items()}
    divergent = {w: g["variants"]["one-divergent"] for w, g in gathered.items()}
    row.lines += _gather_lines(agree, divergent)
    exchanged = {w: g["variants"]["agree"] for w, g in slots.items()}
    row.lines.append(slot_line(exchanged, slots))
    row.lines += _diagnosis_lines(diagnosed)
    row.notes.append(
        "How: each rank is a thread with its own c10d world (torch's ThreadLocalWorld) and its "
        "own gloo group on one TCPStore, at most 32 ranks per process (a rank holds one socket "
        "per peer it talks to, and the slot exchange connects every pair: 65,280 sockets at 256 "
        "ranks, 8,160 per process). Bytes: the payload each rank hands to "
        "torch.distributed calls (a wrapper counts send, gather, broadcast and all_to_all_single"
        "), per rank; the gather row below also measures them at the socket, one process per "
        "rank. Times are rank 0's, from a barrier to the call's return, with up to 256 threads "
        "on 2 cores: scheduling, not the network, dominates."
    )
    row.notes.append(paper_estimate(agree, exchanged))
    return row


def _scale(*argv: str) -> dict:
    done = run_worker("scale", *argv, timeout=900)
    if done.returncode:
        raise RuntimeError(f"workers/scale.py {' '.join(argv)}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def per_peer(exchanged: dict[int, dict]) -> list[int]:
    """The slot exchange's measured bytes per peer: what a rank sends, over the other ranks."""
    return sorted({a["sent_max_other"] // (w - 1) for w, a in exchanged.items() if w > 1})


def _gather_lines(agree: dict[int, dict], divergent: dict[int, dict]) -> list[Line]:
    per_rank = sorted({a["sent_max_other"] for a in agree.values()})
    first, last = min(agree), max(agree)
    growth = agree[last]["rank0_seconds_median"] / max(agree[first]["rank0_seconds_median"], 1e-9)
    slope = loglog_slope({w: a["rank0_seconds_median"] for w, a in agree.items()})
    return [
        Line(
            "gather, all agree: bytes per rank (call site)",
            f"{per_rank} B",
            "constant",
            len(per_rank) == 1,
            "; ".join(
                f"{w} ranks: {a['sent_max_other']} B per rank, rank 0 {a['sent_rank0']} B, "
                f"rank 0 {fmt_ms(a['rank0_seconds_median'])}"
                for w, a in agree.items()
            ),
        ),
        Line(
            f"gather, all agree: rank-0 time {first} → {last} ranks",
            f"∝ ranks^{slope:.2f} ({growth:.0f}× for {last // first}× the ranks)"
            if slope is not None
            else "one world size only",
            f"linear (fitted exponent ≤ {SLOPE_GOAL})",
            slope <= SLOPE_GOAL if slope is not None else None,
            "; ".join(f"{w}: {fmt_ms(a['rank0_seconds_median'])}" for w, a in agree.items())
            + " (the exponent is the least-squares slope of log time over log ranks across all "
            "these world sizes, rather than the two ends alone: with up to 256 threads on this "
            "host's cores, scheduling moves any one size's median by tens of percent)",
            slope,
        ),
        Line(
            "gather, one divergent rank: bytes",
            f"{max(d['sent_max_other'] for d in divergent.values())} B max per rank",
            "—",
            None,
            "; ".join(
                f"{w} ranks: {d['groups']} groups, rank 0 {fmt_ms(d['rank0_seconds_median'])}"
                for w, d in divergent.items()
            )
            + " (the divergent rank also sends its full record)",
        ),
    ]


def slot_line(exchanged: dict[int, dict], slots: dict[int, dict]) -> Line:
    """Bytes per rank of the all_to_all; the slot size in words comes from what was measured."""
    peer = per_peer(exchanged)
    raw = sorted({g.get("slot_bytes") for g in slots.values()} - {None})
    padded = (
        f", the {byte_size(raw)} layout slot padded to whole 8-byte words on the wire"
        if raw and raw != peer
        else ""
    )
    return Line(
        "slot exchange (all_to_all): bytes per rank (call site)",
        ", ".join(f"{w}: {a['sent_max_other']} B" for w, a in exchanged.items()),
        "—",
        None,
        "; ".join(
            f"{w} ranks: rank 0 {fmt_ms(a['rank0_seconds_median'])}" for w, a in exchanged.items()
        )
        + f" ({byte_size(peer)} slots to each peer{padded}: {'/'.join(map(str, peer))} × "
        "(world − 1) per rank, by design)",
    )


def _diagnosis_lines(diagnosed: dict[int, dict]) -> list[Line]:
    return [
        Line(
            f"diagnosis after a failure, {w} ranks: store calls in all",
            f"{d['store_calls']} ({d['store_calls'] / w:.1f} per rank)",
            "O(world)",
            d["store_calls"] <= STORE_CALLS_PER_RANK * w and d["every_rank_names_the_dead_rank"],
            f"by kind {d['store_calls_by_kind']}; every live rank names the dead rank: "
            f"{d['every_rank_names_the_dead_rank']}; slowest rank "
            f"{fmt_s(d['slowest_rank_seconds'])} (three heartbeat intervals of "
            f"{d['heartbeat_interval']:g} s dominate)",
            float(d["store_calls"]),
        )
        for w, d in diagnosed.items()
    ]


def paper_estimate(agree: dict[int, dict], exchanged: dict[int, dict]) -> str:
    """To 4096 ranks from the measured per-rank figures (the slot sizes included)."""
    n = PAPER_WORLD
    slot = max(a["sent_max_other"] for a in agree.values())
    header = max(a["sent_rank0"] for a in agree.values())
    peer = max(per_peer(exchanged))
    return (
        f"Paper estimate to {n} ranks (from the figures above, per-rank costs measured, "
        f"rank-0 costs linear): all agreeing, every rank sends rank 0 one {slot}-byte "
        f"slot and receives rank 0's {header}-byte header (the broadcast is a tree: a rank "
        f"forwards it to at most log2({n}) = {n.bit_length() - 1} children); rank 0 receives "
        f"{n} × {slot} B = {round(n * slot / 1024)} KiB and parses {n} slots (about 1 µs each), "
        "so the gather "
        f"stays far below a second. The layout check's all_to_all costs each rank {peer} × "
        f"{n - 1} B = {round(peer * (n - 1) / 1024)} KiB and {n - 1} messages: tolerable, but "
        "the one place that grows with world size per rank. Diagnosis after a failure: one "
        f"rank reads 2 × {n} heartbeat counters and {n} stage marks (two `multi_get` calls "
        "each when every key exists, else one call per key: about 16k calls, a few seconds at "
        f"~0.1 ms a call) and waits three heartbeat intervals ({n} / 512 = {n // 512} s each, "
        f"{3 * n // 512} s); every other rank makes three calls (an `add`, a `wait`, a `get`): "
        f"about 30k calls in all, where every rank reading every rank's keys made {n}² × 4 = "
        f"{n * n * 4 // 10**6}M."
    )
