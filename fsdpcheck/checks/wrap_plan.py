"""``wrap-plan``: the FSDP2 plan must be the same on every rank.

FSDP2 issues one all-gather and one reduce-scatter per parameter group, in the same order on
every rank, with buffers sized by each group's parameters and mixed-precision dtypes. A rank
that groups parameters differently, casts them to another dtype, reshards differently or
offloads them pairs collectives of different sizes or dtypes: a hang or silently wrong
gradients. Pure functions over :mod:`fsdpcheck.records`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fsdpcheck.records import Finding, FsdpGroupRecord, FsdpPlanRecord
from fsdpcheck.text import ranks_label
from fsdpcheck.vocab import FindingKind

_LISTED = 3
POLICY_FIELDS = (
    "param_dtype",
    "reduce_dtype",
    "output_dtype",
    "cast_forward_inputs",
    "reshard_after_forward",
    "offload",
    "pin_memory",
    "mesh_shape",
    "mesh_dim_names",
    "mesh_device_type",
)


def wrap_plan_findings(
    ref_rank: int, ref: FsdpPlanRecord | None, ranks: Sequence[int], other: FsdpPlanRecord | None
) -> list[Finding]:
    """At most one finding: everything in ``other``'s plan that differs from the reference's.
    Nothing when neither side is wrapped, or neither side's plan could be read."""
    if ref is None and other is None:
        return []
    ref_label, other_label = f"rank {ref_rank}", ranks_label(ranks)
    if ref is None or other is None:
        unwrapped = ref_label if ref is None else other_label
        summary = f"{FindingKind.WRAP_PLAN.phrase}: {unwrapped} did not apply fully_shard at all"
        details = {"unwrapped": "reference" if ref is None else "other"}
        return [_finding(ref_rank, ranks, summary, details, ())]
    if ref.unavailable and other.unavailable:
        return []  # nothing to compare on either side (the unexplained check sees other reasons)
    if ref.unavailable or other.unavailable:
        which, why = (
            (ref_label, ref.unavailable) if ref.unavailable else (other_label, other.unavailable)
        )
        summary = (
            f"{FindingKind.WRAP_PLAN.phrase}: the FSDP2 plan could not be read on {which} "
            f"({why}), so the plans could not be compared"
        )
        details = {"unavailable": "reference" if ref.unavailable else "other", "why": why}
        return [_finding(ref_rank, ranks, summary, details, ())]
    parts: list[str] = []
    details: dict[str, Any] = {}
    tensors: list[str] = []

    ref_groups, other_groups = _keyed(ref.groups), _keyed(other.groups)
    only_ref = [m for m in ref_groups if m not in other_groups]
    only_other = [m for m in other_groups if m not in ref_groups]
    if only_ref or only_other:
        details["only_reference"] = only_ref
        details["only_other"] = only_other
        if only_ref:
            parts.append(f"fully_shard on {_listed(only_ref)} only on {ref_label}")
        if only_other:
            parts.append(f"fully_shard on {_listed(only_other)} only on {other_label}")

    moved = _moved_params(ref.groups, other.groups)
    if moved:
        details["regrouped"] = moved
        tensors.extend(m["name"] for m in moved)
        first = moved[0]
        parts.append(
            f"{len(moved)} parameter{'s' if len(moved) > 1 else ''} in another group, first "
            f"{first['name']} under {first['reference']} on {ref_label} but "
            f"{first['other']} on {other_label}"
        )

    policies = _policy_differences(ref_groups, other_groups)
    if policies:
        details["policies"] = policies
        for field_name in dict.fromkeys(p["field"] for p in policies):
            same = [p for p in policies if p["field"] == field_name]
            groups = _listed([p["group"] for p in same])
            parts.append(
                f"{field_name} {_show(same[0]['reference'])} on {ref_label} but "
                f"{_show(same[0]['other'])} on {other_label} (group{'s' if len(same) > 1 else ''}"
                f" {groups})"
            )
    if not parts:
        return []
    summary = f"{FindingKind.WRAP_PLAN.phrase}: " + "; ".join(parts)
    return [_finding(ref_rank, ranks, summary, details, tensors)]


def unread_note(plans: Mapping[int, FsdpPlanRecord | None]) -> tuple[str, ...]:
    """A warning naming the plan fields this torch keeps where fsdpcheck could not read them,
    and the ranks: those fields were not compared."""
    unread: dict[str, list[int]] = {}
    for rank, plan in sorted(plans.items()):
        groups = plan.groups if plan is not None else ()
        for name in dict.fromkeys(f for g in groups for f in g.unread):
            unread.setdefault(name, []).append(rank)
    if not unread:
        return ()
    by_ranks: dict[tuple[int, ...], list[str]] = {}
    for name, ranks in unread.items():
        by_ranks.setdefault(tuple(ranks), []).append(name)
    parts = [f"{', '.join(names)} on {ranks_label(ranks)}" for ranks, names in by_ranks.items()]
    return (
        "the FSDP2 plan's "
        + "; ".join(parts)
        + " could not be read on this torch (its private state moved), so they were not "
        "compared between ranks",
    )


def _keyed(groups: Sequence[FsdpGroupRecord]) -> dict[str, FsdpGroupRecord]:
    """Groups by their modules' names; a second group of one state gets ``#1`` and so on."""
    out: dict[str, FsdpGroupRecord] = {}
    for group in groups:
        label, i = _label(group.modules), 1
        key = label
        while key in out:
            key, i = f"{label}#{i}", i + 1
        out[key] = group
    return out


def _label(modules: Sequence[str]) -> str:
    return "+".join(m or "<root>" for m in modules) or "?"


def _listed(names: Sequence[str]) -> str:
    text = ", ".join(names[:_LISTED])
    if len(names) > _LISTED:
        text += f" and {len(names) - _LISTED} more"
    return text


def _show(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(str(v) for v in value) + ")"
    return str(value)


def _moved_params(
    ref: Sequence[FsdpGroupRecord], other: Sequence[FsdpGroupRecord]
) -> list[dict[str, str]]:
    ref_owner = {p: _label(g.modules) for g in ref for p in g.params}
    other_owner = {p: _label(g.modules) for g in other for p in g.params}
    moved = []
    for name, owner in ref_owner.items():
        theirs = other_owner.get(name, "no group")
        if theirs != owner:
            moved.append({"name": name, "reference": owner, "other": theirs})
    moved.extend(
        {"name": name, "reference": "no group", "other": owner}
        for name, owner in other_owner.items()
        if name not in ref_owner
    )
    return moved


def _policy_differences(ref_groups: dict, other_groups: dict) -> list[dict[str, Any]]:
    out = []
    for key, a in ref_groups.items():
        b = other_groups.get(key)
        if b is None:
            continue
        for field_name in POLICY_FIELDS:
            if field_name in a.unread or field_name in b.unread:
                continue  # not read on some rank: unknown, not equal (unread_note says so)
            x, y = getattr(a, field_name), getattr(b, field_name)
            if _jsonable(x) != _jsonable(y):
                out.append(
                    {
                        "group": key,
                        "field": field_name,
                        "reference": _jsonable(x),
                        "other": _jsonable(y),
                    }
                )
    return out


def _jsonable(value: Any) -> Any:
    # Lists, not tuples: details must compare equal after a JSON round trip.
    return list(value) if isinstance(value, tuple) else value


def _finding(ref_rank, ranks, summary, details, tensors) -> Finding:
    kind = FindingKind.WRAP_PLAN
    return Finding.about(kind, ranks, ref_rank, summary, tensors=tensors, details=details)
