"""``tie``: parameters that must share storage and do not, or ranks that tie different names.

Each rank records, per stage, the groups of parameter names that are one tensor and the ties its
config asks for (:class:`TieRecord`). Ties are part of the group digest, so ranks that tie alike
share a group and one record speaks for them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fsdpcheck.checks.groups import reference_group, usable_groups
from fsdpcheck.records import Finding, Group, RankRecord, TieRecord
from fsdpcheck.text import name_list, ranks_label
from fsdpcheck.vocab import Cause, FindingKind, Snapshot

_CAUSE = {
    Snapshot.PRE_WRAP: Cause.CONSTRUCTION_TIME,
    Snapshot.POST_WRAP: Cause.WRAPPING,
    Snapshot.LOAD: Cause.LOADING,
}


def _cause(stage: str, ties: Sequence[TieRecord]) -> Cause:
    if stage == Snapshot.POST_WRAP and not any(t.snapshot == Snapshot.PRE_WRAP for t in ties):
        return Cause.UNKNOWN  # no pre-wrap record to tell construction (or a loader) from wrapping
    return _CAUSE.get(stage, Cause.UNKNOWN)


def missing_ties(tie: TieRecord) -> list[tuple[str, str]]:
    """Expected (tied, source) pairs that are separate tensors on this rank."""
    together = {name: shared for shared in tie.shared for name in shared}
    return [(t, s) for t, s in tie.expected if s not in together.get(t, ())]


def tie_findings(groups: Sequence[Group], records: Mapping[int, RankRecord]) -> list[Finding]:
    """Per group: the first stage where a configured tie is missing; failing that, the first
    stage where its ties differ from the reference group's."""
    reference = reference_group(groups, records)
    if reference is None:
        return []
    ref = {t.snapshot: t for t in records[reference.representative].ties}
    findings = []
    for group in usable_groups(groups, records):
        ties = records[group.representative].ties
        finding = _missing(group, ties)
        if finding is None and group is not reference:
            finding = _different(group, ties, ref, reference.representative)
        if finding is not None:
            findings.append(finding)
    return findings


def _missing(group: Group, ties: Sequence[TieRecord]) -> Finding | None:
    for tie in ties:
        missing = missing_ties(tie)
        if missing:
            who = ranks_label(group.ranks)
            pairs = name_list([f"{t} and {s}" for t, s in missing], 3)
            return Finding(
                kind=FindingKind.TIE,
                ranks=tuple(group.ranks),
                reference_rank=group.representative,
                snapshot=tie.snapshot,
                cause=_cause(tie.snapshot, ties),
                summary=f"tied weights differ from the config on {who} ({tie.snapshot}): {pairs}"
                " are separate tensors, but the config ties them (tie_word_embeddings / "
                "_tied_weights_keys): they drift apart from the first optimizer step",
                tensors=tuple(dict.fromkeys(n for pair in missing for n in pair)),
                details={
                    "missing": [list(p) for p in missing],
                    "shared": [list(s) for s in tie.shared],
                    "expected": [list(p) for p in tie.expected],
                },
            )
    return None


def _different(
    group: Group, ties: Sequence[TieRecord], ref: Mapping[str, TieRecord], ref_rank: int
) -> Finding | None:
    for tie in ties:
        theirs = ref.get(tie.snapshot)
        if theirs is None:
            continue
        if set(theirs.shared) != set(tie.shared):
            return _one_sided(group, ties, tie, ref_rank, (theirs.shared, tie.shared), _WEIGHTS)
        # Buffers that share storage (with a buffer or a parameter) on one side only: a buffer
        # that is a view on one rank and a copy on another sees writes there only.
        if set(theirs.buffers) != set(tie.buffers):
            return _one_sided(group, ties, tie, ref_rank, (theirs.buffers, tie.buffers), _BUFFERS)
    return None


@dataclass(frozen=True)
class _Sharing:
    """How a finding words one kind of sharing: weights tied, or buffers sharing storage."""

    what: str  # "tied weights"
    one: str  # the verb after "only rank 0"
    many: str  # the verb after "only ranks 1-3"
    suffix: str  # after the ranks' sets, the consequence
    key: str  # after "only_reference" and "only_other" in the details


_WEIGHTS = _Sharing("tied weights", "ties", "tie", "", "")
_BUFFERS = _Sharing(
    "tied buffers",
    "shares storage between",
    "share storage between",
    ": a write through one is seen through the others on one side only",
    "_buffers",
)


def _one_sided(
    group: Group,
    ties: Sequence[TieRecord],
    tie: TieRecord,
    ref_rank: int,
    sets: tuple[Sequence[Sequence[str]], Sequence[Sequence[str]]],
    sharing: _Sharing,
) -> Finding:
    """The sets of names that share storage on the reference only, and on ``group`` only."""
    ref_sets, other_sets = (set(map(tuple, side)) for side in sets)
    only_ref, only_other = sorted(ref_sets - other_sets), sorted(other_sets - ref_sets)
    who = ranks_label(group.ranks)
    parts = []
    if only_ref:
        parts.append(f"only rank {ref_rank} {sharing.one} {_sets_text(only_ref)}")
    if only_other:
        parts.append(f"only {who} {sharing.many} {_sets_text(only_other)}")
    return Finding(
        kind=FindingKind.TIE,
        ranks=tuple(group.ranks),
        reference_rank=ref_rank,
        snapshot=tie.snapshot,
        cause=_cause(tie.snapshot, ties),
        summary=f"{sharing.what} differ on {who} from rank {ref_rank}'s ({tie.snapshot}): "
        + "; ".join(parts)
        + sharing.suffix,
        tensors=tuple(dict.fromkeys(n for s in (*only_ref, *only_other) for n in s)),
        details={
            f"only_reference{sharing.key}": [list(s) for s in only_ref],
            f"only_other{sharing.key}": [list(s) for s in only_other],
        },
    )


def _sets_text(sets: Sequence[Sequence[str]]) -> str:
    return "; ".join(", ".join(s) for s in sets)
