"""``unexplained``: the last resort behind the verdict.

``consistent`` means that every pair of ranks that must agree agrees in every field fsdpcheck
compares (every field of the per-rank record that :data:`fsdpcheck.records.AGREEMENT` does not
declare per-process or informational).
The checks before this one each explain one kind of difference; a record that differs from the
reference's while no finding names its ranks gets this finding, naming the fields, so that no
difference ever ends ``consistent`` unexplained. Pure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from fsdpcheck.checks.groups import reference_group, speakers
from fsdpcheck.checks.launch import launch_alike
from fsdpcheck.model.keys import is_sharded
from fsdpcheck.records import (
    COMPARED_AS,
    NOT_COMPARED,
    Finding,
    Gathered,
    Group,
    OptimizerTensor,
    RankRecord,
    TensorRecord,
    to_dict,
)
from fsdpcheck.text import ranks_label
from fsdpcheck.vocab import Cause, FindingKind, Snapshot

_LISTED = 3
_MAX_FIELDS = 50  # details stay bounded whatever the model's size
# Records with a values digest (compared between replicas or peers, where both hold values).
_VALUED = (TensorRecord, OptimizerTensor)
_NOT_WALKED = frozenset({"RankRecord.error"})  # a rank's failure is the report's error


def unexplained_findings(
    gathered: Gathered,
    groups: Sequence[Group],
    findings: Sequence[Finding],
    stage: Snapshot = Snapshot.PRE_WRAP,
) -> list[Finding]:
    """One finding per record that differs from the reference's while no finding names any of
    the ranks it speaks for."""
    reference = reference_group(groups, gathered.records)
    if reference is None:
        return []
    ref_rank = reference.representative
    ref = gathered.records[ref_rank]
    named = {rank for f in findings for rank in f.ranks}
    out = []
    for ranks, record in speakers(gathered, reference):
        if named & set(ranks):
            continue
        keys = (record.shard_key, record.sibling_key)  # the same local shards on both
        replicas = keys != (None, None) and keys == (ref.shard_key, ref.sibling_key)
        peers = record.peer_key == ref.peer_key  # unsharded values: on the same meshes only
        fields = record_differences(ref, record, replicas=replicas, peers=peers)
        if fields:
            out.append(_finding(ref_rank, ranks, fields, stage))
    return out


def record_differences(
    a: RankRecord, b: RankRecord, *, replicas: bool = False, peers: bool = True
) -> list[str]:
    """The paths (``post_wrap.buffers[model.rope.inv_freq].device``) of every compared field
    that differs. Values and devices count only where both ranks hold values (not on ``meta``);
    local shards only between HSDP replicas (``replicas``)."""
    out: list[str] = []
    if a.launch is not None and b.launch is not None and launch_alike(a, b):
        b = dataclasses.replace(b, launch=a.launch)  # alike up to each rank's own words
    _walk(a, b, "", out, replicas, peers)
    return out


def _walk(a: Any, b: Any, path: str, out: list[str], replicas: bool, peers: bool) -> None:
    if a is None or b is None:
        if (a is None) != (b is None):
            out.append(path)
        return
    if isinstance(a, _VALUED) and type(a) is type(b):
        _tensor(a, b, path, out, replicas, peers)
    elif dataclasses.is_dataclass(a) and type(a) is type(b):
        _fields(a, b, path, out, replicas, peers)
    elif isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        _sequence(a, b, path, out, replicas, peers)
    elif isinstance(a, Mapping) or isinstance(b, Mapping):
        if to_dict(a) != to_dict(b):  # the config check names key paths
            out.append(path)
    elif to_dict(a) != to_dict(b):  # a word and its plain value are alike
        out.append(path)


def _compared(record: Any) -> list[dataclasses.Field]:
    name = type(record).__name__
    return [
        f
        for f in dataclasses.fields(record)
        if f"{name}.{f.name}" not in NOT_COMPARED and f"{name}.{f.name}" not in _NOT_WALKED
    ]


def _fields(a: Any, b: Any, path: str, out: list[str], replicas: bool, peers: bool) -> None:
    for f in _compared(a):
        _walk(getattr(a, f.name), getattr(b, f.name), _join(path, f.name), out, replicas, peers)


def _tensor(a: Any, b: Any, path: str, out: list[str], replicas: bool, peers: bool) -> None:
    for f in _compared(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        normalise = COMPARED_AS.get(f"{type(a).__name__}.{f.name}")
        if normalise is not None:
            x, y = normalise(x), normalise(y)
        if f.name == "device" and "meta" in (x, y):
            continue  # on meta: nothing there yet, wherever it will go
        if f.name == "digest":
            sharded = is_sharded(a) or is_sharded(b)
            if x is None or y is None or (sharded and not replicas) or not (sharded or peers):
                continue  # no values on one side, or shards that are not the same shard
        _walk(x, y, _join(path, f.name), out, replicas, peers)


def _sequence(
    a: Sequence, b: Sequence, path: str, out: list[str], replicas: bool, peers: bool
) -> None:
    if all(isinstance(t, TensorRecord) for t in (*a, *b)) and (a or b):
        ours, theirs = {t.name: t for t in a}, {t.name: t for t in b}
        if [t.name for t in a] != [t.name for t in b]:
            out.append(f"{path} (names or order)")
        for name, t in ours.items():
            if name in theirs:
                _walk(t, theirs[name], f"{path}[{name}]", out, replicas, peers)
        return
    if len(a) != len(b) or not all(dataclasses.is_dataclass(x) for x in (*a, *b)):
        if to_dict(a) != to_dict(b):
            out.append(path)
        return
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        _walk(x, y, f"{path}[{i}]", out, replicas, peers)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _finding(ref_rank: int, ranks: Sequence[int], fields: list[str], stage: Snapshot) -> Finding:
    shown = ", ".join(fields[:_LISTED])
    if len(fields) > _LISTED:
        shown += f" and {len(fields) - _LISTED} more"
    who = ranks_label(ranks)
    return Finding(
        kind=FindingKind.UNEXPLAINED,
        ranks=tuple(ranks),
        reference_rank=ref_rank,
        snapshot=Snapshot.POST_WRAP if fields[0].startswith("post_wrap") else stage,
        cause=Cause.UNKNOWN,
        summary=f"{FindingKind.UNEXPLAINED.phrase}: {who} and rank {ref_rank} differ in "
        f"{shown}, which no other check explains (please report it to fsdpcheck)",
        details={"fields": fields[:_MAX_FIELDS], "count": len(fields)},
    )
