"""Bring every rank's record to rank 0 over the gloo side channel.

Built for thousands of ranks: every rank first sends rank 0 a fixed-size slot (its record's
group digest, its host, and digests of the values that must agree); then only one
representative per distinct digest, and the few ranks whose values differ, send their full
record. When all ranks agree, each rank sends the same few bytes whatever the model's size.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from fsdpcheck.distributed.environment import seed_tag
from fsdpcheck.model.keys import expert_key, sibling_digest, value_digests, value_senders
from fsdpcheck.model.memory import MEASURED
from fsdpcheck.records import (
    ExpertKey,
    Gathered,
    MemoryRecord,
    RankRecord,
    StageMemory,
    ValueKeys,
    from_dict,
    to_dict,
)
from fsdpcheck.vocab import MemoryPeak

log = logging.getLogger(__name__)

R = TypeVar("R")

_DIGEST_BYTES = 16
_HOST_BYTES = 64
_KEY_BYTES = 8
_FLAG_META = 1  # this rank built (some of) the model on meta
# Bits 1-7 of the flags byte: the rank's hash-seed tag (fsdpcheck.checks.hash_seed.seed_tag),
# so rank 0 learns which ranks share a PYTHONHASHSEED without another byte on the wire.
_SEED_SHIFT = 1
# flags, group digest, host; then the value digest, shard key, replica digest and peer key;
# then the expert place, slot and digest (fsdpcheck.checks.expert) (zeros: none); then the
# sibling key and digest (local shards of what TP left whole, fsdpcheck.checks.value).
_EXPERT_BYTES = 2 * _KEY_BYTES + _DIGEST_BYTES
_SIBLING_BYTES = _KEY_BYTES + _DIGEST_BYTES
SLOT_BYTES = (
    1 + _DIGEST_BYTES + _HOST_BYTES + _DIGEST_BYTES + 2 * _KEY_BYTES + _DIGEST_BYTES + _EXPERT_BYTES
) + _SIBLING_BYTES


def _fixed(digest: str | None, size: int) -> bytes:
    return bytes.fromhex(digest)[:size].ljust(size, b"\0") if digest else bytes(size)


def _pack_slot(
    digest: str,
    host: str,
    flags: int,
    value: str | None = None,
    shard_key: str | None = None,
    replica: str | None = None,
    peers: str | None = None,
    expert: ExpertKey | None = None,
    sibling_key: str | None = None,
    sibling: str | None = None,
) -> bytes:
    raw = bytes([flags]) + _fixed(digest, _DIGEST_BYTES)
    raw += host.encode()[:_HOST_BYTES].ljust(_HOST_BYTES, b"\0")
    return (
        raw
        + _fixed(value, _DIGEST_BYTES)
        + _fixed(shard_key, _KEY_BYTES)
        + _fixed(replica, _DIGEST_BYTES)
        + _fixed(peers, _KEY_BYTES)
        + _pack_expert(expert)
        + _fixed(sibling_key, _KEY_BYTES)
        + _fixed(sibling, _DIGEST_BYTES)
    )


def _pack_expert(key: ExpertKey | None) -> bytes:
    if key is None:
        return bytes(_EXPERT_BYTES)
    place = _fixed(key.place, _KEY_BYTES)
    return place + _fixed(key.slot, _KEY_BYTES) + _fixed(key.digest, _DIGEST_BYTES)


def _unpack_expert(raw: bytes) -> ExpertKey | None:
    place, slot = _unfixed(raw[:_KEY_BYTES]), _unfixed(raw[_KEY_BYTES : 2 * _KEY_BYTES])
    if place is None or slot is None:
        return None
    return ExpertKey(place, slot, _unfixed(raw[2 * _KEY_BYTES :]))


def _unfixed(raw: bytes) -> str | None:
    return raw.hex() if any(raw) else None


def _unpack_slot(
    raw: bytes,
) -> tuple[
    int,
    str,
    str,
    str | None,
    str | None,
    str | None,
    str | None,
    ExpertKey | None,
    str | None,
    str | None,
]:
    fields, offset = [], 1
    for size in (_DIGEST_BYTES, _HOST_BYTES, _DIGEST_BYTES, _KEY_BYTES, _DIGEST_BYTES, _KEY_BYTES):
        fields.append(raw[offset : offset + size])
        offset += size
    digest, host, value, key, replica, peers = fields
    host_name = host.rstrip(b"\0").decode(errors="replace")
    unfixed = (_unfixed(value), _unfixed(key), _unfixed(replica), _unfixed(peers))
    expert = _unpack_expert(raw[offset : offset + _EXPERT_BYTES])
    offset += _EXPERT_BYTES
    sibling_key = _unfixed(raw[offset : offset + _KEY_BYTES])
    sibling = _unfixed(raw[offset + _KEY_BYTES : offset + _SIBLING_BYTES])
    return raw[0], digest.hex(), host_name, *unfixed, expert, sibling_key, sibling


def _built_on_meta(record: RankRecord) -> bool:
    fp = record.pre_wrap
    return fp is not None and any(t.device == "meta" for t in (*fp.buffers, *fp.params))


def representatives(digests: dict[int, str]) -> dict[str, int]:
    """digest → lowest rank holding it."""
    reps: dict[str, int] = {}
    for rank in sorted(digests):
        reps.setdefault(digests[rank], rank)
    return reps


def gather_records(
    record: RankRecord, group: object, *, rank: int, world_size: int
) -> Gathered | None:
    """Collective over ``group``: returns :class:`Gathered` on rank 0 and ``None`` elsewhere.

    Every rank's slot goes to rank 0 (a gather, not an exchange: nobody else needs them);
    rank 0 broadcasts which ranks must also send their full record: one representative per
    distinct group digest, and the few ranks whose values differ."""
    digest = record.group_digest()
    value, replica = value_digests(record)
    flags = _FLAG_META if _built_on_meta(record) else 0
    flags |= seed_tag(record.env.hash_seed) << _SEED_SHIFT
    mine = _pack_slot(
        digest,
        record.env.host,
        flags,
        value,
        record.shard_key,
        replica,
        record.peer_key,
        expert_key(record),
        record.sibling_key,
        sibling_digest(record),
    )
    slots = gather_slots(mine, group, rank=rank, world_size=world_size)
    sent = SLOT_BYTES
    if rank != 0:
        if rank in _broadcast_ranks(None, group):
            sent += _send_payload(_payload(record), group)
        log.debug("digest %s: sent %d bytes", digest[:12], sent)
        return None
    digests, hosts, meta_ranks = {}, {}, []
    values, keys, replicas, peers, experts, sibling_keys, siblings = {}, {}, {}, {}, {}, {}, {}
    seed_tags: dict[int, int] = {}
    for r, slot in enumerate(slots):
        flags, digests[r], hosts[r], values[r], keys[r], replicas[r], peers[r], *more = (
            _unpack_slot(slot)
        )
        experts[r], sibling_keys[r], siblings[r] = more
        seed_tags[r] = flags >> _SEED_SHIFT
        if flags & _FLAG_META:
            meta_ranks.append(r)
    reps = set(representatives(digests).values())
    # Ranks whose values differ send too (no group's representative, no more than a few).
    found = ValueKeys(values, replicas, keys, peers, sibling_keys, siblings)
    extra_senders = value_senders(found) - reps
    senders = sorted((reps | extra_senders) - {0})
    _broadcast_ranks(senders, group)
    log.info("%d ranks, %d digests; full records from ranks %s", world_size, len(reps), senders)
    records: dict[int, RankRecord] = {0: record}
    extra: dict[int, RankRecord] = {}
    for sender in senders:
        held = extra if sender in extra_senders else records
        held[sender] = _recv_record(RankRecord, sender, group)
    return Gathered(
        digests,
        hosts,
        records,
        sent,
        tuple(meta_ranks),
        found,
        extra,
        expert_keys=experts,
        seed_tags=seed_tags,
    )


def gather_slots(mine: bytes, group: object, *, rank: int, world_size: int) -> list[bytes]:
    """Collective: every rank's fixed-size slot on rank 0 (in rank order); ``[]`` elsewhere."""
    tensor = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
    out = [torch.empty_like(tensor) for _ in range(world_size)] if rank == 0 else None
    dist.gather(tensor, out, dst=0, group=group)
    return [t.numpy().tobytes() for t in out] if out is not None else []


