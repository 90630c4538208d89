"""``uninitialized``: a buffer whose value is not what its module computes.

Each rank that holds real buffers compares its non-persistent buffers with ones recomputed from
the model's own config (:mod:`fsdpcheck.model.state`) and tests every other buffer for NaN, Inf
and denormal values; the problems travel in its record (:attr:`RankRecord.uninitialized`). Ranks
with the same problems share a group, so one finding per group names them all. Under
``fsdpcheck run`` a rank also records every parameter and buffer that nothing wrote between
``to_empty()`` and the first forward (:mod:`fsdpcheck.model.writes`): those are named by the
modules they belong to, whatever their garbage holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from fsdpcheck.checks.groups import own_findings
from fsdpcheck.records import BufferProblem, Finding, Group, RankRecord
from fsdpcheck.text import clauses, int_ranges, name_list, ranks_label
from fsdpcheck.vocab import BufferReason, FindingKind

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
    found = own_findings(groups, records, lambda record: record.uninitialized, _finding)
    # Groups differ by whatever else their records hold (garbage values, for one): the same
    # problems on several groups are one finding naming all their ranks.
    merged: dict[tuple, Finding] = {}
    for finding in found:
        key = tuple((p["name"], p["reason"]) for p in finding.details["problems"])
        if key in merged:
            first = merged[key]
            ranks = tuple(sorted({*first.ranks, *finding.ranks}))
            summary = first.summary.replace(ranks_label(first.ranks), ranks_label(ranks), 1)
            merged[key] = replace(first, ranks=ranks, summary=summary)
        else:
            merged[key] = finding
    return list(merged.values())


def _finding(group: Group, problems: Sequence[BufferProblem]) -> Finding:
    who = ranks_label(group.ranks)
    first = problems[0]
    unwritten = [p for p in problems if p.reason == BufferReason.UNWRITTEN]
    others = [p for p in problems if p.reason != BufferReason.UNWRITTEN]
    parts = []
    if unwritten:
        parts.append(_unwritten_text(unwritten, f"rank {group.representative}"))
    if others:
        parts.append(clauses(others, lambda p: _describe(p, who), _LISTED))
    shown = "; ".join(parts)
    return Finding.about(
        FindingKind.UNINITIALIZED,
        group.ranks,
        group.representative,
        f"{'tensors are' if unwritten else 'buffers are'} not initialised on {who}: {shown}",
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
                    **({"detail": p.detail} if p.detail else {}),
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


def _unwritten_text(problems: Sequence[BufferProblem], shown_rank: str) -> str:
    """``20 tensors of layers.0-9 (…)`` were never written, and where, and what wrote the rest."""
    modules = owning_modules([p.name for p in problems])
    count = len(problems)
    text = (
        f"{count} tensor{'s' if count != 1 else ''} of {_module_text(modules)} were never "
        f"written after to_empty() (uninitialised memory, whatever it holds"
    )
    got = problems[0].got
    text += f"; first values on {shown_rank}: {', '.join(got)})" if got else ")"
    if problems[0].detail:
        text += f": {problems[0].detail}"
    return text


def owning_modules(names: Sequence[str]) -> list[str]:
    """The module each tensor belongs to, at the depth a reader names it: up to the first
    numbered child (``layers.3``), else the tensor's parent; in first-seen order."""
    found: dict[str, None] = {}
    for name in names:
        parts = name.split(".")
        cut = next((i + 1 for i, part in enumerate(parts[:-1]) if part.isdigit()), len(parts) - 1)
        found[".".join(parts[:cut]) or "(root)"] = None
    return list(found)


def _module_text(modules: Sequence[str]) -> str:
    """``layers.0-9``, ``norm``: numbered siblings folded into one range each."""
    numbered: dict[str, list[int]] = {}
    plain: list[str] = []
    for module in modules:
        stem, _, last = module.rpartition(".")
        if stem and last.isdigit():
            numbered.setdefault(stem, []).append(int(last))
        else:
            plain.append(module)
    folded = [
        f"{stem}.{int_ranges(sorted(set(ids)))}"
        + (f" ({len(set(ids))} modules)" if len(ids) > 1 else "")
        for stem, ids in numbered.items()
    ]
    return name_list([*folded, *plain])
