"""Fixed-size collectives on the gloo side channel: sizes never depend on what a rank holds, so
ranks that disagree still exchange cleanly."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Span:
    """Each word's least and greatest value over a group's members, and the root's attachment."""

    low: tuple[int, ...]
    high: tuple[int, ...]
    # the root's attachment (uint8, padded to ``attached``) where it landed: no copy made
    landed: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.uint8))
    sent: int = 0  # bytes this member handed to the transport

    @property
    def attachment(self) -> bytes:
        return self.landed.numpy().tobytes()

    def same(self, start: int = 0, stop: int | None = None) -> bool:
        """Every member held the same words ``start:stop``."""
        return self.low[start:stop] == self.high[start:stop]


_SPAN_TAG = 0x5350  # the tree's sends and receives, apart from any other on the side channel
_INT64_MIN = -(2**63)
_STAR_MAX = 4  # groups up to this size span as a star: the root's children are all the others


@dataclass(frozen=True)
class Posted:
    """The receives a member's :func:`span` waits on first (its children's words, in the tree),
    posted ahead of it by :func:`post_span`."""

    count: int
    works: tuple[Any, ...]
    buffers: tuple[torch.Tensor, ...]


def post_span(count: int, group: Any, *, size: int, root: int = 0) -> Posted:
    """Post this member's first receives of a :func:`span` of ``count`` words over gloo, so that
    its children's words arrive while it prepares its own: pass the result to that span, which
    must follow (a receive left posted would take the next span's message)."""
    children = _children((dist.get_rank(group=group) - root) % size, size, root)
    buffers = tuple(torch.empty(2 * count, dtype=torch.int64) for _ in children)
    works = tuple(
        dist.irecv(buf, group=group, group_src=c, tag=_SPAN_TAG)
        for buf, c in zip(buffers, children, strict=True)
    )
    return Posted(count, works, buffers)


def _fan_out(size: int) -> int:
    """Children per member: every other member under the root up to ``_STAR_MAX`` members (one
    hop up and one down, where a binary tree of 4 takes two each way, each a wake-up of a
    process that may share its core), two beyond (bytes per member bounded by 2 messages)."""
    return size - 1 if size <= _STAR_MAX else 2


def _children(position: int, size: int, root: int) -> list[int]:
    k = _fan_out(size)
    return [(c + root) % size for c in range(k * position + 1, k * position + k + 1) if c < size]


def landing_for(count: int, attached: int) -> torch.Tensor:
    """Where a :func:`span` of ``count`` words and ``attached`` bytes lands, made before it runs
    (pass it as ``landing``): the root may pack its attachment straight into
    :func:`landed_bytes` of it, and the other members may lay out views of theirs while they
    wait."""
    return torch.zeros(2 * count + -(-attached // 8), dtype=torch.int64)


def landed_bytes(landing: torch.Tensor, count: int, attached: int) -> torch.Tensor:
    """The attachment's place in ``landing`` (uint8)."""
    return landing[2 * count :].view(torch.uint8)[:attached]


def span(
    words: Sequence[int],
    group: Any,
    *,
    size: int,
    device: Any = "cpu",
    root: int = 0,
    attached: int = 0,
    attachment: bytes | torch.Tensor | None = None,
    landing: torch.Tensor | None = None,
    posted: Posted | None = None,
) -> Span:
    """Collective: each of ``words`` (int64, as many on every member) as its minimum and maximum
    over the group, and the member at group index ``root``'s ``attachment`` (padded to
    ``attached`` bytes, the same on every member) on every member. Equal minimum and maximum:
    every member holds that word; where they differ, the caller fetches the details.
    ``landing`` (from :func:`landing_for`): where the result lands; at the root, an attachment
    already packed into its :func:`landed_bytes` is sent from there. ``posted`` (from
    :func:`post_span`, gloo only): this member's first receives, already posted.

    The cost does not grow with the group per member: on gloo a tree rooted at ``root`` of
    point-to-point messages (each member receives from its children and sends one message up,
    then receives one from its parent and forwards it to its children), where gloo's own
    all_reduce is a ring (2·(size − 1) hops, one after another). Up to ``_STAR_MAX`` members
    the tree is a star (2 hops), beyond it binary (2·log2(size) hops, at most two children).
    On NCCL, one all_reduce (MAX of the negated and plain words, the root's attachment against
    ``INT64_MIN`` elsewhere): NCCL's small all-reduces run as a tree."""
    n = len(words)
    extra = -(-attached // 8)
    if isinstance(attachment, bytes | bytearray):
        raw = bytearray(attachment)
        attachment = torch.frombuffer(raw, dtype=torch.uint8) if raw else None
    size_of = 0 if attachment is None else attachment.numel()
    if size_of > attached:
        raise ValueError(f"attachment of {size_of} bytes exceeds attached={attached}")
    down = landing_for(n, attached) if landing is None else landing
    if down.numel() != 2 * n + extra:
        raise ValueError(f"landing of {down.numel()} words for {n} words and {attached} bytes")
    me = dist.get_rank(group=group)
    mine = torch.tensor([*words, *(-w for w in words)], dtype=torch.int64)
    place = landed_bytes(down, n, attached)
    if size_of and me == root and attachment.data_ptr() != place.data_ptr():
        place[:size_of].copy_(attachment.reshape(-1))  # packed elsewhere: into its place
    if posted is not None and (posted.count != n or torch.device(device).type != "cpu"):
        raise ValueError("posted receives for another span (or for gloo, on NCCL)")
    if torch.device(device).type != "cpu":
        if me != root:
            down[2 * n :] = _INT64_MIN
        down[: 2 * n] = mine
        both = down.to(device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        down.copy_(both)
        sent = both.numel() * 8
        high, low = down[:n], -down[n : 2 * n]
    else:
        sent = _tree(mine, down, group, me=me, size=size, root=root, n=n, posted=posted)
        low, high = down[:n], -down[n : 2 * n]
    return Span(tuple(low.tolist()), tuple(high.tolist()), place, sent)


def _tree(
    mine: torch.Tensor,
    down: torch.Tensor,
    group: Any,
    *,
    me: int,
    size: int,
    root: int,
    n: int,
    posted: Posted | None = None,
) -> int:
    """``down`` becomes ``[min words, −max words, root's payload]`` on every member (the root's
    holds its payload after the words already): up a binary tree of the members rotated so that
    ``root`` is its root, then down it. Returns the bytes this member sent."""
    position = (me - root) % size
    children = _children(position, size, root)
    parent = ((position - 1) // _fan_out(size) + root) % size if position else None
    # mine holds [words, −words]: the elementwise minimum of both halves is [min, −max].
    if posted is None:
        posted = post_span(n, group, size=size, root=root)
    for work, buf in zip(posted.works, posted.buffers, strict=True):
        work.wait()
        mine = torch.minimum(mine, buf)
    if parent is None:
        down[: 2 * n] = mine
    else:
        dist.send(mine, group=group, group_dst=parent, tag=_SPAN_TAG)
        dist.recv(down, group=group, group_src=parent, tag=_SPAN_TAG)
    for c in children:
        dist.send(down, group=group, group_dst=c, tag=_SPAN_TAG)
    up = 0 if parent is None else mine.numel()
    return 8 * (up + len(children) * down.numel())


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