def _broadcast_ranks(ranks: list[int] | None, group: object) -> list[int]:
    """Rank 0's list (``ranks``) on every rank: a count, then the ranks only when there are any."""
    header = torch.tensor([len(ranks) if ranks is not None else 0], dtype=torch.int64)
    dist.broadcast(header, src=0, group=group)
    count = int(header[0])
    if count == 0:
        return []
    payload = torch.tensor(ranks if ranks is not None else [0] * count, dtype=torch.int64)
    dist.broadcast(payload, src=0, group=group)
    return [int(r) for r in payload.tolist()]


def _payload(record: Any) -> bytes:
    return json.dumps(to_dict(record), sort_keys=True).encode()


def _send_payload(payload: bytes, group: object) -> int:
    dist.send(torch.tensor([len(payload)], dtype=torch.int64), dst=0, group=group)
    dist.send(torch.frombuffer(bytearray(payload), dtype=torch.uint8), dst=0, group=group)
    return 8 + len(payload)


def _recv_record(kind: type[R], src: int, group: object) -> R:
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src=src, group=group)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(payload, src=src, group=group)
    return from_dict(kind, json.loads(payload.numpy().tobytes()))


def gather_distinct(record: R, group: object, *, rank: int, world_size: int) -> dict[int, R] | None:
    """Collective over ``group``: every rank's ``record`` on rank 0 (rank → record), ``None``
    elsewhere. Digest-first, as :func:`gather_records`: each rank's 16-byte digest of its record,
    then one full record per distinct digest; ranks that agree send the digest only."""
    payload = _payload(record)
    digest = hashlib.blake2b(payload, digest_size=_DIGEST_BYTES).digest()
    slots = gather_slots(digest, group, rank=rank, world_size=world_size)
    if rank != 0:
        if rank in _broadcast_ranks(None, group):
            _send_payload(payload, group)
        return None
    first: dict[bytes, int] = {}
    for r, slot in enumerate(slots):
        first.setdefault(slot, r)
    senders = sorted(set(first.values()) - {0})
    _broadcast_ranks(senders, group)
    by_sender = {0: record} | {s: _recv_record(type(record), s, group) for s in senders}
    return {r: by_sender[first[slot]] for r, slot in enumerate(slots)}


