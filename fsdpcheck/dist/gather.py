"""Bring every rank's record to rank 0 over the gloo side channel.

Built for thousands of ranks: every rank first sends rank 0 a fixed-size slot (its record's
group digest and its host); rank 0 broadcasts which ranks represent a digest other than its own,
and only those send their full records. When all ranks agree, each rank sends one slot and
receives one 8-byte header, whatever the model's size and the world size (a gather and a
broadcast, not an all_to_all: no rank but rank 0 needs the others' slots).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsdpcheck.records import Gathered, RankRecord, from_dict, to_dict

_DIGEST_BYTES = 16
_HOST_BYTES = 64
_FLAG_META = 1  # this rank built (some of) the model on meta
SLOT_BYTES = 1 + _DIGEST_BYTES + _HOST_BYTES


def _pack_slot(digest: str, host: str, flags: int) -> bytes:
    raw = bytes([flags]) + bytes.fromhex(digest)[:_DIGEST_BYTES].ljust(_DIGEST_BYTES, b"\0")
    return raw + host.encode()[:_HOST_BYTES].ljust(_HOST_BYTES, b"\0")


def _unpack_slot(raw: bytes) -> tuple[int, str, str]:
    digest, host = raw[1 : 1 + _DIGEST_BYTES], raw[1 + _DIGEST_BYTES :]
    return raw[0], digest.hex(), host.rstrip(b"\0").decode(errors="replace")


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
    """Collective over ``group``: returns :class:`Gathered` on rank 0 and ``None`` elsewhere."""
    digest = record.group_digest()
    mine = _pack_slot(digest, record.env.host, _FLAG_META if _built_on_meta(record) else 0)
    slots = _gather_slots(mine, group, rank=rank, world_size=world_size)
    sent = SLOT_BYTES
    if rank != 0:
        if rank in _broadcast_ranks(None, group):
            sent += _send_record(record, group)
        return None
    digests, hosts, meta_ranks = {}, {}, []
    for r, slot in enumerate(slots):
        flags, digests[r], hosts[r] = _unpack_slot(slot)
        if flags & _FLAG_META:
            meta_ranks.append(r)
    reps = representatives(digests)
    others = sorted(r for r in reps.values() if r != 0)
    _broadcast_ranks(others, group)
    records: dict[int, RankRecord] = {0: record}
    for rep in others:
        records[rep] = _recv_record(rep, group)
    return Gathered(digests, hosts, records, sent, tuple(meta_ranks))


def _gather_slots(mine: bytes, group: object, *, rank: int, world_size: int) -> list[bytes]:
    """Every rank's slot on rank 0 (in rank order); ``[]`` elsewhere."""
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


def _send_record(record: RankRecord, group: object) -> int:
    payload = json.dumps(to_dict(record)).encode()
    dist.send(torch.tensor([len(payload)], dtype=torch.int64), dst=0, group=group)
    dist.send(torch.frombuffer(bytearray(payload), dtype=torch.uint8), dst=0, group=group)
    return 8 + len(payload)


def _recv_record(src: int, group: object) -> RankRecord:
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src=src, group=group)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(payload, src=src, group=group)
    return from_dict(RankRecord, json.loads(payload.numpy().tobytes()))
