"""``optimizer``: ranks whose optimizers differ, or a resume that did not restore the optimizer.

``check_model(optimizer=)`` records each rank's optimizer (:class:`OptimizerRecord`): its param
groups' settings by name, which parameters hold state, step counts, shapes and dtypes (compared
on every rank, in the group digest), and digests of the state values, compared like parameter
values (:func:`fsdpcheck.checks.value.value_digests`): FSDP2-sharded state between replicas of
one shard, everything else between peers. With a checkpoint, each rank also records where its
loaded state falls short of the saved one (moments absent or all zero, another step count, a
scheduler at step 0): a resume that restarted the optimizer on every rank alike is found too.
Pure: records in, findings out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fsdpcheck.checks.groups import own_findings, reference_group, usable_groups
from fsdpcheck.model.keys import by_digest, comparisons, is_sharded
from fsdpcheck.records import Finding, Gathered, Group, OptimizerRecord, RankRecord
from fsdpcheck.text import clauses, name_list, ranks_label
from fsdpcheck.vocab import Cause, FindingKind, Snapshot

_LISTED = 3


def optimizer_findings(groups: Sequence[Group], gathered: Gathered) -> list[Finding]:
    """Per group whose optimizer differs from the reference group's, per set of peers (or
    replicas) whose state values differ, and per group whose state falls short of its
    checkpoint: one finding each."""
    records = gathered.records
    findings = _record_findings(groups, records)
    # State values of ranks whose optimizer already differs (another step, another lr) differ
    # as a consequence: that finding says why.
    named = {r for f in findings for r in f.ranks}
    findings += [f for f in _value_findings(gathered) if not set(f.ranks) <= named]
    return findings + own_findings(groups, records, _resumed, _resume_finding)


def _resumed(record: RankRecord) -> OptimizerRecord | None:
    """The record's optimizer where its state falls short of the checkpoint, else None."""
    found = record.optimizer
    return found if found is not None and found.resumed else None


def _record_findings(groups: Sequence[Group], records: Mapping[int, RankRecord]) -> list[Finding]:
    reference = reference_group(groups, records)
    if reference is None:
        return []
    ref_rank = reference.representative
    ref = records[ref_rank].optimizer
    findings = []
    for group in usable_groups(groups, records):
        if group is reference:
            continue
        diffs = differences(ref, records[group.representative].optimizer)
        if not diffs:
            continue
        who = ranks_label(group.ranks)
        shown = clauses(diffs, lambda d: _describe(d, ref_rank), _LISTED)
        on_state = any(d["where"].startswith("parameter ") for d in diffs)
        findings.append(
            Finding(
                kind=FindingKind.OPTIMIZER,
                ranks=tuple(group.ranks),
                reference_rank=ref_rank,
                snapshot=Snapshot.LOAD if on_state else Snapshot.POST_WRAP,
                cause=Cause.LOADING if on_state else Cause.SET_UP,
                summary=f"optimizers differ on {who} from rank {ref_rank}'s: {shown}",
                tensors=_params(diffs),
                details={"count": len(diffs), "differences": diffs[:16]},
            )
        )
    return findings


def differences(ref: OptimizerRecord | None, other: OptimizerRecord | None) -> list[dict]:
    """What differs between two ranks' optimizers, by place (``optimizer``, ``param group N``,
    ``parameter NAME``, ``scheduler``) and field, each side's value as text."""
    if ref is None and other is None:
        return []
    if ref is None or other is None:
        return [_diff("optimizer", "given", ref is not None, other is not None)]
    out = []
    if ref.cls != other.cls:
        out.append(_diff("optimizer", "class", ref.cls, other.cls))
    if len(ref.groups) != len(other.groups):
        out.append(_diff("optimizer", "param groups", len(ref.groups), len(other.groups)))
    for a, b in zip(ref.groups, other.groups, strict=False):
        where = f"param group {a.index}"
        if a.params != b.params:
            out.append(_diff(where, "params", len(a.params), len(b.params)))
        out += _mapping_diffs(where, dict(a.hyper), dict(b.hyper))
    out += _state_diffs(ref, other)
    if ref.scheduler != other.scheduler:
        for name in ("cls", "last_epoch", "step_count", "lrs"):
            a = getattr(ref.scheduler, name, None)
            b = getattr(other.scheduler, name, None)
            if a != b:
                out.append(_diff("scheduler", name, a, b))
    if ref.checkpoint_entries != other.checkpoint_entries:
        out.append(
            _diff(
                "optimizer", "checkpoint entries", ref.checkpoint_entries, other.checkpoint_entries
            )
        )
    return out


