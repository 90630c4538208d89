"""``value``: tensors that must be identical across ranks but are not, compared by name.

Which ranks must agree comes from the device meshes the ranks' DTensors live on (their global
ranks, :class:`MeshRecord`) and the DTensors' placements, never from shapes alone:

- Local shards of a sharded parameter (any placement but Replicate) must agree among ranks that
  hold it on the same mesh (the same global ranks) at the same place along every non-Replicate
  dim: HSDP replicas. Tensor-parallel shards, FSDP shards and expert groups differ by design.
- Every other tensor (buffers, unsharded and fully Replicate parameters, everything before
  wrapping) must agree among ranks whose DTensors live on the same set of meshes: every rank
  for FSDP2 over all ranks or one HSDP mesh, each group's ranks where each group of ranks runs
  FSDP2 over its own sub-mesh (expert or pipeline groups), every rank where none holds a DTensor.
  Each TP rank's sibling sub-mesh (``MeshRecord.family``: the data dims of one root mesh, across
  tp) counts as one mesh: what tensor parallelism left whole is one tensor on every TP rank.
- Local shards of what tensor parallelism left whole (:func:`tp_whole`: a norm FSDP2-sharded
  over the data dims alone, on a sibling sub-mesh, or Replicate along tp on the root mesh) are
  compared on their own (:func:`sibling_key`, :func:`sibling_digest`): among ranks at the same
  place on the non-Replicate dims, whatever their TP coordinate, since a TP rank's
  Colwise/Rowwise shards make every rank's shard key its own. Those TP shards are never in
  that comparison.

The keys that say so (:func:`replica_keys`, :func:`sibling_key`, computed on each rank in
:mod:`fsdpcheck.model.keys` with the digests below) travel in each rank's gather slot.
Tensors on ``meta`` have no values and are never compared.

Digest-first: each rank puts three digests in its gather slot (:func:`value_digests`,
:func:`sibling_digest`); only the lowest rank of each distinct digest sends its full record
(:func:`value_senders`), at most :data:`SENDER_LIMIT` of them, so ranks that agree still send
a fixed number of bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from fsdpcheck.model.keys import (
    SENDER_LIMIT,
    by_digest,
    is_sharded,
    peer_sets,
    shard_sets,
    tp_whole_of,
)
from fsdpcheck.records import (
    Finding,
    Fingerprint,
    RankRecord,
    ValueKeys,
)
from fsdpcheck.text import clauses, ranks_label
from fsdpcheck.vocab import Cause, FindingKind, Snapshot

_LISTED = 3
_CAUSE = {
    Snapshot.PRE_WRAP: Cause.CONSTRUCTION_TIME,
    Snapshot.POST_WRAP: Cause.WRAPPING,
    Snapshot.LOAD: Cause.LOADING,
}


_SHARDS_DIFFER = {
    False: "values differ between HSDP replicas",
    True: "values differ between tensor-parallel replicas",
}


def not_compared(
    values: Mapping[int, str | None],
    replicas: Mapping[int, str | None],
    siblings: Mapping[int, str | None] | None = None,
) -> tuple[int, ...]:
    """Ranks that hold no values at all (every tensor on meta)."""
    held = (replicas, siblings or {})
    return tuple(
        r for r in sorted(values) if values[r] is None and all(d.get(r) is None for d in held)
    )


def value_findings(records: Mapping[int, RankRecord], keys: ValueKeys) -> list[Finding]:
    """One finding per group of ranks whose must-agree values differ from their peers'
    reference (the lowest rank of the peer set), and one per replica set (or set of ranks
    holding one shard on TP sibling sub-meshes) whose local shards differ. No peer keys:
    every rank is every rank's peer."""
    findings: list[Finding] = []
    for members in peer_sets(list(keys.values), keys.peer_keys):
        groups = list(by_digest(keys.values, members).values())
        for ranks in groups[1:]:
            finding = _finding(records, groups[0][0], ranks, sharded=False, compared=members)
            if finding is not None:
                findings.append(finding)
    for members, digests, on_siblings in shard_sets(keys):
        groups = list(by_digest(digests, members).values())
        for ranks in groups[1:]:
            finding = _finding(
                records, groups[0][0], ranks, sharded=True, compared=members, siblings=on_siblings
            )
            if finding is not None:
                findings.append(finding)
    return findings


