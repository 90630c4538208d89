"""``module-state`` and ``numerics``: what makes one rank compute differently with the same
tensors. Pure functions over :class:`ModuleStateRecord` and :class:`NumericsRecord`.

A module in ``eval()`` on one rank only (dropout off there), a forward hook that scales an
output, a LayerNorm built with another ``eps``, or TF32 / deterministic algorithms / a default
dtype switched on one rank only: the layouts, values and configs all agree, and the ranks'
forward outputs still differ, so their gradients are averaged over different functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fsdpcheck.records import Finding, ModuleKind, ModuleStateRecord, NumericsRecord, RankRecord
from fsdpcheck.text import clauses, ranks_label
from fsdpcheck.vocab import Cause, FindingKind, Snapshot

_LISTED = 3
_MAX_DETAILS = 50  # details stay bounded whatever the model's size


def _snapshot(record: RankRecord) -> Snapshot:
    return Snapshot.POST_WRAP if record.post_wrap is not None else Snapshot.PRE_WRAP


def module_differences(a: ModuleStateRecord, b: ModuleStateRecord) -> list[dict[str, Any]]:
    """Per module both records hold (by name), what differs: ``class``, ``training``,
    ``hooks``, or one ``setting``; then modules one side holds only; then the global hooks.
    Each entry: ``module``, ``what``, ``reference``, ``other``."""
    ours, theirs = a.by_name(), b.by_name()
    out: list[dict[str, Any]] = []
    for name, mine in ours.items():
        other = theirs.get(name)
        if other is not None and other != mine:
            out.extend(_kind_differences(name, mine, other))
    only_ref = [n for n in ours if n not in theirs]
    only_other = [n for n in theirs if n not in ours]
    for name in only_ref:
        out.append({"module": name, "what": "present", "reference": True, "other": False})
    for name in only_other:
        out.append({"module": name, "what": "present", "reference": False, "other": True})
    if a.global_hooks != b.global_hooks:
        out.append(
            {
                "module": "",
                "what": "global hooks",
                "reference": list(a.global_hooks),
                "other": list(b.global_hooks),
            }
        )
    return out


def _kind_differences(name: str, a: ModuleKind, b: ModuleKind) -> list[dict[str, Any]]:
    def entry(what: str, x: Any, y: Any) -> dict[str, Any]:
        return {"module": name, "class": a.cls, "what": what, "reference": x, "other": y}

    if a.cls != b.cls:  # another module altogether: its settings are another class's
        return [entry("class", a.cls, b.cls)]
    out = []
    if a.training != b.training:
        out.append(entry("training", a.training, b.training))
    if a.hooks != b.hooks:
        out.append(entry("hooks", list(a.hooks), list(b.hooks)))
    ours, theirs = dict(a.settings), dict(b.settings)
    for key in sorted(set(ours) | set(theirs)):
        if ours.get(key) != theirs.get(key):
            out.append(entry(f"setting {key}", ours.get(key), theirs.get(key)))
    return out


def _describe(d: dict[str, Any], ref_label: str, other_label: str) -> str:
    module = d["module"] or "the model"
    what = d["what"]
    if what == "training":
        mode = lambda flag: "training" if flag else "eval"  # noqa: E731
        return f"{module} is in {mode(d['reference'])} mode on {ref_label} but in " + (
            f"{mode(d['other'])} mode on {other_label}"
        )
    if what == "hooks":
        return f"{module} has hooks {_hooks(d['reference'])} on {ref_label} but " + (
            f"{_hooks(d['other'])} on {other_label}"
        )
    if what == "global hooks":
        return f"global module hooks are {_hooks(d['reference'])} on {ref_label} but " + (
            f"{_hooks(d['other'])} on {other_label}"
        )
    if what == "present":
        side = ref_label if d["reference"] else other_label
        return f"{module} exists on {side} only"
    return f"{module} {what} is {d['reference']} on {ref_label} but {d['other']} on {other_label}"


def _hooks(hooks: Sequence[str]) -> str:
    return "[" + ", ".join(hooks) + "]" if hooks else "none"


def module_state_findings(
    ref_rank: int, ref: RankRecord, ranks: Sequence[int], other: RankRecord
) -> list[Finding]:
    """One finding when ``other``'s modules differ from the reference's (both recorded)."""
    if ref.modules is None or other.modules is None:
        return []
    # A module with tensors on one side only is the layout check's (its names differ there).
    owners = _tensor_owners(ref) | _tensor_owners(other)
    diffs = [
        d
        for d in module_differences(ref.modules, other.modules)
        if d["what"] != "present" or d["module"] not in owners
    ]
    if not diffs:
        return []
    ref_label, other_label = f"rank {ref_rank}", ranks_label(ranks)
    shown = clauses(diffs, lambda d: _describe(d, ref_label, other_label), _LISTED)
    return _set_up_finding(
        FindingKind.MODULE_STATE,
        ref_rank,
        ranks,
        other,
        f"{shown}: the same tensors compute other outputs there",
        {"differences": diffs[:_MAX_DETAILS], "count": len(diffs)},
    )


def _set_up_finding(
    kind: FindingKind,
    ref_rank: int,
    ranks: Sequence[int],
    other: RankRecord,
    text: str,
    details: dict[str, Any],
) -> list[Finding]:
    """The one finding of a difference in how ``ranks`` set their process up (their modules'
    state, the numerics switches) from the reference's, at ``other``'s last snapshot."""
    return [
        Finding(
            kind=kind,
            ranks=tuple(ranks),
            reference_rank=ref_rank,
            snapshot=_snapshot(other),
            cause=Cause.SET_UP,
            summary=f"{kind.phrase}: {text}",
            details=details,
        )
    ]


def _tensor_owners(record: RankRecord) -> set[str]:
    """Every module name that holds a tensor of ``record`` (directly or below it)."""
    owners: set[str] = set()
    for fp in record.fingerprints():
        for t in (*fp.buffers, *fp.params):
            parts = t.name.split(".")[:-1]
            owners.update(".".join(parts[:i]) for i in range(len(parts) + 1))
    return owners


def numerics_differences(a: NumericsRecord, b: NumericsRecord) -> list[dict[str, Any]]:
    ours, theirs = dict(a.flags), dict(b.flags)
    return [
        {"name": name, "reference": ours.get(name), "other": theirs.get(name)}
        for name in dict.fromkeys((*ours, *theirs))
        if ours.get(name) != theirs.get(name)
    ]


def numerics_findings(
    ref_rank: int, ref: RankRecord, ranks: Sequence[int], other: RankRecord
) -> list[Finding]:
    """One finding when ``other``'s process-wide numerics switches differ from the reference's."""
    if ref.numerics is None or other.numerics is None:
        return []
    diffs = numerics_differences(ref.numerics, other.numerics)
    if not diffs:
        return []
    who = ranks_label(ranks)
    shown = clauses(
        diffs,
        lambda d: f"{d['name']} is {d['reference']} on rank {ref_rank} but {d['other']} on {who}",
        _LISTED,
    )
    return _set_up_finding(
        FindingKind.NUMERICS,
        ref_rank,
        ranks,
        other,
        f"{shown}: kernels round (or choose algorithms) differently there",
        {"differences": diffs},
    )
