"""Gather bytes on the wire: what ``gather_records`` sends, one process per rank, at the socket
and at the call site, all ranks agreeing and one divergent."""

from __future__ import annotations

from collections.abc import Iterable

from bench.measure import marked, median, require, run_ranks
from bench.result import Line, Row
from bench.settings import Settings, shown, worker
from bench.text import byte_size, fmt_ms


def row_gather(s: Settings) -> Row:
    row = Row(
        "gather",
        "gather bytes on the wire",
        "`gather_records`, one process per rank (no model: a synthetic record of 64 buffers and "
        "256 parameters): bytes each rank sent, measured at the socket and at the call site, "
        "all agreeing vs one divergent",
    )
    worlds = (2, 4) if s.quick else (2, 4, 8)
    repeats = 3 if s.quick else 10
    per_rank_agree, header = {}, {}
    for world in worlds:
        result = run_ranks([worker("gather"), "--repeats", str(repeats)], world)
        require(result, [0] * world, f"gather on {world} ranks")
        records = sorted(marked(result, "@bench "), key=lambda r: r["rank"])
        row.raw[f"{world} ranks"] = records
        for variant in ("agree", "one-divergent"):
            socket_bytes = [max(r["results"][variant]["socket_bytes"]) for r in records]
            call_bytes = [max(r["results"][variant]["call_bytes"]) for r in records]
            wall = median(records[0]["results"][variant]["seconds"])
            groups = records[0]["results"][variant]["groups"]
            if variant == "agree":
                per_rank_agree[world], header[world] = max(call_bytes[1:]), call_bytes[0]
            row.lines.append(
                Line(
                    f"{world} ranks, {variant}",
                    f"{max(socket_bytes[1:])} B max per rank at the socket",
                    "—",
                    None,
                    f"at the socket (headers included) per rank {socket_bytes}; at the call "
                    f"site {call_bytes}; {groups} group(s) at rank 0; rank 0 {fmt_ms(wall)}",
                    float(max(socket_bytes[1:])),
                )
            )
    constant = len(set(per_rank_agree.values())) == 1
    row.lines.append(
        Line(
            "payload per rank, all agreeing, across world sizes",
            f"{'constant' if constant else 'varies'}: {sorted(set(per_rank_agree.values()))} B",
            "constant",
            constant,
            ", ".join(f"{w} ranks: {b} B" for w, b in per_rank_agree.items()),
        )
    )
    slot, head = byte_size(per_rank_agree.values()), byte_size(header.values())
    row.notes.append(
        "At the socket: the growth of each rank process's `wchar` (/proc/self/io) over one "
        "`gather_records` call: every byte gloo wrote with writev, its message headers "
        f"included (so a few hundred bytes where the payload is one {slot} slot). At the call "
        "site: the "
        f"payload handed to torch.distributed ({shown(worker('scale'))}'s wrapper). When all "
        f"agree each rank sends rank 0 one {slot} slot (digest, host, flags, value digest, "
        f"shard key, replica digest: {slot_design_text(per_rank_agree.values())}) and receives "
        f"rank 0's {head} header; gloo's broadcast is a tree, so a rank also forwards that header "
        "to its children (the socket figures). The divergent rank also sends its full record. "
        "Rank 0's figure at the call site is the header it broadcasts."
    )
    return row


def slot_design_text(measured: Iterable[int]) -> str:
    """How the measured slot compares with the size the gather's code declares."""
    from fsdpcheck.distributed.gather import SLOT_BYTES  # imports torch: only when the row runs

    sizes = set(measured)
    if sizes == {SLOT_BYTES}:
        return f"`SLOT_BYTES` = {SLOT_BYTES} in fsdpcheck/distributed/gather.py"
    return f"measured, where fsdpcheck/distributed/gather.py declares `SLOT_BYTES` = {SLOT_BYTES}"
