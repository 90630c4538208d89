"""Which ranks are compared with which: groups of equal digests, the reference group, and the
pairs (reference, other group) every cross-rank check walks. Pure: no torch."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from fsdpcheck.records import Finding, Gathered, Group, RankRecord, ValueKeys

T = TypeVar("T")


def group_ranks(digests: Mapping[int, str], hosts: Mapping[int, str] | None = None) -> list[Group]:
    """Ranks with equal digests form one group; groups come lowest rank first."""
    members: dict[str, list[int]] = {}
    for rank in sorted(digests):
        members.setdefault(digests[rank], []).append(rank)
    hosts = hosts or {}
    return [
        Group(
            ranks=tuple(ranks),
            digest=digest,
            hosts=tuple(sorted({hosts[r] for r in ranks if r in hosts})),
        )
        for digest, ranks in members.items()  # insertion order is lowest rank first
    ]


def usable_groups(groups: Sequence[Group], records: Mapping[int, RankRecord]) -> list[Group]:
    """Groups whose representative has a record without an error, lowest rank first."""
    keep = [g for g in groups if g.ranks and _has_record(g, records)]
    return sorted(keep, key=lambda g: g.representative)


def reference_group(groups: Sequence[Group], records: Mapping[int, RankRecord]) -> Group | None:
    """The group holding rank 0, else the lowest usable group; ``None`` if none is usable."""
    usable = usable_groups(groups, records)
    for group in usable:
        if 0 in group.ranks:
            return group
    return usable[0] if usable else None


@dataclass(frozen=True)
class Pair:
    """The reference group and one other usable group, with their representatives' records."""

    reference: Group
    group: Group
    ref: RankRecord
    other: RankRecord

    @property
    def ref_rank(self) -> int:
        return self.reference.representative


def pairs(groups: Sequence[Group], records: Mapping[int, RankRecord]) -> Iterator[Pair]:
    """The reference against every other usable group, lowest rank first; none without one."""
    reference = reference_group(groups, records)
    if reference is None:
        return
    ref = records[reference.representative]
    for group in usable_groups(groups, records):
        if group is not reference:
            yield Pair(reference, group, ref, records[group.representative])


def own_findings(
    groups: Sequence[Group],
    records: Mapping[int, RankRecord],
    found: Callable[[RankRecord], T | None],
    finding: Callable[[Group, T], Finding],
) -> list[Finding]:
    """One finding per usable group whose representative's record holds something wrong in
    itself (``found``: falsy when nothing is), whatever the other groups hold."""
    findings = []
    for group in usable_groups(groups, records):
        problem = found(records[group.representative])
        if problem:
            findings.append(finding(group, problem))
    return findings


def _has_record(group: Group, records: Mapping[int, RankRecord]) -> bool:
    record = records.get(group.representative)
    return record is not None and record.error is None


def speakers(gathered: Gathered, reference: Group) -> list[tuple[tuple[int, ...], RankRecord]]:
    """Every record rank 0 holds but the reference's, each with the ranks it speaks for.

    A group's representative speaks for the ranks of its group with its value digest (values
    and devices of what must agree everywhere); a value sender (:class:`Gathered` ``extra``), for
    the ranks that also hold its local shards' digest. Records with an error are left out."""
    keys = gathered.value_keys or ValueKeys({})
    values, replicas, siblings = keys.values, keys.replicas, keys.siblings or {}
    extra = gathered.extra or {}

    def key(rank: int, fine: bool) -> tuple:
        coarse = (gathered.digests.get(rank), values.get(rank))
        return (*coarse, replicas.get(rank), siblings.get(rank)) if fine else coarse

    held = {**gathered.records, **extra}
    seen = set()
    out = []
    for rank in sorted(held):
        fine = rank in extra
        mine = key(rank, fine)
        if held[rank].error is not None or mine in seen:
            continue
        seen.add(mine)
        if mine == key(reference.representative, fine):
            continue
        ranks = tuple(r for r in sorted(gathered.digests) if key(r, fine) == mine)
        out.append((ranks, held[rank]))
    return out
