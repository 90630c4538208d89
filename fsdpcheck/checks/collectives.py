"""The collectives each rank issued, compared across ranks: the first one per process group where
ranks disagree (op, sizes, dtypes, or a rank that never issued it), named in the model's terms.

Pure functions over plain records (no torch, no files): ``fsdpcheck explain`` feeds them the
Flight Recorder dumps of a job that already hung or aborted. Collectives pair by process group
and sequence number (``collective_seq_id``), as the backends pair them, not by position in a
rank's buffer, so one rank's extra collective shows as exactly that.

Naming: a run of consecutive broadcasts is, in the bug class this project exists for, one
broadcast per buffer in each rank's own ``named_buffers()`` order, so the i-th broadcast of the run
is the i-th buffer of that rank's order (checked by size and dtype); an all-gather is the FSDP2
group whose padded shards add up to its size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from fsdpcheck.records import Finding, RankRecord, TensorRecord
from fsdpcheck.text import name_list, ranks_label
from fsdpcheck.vocab import Cause, FindingKind, Snapshot

DEFAULT_GROUP_DESC = "default_pg"

# Flight Recorder spells dtypes as c10 ScalarType names; fingerprints as torch does.
_DTYPES = {
    "Float": "float32",
    "Double": "float64",
    "Half": "float16",
    "BFloat16": "bfloat16",
    "Long": "int64",
    "Int": "int32",
    "Short": "int16",
    "Char": "int8",
    "Byte": "uint8",
    "Bool": "bool",
    "ComplexFloat": "complex64",
    "ComplexDouble": "complex128",
    "Float8_e4m3fn": "float8_e4m3fn",
    "Float8_e5m2": "float8_e5m2",
}
_GATHERS = ("all_gather", "_allgather_base", "_all_gather_base", "all_gather_into_tensor")


@dataclass(frozen=True)
class Collective:
    """One Flight Recorder entry: what one rank issued."""

    group: str  # the process group's name ("0": the default group)
    seq: int  # collective_seq_id within that group (1, 2, …)
    op: str  # "broadcast", "all_reduce", … (the backend prefix dropped)
    input_sizes: tuple[tuple[int, ...], ...] = ()
    input_dtypes: tuple[str, ...] = ()  # as fingerprints spell them ("float32")
    output_sizes: tuple[tuple[int, ...], ...] = ()
    group_desc: str = ""
    backend: str = ""  # "gloo", "nccl"
    record_id: int = 0
    where: str = ""  # the caller's file:line, when the dump has stack frames (pickle dumps)

    def signature(self) -> tuple:
        """What every rank must agree on for the backend to pair the collective correctly."""
        return (self.op, self.input_sizes, self.input_dtypes, self.output_sizes)

    def described(self) -> str:
        """``broadcast (16,) float32``."""
        sizes = ", ".join(_shape(s) for s in self.input_sizes) or "()"
        dtypes = "/".join(sorted(set(self.input_dtypes)))
        return f"{self.op} {sizes}" + (f" {dtypes}" if dtypes else "")


@dataclass(frozen=True)
class RankTrace:
    """One rank's dump: its collectives in the order it issued them."""

    rank: int
    collectives: tuple[Collective, ...]
    truncated: bool = False  # the ring buffer had dropped its oldest entries
    group_ranks: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # pg_config (NCCL)
    p2p: int = 0  # point-to-point entries, not compared


@dataclass(frozen=True)
class Divergence:
    """The first collective of one process group where the ranks disagree."""

    group: str
    group_desc: str
    seq: int
    reason: str  # "missing", "op", "size", "dtype", "same-size-pairing"
    issued: Mapping[int, Collective | None]  # per rank: what it issued there (None: nothing)
    last: Mapping[int, Collective | None]  # per rank: the last collective it issued in the group


@dataclass(frozen=True)
class Named:
    """What a rank's collective carried, in the model's terms."""

    names: tuple[str, ...]
    how: str  # "order": by position in the rank's named_buffers() run; "size": the only match


