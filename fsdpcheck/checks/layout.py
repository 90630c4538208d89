"""Cross-rank analysis: compare each group of ranks against the reference group.

Pure functions over :mod:`fsdpcheck.records` (no torch, no communication), so the same code runs
on rank 0 after the gather and in unit tests on synthetic fingerprints.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fsdpcheck.checks.config import config_findings
from fsdpcheck.checks.flags import device_findings, requires_grad_difference
from fsdpcheck.checks.wrap_plan import wrap_plan_findings
from fsdpcheck.records import (
    Finding,
    Fingerprint,
    Group,
    RankError,
    RankRecord,
    TensorRecord,
)
from fsdpcheck.text import ranks_label
from fsdpcheck.vocab import ErrorKind, ExitCode, FindingKind, Snapshot, Verdict, finding_kind

STAGES = (Snapshot.PRE_WRAP, Snapshot.POST_WRAP)
ENV_FIELDS = ("python", "torch", "transformers", "backend", "accelerate", "nccl", "cuda")

_STAGE_NOTE = {"construction-time": " (before wrapping)", "wrapping": " (after wrapping only)"}
_ORDER_KINDS = ("buffer-order", "param-order")
_LISTED = 3  # names spelled out in one summary before "and N more"


# ---------------------------------------------------------------- shared with predict.py


def usable_groups(groups: Sequence[Group], records: Mapping[int, RankRecord]) -> list[Group]:
    """Groups whose representative has a record without an error, lowest rank first."""
    keep = [g for g in groups if g.ranks and _has_record(g, records)]
    return sorted(keep, key=lambda g: g.representative)


def reference_group(groups: Sequence[Group], records: Mapping[int, RankRecord]) -> Group | None:
    """The group holding rank 0, else the lowest usable group; ``None`` if none is usable."""
    usable = usable_groups(groups, records)
    for group in usable:
        if 0 in group.ranks:
            return group
    return usable[0] if usable else None


def format_shape(shape: Sequence[int] | None) -> str:
    """``(16,)``, ``(4, 8)``, ``()``; lists (after a JSON round trip) print like tuples."""
    if shape is None:
        return "(?)"
    return repr(tuple(shape))


def describe(t: TensorRecord | None) -> str:
    return "nothing" if t is None else f"{t.name} {format_shape(t.shape)} {t.dtype}"


def tensor_dict(t: TensorRecord | None) -> dict[str, Any] | None:
    # Lists, not tuples: details must compare equal after a JSON round trip.
    return None if t is None else {"name": t.name, "shape": list(t.shape), "dtype": t.dtype}


# ---------------------------------------------------------------- public API


def group_ranks(digests: Mapping[int, str], hosts: Mapping[int, str] | None = None) -> list[Group]:
    """Ranks with equal digests form one group; groups come lowest rank first."""
    members: dict[str, list[int]] = {}
    for rank in sorted(digests):
        members.setdefault(digests[rank], []).append(rank)
    hosts = hosts or {}
    return [
        Group(
            ranks=tuple(ranks),
            digest=digest,
            hosts=tuple(sorted({hosts[r] for r in ranks if r in hosts})),
        )
        for digest, ranks in members.items()  # insertion order is lowest rank first
    ]


def analyse(groups: Sequence[Group], records: Mapping[int, RankRecord]) -> list[Finding]:
    """Every difference between each usable group and the reference group."""
    reference = reference_group(groups, records)
    if reference is None:
        return []
    findings: list[Finding] = []
    for group in usable_groups(groups, records):
        if group is not reference:
            findings.extend(_compare(reference, group, records))
    findings.extend(_state_findings(reference, groups, records))
    return findings


def verdict(findings: Sequence[Finding], errors: Sequence[RankError]) -> tuple[Verdict, ExitCode]:
    """``latent``: the ranks agree now, but only because they share a hash seed."""
    if errors:
        bad_input = all(e.kind == ErrorKind.INPUT for e in errors)
        return Verdict.ERROR, ExitCode.BAD_INPUT if bad_input else ExitCode.RUNTIME
    # A wrong prediction is fsdpcheck's bug, not a difference between the ranks.
    findings = [f for f in findings if f.kind != FindingKind.PREDICTION]
    if findings and all(f.kind == FindingKind.HASH_SEED for f in findings):
        return Verdict.LATENT, ExitCode.FINDINGS
    if findings:
        return Verdict.INCONSISTENT, ExitCode.FINDINGS
    return Verdict.CONSISTENT, ExitCode.CONSISTENT


def phrase(kind: str) -> str:
    member = finding_kind(kind)
    return member.phrase if member is not None else kind


def kind_order(kind: str) -> int:
    member = finding_kind(kind)
    return member.order if member is not None else len(FindingKind)


def headline(findings: Sequence[Finding], errors: Sequence[RankError], world_size: int) -> str:
    """One short line a person can act on."""
    if errors:
        return _error_headline(errors)
    findings = [f for f in findings if f.kind != FindingKind.PREDICTION]  # report_headline says it
    if not findings:
        if world_size <= 1:
            return "1 rank: nothing to compare across ranks"
        return f"all {world_size} ranks consistent"
    first = min(findings, key=_headline_key)
    same = [f for f in findings if (f.kind, f.cause) == (first.kind, first.cause)]
    ranks = {r for f in same for r in f.ranks}
    where = f"on {ranks_label(ranks)}" if ranks else "across hash seeds"
    line = f"{phrase(first.kind)} {where} ({first.cause})"
    rest = len(findings) - len(same)
    if rest:
        line += f"; {rest} other difference{'s' if rest > 1 else ''}"
    return line


# ---------------------------------------------------------------- internals


def _headline_key(f: Finding) -> tuple:
    stage = STAGES.index(f.stage) if f.stage in STAGES else len(STAGES)
    return kind_order(f.kind), stage, min(f.ranks, default=0)


def _has_record(group: Group, records: Mapping[int, RankRecord]) -> bool:
    record = records.get(group.representative)
    return record is not None and record.error is None


def _error_headline(errors: Sequence[RankError]) -> str:
    ordered = sorted(errors, key=lambda e: e.rank)
    first = ordered[0]
    alike = [e for e in ordered if (e.stage, e.message) == (first.stage, first.message)]
    lines = first.message.strip().splitlines()
    message = lines[0] if lines else ""
    if len(message) > 160:
        message = message[:157] + "..."
    line = f"{ranks_label(e.rank for e in alike)} failed at {first.stage}: {message}"
    rest = len({e.rank for e in ordered} - {e.rank for e in alike})
    if rest:
        line += f"; {rest} more rank{'s' if rest > 1 else ''} failed differently"
    return line


class _Sides:
    """Who is compared, for summaries: the reference rank and the differing group's ranks."""

    def __init__(self, reference: Group, group: Group):
        self.ref_rank = reference.representative
        self.ranks = group.ranks
        self.ref = f"rank {self.ref_rank}"
        self.other = ranks_label(group.ranks)

    def verb(self, singular: str, plural: str) -> str:
        """``rank 1 has`` / ``ranks 1,3 have``."""
        return f"{self.other} {singular if len(self.ranks) == 1 else plural}"


