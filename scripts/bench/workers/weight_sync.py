"""One rank of the weight-sync benchmark: a stack of bfloat16 linear layers (``--mb`` MiB in all)
under FSDP2 on 2 ranks (gloo), then, in a seeded order per repeat,
``fsdpcheck.state_digests(model)`` on the shards (each rank its own, combined by position) and
plain reads of the same shards (``torch.sum`` of each, as float32 and as bfloat16, an int64 sum
of each one's bytes, and a copy of each). Prints one line ``@bench {json}`` per rank; run by
scripts/bench (the weight-sync row)."""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import fsdpcheck

MARK = "@bench "


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    width = 2048  # rows of 4 KiB in bfloat16; 8 MiB per layer
    layers = max(1, args.mb // 8)
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    model.to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_()
    side = dist.new_group(backend="gloo", timeout=timedelta(seconds=600))
    shards = [p.to_local() for p in model.parameters()]
    seconds: dict[str, list[float]] = {
        "state_digests": [],
        "torch.sum": [],
        "torch.sum, no dtype": [],
        "int64 sum": [],
        "copy": [],
    }
    # Once untimed: the first call imports fsdpcheck's records and works out each shard's place
    # (kept for later steps); a weight sync pays that once per run, not per step.
    fsdpcheck.state_digests(model, group=side)
    # Wall time, and this process's CPU time (all its threads): on a loaded host a rank waits,
    # descheduled or in the gather for the other rank, and only the wall time counts that.
    cpu: dict[str, list[float]] = {key: [] for key in seconds}

    def timed(key: str, run) -> None:
        start, used = time.perf_counter(), time.process_time()
        run()
        seconds[key].append(time.perf_counter() - start)
        cpu[key].append(time.process_time() - used)

    def each(read) -> None:  # one shard at a time, its result dropped before the next
        for shard in shards:
            read(shard)

    methods = {
        "state_digests": lambda: fsdpcheck.state_digests(model, group=side),
        "torch.sum": lambda: each(lambda s: torch.sum(s, dtype=torch.float32)),
        # the same read with bfloat16's own reduction: a check on the line above, whose
        # conversion kernel runs about 10x slower in some processes, for as long as they live
        "torch.sum, no dtype": lambda: each(torch.sum),
        # the same bytes as 64-bit integers: a read with no conversion
        "int64 sum": lambda: each(lambda s: s.reshape(-1).view(torch.int64).sum()),
        "copy": lambda: each(torch.clone),
    }
    for repeat in range(args.repeats):
        # A seeded order per repeat, the same on both ranks (they read at once, as a sync
        # does): no method always runs first after the barrier or after another one.
        for key in random.Random(repeat).sample(list(methods), len(methods)):
            dist.barrier()
            timed(key, methods[key])
    local = sum(s.numel() * s.element_size() for s in shards)
    record = {"rank": dist.get_rank(), "shard_bytes": local, "seconds": seconds, "cpu": cpu}
    print(MARK + json.dumps(record), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
