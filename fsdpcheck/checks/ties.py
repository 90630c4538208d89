"""``tie``: parameters that must share storage and do not, or ranks that tie different names.

Each rank records, per stage, the groups of parameter names that are one tensor and the ties its
config asks for (:class:`TieRecord`). Ties are part of the group digest, so ranks that tie alike
share a group and one record speaks for them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from fsdpcheck.checks.groups import reference_group, usable_groups
from fsdpcheck.records import Finding, Group, RankRecord, TieRecord
from fsdpcheck.text import ranks_label
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
            pairs = ", ".join(f"{t} and {s}" for t, s in missing[:3])
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            return Finding(
                kind=FindingKind.TIE,
                ranks=tuple(group.ranks),
                reference_rank=group.representative,
                snapshot=tie.snapshot,
                cause=_cause(tie.snapshot, ties),
                summary=f"tied weights differ from the config on {who} ({tie.snapshot}): {pairs}"
                f"{more} are separate tensors, but the config ties them (tie_word_embeddings / "
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
        if set(theirs.shared) == set(tie.shared):
            found = _different_buffers(group, ties, tie, theirs, ref_rank)
            if found is not None:
                return found
            continue
        only_ref = sorted(set(theirs.shared) - set(tie.shared))
        only_other = sorted(set(tie.shared) - set(theirs.shared))
        who = ranks_label(group.ranks)
        parts = []
        if only_ref:
            parts.append(f"only rank {ref_rank} ties {'; '.join(', '.join(s) for s in only_ref)}")
        if only_other:
            parts.append(f"only {who} tie {'; '.join(', '.join(s) for s in only_other)}")
        return Finding(
            kind=FindingKind.TIE,
            ranks=tuple(group.ranks),
            reference_rank=ref_rank,
            snapshot=tie.snapshot,
            cause=_cause(tie.snapshot, ties),
            summary=f"tied weights differ on {who} from rank {ref_rank}'s ({tie.snapshot}): "
            + "; ".join(parts),
            tensors=tuple(dict.fromkeys(n for s in (*only_ref, *only_other) for n in s)),
            details={
                "only_reference": [list(s) for s in only_ref],
                "only_other": [list(s) for s in only_other],
            },
        )
    return None


def _different_buffers(
    group: Group, ties: Sequence[TieRecord], tie: TieRecord, theirs: TieRecord, ref_rank: int
) -> Finding | None:
    """Buffers that share storage (with a buffer or a parameter) on one side only: a buffer
    that is a view on one rank and a copy on another sees writes there only."""
    if set(theirs.buffers) == set(tie.buffers):
        return None
    only_ref = sorted(set(theirs.buffers) - set(tie.buffers))
    only_other = sorted(set(tie.buffers) - set(theirs.buffers))
    who = ranks_label(group.ranks)
    parts = []
    if only_ref:
        shown = "; ".join(", ".join(s) for s in only_ref)
        parts.append(f"only rank {ref_rank} shares storage between {shown}")
    if only_other:
        shown = "; ".join(", ".join(s) for s in only_other)
        parts.append(f"only {who} share storage between {shown}")
    return Finding(
        kind=FindingKind.TIE,
        ranks=tuple(group.ranks),
        reference_rank=ref_rank,
        snapshot=tie.snapshot,
        cause=_cause(tie.snapshot, ties),
        summary=f"tied buffers differ on {who} from rank {ref_rank}'s ({tie.snapshot}): "
        + "; ".join(parts)
        + ": a write through one is seen through the others on one side only",
        tensors=tuple(dict.fromkeys(n for s in (*only_ref, *only_other) for n in s)),
        details={
            "only_reference_buffers": [list(s) for s in only_ref],
            "only_other_buffers": [list(s) for s in only_other],
        },
    )