def _compare(reference: Group, group: Group, records: Mapping[int, RankRecord]) -> list[Finding]:
    ref, other = records[reference.representative], records[group.representative]
    sides = _Sides(reference, group)
    findings: list[Finding] = []

    env = _env_difference(ref, other, sides)
    if env is not None:
        details, summary = env
        findings.append(_finding("env", sides, "pre-wrap", "environment", summary, details))

    raw: dict[str, dict[str, tuple]] = {}
    for stage, a, b in (
        ("pre-wrap", ref.pre_wrap, other.pre_wrap),
        ("post-wrap", ref.post_wrap, other.post_wrap),
    ):
        if a is not None and b is not None:
            raw[stage] = _stage_differences(a, b, stage, sides)

    pre, post = raw.get("pre-wrap"), raw.get("post-wrap")
    for kind in FindingKind:
        if kind == "env":
            continue
        if pre is not None and kind in pre:
            if _explained(kind, pre):
                continue
            tensors, details, summary = pre[kind]
            details = {**details, "persists_after_wrap": None if post is None else kind in post}
            findings.append(
                _finding(kind, sides, "pre-wrap", "construction-time", summary, details, tensors)
            )
        elif post is not None and kind in post and not _explained(kind, post):
            tensors, details, summary = post[kind]
            # Without a pre-wrap fingerprint we cannot tell construction from wrapping.
            cause = "wrapping" if pre is not None else "unknown"
            findings.append(_finding(kind, sides, "post-wrap", cause, summary, details, tensors))
    findings.sort(key=lambda f: (kind_order(f.kind), STAGES.index(f.stage)))
    return findings


