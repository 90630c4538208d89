"""``memory``: a rank that held about the full model in host memory where rank-0 loading was
asked, or far more than the other ranks (pure: per-rank memory records in, findings out).

What is compared is what a rank *held* for the model above what it held before: in the audit,
the peak of its build and wrap (and load) stages above the RSS its build started from, so that
imports and the interpreter (the same on every rank) stay out; from ``check_model``, which
cannot see where the script's build began, its process peak above its RSS at the check plus
the shards it holds at the check (after the load a rank holds its shards above its start; a
peak higher than that held more, and let it go)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from fsdpcheck.records import Finding, MemoryRecord
from fsdpcheck.text import ranks_label, size_label
from fsdpcheck.vocab import FindingKind, Stage

MIB = 2**20
# Below this a model never makes a finding: allocator noise and import-time differences are
# of this order, and a small model cannot stall a host.
FLOOR = 64 * MIB
# A rank > 0 of a rank-0 load "held the full model" when it held its own shards plus more than
# this share of the rest; "far above the others" is this share of the model above their median.
SHARE = 0.5
OUTLIER_FACTOR = 2.0  # ... and more than twice their median


def memory_findings(memory: Sequence[MemoryRecord], *, rank0_load: bool) -> list[Finding]:
    """``rank0_load``: the job loads rank 0's weights into every rank (``--init rank0``, a
    builder's rank-0 state dict, ``check_model(rank0_load=True)``), so a rank > 0 should never
    hold the full model. ``--init all`` materialises it on every rank by design: only a rank far
    above the others is found there. Rank 0 is never found: it may hold more by design (the
    full model under rank-0 loading, a script's logging and evaluation)."""
    by_rank = {m.rank: m for m in memory if held(m) is not None}
    full = max((m.model_bytes or 0 for m in by_rank.values()), default=0)
    if full < FLOOR:
        return []
    found: list[Finding] = []
    for rank, m in sorted(by_rank.items()):
        if rank == 0:
            continue
        finding = _held_full(m, by_rank.get(0), full) if rank0_load else None
        if finding is None:
            others = [o for r, o in by_rank.items() if r != rank and not (rank0_load and r == 0)]
            finding = _outlier(m, others, full)
        if finding is not None:
            found.append(finding)
    return found


def held(m: MemoryRecord, *, before_load: bool = False) -> int | None:
    """What the rank held for the model at its peak, in bytes (None: not measured).

    ``before_load``: the audit's build and wrap stages only. Its own load stages a rank's shards
    through a transfer buffer of up to a shard (at 2 ranks, shard and buffer make the model);
    a rank that built the full model shows it before any transfer."""
    if m.stages:
        peaks = [s.peak for s in m.stages if not (before_load and s.stage == Stage.LOAD)]
        return max(0, max(peaks, default=0) - m.stages[0].start)
    if m.process_peak is None or m.current is None:
        return None
    return max(0, m.process_peak - m.current) + (m.shard_bytes or 0)


def _held_full(m: MemoryRecord, reference: MemoryRecord | None, full: int) -> Finding | None:
    shard = min(full, m.shard_bytes or 0)
    gap = full - shard  # what holding its shards saves against holding the full model
    bytes_held = held(m, before_load=True)
    if gap < FLOOR or bytes_held is None:
        return None  # HSDP's replicate dim holds the whole model: never one
    above = bytes_held
    if m.stages:
        imports = _first_build_imports(reference, full)
        if imports is None:
            return None  # nothing to tell the build's imports from the model by
        # They land in its build stage: never more is taken off than that stage grew.
        above -= min(imports, _build_growth(m) or 0)
    if above < shard + SHARE * gap:
        return None
    when = "its build and wrap" if m.stages else "its process, at its peak,"
    summary = (
        f"rank {m.rank} held {size_label(bytes_held)} of host memory for a {size_label(full)} "
        f"model under rank-0 loading, where it should hold its shards ({size_label(shard)}): "
        f"{when} held about the full model"
    )
    details = _details(m, bytes_held, full, shard, "rank0-load")
    return Finding.about(FindingKind.MEMORY, (m.rank,), 0, summary, details=details)


def _build_growth(m: MemoryRecord) -> int | None:
    return next((s.growth for s in m.stages if s.stage == Stage.BUILD), None)


def _first_build_imports(reference: MemoryRecord | None, full: int) -> int | None:
    """What the audit's first build costs every rank besides the model, from rank 0's record
    (None: rank 0 has no build stage measured).

    The first build imports transformers and the model's module inside the ``build`` stage,
    alike on every rank: rank 0, which built the full model under rank-0 loading, grew by those
    and the model, so its build above ``full`` is theirs. Only rank 0's
    build is read, never its wrap: rank 0 keeps its state dict alive while FSDP copies its
    shards out (the full model plus every shard), where a rank > 0 that built the full model
    lets its weights go as they are sharded or only at the wrap's end, as its garbage
    collector happens to run (tests/workers/memory_worker.py, a 192 MiB model: rank 1's wrap
    peaked 224 or 288 MiB above its build's start, rank 0's 288 every time)."""
    if reference is None or not reference.stages:
        return None
    growth = _build_growth(reference)
    return None if growth is None else max(0, growth - full)


def _outlier(m: MemoryRecord, others: list[MemoryRecord], full: int) -> Finding | None:
    bytes_held = held(m)
    pool = [h for h in (held(o) for o in others) if h is not None]
    if bytes_held is None or not pool:
        return None
    median = int(statistics.median(pool))
    excess = bytes_held - median
    if bytes_held <= OUTLIER_FACTOR * median or excess < max(FLOOR, SHARE * full):
        return None
    label = ranks_label([o.rank for o in others])
    summary = (
        f"rank {m.rank} held {size_label(bytes_held)} of host memory for a {size_label(full)} "
        f"model, {size_label(excess)} above the median of {label} ({size_label(median)})"
    )
    details = {**_details(m, bytes_held, full, m.shard_bytes, "outlier"), "median": median}
    reference = min(o.rank for o in others)
    return Finding.about(FindingKind.MEMORY, (m.rank,), reference, summary, details=details)


def _details(m: MemoryRecord, bytes_held: int, full: int, shard: int | None, rule: str) -> dict:
    details = {
        "bytes": bytes_held,
        "model_bytes": full,
        "shard_bytes": shard,
        "method": m.method.value,
        "rule": rule,
    }
    if m.stages:
        details["stages"] = {s.stage.value: s.growth for s in m.stages}
    else:
        details["process_peak"], details["current"] = m.process_peak, m.current
    return details