# ---------------------------------------------------------------- matching


def divergences(traces: Mapping[int, RankTrace]) -> list[Divergence]:
    """Per process group, the first sequence number where the member ranks disagree, in the order
    the groups first appear. Ranks whose buffers wrapped are compared from the first number every
    member still holds."""
    found = []
    for group, members in _groups(traces).items():
        by_rank = {r: _in_group(traces[r], group) for r in members}
        start = _first_common(traces, by_rank)
        if start is None:
            continue
        keys = sorted({k for entries in by_rank.values() for k in entries if k[0] >= start})
        for key in keys:
            issued = {r: by_rank[r].get(key) for r in members}
            reason = _disagreement(list(issued.values()))
            if reason is None:
                continue
            desc = next(c.group_desc for c in issued.values() if c is not None)
            last = {r: _last(by_rank[r]) for r in members}
            found.append(Divergence(group, desc, key[0], reason, issued, last))
            break
    return found


def _groups(traces: Mapping[int, RankTrace]) -> dict[str, tuple[int, ...]]:
    """Each group's member ranks among the dumps: as recorded (NCCL's pg_config), every rank for
    the default group, else the ranks that issued anything in it (gloo records no membership)."""
    seen: dict[str, set[int]] = {}
    desc: dict[str, str] = {}
    for rank, trace in sorted(traces.items()):
        for c in trace.collectives:
            seen.setdefault(c.group, set()).add(rank)
            desc.setdefault(c.group, c.group_desc)
    groups = {}
    for group, ranks in seen.items():
        recorded = {r for t in traces.values() for r in t.group_ranks.get(group, ())}
        if recorded:
            ranks = recorded & set(traces)
        elif desc[group] == DEFAULT_GROUP_DESC:
            ranks = set(traces)
        groups[group] = tuple(sorted(ranks))
    return {g: r for g, r in groups.items() if len(r) >= 2}


def _in_group(trace: RankTrace, group: str) -> dict[tuple[int, int], Collective]:
    """A rank's collectives in one group keyed by (seq, position): coalesced ops share a seq."""
    keyed: dict[tuple[int, int], Collective] = {}
    counts: dict[int, int] = {}
    for c in trace.collectives:
        if c.group == group:
            k = counts.get(c.seq, 0)
            counts[c.seq] = k + 1
            keyed[(c.seq, k)] = c
    return keyed


def _first_common(
    traces: Mapping[int, RankTrace], by_rank: Mapping[int, Mapping[tuple[int, int], Collective]]
) -> int | None:
    """The first sequence number every member still holds (``None``: a wrapped buffer hides the
    whole group on some rank)."""
    start = 0
    for rank, entries in by_rank.items():
        if traces[rank].truncated:
            if not entries:
                return None
            start = max(start, min(k[0] for k in entries))
    return start


def _disagreement(issued: Sequence[Collective | None]) -> str | None:
    if any(c is None for c in issued):
        return "missing"
    present = [c for c in issued if c is not None]
    for reason, part in (("op", 0), ("size", 1), ("dtype", 2), ("size", 3)):
        if len({c.signature()[part] for c in present}) > 1:
            return reason
    return None


def _last(entries: Mapping[tuple[int, int], Collective]) -> Collective | None:
    return entries[max(entries)] if entries else None


# ---------------------------------------------------------------- naming


def name_collective(
    trace: RankTrace, target: Collective, record: RankRecord | None, world: int
) -> Named | None:
    """The tensors behind ``target`` on ``trace``'s rank, from that rank's fingerprint."""
    if record is None:
        return None
    if target.op == "broadcast":
        return _name_broadcast(trace, target, record)
    if target.op in _GATHERS:
        return _name_gather(target, record, world)
    return None


