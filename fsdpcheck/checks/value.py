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

The keys that say so (:func:`replica_keys`) travel in each rank's gather slot. Tensors on
``meta`` have no values and are never compared.

Digest-first: each rank puts two digests in its gather slot (:func:`value_digests`); only the
lowest rank of each distinct digest sends its full record (:func:`value_senders`), at most
:data:`SENDER_LIMIT` of them, so ranks that agree still send a fixed number of bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from fsdpcheck.checks.wrapper import canonical_record
from fsdpcheck.records import (
    Finding,
    Fingerprint,
    MeshRecord,
    RankRecord,
    TensorRecord,
    short_digest,
)
from fsdpcheck.text import ranks_label
from fsdpcheck.vocab import Cause, FindingKind, Snapshot

SENDER_LIMIT = 8  # distinct value digests (and replica sets) examined in detail
_LISTED = 3
_CAUSE = {
    Snapshot.PRE_WRAP: Cause.CONSTRUCTION_TIME,
    Snapshot.POST_WRAP: Cause.WRAPPING,
    Snapshot.LOAD: Cause.LOADING,
}


_REPLICATE = ("R", "Replicate()")


def is_sharded(t: TensorRecord) -> bool:
    """Any placement but Replicate: ``S(0)``, ``_S(0, 2)``, ``Shard(dim=0)``, ``P(sum)``..."""
    return t.placements is not None and any(p not in _REPLICATE for p in t.placements)


def replica_keys(
    params: tuple[TensorRecord, ...], meshes: tuple[MeshRecord, ...]
) -> tuple[str | None, str | None]:
    """(shard key, peer key) of a rank whose parameters are ``params`` (its latest look) on
    ``meshes``. Ranks with equal shard keys hold the same local shards: for every sharded
    parameter the same mesh (global ranks) and the same coordinate along its non-Replicate
    dims. Ranks with equal peer keys hold DTensors on the same set of meshes, so their unsharded
    tensors must agree. None: no such parameter (no DTensor at all, for the peer key)."""
    by_id = {m.id: m for m in meshes}
    on: set[str] = set()
    places: set[tuple] = set()
    for t in params:
        mesh = by_id.get(t.mesh) if t.mesh is not None else None
        if mesh is None or t.placements is None:
            continue
        # TP ranks' sibling sub-meshes hold the same tensor: one mesh, for who is compared.
        key = mesh.family or mesh.id
        on.add(key)
        dims = tuple(i for i, p in enumerate(t.placements) if p not in _REPLICATE)
        if dims and mesh.coordinate is not None:
            places.add((key, dims, tuple(mesh.coordinate[i] for i in dims)))
    shard = short_digest(repr(sorted(places))) if places else None
    peers = short_digest(repr(sorted(on))) if on else None
    return shard, peers


def value_digests(record: RankRecord) -> tuple[str | None, str | None]:
    """(digest of what must agree on every rank, digest of this rank's local shards); ``None``
    where the rank holds no values to compare (on meta, or nothing gathered). Each tensor that
    holds values counts with its device: a buffer on ``cuda`` on one rank and ``cpu`` on another
    makes them differ even with equal values (the ``device`` check names it)."""
    shared: list[tuple[str, ...]] = []
    replica: list[tuple[str, ...]] = []
    record = canonical_record(record)  # a rank that wraps holds the same tensors by these names
    for fp in record.fingerprints():
        for t in fp.buffers:
            if t.digest is not None:
                shared.append((fp.snapshot, "buffer", t.name, t.device, t.digest))
        for t in fp.params:
            if t.digest is not None:
                entry = (fp.snapshot, "param", t.name, t.device, t.digest)
                (replica if is_sharded(t) else shared).append(entry)
    return (
        short_digest(repr(shared)) if shared else None,
        short_digest(repr(replica)) if replica else None,
    )


def _by_digest(digests: Mapping[int, str | None], ranks: Sequence[int]) -> dict[str, list[int]]:
    """digest → its ranks, lowest rank first; ranks without a digest left out."""
    out: dict[str, list[int]] = {}
    for rank in sorted(ranks):
        digest = digests.get(rank)
        if digest is not None:
            out.setdefault(digest, []).append(rank)
    return out


def _replica_sets(shard_keys: Mapping[int, str | None]) -> list[list[int]]:
    sets: dict[str, list[int]] = {}
    for rank in sorted(shard_keys):
        if shard_keys[rank] is not None:
            sets.setdefault(shard_keys[rank], []).append(rank)
    return [ranks for ranks in sets.values() if len(ranks) > 1]


def peer_sets(ranks: Sequence[int], peer_keys: Mapping[int, str | None] | None) -> list[list[int]]:
    """The sets of ranks whose unsharded values are compared with each other: ranks with equal
    peer keys (a rank without one: with the others without one). One set of every rank when
    no peer keys were gathered."""
    sets: dict[str | None, list[int]] = {}
    for rank in sorted(ranks):
        sets.setdefault((peer_keys or {}).get(rank), []).append(rank)
    return list(sets.values())


