"""One rank of the buffer-broadcast benchmark: 200 non-persistent buffers (RoPE-sized, 8 to 128
float32 elements) broadcast from rank 0 one ``dist.broadcast`` per buffer (as loaders do) versus
``fsdpcheck.loader.load.broadcast_buffers`` (validated layout, one flat broadcast per dtype)
versus the flat broadcast alone, versus describing then the flat broadcast, versus the two least
designs that tell every rank its verdict, comparing nothing (the digests up then the flat
broadcast; the values down while every rank's digest goes to every rank), versus the cheapest
two-round validation (describe, one digest all_reduce, the flat broadcast), and the validated
path's parts alone (describing and digesting; the check with the values attached). Methods run
in a seeded order per repeat. Prints one line ``@bench {json}`` per rank with every repeat's
(start, end) on the host's monotonic clock; run by scripts/bench (the buffers row) through
fsdpcheck.children.launch."""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

MARK = "@bench "


def make_model(count: int, real: bool) -> nn.Module:
    model = nn.Module()
    for i in range(count):
        size = 8 * (1 + i % 16)  # 8 .. 128 elements
        value = torch.arange(size, dtype=torch.float32) + i if real else torch.zeros(size)
        model.register_buffer(f"rotary_{i:03d}_inv_freq", value, persistent=False)
    return model


def per_buffer(model: nn.Module, group) -> None:
    """One broadcast per buffer, in name order (verl after its fix)."""
    for _, buf in sorted(model.named_buffers()):
        dist.broadcast(buf, src=0, group=group)


def flat_only(model: nn.Module, group) -> None:
    """One flat broadcast of every buffer, unvalidated, packed and unpacked by broadcast_buffers'
    own helpers: what coalescing costs without the layout check."""
    from fsdpcheck.loader.load import _pack_flat, _unpack_flat

    buffers = [b for _, b in sorted(model.named_buffers())]
    if dist.get_rank() == 0:
        flat = _pack_flat(buffers, torch.device("cpu"))
    else:
        flat = torch.empty(sum(b.numel() for b in buffers))
    dist.broadcast(flat, src=0, group=group)
    if dist.get_rank() != 0:
        _unpack_flat(flat, buffers)


def describe(model: nn.Module, rank: int) -> bytes:
    """What every rank must do before any validated broadcast: find its buffers and digest
    their names, shapes and dtypes."""
    from fsdpcheck.loader.agree import layout_digest, local_layout

    return layout_digest(local_layout(model, rank, src=0, source=None, with_state=False).buffers)


def floor(model: nn.Module, rank: int, group) -> None:
    """A bound no validated broadcast can beat: every rank describes and digests its buffers,
    and the values move in one flat broadcast; here nothing compares the digests at all."""
    describe(model, rank)
    flat_only(model, group)


def _digest_word(model: nn.Module, rank: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(describe(model, rank)), dtype=torch.uint8)


def _post_digests(world: int, group) -> list:
    """Rank 0's receives of every other rank's digest (``_DIGEST`` bytes), posted."""
    from fsdpcheck.loader.agree import _DIGEST

    return [
        dist.irecv(torch.empty(_DIGEST, dtype=torch.uint8), src=peer, group=group)
        for peer in range(1, world)
    ]


def verdict_up_floor(model: nn.Module, rank: int, world: int, group) -> None:
    """What any validated broadcast that tells every rank its verdict costs at least, as one
    design: every rank describes and digests its buffers, each other rank's digest goes up to
    rank 0 (received as soon as it is sent: posted before rank 0 describes), then the values
    go down in the flat broadcast, where the verdict would ride. Compares nothing."""
    posted = _post_digests(world, group) if rank == 0 else []
    digest = _digest_word(model, rank)
    if rank != 0:
        dist.send(digest, dst=0, group=group)
    for work in posted:
        work.wait()
    flat_only(model, group)