def _name_broadcast(trace: RankTrace, target: Collective, record: RankRecord) -> Named | None:
    run, at = _broadcast_run(trace, target)
    buffers = _buffers(record)
    by_order = _aligned(run, at, buffers)
    if by_order is not None:
        return Named((by_order.name,), "order")
    matches = [t.name for t in (*buffers, *_params(record)) if _fits(target, t)]
    if len(matches) == 1:
        return Named(tuple(matches), "size")
    return None


def _broadcast_run(trace: RankTrace, target: Collective) -> tuple[list[Collective], int]:
    """The consecutive broadcasts of ``target``'s group around it, and its index there."""
    ordered = [c for c in trace.collectives if c.group == target.group]
    i = next(k for k, c in enumerate(ordered) if c is target)
    lo = i
    while lo > 0 and ordered[lo - 1].op == "broadcast":
        lo -= 1
    hi = i
    while hi + 1 < len(ordered) and ordered[hi + 1].op == "broadcast":
        hi += 1
    return ordered[lo : hi + 1], i - lo


def _aligned(
    run: Sequence[Collective], at: int, order: Sequence[TensorRecord]
) -> TensorRecord | None:
    """The tensor at ``run[at]`` when the run is the rank's tensor order, one broadcast each:
    the whole order inside the run (other broadcasts around it), or the run a window of the order
    (the dump cut it short). ``None`` unless exactly one alignment fits by size and dtype."""
    if not order:
        return None
    found = set()
    for offset in range(-(len(order) - 1), len(run)):
        # run[j] ↔ order[j - offset]; the overlap must hold ``at`` and be a whole side.
        lo, hi = max(0, offset), min(len(run), offset + len(order))
        if not (lo <= at < hi) or (hi - lo) not in (len(order), len(run)):
            continue
        if all(_fits(run[j], order[j - offset]) for j in range(lo, hi)):
            found.add(order[at - offset].name)
    if len(found) != 1:
        return None
    name = found.pop()
    return next(t for t in order if t.name == name)


def _fits(c: Collective, t: TensorRecord) -> bool:
    if len(c.input_sizes) != 1:
        return False
    numel = math.prod(c.input_sizes[0])
    return numel == t.numel and (not c.input_dtypes or c.input_dtypes[0] == t.dtype)


def _name_gather(target: Collective, record: RankRecord, world: int) -> Named | None:
    """The FSDP2 groups whose padded shards, flattened, are this all-gather's input."""
    plan = record.fsdp_plan
    fp = record.post_wrap or record.pre_wrap
    if plan is None or fp is None or len(target.input_sizes) != 1 or world < 1:
        return None
    params = {t.name: t for t in fp.params}
    numel = math.prod(target.input_sizes[0])
    fits = []
    for group in plan.groups:
        tensors = [params[n] for n in group.params if n in params]
        if tensors and sum(_shard_numel(t, world) for t in tensors) == numel:
            fits.append(", ".join(m or "<root>" for m in group.modules))
    if not fits:
        return None
    return Named(tuple(fits), "size")