def _state_findings(
    reference: Group, groups: Sequence[Group], records: Mapping[int, RankRecord]
) -> list[Finding]:
    """Wrap plan and config of each group against the reference; devices of every group."""
    ref_rank = reference.representative
    ref = records[ref_rank]
    usable = usable_groups(groups, records)
    findings: list[Finding] = []
    for group in usable:
        if group is not reference:
            other = records[group.representative]
            findings.extend(
                wrap_plan_findings(ref_rank, ref.fsdp_plan, group.ranks, other.fsdp_plan)
            )
            findings.extend(config_findings(ref_rank, ref.config, group.ranks, other.config))
    findings.extend(
        device_findings(ref_rank, [(g.ranks, records[g.representative]) for g in usable])
    )
    return findings


def _explained(kind: str, diffs: Mapping[str, tuple]) -> bool:
    # A state-dict walk follows module order, so a buffer/param order change already explains it.
    return kind == "state-dict-order" and any(k in diffs for k in _ORDER_KINDS)


def _finding(
    kind: str,
    sides: _Sides,
    stage: str,
    cause: str,
    summary: str,
    details: Mapping[str, Any],
    tensors: Sequence[str] = (),
) -> Finding:
    return Finding(
        kind=kind,
        ranks=tuple(sides.ranks),
        reference_rank=sides.ref_rank,
        stage=stage,
        cause=cause,
        summary=summary + _STAGE_NOTE.get(cause, ""),
        tensors=tuple(tensors),
        details=details,
    )


def _env_difference(ref: RankRecord, other: RankRecord, sides: _Sides) -> tuple | None:
    diffs = [
        {"field": name, "reference": a, "other": b}
        for name, a, b in zip(ENV_FIELDS, ref.env.versions(), other.env.versions(), strict=True)
        if a != b
    ]
    if not diffs:
        return None
    text = "; ".join(
        f"{d['field']} {d['reference']} on {sides.ref} but {d['other']} on {sides.other}"
        for d in diffs
    )
    return {"differences": diffs}, f"{FindingKind.ENV.phrase}: {text}"


def _stage_differences(a: Fingerprint, b: Fingerprint, stage: str, sides: _Sides) -> dict:
    """kind -> (tensors, details, summary) for one stage, before cause attribution."""
    out: dict[str, tuple] = {}
    for prefix, ref_list, other_list in (
        ("buffer", a.buffers, b.buffers),
        ("param", a.params, b.params),
    ):
        _tensor_differences(out, prefix, ref_list, other_list, sides)
        if prefix == "param" and stage == Snapshot.POST_WRAP:
            _field_difference(out, "param-placement", ref_list, other_list, sides)
    sd = _state_dict_order(a.state_dict_keys, b.state_dict_keys, sides)
    if sd is not None:
        out["state-dict-order"] = sd
    grads = requires_grad_difference(a, b, sides.ref, sides.other)
    if grads is not None:
        out["requires-grad"] = grads
    return out


def _tensor_differences(
    out: dict,
    prefix: str,
    ref_list: Sequence[TensorRecord],
    other_list: Sequence[TensorRecord],
    sides: _Sides,
) -> None:
    ref_names = {t.name for t in ref_list}
    other_names = {t.name for t in other_list}
    only_ref = [t for t in ref_list if t.name not in other_names]
    only_other = [t for t in other_list if t.name not in ref_names]
    if only_ref or only_other:
        out[f"{prefix}-set"] = _set_difference(
            prefix, ref_list, other_list, only_ref, only_other, sides
        )
    _field_difference(out, f"{prefix}-shape", ref_list, other_list, sides)
    _field_difference(out, f"{prefix}-dtype", ref_list, other_list, sides)
    if prefix == "buffer":
        _field_difference(out, "buffer-persistence", ref_list, other_list, sides)
    order = _order_difference(prefix, ref_list, other_list, sides)
    if order is not None:
        out[f"{prefix}-order"] = order


def _first_divergence(
    ref_list: Sequence[TensorRecord], other_list: Sequence[TensorRecord]
) -> dict[str, Any] | None:
    for i in range(max(len(ref_list), len(other_list))):
        a = ref_list[i] if i < len(ref_list) else None
        b = other_list[i] if i < len(other_list) else None
        if a is None or b is None or a.name != b.name:
            return {"index": i, "reference": tensor_dict(a), "other": tensor_dict(b)}
    return None


