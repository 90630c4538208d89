"""What a rank computes from its own record for the gather: the keys and digests its slot
carries, so that ranks that agree send a fixed number of bytes and rank 0 knows which ranks to
ask for their full records.

Value digests, shard, peer and sibling keys (which ranks must hold equal values, and whether
they do: the ``value`` check compares them, :mod:`fsdpcheck.checks.value`), where a rank's
experts sit (:class:`ExpertKey`, compared by :mod:`fsdpcheck.checks.expert`) and which of its
tensors are misplaced (``RankRecord.misplaced``, told by :mod:`fsdpcheck.checks.flags`). Pure
functions over :mod:`fsdpcheck.records`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fsdpcheck.model.names import canonical_record
from fsdpcheck.options import TP_DIMS
from fsdpcheck.records import (
    ExpertKey,
    Fingerprint,
    FsdpPlanRecord,
    MeshRecord,
    RankRecord,
    TensorRecord,
    ValueKeys,
    short_digest,
)

SENDER_LIMIT = 8  # distinct value digests (and replica sets) examined in detail
_REPLICATE = ("R", "Replicate()")
EXPERT_LEVEL = "experts"
_KEY_SIZE = 8  # bytes of place and slot in the gather slot
# Backends whose collectives only take accelerator tensors. A mixed backend string such as
# "cpu:gloo,cuda:nccl" also serves CPU tensors, so it is not in here.
_DEVICE_ONLY_BACKENDS = {"nccl": "cuda", "xccl": "xpu", "hccl": "npu"}


# ---------------------------------------------------------------- value keys and digests


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


def tp_whole_of(record: RankRecord):
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
    whole = tp_whole_of(record)
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
    whole = tp_whole_of(record)
    held = [
        (fp.snapshot, t.name, t.device, t.digest)
        for fp in record.fingerprints()
        for t in fp.params
        if t.digest is not None and whole(t)
    ]
    return short_digest(repr(held)) if held else None


def by_digest(digests: Mapping[int, str | None], ranks: Sequence[int]) -> dict[str, list[int]]:
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


def shard_sets(keys: ValueKeys) -> list[tuple[list[int], Mapping[int, str | None], bool]]:
    """(ranks holding the same local shards, their digests, on sibling sub-meshes or not)."""
    out = [(members, keys.replicas, False) for members in _replica_sets(keys.shard_keys)]
    siblings = keys.siblings or {}
    out += [(members, siblings, True) for members in _replica_sets(keys.sibling_keys or {})]
    return out


def value_keys(records: Mapping[int, RankRecord]) -> ValueKeys:
    """The :class:`ValueKeys` of ``records`` (rank → its record), as the gather's slots carry
    them."""
    values, replicas = {}, {}
    for rank in sorted(records):
        values[rank], replicas[rank] = value_digests(records[rank])
    return ValueKeys(
        values,
        replicas,
        {rank: records[rank].shard_key for rank in values},
        {rank: records[rank].peer_key for rank in values},
        {rank: records[rank].sibling_key for rank in values},
        {rank: sibling_digest(records[rank]) for rank in values},
    )


def value_senders(keys: ValueKeys) -> set[int]:
    """Ranks whose full record rank 0 needs to name differing tensors; every rank computes the
    same set from the slots. Empty when every rank agrees."""
    senders: set[int] = set()
    differing = 0
    compared = [(members, keys.values) for members in peer_sets(list(keys.values), keys.peer_keys)]
    compared += [(members, digests) for members, digests, _ in shard_sets(keys)]
    for members, digests in compared:
        groups = by_digest(digests, members)
        if len(groups) > 1 and differing < SENDER_LIMIT:
            differing += 1
            senders.update(ranks[0] for ranks in list(groups.values())[:SENDER_LIMIT])
    return senders


# ---------------------------------------------------------------- experts


def is_ep_dim(name: str | None) -> bool:
    return bool(name) and (name == "ep" or name.startswith(("ep_", "expert")))


def is_expert(name: str) -> bool:
    return EXPERT_LEVEL in name.split(".")


def latest(record: RankRecord) -> Fingerprint | None:
    return record.post_wrap or record.pre_wrap


def expert_key(record: RankRecord) -> ExpertKey | None:
    """Where this rank's experts sit and what they hold; None where no expert parameter is a
    DTensor on a recorded mesh (no slot to tell)."""
    record = canonical_record(record)
    fp = latest(record)
    if fp is None or record.error is not None:
        return None
    meshes = {m.id: m for m in record.meshes}
    places, slots, digests = set(), set(), []
    for t in fp.params:
        if not is_expert(t.name):
            continue
        digests.append((t.name, t.digest))
        mesh = meshes.get(t.mesh) if t.mesh is not None else None
        if mesh is None or t.placements is None or mesh.coordinate is None:
            continue
        ep = [i for i, n in enumerate(mesh.dim_names or ()) if is_ep_dim(n)]
        slots.add(("ep", tuple(mesh.coordinate[i] for i in ep)) if ep else ("mesh", mesh.ranks))
        sharded = [i for i, p in enumerate(t.placements) if p not in _REPLICATE and i not in ep]
        places.add((t.name, mesh.shape, tuple((i, mesh.coordinate[i]) for i in sharded)))
    if not slots:
        return None
    values = None
    if all(d is not None for _, d in digests):
        values = short_digest(repr(sorted(digests)))
    return ExpertKey(
        place=short_digest(repr(sorted(places)), size=_KEY_SIZE),
        slot=short_digest(repr(sorted(slots)), size=_KEY_SIZE),
        digest=values,
    )


# ---------------------------------------------------------------- misplaced tensors


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
    for kind, t in tensors_of(record.post_wrap):
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
    return [t.name for _, t in tensors_of(latest) if t.device == "meta"]


def misplaced(record: RankRecord) -> tuple[str, ...]:
    """``name:device`` of each device exception and ``name:meta`` of each tensor left on meta
    (:func:`left_on_meta`): what a rank puts in ``RankRecord.misplaced``, so that its group
    digest separates it from ranks whose tensors are where they belong (devices themselves are
    not in the group digest: ranks on meta before a load must not split off)."""
    wrong = [f"{e['name']}:{e['device']}" for e in device_exceptions(record)]
    return (*wrong, *(f"{name}:meta" for name in left_on_meta(record)))


def tensors_of(fp: Fingerprint):
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
