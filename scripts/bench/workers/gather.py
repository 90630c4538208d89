"""One rank of the gather benchmark, one process per rank (no model: a synthetic record of 64
buffers and 256 parameters): ``fsdpcheck.distributed.gather.gather_records`` with every rank
agreeing and with the last rank divergent. Bytes each rank sent are measured two ways: at the
socket (the growth of this process's ``wchar`` in /proc/self/io over the call: every byte gloo
wrote, headers included) and at the call site (the payload handed to torch.distributed calls,
counted by the wrapper in scripts/bench/workers/scale.py). Prints one line ``@bench {json}`` per
rank; run by scripts/bench (the gather row) through fsdpcheck.children.launch."""

from __future__ import annotations

import argparse
import json
import sys
import time

import scale  # this script's own folder is first on sys.path
import torch.distributed as dist

MARK = "@bench "


def written() -> int:
    """Bytes this process has passed to write()-family calls (gloo's sockets write with writev)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()

    from fsdpcheck.distributed import gather, setup

    scale._install_counters()
    ctx = setup.init("gloo", 120.0)
    last = ctx.world_size - 1
    variants = {
        "agree": scale._record(ctx.rank, ctx.world_size, False),
        "one-divergent": scale._record(ctx.rank, ctx.world_size, ctx.rank == last),
    }
    for _ in range(2):  # warm-up
        for record in variants.values():
            gather.gather_records(
                record, ctx.side_channel, rank=ctx.rank, world_size=ctx.world_size
            )
    results: dict[str, dict] = {}
    for name, record in variants.items():
        results[name] = {"seconds": [], "socket_bytes": [], "call_bytes": [], "groups": None}
        for _ in range(args.repeats):
            dist.barrier(group=ctx.side_channel)
            scale._sent.bytes = 0
            before = written()
            start = time.perf_counter()
            got = gather.gather_records(
                record, ctx.side_channel, rank=ctx.rank, world_size=ctx.world_size
            )
            results[name]["seconds"].append(time.perf_counter() - start)
            results[name]["socket_bytes"].append(written() - before)
            results[name]["call_bytes"].append(scale._sent.bytes)
            if got is not None:
                results[name]["groups"] = len(got.records)
    out = {
        "rank": ctx.rank,
        "world": ctx.world_size,
        "record_bytes": len(json.dumps(scale._record(0, 1, False), default=vars)),
        "results": results,
    }
    print(MARK + json.dumps(out), flush=True)
    setup.shutdown(ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