def _listed(tensors: Sequence[TensorRecord]) -> str:
    text = ", ".join(describe(t) for t in tensors[:_LISTED])
    if len(tensors) > _LISTED:
        text += f" and {len(tensors) - _LISTED} more"
    return text


def _set_difference(prefix, ref_list, other_list, only_ref, only_other, sides: _Sides) -> tuple:
    parts = []
    if only_ref:
        parts.append(f"only {sides.ref} has {_listed(only_ref)}")
    if only_other:
        parts.append(f"only {sides.verb('has', 'have')} {_listed(only_other)}")
    details = {
        "only_reference": [t.name for t in only_ref],
        "only_other": [t.name for t in only_other],
        "first_divergence": _first_divergence(ref_list, other_list),
    }
    tensors = [t.name for t in only_ref] + [t.name for t in only_other]
    return tensors, details, f"{phrase(prefix + '-set')}: {'; '.join(parts)}"


_FIELDS = {
    "shape": (lambda t: t.shape, lambda t: list(t.shape), format_shape),
    "dtype": (lambda t: t.dtype, lambda t: t.dtype, str),
    "persistence": (
        lambda t: t.persistent,
        lambda t: t.persistent,
        lambda v: {True: "persistent", False: "non-persistent"}.get(v, "of unknown persistence"),
    ),
    "placement": (
        lambda t: t.placements,
        lambda t: None if t.placements is None else list(t.placements),
        lambda v: "not sharded" if v is None else "[" + ", ".join(v) + "]",
    ),
}


def _field_difference(out: dict, kind: str, ref_list, other_list, sides: _Sides) -> None:
    """Per common name, one attribute (shape, dtype, persistence, placement) that differs."""
    get, jsonable, show = _FIELDS[kind.split("-", 1)[1]]
    others = {t.name: t for t in other_list}
    diffs = []
    for a in ref_list:
        b = others.get(a.name)
        if b is not None and get(a) != get(b):
            diffs.append((a, b))
    if not diffs:
        return
    text = "; ".join(
        f"{a.name} is {show(get(a))} on {sides.ref} but {show(get(b))} on {sides.other}"
        for a, b in diffs[:_LISTED]
    )
    if len(diffs) > _LISTED:
        text += f"; and {len(diffs) - _LISTED} more"
    details = {
        "differences": [
            {"name": a.name, "reference": jsonable(a), "other": jsonable(b)} for a, b in diffs
        ]
    }
    out[kind] = ([a.name for a, _ in diffs], details, f"{phrase(kind)}: {text}")


def _moved(ref_names: Sequence[str], other_names: Sequence[str]) -> list[str] | None:
    """Common names whose position among the common names differs; None if the order agrees."""
    common = set(ref_names) & set(other_names)
    ref_common = [n for n in ref_names if n in common]
    other_common = [n for n in other_names if n in common]
    if ref_common == other_common:
        return None
    position = {n: i for i, n in enumerate(other_common)}
    return [n for i, n in enumerate(ref_common) if position[n] != i]


def _order_difference(prefix, ref_list, other_list, sides: _Sides) -> tuple | None:
    moved = _moved([t.name for t in ref_list], [t.name for t in other_list])
    if moved is None:
        return None
    first = _first_divergence(ref_list, other_list)
    i = first["index"] if first else 0
    a = ref_list[i] if i < len(ref_list) else None
    b = other_list[i] if i < len(other_list) else None
    summary = (
        f"{phrase(prefix + '-order')} at index {i}: {sides.ref} has {describe(a)}, "
        f"{sides.verb('has', 'have')} {describe(b)}"
    )
    return moved, {"first_divergence": first, "moved": moved}, summary


def _state_dict_order(ref_keys: Sequence[str], other_keys: Sequence[str], sides: _Sides):
    if set(ref_keys) != set(other_keys) or list(ref_keys) == list(other_keys):
        return None
    i = next(i for i, (a, b) in enumerate(zip(ref_keys, other_keys, strict=False)) if a != b)
    moved = _moved(ref_keys, other_keys) or []
    details = {
        "first_divergence": {"index": i, "reference": ref_keys[i], "other": other_keys[i]},
        "moved": moved,
    }
    summary = (
        f"{FindingKind.STATE_DICT_ORDER.phrase} at index {i}: {sides.ref} walks {ref_keys[i]}, "
        f"{sides.verb('walks', 'walk')} {other_keys[i]}"
    )
    return moved, details, summary
