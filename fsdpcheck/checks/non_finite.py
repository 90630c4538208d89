"""``non-finite``: a rank's parameter (its local shard) or buffer holds NaN or ±Inf.

Counted while the values are digested (:mod:`fsdpcheck.model.checksum`), so it runs wherever
values are read: ``check_model`` on a script's loaded model, the audit's fingerprints, and every
tensor after the audit's load. A rank that holds such a tensor has its own group digest, so its
record reaches rank 0 whatever else agrees. Buffers the ``uninitialized`` check already names are
left to it; a buffer of only 0 and ±inf (an attention mask) is never counted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from fsdpcheck.checks.groups import own_findings
from fsdpcheck.records import Finding, Group, NonFinite, RankRecord
from fsdpcheck.text import clauses, ranks_label
from fsdpcheck.vocab import Cause, FindingKind, Snapshot

_LISTED = 3


def non_finite_findings(
    groups: Sequence[Group], records: Mapping[int, RankRecord]
) -> list[Finding]:
    """One finding per group of ranks whose representative holds NaN or Inf."""
    return own_findings(groups, records, _non_finite, _finding)


def _non_finite(record: RankRecord) -> list[NonFinite]:
    told = {p.name for p in record.uninitialized}
    return [n for n in record.non_finite_tensors() if not (n.buffer and n.name in told)]


def _finding(group: Group, found: Sequence[NonFinite]) -> Finding:
    who = ranks_label(group.ranks)
    first = found[0]
    shown = clauses(found, _describe, _LISTED)
    return Finding(
        kind=FindingKind.NON_FINITE,
        ranks=tuple(group.ranks),
        reference_rank=group.representative,
        snapshot=first.snapshot,
        cause=Cause.LOADING if first.snapshot == Snapshot.LOAD else Cause.UNKNOWN,
        summary=f"NaN or Inf on {who}: {shown}",
        tensors=tuple(dict.fromkeys(n.name for n in found)),
        details={
            "counted_on": group.representative,
            "tensors": [
                {
                    "name": n.name,
                    "kind": "buffer" if n.buffer else "param",
                    "snapshot": n.snapshot,
                    "count": n.count,
                }
                for n in found
            ],
        },
    )


def _describe(n: NonFinite) -> str:
    what = "buffer" if n.buffer else "param"
    where = {Snapshot.LOAD: "after the load"}.get(n.snapshot, f"at {n.snapshot}")
    plural = "s" if n.count != 1 else ""
    return f"{what} {n.name}: {n.count} non-finite element{plural} {where}"
