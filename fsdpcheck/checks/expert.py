"""``expert``: expert-parallel slots must hold different experts, and as many as the config says.

The failure (KempnerForge #202, UniRL #158): local experts are renumbered from 0, every EP rank
saves the same names, and a resume copies one rank's experts onto every slot. The layout
agrees and every DP replica of a slot agrees, so nothing else notices; but the model now has
one slot's experts, N times over.

Which ranks are which slot comes from the meshes their expert parameters (a ``experts`` level in
the name) live on, never from the names:

- a mesh dim named ``ep`` (``ep_...``, ``expert...``): the rank's coordinate along it is its slot;
- otherwise each slot runs its experts on its own mesh (FSDP2 over each EP group's ``dp``
  sub-mesh): the mesh's global ranks are the slot.

A rank's *place* inside its slot is its coordinate along the other dims its experts are sharded
on. Ranks at one place in different slots must hold different expert values: an equal digest
there is the finding. Ranks at one place in one slot are DP replicas; the value check compares
those (by their shard keys). Experts that are no DTensor name no slot and are not compared.
Each rank's :class:`ExpertKey` travels in its gather slot. Pure functions over
:mod:`fsdpcheck.records`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fsdpcheck.model.keys import EXPERT_LEVEL, is_ep_dim, is_expert, latest
from fsdpcheck.model.names import canonical_record
from fsdpcheck.records import (
    ExpertKey,
    Finding,
    Gathered,
    MeshRecord,
    RankRecord,
    TensorRecord,
)
from fsdpcheck.text import ranks_label
from fsdpcheck.vocab import Cause, FindingKind, Snapshot

# Config keys that count the routed experts, across transformers' MoE models.
COUNT_KEYS = (
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "moe_num_experts",
    "num_routed_experts",
)
_REPLICATE = ("R", "Replicate()")


def expert_findings(gathered: Gathered) -> list[Finding]:
    """Collapsed experts (one finding), and experts held in all that no config count matches
    (one finding), from every rank's key and the reference's record."""
    keys = {r: k for r, k in (gathered.expert_keys or {}).items() if k is not None}
    records = gathered.records
    everyone = tuple(sorted(gathered.digests))
    found = [_collapsed(keys, records), _count(keys, records, everyone)]
    return [f for f in found if f is not None]


def slot_ranks(keys: Mapping[int, ExpertKey]) -> list[list[int]]:
    """The ranks of each slot, lowest rank first."""
    slots: dict[str, list[int]] = {}
    for rank in sorted(keys):
        slots.setdefault(keys[rank].slot, []).append(rank)
    return list(slots.values())


def _collapsed(keys: Mapping[int, ExpertKey], records: Mapping[int, RankRecord]) -> Finding | None:
    by_place: dict[str, dict[str, list[int]]] = {}  # place → digest → ranks
    for rank in sorted(keys):
        key = keys[rank]
        if key.digest is not None:
            by_place.setdefault(key.place, {}).setdefault(key.digest, []).append(rank)
    collapsed = [
        ranks
        for digests in by_place.values()
        for ranks in digests.values()
        if len({keys[r].slot for r in ranks}) > 1
    ]
    if not collapsed:
        return None
    collapsed.sort()
    reference = collapsed[0][0]
    ref_slot = keys[reference].slot
    ranks = sorted({r for same in collapsed for r in same if keys[r].slot != ref_slot})
    ref_ranks = sorted({r for same in collapsed for r in same if keys[r].slot == ref_slot})
    names = _expert_names(records.get(reference))
    pairs = ", ".join("=".join(str(r) for r in same) for same in collapsed[:8])
    summary = (
        f"{FindingKind.EXPERT.phrase}: {ranks_label(ranks)} hold the same experts as "
        f"{ranks_label(ref_ranks)}, though they are other expert-parallel slots (identical "
        f"expert values at the same place in each slot: ranks {pairs}): the experts collapsed "
        "to one slot's copy"
    )
    return Finding(
        kind=FindingKind.EXPERT,
        ranks=tuple(ranks),
        reference_rank=reference,
        snapshot=_snapshot(records.get(reference)),
        cause=Cause.UNKNOWN,
        summary=summary,
        tensors=tuple(names),
        details={
            "collapsed": [list(same) for same in collapsed],
            "slots": slot_ranks(keys),
            "experts": names[:16],
        },
    )


def _snapshot(record: RankRecord | None) -> Snapshot:
    return Snapshot.POST_WRAP if record is not None and record.post_wrap else Snapshot.PRE_WRAP


def _expert_names(record: RankRecord | None) -> list[str]:
    fp = latest(canonical_record(record)) if record is not None else None
    return [t.name for t in fp.params if is_expert(t.name)] if fp is not None else []


def _count(
    keys: Mapping[int, ExpertKey], records: Mapping[int, RankRecord], everyone: tuple[int, ...]
) -> Finding | None:
    reference = min((r for r in records if records[r].error is None), default=None)
    record = records.get(reference) if reference is not None else None
    if record is None or record.error is not None or record.config is None:
        return None
    expected = config_counts(record.config.canonical)
    fp = latest(canonical_record(record))
    if not expected or fp is None:
        return None
    slots = max(len(slot_ranks(keys)), 1)
    meshes = {m.id: m for m in record.meshes}
    wrong = []
    for module, params in expert_modules(fp.params).items():
        count = global_count(params, meshes, slots)
        if count is not None and count not in expected.values():
            wrong.append({"module": module, "experts": count})
    if not wrong:
        return None
    shown = ", ".join(f"{w['module']}: {w['experts']}" for w in wrong[:3])
    keys_shown = ", ".join(f"{k}={v}" for k, v in expected.items())
    summary = (
        f"{FindingKind.EXPERT.phrase}: the ranks hold {shown} experts in all "
        f"({slots} expert-parallel slot{'s' if slots > 1 else ''}), but the config says "
        f"{keys_shown}"
    )
    return Finding(
        kind=FindingKind.EXPERT,
        ranks=everyone,
        reference_rank=reference,
        snapshot=_snapshot(record),
        cause=Cause.CONSTRUCTION_TIME,
        summary=summary,
        tensors=tuple(w["module"] for w in wrong),
        details={"count": wrong, "config": expected, "slots": slots},
    )


def config_counts(canonical: Mapping[str, Any]) -> dict[str, int]:
    """The config's expert counts (top level, or its ``text_config``), by key."""
    found: dict[str, int] = {}
    for where in (canonical, canonical.get("text_config")):
        if not isinstance(where, Mapping):
            continue
        for key in COUNT_KEYS:
            value = where.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                found.setdefault(key, value)
    return found