# gather_memory's fixed slot, int64 words (-1: None): the method, the record's own numbers,
# then per measured stage whether it ran and its numbers.
_METHODS = tuple(MemoryPeak)
_RECORD_FIELDS = ("process_peak", "current", "cuda_peak", "cuda_current", "model_bytes")
_RECORD_FIELDS += ("shard_bytes", "trimmed")
_STAGE_FIELDS = ("start", "peak", "end", "cuda_start", "cuda_peak")
MEMORY_WORDS = 2 + len(_RECORD_FIELDS) + len(MEASURED) * (1 + len(_STAGE_FIELDS))


def _pack_memory(record: MemoryRecord | None) -> list[int]:
    if record is None:
        return [0] * MEMORY_WORDS
    words = [1, _METHODS.index(record.method)]
    words += [_word(getattr(record, name)) for name in _RECORD_FIELDS]
    by_stage = {s.stage: s for s in record.stages}
    for stage in MEASURED:
        measured = by_stage.get(stage)
        words.append(int(measured is not None))
        words += [_word(getattr(measured, n, None)) for n in _STAGE_FIELDS]
    return words


def _word(value: int | None) -> int:
    return -1 if value is None else int(value)


def _unpack_memory(rank: int, words: list[int]) -> MemoryRecord | None:
    if not words[0]:
        return None
    values = [None if w < 0 else w for w in words[2 : 2 + len(_RECORD_FIELDS)]]
    flag = _RECORD_FIELDS.index("trimmed")  # a flag, in a word like the numbers
    values[flag] = None if values[flag] is None else bool(values[flag])
    offset, stages = 2 + len(_RECORD_FIELDS), []
    for stage in MEASURED:
        if words[offset]:
            numbers = [None if w < 0 else w for w in words[offset + 1 : offset + 6]]
            start, peak, end, cuda_start, cuda_peak = numbers
            host = (start or 0, peak or 0, end or 0)
            stages.append(StageMemory(stage, *host, cuda_start, cuda_peak))
        offset += 1 + len(_STAGE_FIELDS)
    return MemoryRecord(
        rank, _METHODS[words[1]], tuple(stages), **dict(zip(_RECORD_FIELDS, values, strict=True))
    )


def gather_memory(
    record: MemoryRecord | None, group: object, *, rank: int, world_size: int
) -> tuple[MemoryRecord, ...] | None:
    """Collective over ``group``: every rank's memory record on rank 0, in rank order (a rank
    with none left out); ``None`` elsewhere. One fixed-size slot per rank: memory differs per
    rank by nature, so it never rides in the group digest that decides who sends a record."""
    mine = torch.tensor(_pack_memory(record), dtype=torch.int64)
    out = [torch.empty_like(mine) for _ in range(world_size)] if rank == 0 else None
    dist.gather(mine, out, dst=0, group=group)
    if out is None:
        return None
    found = (_unpack_memory(r, t.tolist()) for r, t in enumerate(out))
    return tuple(m for m in found if m is not None)