def _shard_numel(t: TensorRecord, world: int) -> int:
    """FSDP2 pads dim 0 to a multiple of the world size; each rank sends one padded shard."""
    if not t.shape:
        return 1
    rows = -(-t.shape[0] // world)
    return rows * math.prod(t.shape[1:])


def _buffers(record: RankRecord) -> tuple[TensorRecord, ...]:
    fp = record.pre_wrap or record.post_wrap  # fully_shard does not reorder buffers
    return fp.buffers if fp is not None else ()


def _params(record: RankRecord) -> tuple[TensorRecord, ...]:
    fp = record.pre_wrap or record.post_wrap
    return fp.params if fp is not None else ()


# ---------------------------------------------------------------- findings


def collective_findings(
    traces: Mapping[int, RankTrace], records: Mapping[int, RankRecord] | None = None
) -> list[Finding]:
    """One ``collective`` finding per process group whose ranks diverged; with fingerprints
    (``records``, by rank), also a same-size pairing the sizes alone cannot show."""
    records = records or {}
    world = len(traces)
    first = divergences(traces)
    found = [_finding(d, traces, records, world) for d in first]
    diverged = {d.group for d in first}
    found.extend(
        _finding(d, traces, records, world)
        for d in same_size_pairings(traces, records)
        if d.group not in diverged
    )
    return found


def same_size_pairings(
    traces: Mapping[int, RankTrace], records: Mapping[int, RankRecord]
) -> list[Divergence]:
    """Broadcasts every rank agrees on by size that, read as each rank's own named_buffers()
    order, pair different buffers: what a same-size swap looks like to Flight Recorder."""
    if len([r for r in traces if r in records]) < 2:
        return []
    found = []
    for group, members in _groups(traces).items():
        if not all(r in records for r in members):
            continue
        by_rank = {r: _in_group(traces[r], group) for r in members}
        common = set.intersection(*(set(e) for e in by_rank.values()))
        for key in sorted(common):
            issued = {r: by_rank[r][key] for r in members}
            if any(c.op != "broadcast" for c in issued.values()):
                continue
            names = {r: _by_order(traces[r], c, records[r]) for r, c in issued.items()}
            if None in names.values() or len(set(names.values())) < 2:
                continue
            first = issued[members[0]]
            last = {r: _last(by_rank[r]) for r in members}
            found.append(
                Divergence(group, first.group_desc, key[0], "same-size-pairing", issued, last)
            )
            break
    return found


def _by_order(trace: RankTrace, c: Collective, record: RankRecord) -> str | None:
    run, at = _broadcast_run(trace, c)
    found = _aligned(run, at, _buffers(record))
    return found.name if found is not None else None


def _finding(
    d: Divergence,
    traces: Mapping[int, RankTrace],
    records: Mapping[int, RankRecord],
    world: int,
) -> Finding:
    members = sorted(d.issued)
    reference = 0 if 0 in d.issued else members[0]
    names = {
        r: name_collective(traces[r], c, records.get(r) or _any(records), world)
        for r, c in d.issued.items()
        if c is not None
    }
    ref_sig = _sig(d.issued[reference])
    ranks = tuple(r for r in members if r != reference and _sig(d.issued[r]) != ref_sig)
    if d.reason == "same-size-pairing":
        ranks = tuple(r for r in members if r != reference and names[r] != names[reference])
    tensors = tuple(dict.fromkeys(n for named in names.values() if named for n in named.names))
    return Finding(
        kind=FindingKind.COLLECTIVE,
        ranks=ranks,
        reference_rank=reference,
        snapshot=Snapshot.TRACE,
        cause=_cause(records),
        summary=_summary(d, names, reference),
        tensors=tensors,
        details={
            "group": d.group,
            "group_desc": d.group_desc,
            "seq": d.seq,
            "reason": d.reason,
            "issued": {str(r): _detail(c, names.get(r)) for r, c in sorted(d.issued.items())},
            "last": {str(r): _detail(c, None) for r, c in sorted(d.last.items())},
        },
    )


def _any(records: Mapping[int, RankRecord]) -> RankRecord | None:
    """Another rank's fingerprint: the same tensors (maybe in another order) name by size."""
    return records[min(records)] if records else None


def _sig(c: Collective | None) -> tuple | None:
    return c.signature() if c is not None else None


def _cause(records: Mapping[int, RankRecord]) -> Cause:
    """Construction time when the ranks' fingerprints already differ in their buffer order or
    layout; otherwise the ranks' own code or data."""
    digests = {
        fp.layout_digest()
        for r in records.values()
        if (fp := r.pre_wrap or r.post_wrap) is not None
    }
    return Cause.CONSTRUCTION_TIME if len(digests) > 1 else Cause.DIVERGENT


def _detail(c: Collective | None, named: Named | None) -> dict | None:
    if c is None:
        return None
    detail = {
        "op": c.op,
        "seq": c.seq,
        "input_sizes": [list(s) for s in c.input_sizes],
        "input_dtypes": list(c.input_dtypes),
        "output_sizes": [list(s) for s in c.output_sizes],
    }
    if c.where:
        detail["where"] = c.where
    if named is not None:
        detail["tensors"] = list(named.names)
        detail["named_by"] = named.how
    return detail


def _summary(d: Divergence, names: Mapping[int, Named | None], reference: int) -> str:
    where = f"as collective #{d.seq} of {_group_label(d)}"
    if d.reason == "missing":
        return _missing_summary(d, names, where)
    # The ranks that differ first, the reference last; ranks that issued the same read as one.
    order = sorted(d.issued, key=lambda r: (r == reference, r))
    said = [f"rank {r} {_what(c, names.get(r))}" for r in order if (c := d.issued[r]) is not None]
    clauses = " while ".join(dict.fromkeys(said))
    if d.reason == "same-size-pairing":
        return (
            f"{clauses}, {where}: the same size, so no error but silent corruption, if the "
            "loader walks each rank's named_buffers() order (the sizes fit it on every rank; "
            "Flight Recorder records sizes, not names)"
        )
    effect = {
        "size": (
            "the sizes differ, so gloo aborts a rank whose receive buffer is the smaller (and "
            "fills a larger one in front, silently), and NCCL blocks on the count mismatch"
        ),
        "dtype": "the dtypes differ: the bytes are reinterpreted, or the backend aborts",
        "op": "the operations differ: each rank waits for partners that are elsewhere",
    }[d.reason]
    return f"{clauses}, {where}: {effect}"


def _missing_summary(d: Divergence, names: Mapping[int, Named | None], where: str) -> str:
    issued = sorted(r for r, c in d.issued.items() if c is not None)
    absent = sorted(r for r, c in d.issued.items() if c is None)
    first = d.issued[issued[0]]
    assert first is not None
    lasts = []
    for r in absent:
        last = d.last.get(r)
        lasts.append(
            f"rank {r}'s last there: #{last.seq} {last.op}"
            if last is not None
            else f"rank {r} issued nothing there"
        )
    verb = "waits" if len(issued) == 1 else "wait"
    return (
        f"{ranks_label(issued)} {_what(first, names.get(issued[0]))} {where}, which "
        f"{ranks_label(absent)} never issued ({'; '.join(lasts)}): {ranks_label(issued)} {verb} "
        "in it until the timeout"
    )


def _what(c: Collective, named: Named | None) -> str:
    verb = {"broadcast": "broadcast"}.get(c.op, f"issued {c.op}")
    sizes = ", ".join(_shape(s) for s in c.input_sizes) or "()"
    dtype = "/".join(sorted(set(c.input_dtypes)))
    tail = f" {sizes}" + (f" {dtype}" if dtype else "")
    if named is not None:
        label = name_list([f"`{n}`" for n in named.names], limit=3)
        if c.op in _GATHERS:
            label = (
                f"FSDP group {label}" if len(named.names) == 1 else f"one of FSDP groups {label}"
            )
        tail = f" {label}{tail}"
    at = f" at {c.where}" if c.where else ""
    return f"{verb}{tail}{at}"


def _group_label(d: Divergence) -> str:
    if d.group_desc == DEFAULT_GROUP_DESC:
        return "the default process group"
    if d.group_desc and d.group_desc not in (d.group, "undefined"):
        return f"process group {d.group} ({d.group_desc})"
    return f"process group {d.group}"


def _shape(size: Sequence[int]) -> str:
    return "(" + ", ".join(str(s) for s in size) + ("," if len(size) == 1 else "") + ")"


def dtype_name(flight_recorder_dtype: str) -> str:
    """``Float`` → ``float32``; an unknown name is kept, lowercased."""
    return _DTYPES.get(flight_recorder_dtype, flight_recorder_dtype.lower())