def exchange_floor(model: nn.Module, rank: int, world: int, group) -> None:
    """The other design: everything in one step of point-to-point messages, every receive
    posted before the rank describes: rank 0's values go down to each rank, its digest riding
    after them, while every other rank sends its digest to every rank. Each rank then holds
    every digest, the verdict, after one step (with 2 ranks: one message each way; with more,
    each rank also sends its digest to its peers, world - 2 messages more). Compares nothing.
    (This row's buffers are float32: rank 0's digest rides after its values as float32
    words.)"""
    from fsdpcheck.loader.agree import _DIGEST
    from fsdpcheck.loader.load import _unpack_flat

    buffers = [b for _, b in sorted(model.named_buffers())]
    count = sum(b.numel() for b in buffers)
    peers = [p for p in range(world) if p != rank]
    # every other rank's digest (rank 0's: with its values)
    works = [
        dist.irecv(torch.empty(_DIGEST, dtype=torch.uint8), src=p, group=group)
        for p in peers
        if p != 0
    ]
    if rank == 0:
        digest = _digest_word(model, rank).view(torch.float32)
        flat = torch.cat([*(b if b.dim() == 1 else b.reshape(-1) for b in buffers), digest])
        works += [dist.isend(flat, dst=p, group=group) for p in peers]
    else:
        flat = torch.empty(count + _DIGEST // 4)
        works.append(dist.irecv(flat, src=0, group=group))
        digest = _digest_word(model, rank)
        works += [dist.isend(digest, dst=p, group=group) for p in peers]
    for work in works:
        work.wait()
    if rank != 0:
        _unpack_flat(flat[:count], buffers)


def two_rounds(model: nn.Module, rank: int, group) -> None:
    """The cheapest validation in two rounds: describe and digest, one all_reduce of the
    digest (MAX of each word and of its negation: the ranks agree where the maximum is minus
    the minimum), then the flat broadcast alone; no details on disagreement."""
    digest = describe(model, rank)
    words = [int.from_bytes(digest[i : i + 8], "big") >> 1 for i in range(0, len(digest), 8)]
    both = torch.tensor([*words, *(-w for w in words)], dtype=torch.int64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    if both[: len(words)].tolist() != (-both[len(words) :]).tolist():
        raise RuntimeError("buffer layouts differ")
    flat_only(model, group)


def check(model: nn.Module, rank: int, world: int, group):
    """``broadcast_buffers``' check alone (its own ``_check_buffers``: rank 0's values packed
    where they land, the other ranks' views of that place laid out), without copying the
    values out."""
    from fsdpcheck.loader.load import _check_buffers

    ranks = list(range(world))
    return lambda: _check_buffers(model, src=0, group=group, ranks=ranks)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--buffers", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()

    from fsdpcheck.distributed import setup as distributed
    from fsdpcheck.loader.load import broadcast_buffers

    ctx = distributed.init("gloo", 120.0)
    group = ctx.side_channel
    model = make_model(args.buffers, real=ctx.rank == 0)
    methods = {
        "per-buffer": lambda: per_buffer(model, group),
        "coalesced": lambda: broadcast_buffers(model, group=group),
        "flat-only": lambda: flat_only(model, group),
        "floor": lambda: floor(model, ctx.rank, group),
        "verdict-up": lambda: verdict_up_floor(model, ctx.rank, ctx.world_size, group),
        "exchange": lambda: exchange_floor(model, ctx.rank, ctx.world_size, group),
        "two-rounds": lambda: two_rounds(model, ctx.rank, group),
        # The validated path's parts, alone: each rank describing and digesting its buffers (no
        # collective), and the whole check with rank 0's packed values attached.
        "describe": lambda: describe(model, ctx.rank),
        "check": check(model, ctx.rank, ctx.world_size, group),
    }
    for fn in methods.values():  # warm-up: connections, allocator
        fn()
    # (start, end) on this rank's monotonic clock, which every process on a host shares: the
    # bench takes the latest end minus the earliest start, with no trailing barrier in it.
    spans: dict[str, list[tuple[float, float]]] = {name: [] for name in methods}
    names = list(methods)
    for repeat in range(args.repeats):
        # A new order every repeat, the same on every rank (seeded by the repeat): no method
        # runs after the same one each time (the per-buffer loop's 200 collectives leave
        # caches and the scheduler in a different state from a single one; a rotation kept
        # broadcast_buffers right after it in all but one repeat in seven).
        for name in random.Random(repeat).sample(names, len(names)):
            fn = methods[name]
            dist.barrier(group=group)
            start = time.perf_counter()
            fn()
            spans[name].append((start, time.perf_counter()))
    moved = broadcast_buffers(model, group=group)
    expected = make_model(args.buffers, real=True)
    ok = all(torch.equal(a, b) for a, b in zip(model.buffers(), expected.buffers(), strict=True))
    record = {
        "rank": ctx.rank,
        "world": ctx.world_size,
        "buffers": args.buffers,
        "bytes": moved.bytes,
        "collectives": {"per-buffer": args.buffers, "coalesced": moved.collectives},
        "inline": moved.inline,
        "spans": spans,
        "equal_to_rank0": ok,
    }
    print(MARK + json.dumps(record), flush=True)
    distributed.shutdown(ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
