"""Per-tensor flags that must agree across ranks: ``requires_grad`` and device placement.

Pure functions over :mod:`fsdpcheck.records`. FSDP2 assumes every rank does the same thing
(SPMD): a parameter frozen on one rank only makes its reduce-scatter mismatch or its gradients
differ silently; a tensor left on a device the job's collectives or kernels cannot use fails
(or silently slows) the first step on that rank only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from fsdpcheck.model.keys import device_exceptions, left_on_meta, tensors_of
from fsdpcheck.records import (
    Finding,
    Fingerprint,
    RankRecord,
)
from fsdpcheck.text import clauses, ranks_label
from fsdpcheck.vocab import Cause, FindingKind, Snapshot

_LISTED = 3


# ---------------------------------------------------------------- requires-grad


def requires_grad_difference(
    a: Fingerprint, b: Fingerprint, ref_label: str, other_label: str
) -> tuple[list[str], dict[str, Any], str] | None:
    """Parameters present on both sides whose ``requires_grad`` differs, as
    ``(tensors, details, summary)``; None when they agree or either side did not record it."""
    others = {t.name: t for t in b.params}
    diffs = []
    for t in a.params:
        o = others.get(t.name)
        if o is None or t.requires_grad is None or o.requires_grad is None:
            continue
        if t.requires_grad != o.requires_grad:
            diffs.append((t.name, t.requires_grad, o.requires_grad))
    if not diffs:
        return None
    shown = clauses(
        diffs,
        lambda d: (
            f"{d[0]} is {_trainable(d[1])} on {ref_label} but {_trainable(d[2])} on {other_label}"
        ),
        _LISTED,
    )
    details = {
        "differences": [{"name": n, "reference": x, "other": y} for n, x, y in diffs],
    }
    return [n for n, _, _ in diffs], details, f"{FindingKind.REQUIRES_GRAD.phrase}: {shown}"


def _trainable(flag: bool) -> str:
    return "trainable" if flag else "frozen"


# ---------------------------------------------------------------- device


def device_findings(
    ref_rank: int,
    groups: Sequence[tuple[Sequence[int], RankRecord]],
    others: Sequence[tuple[Sequence[int], RankRecord]] = (),
) -> list[Finding]:
    """One finding per group (the reference group included) whose tensors are on a device its
    job cannot use; then one per record of ``others`` (every other record rank 0 holds, with the
    ranks it speaks for) whose tensors sit on other device types than the reference's."""
    findings = []
    for ranks, record in groups:
        wrong = device_exceptions(record)
        if wrong:
            # After wrapping with a pre-wrap record at hand, FSDP2's placement left it there.
            after = Cause.WRAPPING if record.pre_wrap is not None else Cause.UNKNOWN
            findings.append(_exceptions_finding(ref_rank, ranks, wrong, after))
    ref = next((rec for ranks, rec in groups if ref_rank in ranks), None)
    if ref is not None:
        findings.extend(_meta_findings(ref_rank, ref, groups))
        for ranks, record in others:
            finding = _cross_rank(ref_rank, ref, ranks, record)
            if finding is not None:
                findings.append(finding)
    return findings


def _meta_findings(
    ref_rank: int, ref: RankRecord, groups: Sequence[tuple[Sequence[int], RankRecord]]
) -> list[Finding]:
    """One finding per other group where one side left tensors on meta
    (:func:`left_on_meta`) that the other side holds on a real device."""
    findings = []
    ref_left, ref_real = left_on_meta(ref), _real_devices(ref)
    for ranks, record in groups:
        if ref_rank in ranks:
            continue
        theirs = _real_devices(record)
        left = [(n, ref_real[n], ranks, (ref_rank,)) for n in left_on_meta(record) if n in ref_real]
        left += [(n, theirs[n], (ref_rank,), ranks) for n in ref_left if n in theirs]
        if left:
            findings.append(_meta_finding(ref_rank, ranks, record, left))
    return findings


def _real_devices(record: RankRecord) -> dict[str, str]:
    latest = record.post_wrap or record.pre_wrap
    if latest is None:
        return {}
    return {t.name: t.device for _, t in tensors_of(latest) if t.device != "meta"}


