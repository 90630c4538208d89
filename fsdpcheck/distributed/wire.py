"""Fixed-size collectives on the gloo side channel: sizes never depend on what a rank holds, so
ranks that disagree still exchange cleanly."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def exchange_slots(
    raw: bytes,
    group: Any,
    *,
    size: int,
    device: Any = "cpu",
    src: int = 0,
    attached: int = 0,
    attachment: bytes = b"",
) -> tuple[list[bytes], bytes]:
    """Collective: every rank's fixed-size ``raw``, in group order, on every rank.

    With ``attached`` > 0 (the same on every rank), the rank at group index ``src`` also sends
    every other rank its ``attachment``, padded to ``attached`` bytes, in the same round:
    returned second on every rank, ``src`` included (``b""`` otherwise). Sizes never depend on
    what a rank holds, so ranks that disagree still exchange cleanly. An all_to_all of the slot
    rather than an all_gather: gloo's all_gather is a ring (world-1 hops, one after another),
    its all_to_all one round of direct messages; 0.9 ms against 3.0 ms at 4 ranks on 2 cores
    (see docs/benchmarks.md)."""
    me = dist.get_rank(group=group)
    if len(attachment) > attached:
        raise ValueError(f"attachment of {len(attachment)} bytes exceeds attached={attached}")
    width = len(raw)
    # Each part padded to whole 8-byte words and moved as int64: gloo moves a uint8 tensor
    # several times slower than the same bytes as int64.
    padded_width, padded_attached = -(-width // 8) * 8, -(-attached // 8) * 8
    slot = raw.ljust(padded_width, b"\0")
    extra_to = [padded_attached if i == src and i != me else 0 for i in range(size)]
    if me == src and padded_attached:  # the attachment to every other rank, not to itself
        message = slot + attachment.ljust(padded_attached, b"\0")
        own = b"".join(slot if i == me else message for i in range(size))
        sent = [(padded_width + (0 if i == me else padded_attached)) // 8 for i in range(size)]
    else:
        own = slot * size
        sent = [padded_width // 8] * size
    word = torch.frombuffer(bytearray(own), dtype=torch.int64).to(device)
    received = [(padded_width + extra_to[i]) // 8 for i in range(size)]
    out = torch.empty(sum(received), dtype=torch.int64, device=device)
    dist.all_to_all_single(
        out, word, output_split_sizes=received, input_split_sizes=sent, group=group
    )
    flat = out.cpu().numpy().tobytes()
    slots, extra, offset = [], b"", 0
    for i, count in enumerate(received):
        slots.append(flat[offset : offset + width])
        if i == src:
            extra = flat[offset + padded_width : offset + padded_width + attached]
        offset += count * 8
    if me == src and attached:
        extra = attachment.ljust(attached, b"\0")
    return slots, extra


def transport_device(group: Any) -> torch.device:
    # gloo (including the cpu half of a "cpu:gloo,cuda:nccl" group) moves CPU tensors only.
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "nccl" not in backend:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def broadcast_decision(code: int, text: str, group: object) -> tuple[int, str]:
    """Rank 0's integer decision and a short text (its one-line conclusion), on every rank."""
    raw = text.encode()[:4096]
    header = torch.tensor([code, len(raw)], dtype=torch.int64)
    dist.broadcast(header, src=0, group=group)
    size = int(header[1])
    if size == 0:
        return int(header[0]), ""
    payload = torch.frombuffer(bytearray(raw.ljust(size, b"\0")[:size]), dtype=torch.uint8)
    dist.broadcast(payload, src=0, group=group)
    return int(header[0]), payload.numpy().tobytes().decode(errors="replace")