def expert_modules(params: Sequence[TensorRecord]) -> dict[str, list[TensorRecord]]:
    """Expert parameters by their experts module (the name up to its ``experts`` level)."""
    out: dict[str, list[TensorRecord]] = {}
    for t in params:
        parts = t.name.split(".")
        if EXPERT_LEVEL in parts:
            cut = len(parts) - 1 - parts[::-1].index(EXPERT_LEVEL)
            out.setdefault(".".join(parts[: cut + 1]), []).append(t)
    return out


def global_count(
    params: Sequence[TensorRecord], meshes: Mapping[str, MeshRecord], slots: int
) -> int | None:
    """Experts one experts module holds over every slot: its indexed children
    (``experts.3.w1``) times the slots, or a fused tensor's first dim (``experts.gate_up_proj``,
    three or more dims): its global size where a mesh dim named ``ep`` shards it, else times the
    slots. None where neither tells (an experts module of plain layers)."""
    indices = set()
    for t in params:
        parts = t.name.split(".")
        after = len(parts) - parts[::-1].index(EXPERT_LEVEL)
        if after < len(parts) and parts[after].isdigit():
            indices.add(int(parts[after]))
    if indices:
        return len(indices) * slots
    fused = [t for t in params if len(t.shape) >= 3]
    if not fused:
        return None
    t = fused[0]
    mesh = meshes.get(t.mesh) if t.mesh is not None else None
    if mesh is not None and t.placements is not None:
        ep = [i for i, n in enumerate(mesh.dim_names or ()) if is_ep_dim(n)]
        if any(t.placements[i] not in _REPLICATE for i in ep if i < len(t.placements)):
            return t.shape[0]
    return t.shape[0] * slots