def _meta_finding(
    ref_rank: int,
    ranks: Sequence[int],
    record: RankRecord,
    left: list[tuple[str, str, Sequence[int], Sequence[int]]],
) -> Finding:
    """``left``: (name, the real side's device, the ranks on meta, the ranks holding it)."""
    text = clauses(
        left,
        lambda e: f"{ranks_label(e[2])} left {e[0]} on meta ({e[1]} on {ranks_label(e[3])})",
        _LISTED,
    )
    snapshot = Snapshot.POST_WRAP if record.post_wrap is not None else Snapshot.PRE_WRAP
    summary = (
        f"{FindingKind.DEVICE.phrase}: {text}, beside real parameters: no load fills a tensor "
        "that is in no state dict (a non-persistent buffer after load_state_dict(assign=True)), "
        "and the first forward on meta fails"
    )
    names = dict.fromkeys(name for name, *_ in left)
    where = [
        {"name": n, "ranks": list(on_meta), "device": d, "real_on": list(real)}
        for n, d, on_meta, real in left
    ]
    details = {"left_on_meta": where}
    return _device(ranks, ref_rank, snapshot, Cause.LOADING, summary, names, details)


def _exceptions_finding(
    ref_rank: int, ranks: Sequence[int], shown: list[dict[str, Any]], cause: Cause
) -> Finding:
    text = ", ".join(
        f"{e['name']} on {e['device']}, not {e['expected']} ({e['because']})"
        for e in shown[:_LISTED]
    )
    if len(shown) > _LISTED:
        text += f"; and {len(shown) - _LISTED} more"
    verb = "has" if len(ranks) == 1 else "have"
    summary = f"{FindingKind.DEVICE.phrase}: {ranks_label(ranks)} {verb} {text}"
    names, details = (e["name"] for e in shown), {"misplaced": shown}
    return _device(ranks, ref_rank, Snapshot.POST_WRAP, cause, summary, names, details)


def _cross_rank(
    ref_rank: int, ref: RankRecord, ranks: Sequence[int], other: RankRecord
) -> Finding | None:
    """Names whose device type differs from the reference's, at the first stage both recorded
    where any does (tensors on ``meta`` hold nothing yet and are never compared)."""
    theirs = {fp.snapshot: fp for fp in other.fingerprints()}
    stages = [fp.snapshot for fp in ref.fingerprints() if fp.snapshot in theirs]
    for fp in ref.fingerprints():
        if fp.snapshot not in theirs:
            continue
        diffs = _device_differences(fp, theirs[fp.snapshot])
        if not diffs:
            continue
        if fp.snapshot == Snapshot.PRE_WRAP:
            cause = Cause.CONSTRUCTION_TIME
        else:  # the pre-wrap devices agreed, or there were none to tell
            cause = Cause.WRAPPING if Snapshot.PRE_WRAP in stages else Cause.UNKNOWN
        text = clauses(
            diffs,
            lambda d: (
                f"{d['name']} is on {d['reference']} on rank {ref_rank} but on "
                f"{d['other']} on {ranks_label(ranks)}"
            ),
            _LISTED,
        )
        summary = f"{FindingKind.DEVICE.phrase}: {text}"
        names, details = (d["name"] for d in diffs), {"differences": diffs}
        return _device(ranks, ref_rank, fp.snapshot, cause, summary, names, details)
    return None


def _device(
    ranks: Sequence[int],
    ref_rank: int,
    snapshot: Snapshot,
    cause: Cause,
    summary: str,
    names: Iterable[str],
    details: dict[str, Any],
) -> Finding:
    """A ``device`` finding: where and why it was seen differ from one to the next."""
    return Finding.about(
        FindingKind.DEVICE, ranks, ref_rank, summary, snapshot=snapshot, cause=cause,
        tensors=names, details=details,
    )  # fmt: skip


def _device_differences(a: Fingerprint, b: Fingerprint) -> list[dict[str, Any]]:
    devices: Mapping[str, str] = {t.name: t.device for _, t in tensors_of(a) if t.device != "meta"}
    return [
        {"name": t.name, "reference": devices[t.name], "other": t.device}
        for _, t in tensors_of(b)
        if t.device != "meta" and t.name in devices and devices[t.name] != t.device
    ]