def _finding(
    records: Mapping[int, RankRecord],
    ref_rank: int,
    ranks: Sequence[int],
    *,
    sharded: bool,
    compared: Sequence[int] = (),
    siblings: bool = False,
) -> Finding | None:
    """``compared``: the ranks whose values were compared with each other, the reference among
    them (the replica set, for local shards). ``siblings``: local shards on TP sibling
    sub-meshes (what tensor parallelism left whole), not the HSDP replicas' other shards."""
    replicas = list(compared) if sharded else []
    ref, other = records.get(ref_rank), records.get(ranks[0])
    who = ranks_label(ranks)
    what = "values differ" if not sharded else _SHARDS_DIFFER[siblings]
    if ref is None or other is None:  # past SENDER_LIMIT: known to differ, not examined
        return Finding(
            kind=FindingKind.VALUE,
            ranks=tuple(ranks),
            reference_rank=ref_rank,
            snapshot=Snapshot.POST_WRAP if sharded else Snapshot.PRE_WRAP,
            cause=Cause.UNKNOWN,
            summary=f"{what} on {who} from rank {ref_rank}'s (not examined: more than "
            f"{SENDER_LIMIT} distinct values)",
            details={"examined": False, "replicas": replicas, "compared": list(compared)},
        )
    diffs = compare_values(ref, other, sharded=sharded, siblings=siblings if sharded else None)
    if sharded:  # shards of parameters that already differed whole, before wrapping, are told
        before = {d["name"] for d in compare_values(ref, other, sharded=False)}
        diffs = [d for d in diffs if d["name"] not in before]
    if not diffs:  # only meta-vs-real or buffers already reported as uninitialized
        return None
    first = diffs[0]
    stages = {fp.snapshot for fp in ref.fingerprints()} & {
        fp.snapshot for fp in other.fingerprints()
    }
    cause = _CAUSE.get(first["snapshot"], Cause.UNKNOWN)
    if cause == Cause.WRAPPING and Snapshot.PRE_WRAP not in stages:
        cause = Cause.UNKNOWN  # no pre-wrap values to tell construction from wrapping
    shown = clauses(diffs, lambda d: _describe(d, ref_rank, who), _LISTED)
    where = {"pre-wrap": " (before wrapping)", "post-wrap": " (after wrapping)"}.get(
        first["snapshot"], ""
    )
    return Finding(
        kind=FindingKind.VALUE,
        ranks=tuple(ranks),
        reference_rank=ref_rank,
        snapshot=first["snapshot"],
        cause=cause,
        summary=f"{what} on {who} from rank {ref_rank}'s{where}: {shown}",
        tensors=tuple(dict.fromkeys(d["name"] for d in diffs)),
        details={
            "examined": True,
            "count": len(diffs),
            "differences": diffs[:16],
            "replicas": replicas,
            "compared": list(compared),
        },
    )


def compare_values(
    ref: RankRecord, other: RankRecord, *, sharded: bool, siblings: bool | None = None
) -> list[dict[str, Any]]:
    """Tensors whose digests differ, stage by stage, by name; both sides must hold values.
    Buffers either side reports as uninitialized are left to that finding. ``siblings``: only
    the local shards on TP sibling sub-meshes (True) or only the others (False); None: all."""
    explained = {p.name for r in (ref, other) for p in r.uninitialized}
    theirs = {fp.snapshot: fp for fp in other.fingerprints()}
    whole = (tp_whole_of(ref), tp_whole_of(other))
    diffs = []
    for fp in ref.fingerprints():
        match = theirs.get(fp.snapshot)
        if match is None:
            continue
        for kind, a, b in _pairs(fp, match, sharded):
            if siblings is not None and (whole[0](a), whole[1](b)) != (siblings,) * 2:
                continue
            if a.name in explained or a.digest is None or b.digest is None:
                continue
            if a.digest != b.digest:
                diffs.append(
                    {
                        "snapshot": fp.snapshot,
                        "kind": kind,
                        "name": a.name,
                        "reference": list(a.head or ()),
                        "other": list(b.head or ()),
                        "max_abs_diff_first_values": _max_abs_diff(a.head, b.head),
                    }
                )
    return diffs


def _pairs(a: Fingerprint, b: Fingerprint, sharded: bool):
    theirs = {t.name: t for t in b.buffers}
    if not sharded:
        for t in a.buffers:
            if t.name in theirs:
                yield "buffer", t, theirs[t.name]
    theirs = {t.name: t for t in b.params}
    for t in a.params:
        match = theirs.get(t.name)
        if match is not None and is_sharded(t) == sharded and is_sharded(match) == sharded:
            yield "param", t, match


def _max_abs_diff(a: Sequence[str] | None, b: Sequence[str] | None) -> float | None:
    try:
        diffs = [abs(float(x) - float(y)) for x, y in zip(a or (), b or (), strict=False)]
    except ValueError:  # not numbers (complex, bool)
        return None
    best = max(diffs, default=None)
    return best if best is not None and math.isfinite(best) else None


def _describe(d: Mapping[str, Any], ref_rank: int, who: str) -> str:
    text = f"{d['kind']} {d['name']}"
    if d["reference"] or d["other"]:
        text += (
            f" (first values {', '.join(d['reference'])} on rank {ref_rank}; "
            f"{', '.join(d['other'])} on {who}"
        )
        if d["max_abs_diff_first_values"] is not None:
            text += f"; max |diff| {d['max_abs_diff_first_values']:.3g} among them"
        text += ")"
    return text
