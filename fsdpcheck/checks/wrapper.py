"""``wrapper``: activation checkpointing or ``torch.compile`` wraps different modules on some
ranks, and the names the wrappers add.

``torch.compile(m)`` puts ``m`` under ``_orig_mod``, ``checkpoint_wrapper`` under
``_checkpoint_wrapped_module`` (FSDP1 under ``_fsdp_wrapped_module``, DDP under ``module``): a
rank that wraps where another does not names every tensor below differently. Loaders see
those raw names, so the difference is a hazard for every loader keyed by names; but the
tensors are the same ones. The other checks therefore pair tensors by their *canonical* names
(:func:`fsdpcheck.model.names.canonical_record`: the wrapper levels left out), and this
check alone reports the raw-name difference, naming which ranks wrap what. Pure functions over
:mod:`fsdpcheck.records`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fsdpcheck.records import (
    Finding,
    RankRecord,
    WrapperRecord,
)
from fsdpcheck.text import name_list, ranks_label
from fsdpcheck.vocab import Cause, FindingKind, Snapshot

_LISTED = 3


# ---------------------------------------------------------------- the check


def wrapper_findings(
    ref_rank: int, ref: RankRecord, ranks: Sequence[int], other: RankRecord
) -> list[Finding]:
    """At most one finding: the modules only one side checkpoints or compiles, and the wrapper
    levels in one side's names that the other's lack. Nothing where neither side read its
    wrappers (a record from before they were recorded)."""
    a, b = ref.wrappers, other.wrappers
    if a is None and b is None:
        return []
    a, b = a or WrapperRecord(), b or WrapperRecord()
    ref_label, other_label = f"rank {ref_rank}", ranks_label(ranks)
    theirs = {(m.name, m.how) for m in b.modules}
    mine = {(m.name, m.how) for m in a.modules}
    only_ref = [m for m in a.modules if (m.name, m.how) not in theirs]
    only_other = [m for m in b.modules if (m.name, m.how) not in mine]
    levels = _level_differences(a, b)
    if not only_ref and not only_other and not levels:
        return []
    parts = [
        f"{who} {_wraps(modules)} and {whom} does not"
        for who, whom, modules in (
            (ref_label, other_label, only_ref),
            (other_label, ref_label, only_other),
        )
        if modules
    ]
    if levels:
        shown = "; ".join(
            f"{d['level']}. in {d['reference']['names']} names on {ref_label}, "
            f"{d['other']['names']} on {other_label}"
            for d in levels
        )
        keys = any(d["reference"]["keys"] != d["other"]["keys"] for d in levels)
        parts.append(
            f"tensor names differ by wrapper levels ({shown}), compared here without them; "
            + (
                "model.state_dict() keys differ too: a loader or checkpoint keyed by them "
                "(fsdpcheck's sorted loader, a state_dict() saved on another rank) finds none "
                "of these tensors there (DCP's names leave the level out)"
                if keys
                else "the state dict leaves the level out, named_parameters() does not: code "
                "that pairs by parameter names (optimizer state, parameter filters) differs"
            )
        )
    details: dict[str, Any] = {
        "only_reference": [_module(m) for m in only_ref],
        "only_other": [_module(m) for m in only_other],
        "levels": levels,
    }
    snapshot = Snapshot.POST_WRAP if ref.post_wrap and other.post_wrap else Snapshot.PRE_WRAP
    both_pre = ref.pre_wrap is not None and other.pre_wrap is not None
    return [
        Finding(
            kind=FindingKind.WRAPPER,
            ranks=tuple(ranks),
            reference_rank=ref_rank,
            snapshot=snapshot,
            cause=Cause.CONSTRUCTION_TIME if both_pre else Cause.UNKNOWN,
            summary=f"{FindingKind.WRAPPER.phrase}: " + "; ".join(parts),
            tensors=tuple(dict.fromkeys(m.name for m in (*only_ref, *only_other))),
            details=details,
        )
    ]


def _wraps(modules: Sequence[Any]) -> str:
    by_how: dict[str, list[str]] = {}
    for m in modules:
        by_how.setdefault(str(m.how), []).append(m.name or "the root")
    return "; ".join(f"wraps {name_list(names, _LISTED)} in {how}" for how, names in by_how.items())


def _module(m: Any) -> dict[str, str]:
    return {"name": m.name, "how": str(m.how)}


def _level_differences(a: WrapperRecord, b: WrapperRecord) -> list[dict[str, Any]]:
    mine: Mapping[str, Any] = {r.level: r for r in a.renamed}
    theirs: Mapping[str, Any] = {r.level: r for r in b.renamed}
    out = []
    for level in dict.fromkeys([*mine, *theirs]):
        x, y = mine.get(level), theirs.get(level)
        counts = [(r.names, r.keys) if r is not None else (0, 0) for r in (x, y)]
        if counts[0] != counts[1]:
            out.append(
                {
                    "level": level,
                    "reference": {"names": counts[0][0], "keys": counts[0][1]},
                    "other": {"names": counts[1][0], "keys": counts[1][1]},
                }
            )
    return out
