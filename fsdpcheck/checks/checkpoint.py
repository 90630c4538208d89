"""``checkpoint``: every rank must resume from the same checkpoint.

A ``LATEST`` file stale on one node, an ``exists()`` that disagrees on NFS, node-local shards
that were moved: the ranks then load different steps or different saves, every collective
still matches, and training diverges in silence. Each rank records what it resolved and read
(:class:`fsdpcheck.records.CheckpointRecord`); this check names the ranks whose resolved path,
step, ``.metadata`` digest or shard files differ from the reference's, and every rank that
could not read its own. Pure: records in, one finding out.

How many ranks saved the checkpoint is compared too (a shard file missing on one node), but a
job resuming on another world size than the one that saved is no finding: DCP reshards on
load, and elastic jobs resume that way. :func:`resharded_note` says it in the report's
warnings instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fsdpcheck.checks.groups import reference_group, usable_groups
from fsdpcheck.records import CheckpointRecord, Finding, Group, RankRecord
from fsdpcheck.text import ranks_label
from fsdpcheck.vocab import FindingKind

# What must agree, in the order a person reads it.
COMPARED = ("path", "step", "metadata", "shard_files", "saved_ranks", "problem")
_LISTED = 3


def checkpoint_findings(
    groups: Sequence[Group], records: Mapping[int, RankRecord]
) -> list[Finding]:
    """At most one finding: the ranks whose checkpoint differs from the reference group's (or
    that recorded none while it did), and the ranks that could not read theirs."""
    reference = reference_group(groups, records)
    if reference is None:
        return []
    ref = records[reference.representative].checkpoint
    ref_rank = reference.representative
    differing: list[dict[str, Any]] = []
    unreadable: list[int] = []
    if ref is not None and ref.problem is not None:
        unreadable.extend(reference.ranks)
    for group in usable_groups(groups, records):
        if group is reference:
            continue
        other = records[group.representative].checkpoint
        if other is None and ref is None:
            continue
        fields = _differences(ref, other)
        if other is not None and other.problem is not None:
            unreadable.extend(group.ranks)
        if fields:
            differing.append({"ranks": list(group.ranks), "differences": fields})
    if not differing and not unreadable:
        return []
    ranks = sorted({*unreadable, *(r for d in differing for r in d["ranks"])})
    text = _summary(ref_rank, ref, differing, unreadable, records, groups)
    summary = f"{FindingKind.CHECKPOINT.phrase}: {text}"
    details = {"reference": _view(ref), "groups": differing, "unreadable": sorted(set(unreadable))}
    return [Finding.about(FindingKind.CHECKPOINT, ranks, ref_rank, summary, details=details)]


def _differences(
    ref: CheckpointRecord | None, other: CheckpointRecord | None
) -> list[dict[str, Any]]:
    if ref is None or other is None:
        return [{"field": "checkpoint", "reference": _view(ref), "other": _view(other)}]
    return [
        {"field": name, "reference": getattr(ref, name), "other": getattr(other, name)}
        for name in COMPARED
        if getattr(ref, name) != getattr(other, name)
    ]


def _view(record: CheckpointRecord | None) -> dict[str, Any] | None:
    if record is None:
        return None
    return {name: getattr(record, name) for name in ("given", *COMPARED, "index")}


def _summary(
    ref_rank: int,
    ref: CheckpointRecord | None,
    differing: list[dict[str, Any]],
    unreadable: list[int],
    records: Mapping[int, RankRecord],
    groups: Sequence[Group],
) -> str:
    parts = [
        f"{ranks_label(ranks)} cannot read its checkpoint ({problem})"
        for ranks, problem in _problems(unreadable, records, groups)
    ]
    for entry in differing[:_LISTED]:
        fields = [d["field"] for d in entry["differences"] if d["field"] != "problem"]
        if not fields:
            continue
        other = records[entry["ranks"][0]].checkpoint
        parts.append(
            f"{ranks_label(entry['ranks'])} resumed from {_where(other)} but rank {ref_rank} "
            f"from {_where(ref)} (they differ in {', '.join(fields)})"
        )
    if len(differing) > _LISTED:
        parts.append(f"and {len(differing) - _LISTED} more groups")
    return "; ".join(parts) + ": the ranks train from different states and diverge silently"


def _where(record: CheckpointRecord | None) -> str:
    if record is None:
        return "no recorded checkpoint"
    said = [f"step {record.step}"] if record.step is not None else []
    if record.metadata is not None:
        said.append(f"{record.index or '.metadata'} {record.metadata[:12]}")  # what it digests
    where = record.path or record.given
    return f"{where} ({', '.join(said)})" if said else where


def _problems(
    ranks: list[int], records: Mapping[int, RankRecord], groups: Sequence[Group]
) -> list[tuple[tuple[int, ...], str]]:
    found = []
    for group in groups:
        record = records.get(group.representative)
        if record is None or record.checkpoint is None or group.representative not in ranks:
            continue
        found.append((group.ranks, record.checkpoint.problem or ""))
    return found


def resharded_note(records: Mapping[int, RankRecord], world_size: int) -> tuple[str, ...]:
    """A warning when the checkpoint was saved by another number of ranks than this job has
    (DCP reshards on load: expected for an elastic resume, worth a look otherwise)."""
    saved = {
        r.checkpoint.saved_ranks
        for r in records.values()
        if r.checkpoint is not None and r.checkpoint.saved_ranks is not None
    }
    if len(saved) != 1 or world_size in saved:
        return ()
    [count] = saved
    return (
        f"the resume checkpoint was saved by {count} rank{'s' if count != 1 else ''}, this job "
        f"has {world_size}: DCP reshards on load (expected for an elastic resume; otherwise "
        "check that this is the checkpoint you meant)",
    )
