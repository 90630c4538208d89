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

The keys that say so (:func:`replica_keys`, :func:`sibling_key`) travel in each rank's gather
slot. Tensors on ``meta`` have no values and are never compared.

Digest-first: each rank puts three digests in its gather slot (:func:`value_digests`,
:func:`sibling_digest`); only the lowest rank of each distinct digest sends its full record
(:func:`value_senders`), at most :data:`SENDER_LIMIT` of them, so ranks that agree still send
a fixed number of bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from fsdpcheck.checks.wrapper import canonical_record
from fsdpcheck.options import TP_DIMS
from fsdpcheck.records import (
    Finding,
    Fingerprint,
    MeshRecord,
    RankRecord,
    TensorRecord,
    short_digest,
)
from fsdpcheck.text import clauses, ranks_label
from fsdpcheck.vocab import Cause, FindingKind, Snapshot

SENDER_LIMIT = 8  # distinct value digests (and replica sets) examined in detail
_LISTED = 3
_CAUSE = {
    Snapshot.PRE_WRAP: Cause.CONSTRUCTION_TIME,
    Snapshot.POST_WRAP: Cause.WRAPPING,
    Snapshot.LOAD: Cause.LOADING,
}


_REPLICATE = ("R", "Replicate()")
_SHARDS_DIFFER = {
    False: "values differ between HSDP replicas",
    True: "values differ between tensor-parallel replicas",
}


def is_sharded(t: TensorRecord) -> bool:
    """Any placement but Replicate: ``S(0)``, ``_S(0, 2)``, ``Shard(dim=0)``, ``P(sum)``..."""
    return t.placements is not None and any(p not in _REPLICATE for p in t.placements)


def tp_whole(t: TensorRecord, mesh: MeshRecord | None) -> bool:
    """``t`` is a local shard of what tensor parallelism left whole: sharded over data dims
    only, on a TP rank's sibling sub-mesh (``MeshRecord.family``) or on a mesh with a tp dim
    along which it is Replicate (a SequenceParallel norm). TP ranks hold the same such shard."""
    if mesh is None or t.placements is None or not is_sharded(t):
        return False
    if mesh.family is not None:
        return True
    tp = [i for i, n in enumerate(mesh.dim_names or ()) if n in TP_DIMS and i < len(t.placements)]
    return bool(tp) and all(t.placements[i] in _REPLICATE for i in tp)


def _places(
    params: tuple[TensorRecord, ...], meshes: tuple[MeshRecord, ...], *, whole: bool
) -> tuple[set[str], set[tuple]]:
    """(every mesh key ``params`` live on, their places on the non-Replicate dims) of the
    parameters tensor parallelism left whole (``whole``, :func:`tp_whole`) or of the others."""
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
        if tp_whole(t, mesh) != whole:
            continue
        dims = tuple(i for i, p in enumerate(t.placements) if p not in _REPLICATE)
        if dims and mesh.coordinate is not None:
            places.add((key, dims, tuple(mesh.coordinate[i] for i in dims)))
    return on, places


def replica_keys(
    params: tuple[TensorRecord, ...], meshes: tuple[MeshRecord, ...]
) -> tuple[str | None, str | None]:
    """(shard key, peer key) of a rank whose parameters are ``params`` (its latest look) on
    ``meshes``. Ranks with equal shard keys hold the same local shards: for every sharded
    parameter the same mesh (global ranks) and the same coordinate along its non-Replicate
    dims (what tensor parallelism left whole is :func:`sibling_key`'s). Ranks with equal peer
    keys hold DTensors on the same set of meshes, so their unsharded tensors must agree. None:
    no such parameter (no DTensor at all, for the peer key)."""
    on, places = _places(params, meshes, whole=False)
    shard = short_digest(repr(sorted(places))) if places else None
    peers = short_digest(repr(sorted(on))) if on else None
    return shard, peers


def sibling_key(params: tuple[TensorRecord, ...], meshes: tuple[MeshRecord, ...]) -> str | None:
    """Equal on ranks that hold the same local shards of what tensor parallelism left whole
    (:func:`tp_whole`): the same mesh (a sibling family counts as one) and the same coordinate
    along the non-Replicate dims, whatever the TP coordinate. None: no such parameter."""
    _, places = _places(params, meshes, whole=True)
    return short_digest(repr(sorted(places))) if places else None


def _whole(record: RankRecord):
    """:func:`tp_whole` over ``record``'s own meshes."""
    by_id = {m.id: m for m in record.meshes}
    return lambda t: tp_whole(t, by_id.get(t.mesh) if t.mesh is not None else None)


