"""One rank of the gather-scaling benchmark: every rank builds the hazard model on meta, wraps
it, fingerprints it (the audit's own records), then calls ``fsdpcheck.dist.gather.gather_records``
repeatedly: with every rank agreeing, and with the last rank divergent (its RoPE buffers in the
other order, as a different hash seed gives). Prints one line ``@bench {json}`` per rank with
the bytes this rank sent and each repeat's seconds; run by scripts/bench.py."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import torch.distributed as dist

MARK = "@bench "


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--model", default="hazard")
    args = parser.parse_args()

    from fsdpcheck.dist import gather
    from fsdpcheck.dist import setup as distributed
    from fsdpcheck.dist.environment import env_record
    from fsdpcheck.model import wrap
    from fsdpcheck.model.build import build
    from fsdpcheck.model.fingerprint import fingerprint
    from fsdpcheck.model.resolve import resolve
    from fsdpcheck.records import RankRecord

    ctx = distributed.init("gloo", 120.0)
    model = build(resolve(args.model, rank=ctx.rank), rank=ctx.rank, init="meta").model
    pre = fingerprint(model, "pre-wrap")
    targets = wrap.plan(model).modules
    wrap.apply(targets, ctx.mesh)
    post = fingerprint(model, "post-wrap")
    env = env_record(ctx.rank, ctx.local_rank, ctx.world_size, ctx.backend)
    agreeing = RankRecord(env=env, pre_wrap=pre, post_wrap=post)
    flipped = [dataclasses.replace(fp, buffers=tuple(reversed(fp.buffers))) for fp in (pre, post)]
    divergent = RankRecord(env=env, pre_wrap=flipped[0], post_wrap=flipped[1])
    last = ctx.world_size - 1

    sent: list[int] = []
    original = gather._send_record

    def counting(record: RankRecord, group: object) -> int:
        n = original(record, group)
        sent.append(n)
        return n

    gather._send_record = counting
    results: dict[str, dict] = {}
    variants = {
        "agree": agreeing,
        "one-divergent": divergent if ctx.rank == last else agreeing,
    }
    for _ in range(2):  # warm-up
        for record in variants.values():
            gather.gather_records(
                record, ctx.side_channel, rank=ctx.rank, world_size=ctx.world_size
            )
    for name in variants:
        results[name] = {"seconds": [], "bytes": None, "groups": None}
    for _ in range(args.repeats):
        for name, record in variants.items():
            sent.clear()
            dist.barrier(group=ctx.side_channel)
            start = time.perf_counter()
            got = gather.gather_records(
                record, ctx.side_channel, rank=ctx.rank, world_size=ctx.world_size
            )
            dist.barrier(group=ctx.side_channel)
            results[name]["seconds"].append(time.perf_counter() - start)
            results[name]["bytes"] = gather.SLOT_BYTES + sum(sent)
            if got is not None:
                results[name]["groups"] = len(got.records)
                results[name]["rank0_bytes_sent"] = got.bytes_sent
    out = {
        "rank": ctx.rank,
        "world": ctx.world_size,
        "record_bytes": len(json.dumps(dataclasses.asdict(agreeing))),
        "results": results,
    }
    print(MARK + json.dumps(out), flush=True)
    distributed.shutdown(ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
