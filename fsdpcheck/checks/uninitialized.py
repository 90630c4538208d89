"""``uninitialized``: a buffer whose value is not what its module computes.

Each rank that holds real buffers compares its non-persistent buffers with ones recomputed from
the model's own config (:mod:`fsdpcheck.model.state`) and tests every other buffer for NaN, Inf
and denormal values; the problems travel in its record (:attr:`RankRecord.uninitialized`). Ranks
with the same problems share a group, so one finding per group names them all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from fsdpcheck.checks.groups import own_findings
from fsdpcheck.records import BufferProblem, Finding, Group, RankRecord
from fsdpcheck.text import clauses, ranks_label
from fsdpcheck.vocab import FindingKind

_LISTED = 3
_WHY = {
    "differs": "not what its module computes",
    "nan": "holds NaN",
    "inf": "holds Inf next to finite values",
    "denormal": "holds denormal values (uninitialised memory)",
}


def uninitialized_findings(
    groups: Sequence[Group], records: Mapping[int, RankRecord]
) -> list[Finding]:
    return own_findings(groups, records, lambda record: record.uninitialized, _finding)


def _finding(group: Group, problems: Sequence[BufferProblem]) -> Finding:
    who = ranks_label(group.ranks)
    first = problems[0]
    shown = clauses(problems, lambda p: _describe(p, who), _LISTED)
    return Finding.about(
        FindingKind.UNINITIALIZED,
        group.ranks,
        group.representative,
        f"buffers are not initialised on {who}: {shown}",
        snapshot=first.snapshot,
        tensors=(p.name for p in problems),
        details={
            "problems": [
                {
                    "name": p.name,
                    "snapshot": p.snapshot,
                    "reason": p.reason,
                    "got": list(p.got),
                    "expected": list(p.expected),
                }
                for p in problems
            ]
        },
    )


def _describe(p: BufferProblem, who: str) -> str:
    text = f"{p.name} {_WHY.get(p.reason, p.reason)}"
    if p.got:
        text += f" (first values {', '.join(p.got)} on {who.split(',')[0]}"
        if p.expected:
            text += f"; expected {', '.join(p.expected)}"
        text += ")"
    return text