def value_digests(record: RankRecord) -> tuple[str | None, str | None]:
    """(digest of what must agree on every rank, digest of this rank's local shards); ``None``
    where the rank holds no values to compare (on meta, or nothing gathered). Each tensor that
    holds values counts with its device: a buffer on ``cuda`` on one rank and ``cpu`` on another
    makes them differ even with equal values (the ``device`` check names it)."""
    shared: list[tuple[str, ...]] = []
    replica: list[tuple[str, ...]] = []
    record = canonical_record(record)  # a rank that wraps holds the same tensors by these names
    whole = _whole(record)
    for fp in record.fingerprints():
        for t in fp.buffers:
            if t.digest is not None:
                shared.append((fp.snapshot, "buffer", t.name, t.device, t.digest))
        for t in fp.params:
            if t.digest is None or whole(t):
                continue  # what tensor parallelism left whole: sibling_digest's
            entry = (fp.snapshot, "param", t.name, t.device, t.digest)
            (replica if is_sharded(t) else shared).append(entry)
    # Optimizer state like its parameter's values: among replicas where sharded, else peers.
    for state in record.optimizer.states if record.optimizer is not None else ():
        for t in state.tensors:
            if t.digest is not None:
                entry = ("optimizer", state.param, t.key, t.digest)
                (replica if is_sharded(t) else shared).append(entry)
    return (
        short_digest(repr(shared)) if shared else None,
        short_digest(repr(replica)) if replica else None,
    )


def sibling_digest(record: RankRecord) -> str | None:
    """Digest of this rank's local shards of what tensor parallelism left whole (what
    :func:`value_digests` leaves out), compared among ranks with equal :func:`sibling_key`;
    None: none with values."""
    record = canonical_record(record)
    whole = _whole(record)
    held = [
        (fp.snapshot, t.name, t.device, t.digest)
        for fp in record.fingerprints()
        for t in fp.params
        if t.digest is not None and whole(t)
    ]
    return short_digest(repr(held)) if held else None


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
    sibling_keys: Mapping[int, str | None] | None = None,
) -> dict[str, list[list[int]]]:
    """Which ranks' values were compared with which: ``unsharded`` (buffers, unsharded
    parameters), ``shards`` (local shards, among replicas) and ``siblings`` (local shards on TP
    sibling sub-meshes, among the ranks that hold the same one), each a list of rank sets."""
    return {
        "unsharded": [s for s in peer_sets(ranks, peer_keys) if len(s) > 1],
        "shards": _replica_sets({r: shard_keys.get(r) for r in ranks}),
        "siblings": _replica_sets({r: (sibling_keys or {}).get(r) for r in ranks}),
    }


def _shard_sets(
    shard_keys: Mapping[int, str | None],
    replicas: Mapping[int, str | None],
    sibling_keys: Mapping[int, str | None] | None,
    siblings: Mapping[int, str | None] | None,
) -> list[tuple[list[int], Mapping[int, str | None], bool]]:
    """(ranks holding the same local shards, their digests, on sibling sub-meshes or not)."""
    out = [(members, replicas, False) for members in _replica_sets(shard_keys)]
    out += [(members, siblings or {}, True) for members in _replica_sets(sibling_keys or {})]
    return out


def value_senders(
    values: Mapping[int, str | None],
    replicas: Mapping[int, str | None],
    shard_keys: Mapping[int, str | None],
    peer_keys: Mapping[int, str | None] | None = None,
    sibling_keys: Mapping[int, str | None] | None = None,
    siblings: Mapping[int, str | None] | None = None,
) -> set[int]:
    """Ranks whose full record rank 0 needs to name differing tensors; every rank computes the
    same set from the slots. Empty when every rank agrees."""
    senders: set[int] = set()
    differing = 0
    compared = [(members, values) for members in peer_sets(list(values), peer_keys)]
    compared += [(m, d) for m, d, _ in _shard_sets(shard_keys, replicas, sibling_keys, siblings)]
    for members, digests in compared:
        groups = _by_digest(digests, members)
        if len(groups) > 1 and differing < SENDER_LIMIT:
            differing += 1
            senders.update(ranks[0] for ranks in list(groups.values())[:SENDER_LIMIT])
    return senders


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


def value_findings(
    records: Mapping[int, RankRecord],
    values: Mapping[int, str | None],
    replicas: Mapping[int, str | None],
    shard_keys: Mapping[int, str | None],
    peer_keys: Mapping[int, str | None] | None = None,
    sibling_keys: Mapping[int, str | None] | None = None,
    siblings: Mapping[int, str | None] | None = None,
) -> list[Finding]:
    """One finding per group of ranks whose must-agree values differ from their peers'
    reference (the lowest rank of the peer set), and one per replica set (or set of ranks
    holding one shard on TP sibling sub-meshes) whose local shards differ. ``peer_keys`` None:
    every rank is every rank's peer."""
    findings: list[Finding] = []
    for members in peer_sets(list(values), peer_keys):
        groups = list(_by_digest(values, members).values())
        for ranks in groups[1:]:
            finding = _finding(records, groups[0][0], ranks, sharded=False, compared=members)
            if finding is not None:
                findings.append(finding)
    for members, digests, on_siblings in _shard_sets(shard_keys, replicas, sibling_keys, siblings):
        groups = list(_by_digest(digests, members).values())
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
    whole = (_whole(ref), _whole(other))
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
