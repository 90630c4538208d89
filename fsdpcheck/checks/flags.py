"""Per-tensor flags that must agree across ranks: ``requires_grad`` and device placement.

Pure functions over :mod:`fsdpcheck.records`. FSDP2 assumes every rank does the same thing
(SPMD): a parameter frozen on one rank only makes its reduce-scatter mismatch or its gradients
differ silently; a tensor left on a device the job's collectives or kernels cannot use fails
(or silently slows) the first step on that rank only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fsdpcheck.records import (
    Finding,
    Fingerprint,
    FsdpPlanRecord,
    RankRecord,
)
from fsdpcheck.text import clauses, ranks_label
from fsdpcheck.vocab import Cause, FindingKind, Snapshot

_LISTED = 3
# Backends whose collectives only take accelerator tensors. A mixed backend string such as
# "cpu:gloo,cuda:nccl" also serves CPU tensors, so it is not in here.
_DEVICE_ONLY_BACKENDS = {"nccl": "cuda", "xccl": "xpu", "hccl": "npu"}


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


def device_exceptions(record: RankRecord) -> list[dict[str, Any]]:
    """This rank's tensors that sit where its job cannot use them, from its own record only.

    Only the wrapped model is judged: before ``fully_shard`` any placement is fine, because
    ``fully_shard`` moves every tensor of the modules it manages to the mesh's device. After
    it, each tensor belongs where FSDP2 put it: the mesh's device type, or CPU for parameters
    under a CPU offload policy; a buffer outside every ``fully_shard`` belongs on the backend's
    device. Tensors on ``meta`` are never exceptions: ranks > 0 hold the model on meta until
    the loader runs.
    """
    out: list[dict[str, Any]] = []
    if record.post_wrap is None:
        return out
    backend = record.env.backend
    backend_rule = (
        (_DEVICE_ONLY_BACKENDS[backend], f"the {backend} backend")
        if (backend in _DEVICE_ONLY_BACKENDS)
        else None
    )
    params, buffers = _post_wrap_expectations(record.fsdp_plan, record.post_wrap)
    for kind, t in _tensors(record.post_wrap):
        # A parameter FSDP2 does not manage (or an unreadable plan) has no rule: it may be
        # offloaded on purpose. A buffer outside every fully_shard belongs on the backend's.
        rule = params.get(t.name) if kind == "param" else buffers.get(t.name, backend_rule)
        if rule is not None and t.device not in ("meta", rule[0]):
            out.append(
                {
                    "kind": kind,
                    "name": t.name,
                    "device": t.device,
                    "expected": rule[0],
                    "because": rule[1],
                }
            )
    return out


def left_on_meta(record: RankRecord) -> list[str]:
    """Tensors still on ``meta`` in this rank's latest fingerprint once its parameters are
    materialised (one or more of them real): what a load with ``assign=True`` leaves behind
    (non-persistent buffers are in no state dict), which the first forward on this rank fails
    on. A rank whose parameters are all on meta has not been loaded yet (ranks > 0 under
    ``--init rank0``, a script that checks before its loader): nothing is left behind there."""
    latest = record.post_wrap or record.pre_wrap
    if latest is None or all(t.device == "meta" for t in latest.params):
        return []
    return [t.name for _, t in _tensors(latest) if t.device == "meta"]


def misplaced(record: RankRecord) -> tuple[str, ...]:
    """``name:device`` of each device exception and ``name:meta`` of each tensor left on meta
    (:func:`left_on_meta`): what a rank puts in ``RankRecord.misplaced``, so that its group
    digest separates it from ranks whose tensors are where they belong (devices themselves are
    not in the group digest: ranks on meta before a load must not split off)."""
    wrong = [f"{e['name']}:{e['device']}" for e in device_exceptions(record)]
    return (*wrong, *(f"{name}:meta" for name in left_on_meta(record)))


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
            after = "wrapping" if record.pre_wrap is not None else "unknown"
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
    return {t.name: t.device for _, t in _tensors(latest) if t.device != "meta"}


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
    return Finding(
        kind=FindingKind.DEVICE,
        ranks=tuple(ranks),
        reference_rank=ref_rank,
        snapshot=snapshot,
        cause=Cause.LOADING,
        summary=f"{FindingKind.DEVICE.phrase}: {text}, beside real parameters: no load fills "
        "a tensor that is in no state dict (a non-persistent buffer after "
        "load_state_dict(assign=True)), and the first forward on meta fails",
        tensors=tuple(dict.fromkeys(name for name, *_ in left)),
        details={
            "left_on_meta": [
                {"name": n, "ranks": list(on_meta), "device": d, "real_on": list(real)}
                for n, d, on_meta, real in left
            ]
        },
    )


def _tensors(fp: Fingerprint):
    yield from (("buffer", t) for t in fp.buffers)
    yield from (("param", t) for t in fp.params)


_Rule = tuple[str, str]  # (expected device type, why)


def _post_wrap_expectations(
    plan: FsdpPlanRecord | None, fp: Fingerprint
) -> tuple[dict[str, _Rule], dict[str, _Rule]]:
    """name → (expected device type, why), for the parameters and buffers FSDP2 manages."""
    params: dict[str, _Rule] = {}
    owners: list[tuple[str, str]] = []  # (fully_shard module prefix, mesh device type)
    if plan is None:
        return params, {}
    mesh = "the FSDP2 mesh"
    for group in plan.groups:
        device = group.mesh_device_type
        if device is None:
            continue
        offloaded = group.offload is not None and "CPU" in group.offload
        rule = ("cpu", "the CPU offload policy") if offloaded else (device, mesh)
        for name in group.params:
            params[name] = rule
        owners.extend((module, device) for module in group.modules)
    buffers: dict[str, _Rule] = {}
    for t in fp.buffers:
        # fully_shard moves the buffers of every module under the one it was applied to.
        under = [(m, d) for m, d in owners if m == "" or t.name.startswith(m + ".")]
        if under:
            buffers[t.name] = (max(under, key=lambda md: len(md[0]))[1], mesh)
    return params, buffers


def _exceptions_finding(
    ref_rank: int, ranks: Sequence[int], shown: list[dict[str, Any]], cause: str
) -> Finding:
    text = ", ".join(
        f"{e['name']} on {e['device']}, not {e['expected']} ({e['because']})"
        for e in shown[:_LISTED]
    )
    if len(shown) > _LISTED:
        text += f"; and {len(shown) - _LISTED} more"
    verb = "has" if len(ranks) == 1 else "have"
    summary = f"{FindingKind.DEVICE.phrase}: {ranks_label(ranks)} {verb} {text}"
    return Finding(
        kind=FindingKind.DEVICE,
        ranks=tuple(ranks),
        reference_rank=ref_rank,
        snapshot="post-wrap",
        cause=cause,
        summary=summary,
        tensors=tuple(e["name"] for e in shown),
        details={"misplaced": shown},
    )


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
        return Finding(
            kind=FindingKind.DEVICE,
            ranks=tuple(ranks),
            reference_rank=ref_rank,
            snapshot=fp.snapshot,
            cause=cause,
            summary=f"{FindingKind.DEVICE.phrase}: {text}",
            tensors=tuple(d["name"] for d in diffs),
            details={"differences": diffs},
        )
    return None


def _device_differences(a: Fingerprint, b: Fingerprint) -> list[dict[str, Any]]:
    devices: Mapping[str, str] = {t.name: t.device for _, t in _tensors(a) if t.device != "meta"}
    return [
        {"name": t.name, "reference": devices[t.name], "other": t.device}
        for _, t in _tensors(b)
        if t.device != "meta" and t.name in devices and devices[t.name] != t.device
    ]
