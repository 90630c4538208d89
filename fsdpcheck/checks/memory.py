"""``memory``: a rank that held about the full model in host memory where rank-0 loading was
asked, or far more than the other ranks (pure: per-rank memory records in, findings out).

What is compared is what the build, wrap and load added above the RSS the build started from
(imports and the interpreter cost every rank alike); from ``check_model``, which cannot see
where the script's stages began, each rank's process peak against the other ranks' (rank 0's
under rank-0 loading, where it held the full model and the others about their shards)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from fsdpcheck.records import Finding, MemoryRecord
from fsdpcheck.text import ranks_label
from fsdpcheck.vocab import Cause, FindingKind, MemoryPeak, Snapshot

MIB = 2**20
# Below this a model never makes a finding: allocator noise and import-time differences are
# of this order, and a small model cannot stall a host.
FLOOR = 64 * MIB
# A rank > 0 of a rank-0 load "held the full model" when it held more than its own shard plus
# this share of the rest: about the full model, with room for a transfer bucket.
SHARE = 0.5
OUTLIER_FACTOR = 2.0  # "far above the other ranks": more than twice their median growth ...


def memory_findings(memory: Sequence[MemoryRecord], *, rank0_load: bool) -> list[Finding]:
    """``rank0_load``: the job loads rank 0's weights into every rank (``--init rank0``, a
    builder's rank-0 state dict, ``check_model(rank0_load=True)``), so a rank > 0 should never
    hold the full model. ``--init all`` materialises it on every rank by design: only a rank far
    above the others is found there."""
    by_rank = {m.rank: m for m in memory if _measured(m)}
    full = max((m.model_bytes or 0 for m in by_rank.values()), default=0)
    if full < FLOOR:
        return []
    found: list[Finding] = []
    named: set[int] = set()
    if rank0_load and 0 in by_rank:
        for rank, m in sorted(by_rank.items()):
            finding = _held_full(m, by_rank[0], full) if rank else None
            if finding is not None:
                found.append(finding)
                named.add(rank)
    for rank, m in sorted(by_rank.items()):
        if rank in named or (rank0_load and rank == 0):  # rank 0 holds the full model there
            continue
        others = [o for r, o in by_rank.items() if r != rank and not (rank0_load and r == 0)]
        finding = _outlier(m, others, full)
        if finding is not None:
            found.append(finding)
    return found


def _measured(m: MemoryRecord) -> bool:
    return m.growth() is not None or m.process_peak is not None


def _expected_gap(m: MemoryRecord, full: int) -> int:
    """What a rank > 0 of a rank-0 load saves against holding the full model: the model less
    its own shards (nothing where it holds a whole replica, as HSDP's replicate dim does)."""
    shard = m.shard_bytes if m.shard_bytes is not None else 0
    return max(0, full - shard)


def _held_full(m: MemoryRecord, reference: MemoryRecord, full: int) -> Finding | None:
    gap = _expected_gap(m, full)
    if gap < FLOOR:  # its shard is about the model: holding it all is no waste
        return None
    shard = full - gap
    growth = m.growth()
    if growth is not None:
        if growth < shard + SHARE * gap:
            return None
        held = growth
        how = f"its build, wrap and load added {_size(growth)} to its host memory"
        details = {"bytes": growth, "stages": _stage_growth(m)}
    else:
        if reference.process_peak is None or m.process_peak is None:
            return None
        below = reference.process_peak - m.process_peak
        if below > SHARE * gap:
            return None
        held = full - max(0, below) + shard  # rank 0's peak taken as the full model + a shard
        where = f"only {_size(below)} below" if below >= 0 else "above"
        how = (
            f"its host memory peaked at {_size(m.process_peak)}, {where} rank 0's "
            f"{_size(reference.process_peak)}, where a rank > 0 sits about {_size(gap)} lower"
        )
        details = {
            "bytes": m.process_peak,
            "reference_peak": reference.process_peak,
            "below_reference": below,
        }
    return Finding(
        kind=FindingKind.MEMORY,
        ranks=(m.rank,),
        reference_rank=0,
        snapshot=Snapshot.LOAD,
        cause=Cause.LOADING,
        summary=(
            f"rank {m.rank} held about the full model ({_size(full)}) under rank-0 loading, "
            f"where it should hold its shards ({_size(shard)}): {how}"
        ),
        details={
            **details,
            "held": held,
            "model_bytes": full,
            "shard_bytes": shard,
            "method": m.method.value,
            "rule": "rank0-load",
        },
    )


def _outlier(m: MemoryRecord, others: list[MemoryRecord], full: int) -> Finding | None:
    growth = m.growth()
    if growth is not None:
        pool = [g for g in (o.growth() for o in others) if g is not None]
        what = "growth over build, wrap and load"
    else:
        growth = m.process_peak
        pool = [o.process_peak for o in others if o.process_peak is not None]
        what = "process peak"
    if growth is None or not pool:
        return None
    median = int(statistics.median(pool))
    excess = growth - median
    # Growth doubles the others' (stages: both start from the same imports); the excess, in
    # bytes, is half a model at least, and never less than the floor.
    doubled = m.method == MemoryPeak.PROCESS or growth > OUTLIER_FACTOR * median
    if not doubled or excess < max(FLOOR, SHARE * full):
        return None
    label = ranks_label([o.rank for o in others])
    return Finding(
        kind=FindingKind.MEMORY,
        ranks=(m.rank,),
        reference_rank=min(o.rank for o in others),
        snapshot=Snapshot.LOAD,
        cause=Cause.LOADING,
        summary=(
            f"rank {m.rank}'s host memory {what} was {_size(growth)}, {_size(excess)} above "
            f"the median of {label} ({_size(median)}); the model is {_size(full)}"
        ),
        details={
            "bytes": growth,
            "median_others": median,
            "model_bytes": full,
            "method": m.method.value,
            "rule": "outlier",
            **({"stages": _stage_growth(m)} if m.stages else {}),
        },
    )


def _stage_growth(m: MemoryRecord) -> dict[str, int]:
    return {s.stage.value: s.growth for s in m.stages}


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / MIB:.0f} MiB"
