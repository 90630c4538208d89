"""Bring every rank's record to rank 0 over the gloo side channel.

Built for thousands of ranks: every rank first shares a fixed-size slot (its record's group
digest and its host); then only one representative per distinct digest sends its full record.
When all ranks agree, each rank sends the same few bytes whatever the model's size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsdpcheck.dist.wire import exchange_slots
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
    slots, _ = exchange_slots(mine, group, size=world_size)
    digests, hosts, meta_ranks = {}, {}, []
    for r, slot in enumerate(slots):
        flags, digests[r], hosts[r] = _unpack_slot(slot)
        if flags & _FLAG_META:
            meta_ranks.append(r)
    reps = representatives(digests)
    sent = SLOT_BYTES
    records: dict[int, RankRecord] = {}
    if rank == 0:
        records[0] = record
        for rep in sorted(reps.values()):
            if rep != 0:
                records[rep] = _recv_record(rep, group)
        return Gathered(digests, hosts, records, sent, tuple(meta_ranks))
    if reps[digests[rank]] == rank:
        sent += _send_record(record, group)
    return None


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