def comparisons(
    ranks: Sequence[int],
    shard_keys: Mapping[int, str | None],
    peer_keys: Mapping[int, str | None] | None = None,
) -> dict[str, list[list[int]]]:
    """Which ranks' values were compared with which: ``unsharded`` (buffers, unsharded
    parameters) and ``shards`` (local shards, among replicas), each a list of rank sets."""
    return {
        "unsharded": [s for s in peer_sets(ranks, peer_keys) if len(s) > 1],
        "shards": _replica_sets({r: shard_keys.get(r) for r in ranks}),
    }


def value_senders(
    values: Mapping[int, str | None],
    replicas: Mapping[int, str | None],
    shard_keys: Mapping[int, str | None],
    peer_keys: Mapping[int, str | None] | None = None,
) -> set[int]:
    """Ranks whose full record rank 0 needs to name differing tensors; every rank computes the
    same set from the slots. Empty when every rank agrees."""
    senders: set[int] = set()
    differing = 0
    for members in peer_sets(list(values), peer_keys):
        groups = _by_digest(values, members)
        if len(groups) > 1 and differing < SENDER_LIMIT:
            differing += 1
            senders.update(ranks[0] for ranks in list(groups.values())[:SENDER_LIMIT])
    for members in _replica_sets(shard_keys):
        groups = _by_digest(replicas, members)
        if len(groups) > 1 and differing < SENDER_LIMIT:
            differing += 1
            senders.update(ranks[0] for ranks in list(groups.values())[:SENDER_LIMIT])
    return senders


def not_compared(
    values: Mapping[int, str | None], replicas: Mapping[int, str | None]
) -> tuple[int, ...]:
    """Ranks that hold no values at all (every tensor on meta)."""
    return tuple(r for r in sorted(values) if values[r] is None and replicas.get(r) is None)


def value_findings(
    records: Mapping[int, RankRecord],
    values: Mapping[int, str | None],
    replicas: Mapping[int, str | None],
    shard_keys: Mapping[int, str | None],
    peer_keys: Mapping[int, str | None] | None = None,
) -> list[Finding]:
    """One finding per group of ranks whose must-agree values differ from their peers'
    reference (the lowest rank of the peer set), and one per replica set whose local shards
    differ. ``peer_keys`` None: every rank is every rank's peer."""
    findings: list[Finding] = []
    for members in peer_sets(list(values), peer_keys):
        groups = list(_by_digest(values, members).values())
        for ranks in groups[1:]:
            finding = _finding(records, groups[0][0], ranks, sharded=False, compared=members)
            if finding is not None:
                findings.append(finding)
    for members in _replica_sets(shard_keys):
        groups = list(_by_digest(replicas, members).values())
        for ranks in groups[1:]:
            finding = _finding(records, groups[0][0], ranks, sharded=True, compared=members)
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
) -> Finding | None:
    """``compared``: the ranks whose values were compared with each other, the reference among
    them (the replica set, for local shards)."""
    replicas = list(compared) if sharded else []
    ref, other = records.get(ref_rank), records.get(ranks[0])
    who = ranks_label(ranks)
    what = "values differ between HSDP replicas" if sharded else "values differ"
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
    diffs = compare_values(ref, other, sharded=sharded)
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
    shown = "; ".join(_describe(d, ref_rank, who) for d in diffs[:_LISTED])
    more = f"; and {len(diffs) - _LISTED} more" if len(diffs) > _LISTED else ""
    where = {"pre-wrap": " (before wrapping)", "post-wrap": " (after wrapping)"}.get(
        first["snapshot"], ""
    )
    return Finding(
        kind=FindingKind.VALUE,
        ranks=tuple(ranks),
        reference_rank=ref_rank,
        snapshot=first["snapshot"],
        cause=cause,
        summary=f"{what} on {who} from rank {ref_rank}'s{where}: {shown}{more}",
        tensors=tuple(dict.fromkeys(d["name"] for d in diffs)),
        details={
            "examined": True,
            "count": len(diffs),
            "differences": diffs[:16],
            "replicas": replicas,
            "compared": list(compared),
        },
    )


def compare_values(ref: RankRecord, other: RankRecord, *, sharded: bool) -> list[dict[str, Any]]:
    """Tensors whose digests differ, stage by stage, by name; both sides must hold values.
    Buffers either side reports as uninitialized are left to that finding."""
    explained = {p.name for r in (ref, other) for p in r.uninitialized}
    theirs = {fp.snapshot: fp for fp in other.fingerprints()}
    diffs = []
    for fp in ref.fingerprints():
        match = theirs.get(fp.snapshot)
        if match is None:
            continue
        for kind, a, b in _pairs(fp, match, sharded):
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