def _state_diffs(ref: OptimizerRecord, other: OptimizerRecord) -> list[dict]:
    mine = {s.param: s for s in ref.states}
    theirs = {s.param: s for s in other.states}
    out = []
    for name in dict.fromkeys([*mine, *theirs]):
        where = f"parameter {name}"
        a, b = mine.get(name), theirs.get(name)
        if a is None or b is None:
            out.append(_diff(where, "state", _held(a), _held(b)))
            continue
        out += _mapping_diffs(where, dict(a.scalars), dict(b.scalars))
        ta, tb = {t.key: t for t in a.tensors}, {t.key: t for t in b.tensors}
        if set(ta) != set(tb):
            out.append(_diff(where, "state keys", sorted(ta), sorted(tb)))
        for key in ta.keys() & tb.keys():
            for field in ("shape", "dtype", "placements"):
                x, y = getattr(ta[key], field), getattr(tb[key], field)
                if x != y:
                    out.append(_diff(where, f"{key} {field}", x, y))
    return out


def _held(state: Any) -> str:
    return "absent" if state is None else "present"


def _mapping_diffs(where: str, a: Mapping[str, str], b: Mapping[str, str]) -> list[dict]:
    return [
        _diff(where, key, a.get(key, "absent"), b.get(key, "absent"))
        for key in dict.fromkeys([*a, *b])
        if a.get(key) != b.get(key)
    ]


def _diff(where: str, field: str, reference: Any, other: Any) -> dict:
    def shown(v: Any) -> Any:
        return list(v) if isinstance(v, tuple) else v

    return {"where": where, "field": field, "reference": shown(reference), "other": shown(other)}


def _describe(d: Mapping[str, Any], ref_rank: int) -> str:
    return f"{d['where']} {d['field']} {d['other']} (rank {ref_rank}: {d['reference']})"


def _params(diffs: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
    return tuple(
        dict.fromkeys(
            d["where"].removeprefix("parameter ")
            for d in diffs
            if d["where"].startswith("parameter ")
        )
    )


def _value_findings(gathered: Gathered) -> list[Finding]:
    """Peers (or replicas of one shard) whose optimizer state values differ, by parameter."""
    keys = gathered.value_keys
    if keys is None:
        return []
    everyone = {**gathered.records, **(gathered.extra or {})}
    sets = comparisons(list(keys.values), keys.shard_keys, keys.peer_keys)
    findings = []
    for sharded, members_list, digests in (
        (False, sets["unsharded"], keys.values),
        (True, sets["shards"], keys.replicas),
    ):
        for members in members_list:
            groups = list(by_digest(digests, members).values())
            for ranks in groups[1:]:
                ref, other = everyone.get(groups[0][0]), everyone.get(ranks[0])
                if ref is None or other is None:
                    continue  # past the gather's sender limit: the value check says so
                diffs = state_value_diffs(ref.optimizer, other.optimizer, sharded=sharded)
                if diffs:
                    findings.append(_value_finding(groups[0][0], ranks, diffs, members, sharded))
    return findings


def state_value_diffs(
    ref: OptimizerRecord | None, other: OptimizerRecord | None, *, sharded: bool
) -> list[dict]:
    """(parameter, state key) whose digests differ, among the sharded or the unsharded state."""
    if ref is None or other is None:
        return []
    theirs = {(s.param, t.key): t for s in other.states for t in s.tensors}
    out = []
    for s in ref.states:
        for t in s.tensors:
            match = theirs.get((s.param, t.key))
            if match is None or t.digest is None or match.digest is None:
                continue
            if is_sharded(t) == sharded == is_sharded(match) and t.digest != match.digest:
                out.append({"param": s.param, "key": t.key})
    return out


def _value_finding(
    ref_rank: int, ranks: Sequence[int], diffs: list[dict], members: Sequence[int], sharded: bool
) -> Finding:
    who = ranks_label(ranks)
    what = "state values differ between replicas" if sharded else "state values differ"
    shown = name_list([f"{d['param']} {d['key']}" for d in diffs], _LISTED)
    return Finding(
        kind=FindingKind.OPTIMIZER,
        ranks=tuple(ranks),
        reference_rank=ref_rank,
        snapshot=Snapshot.LOAD,
        cause=Cause.LOADING,
        summary=f"optimizer {what} on {who} from rank {ref_rank}'s: {shown}",
        tensors=tuple(dict.fromkeys(d["param"] for d in diffs)),
        details={"count": len(diffs), "differences": diffs[:16], "compared": list(members)},
    )


def _resume_finding(group: Group, found: OptimizerRecord) -> Finding:
    who = ranks_label(group.ranks)
    mismatches = found.resumed
    shown = clauses(
        mismatches,
        lambda m: (
            f"{m.param + ' ' if m.param else 'lr scheduler '}{m.field} {m.loaded} "
            f"(checkpoint: {m.saved})"
        ),
        _LISTED,
    )
    return Finding(
        kind=FindingKind.OPTIMIZER,
        ranks=tuple(group.ranks),
        reference_rank=group.representative,
        snapshot=Snapshot.LOAD,
        cause=Cause.LOADING,
        summary=f"optimizer state not restored from the checkpoint on {who}: {shown}",
        tensors=tuple(dict.fromkeys(m.param for m in mismatches if m.param)),
        details={
            "count": len(mismatches),
            "mismatches": [
                {"param": m.param, "field": m.field, "loaded": m.loaded, "saved": m.saved}
                for m in mismatches[:16]
            ],
        },
    )
