"""One rank of the weight-sync benchmark: a stack of bfloat16 linear layers (``--mb`` MiB in all)
under FSDP2 on 2 ranks (gloo), then, alternating, ``fsdpcheck.state_digests(model)`` on the
shards (each rank its own, combined by position) and one plain read of the same shards
(``torch.sum`` of each, and a copy of each). Prints one line ``@bench {json}`` per rank; run by
scripts/bench (the weight-sync row)."""

from __future__ import annotations

import argparse
import json
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
    seconds: dict[str, list[float]] = {"state_digests": [], "torch.sum": [], "copy": []}
    # Once untimed: the first call imports fsdpcheck's records and works out each shard's place
    # (kept for later steps); a weight sync pays that once per run, not per step.
    fsdpcheck.state_digests(model, group=side)
    for _ in range(args.repeats):
        dist.barrier()
        start = time.perf_counter()
        fsdpcheck.state_digests(model, group=side)
        seconds["state_digests"].append(time.perf_counter() - start)
        start = time.perf_counter()
        for shard in shards:
            torch.sum(shard, dtype=torch.float32)
        seconds["torch.sum"].append(time.perf_counter() - start)
        start = time.perf_counter()
        for shard in shards:
            shard.clone()
        seconds["copy"].append(time.perf_counter() - start)
    local = sum(s.numel() * s.element_size() for s in shards)
    record = {"rank": dist.get_rank(), "shard_bytes": local, "seconds": seconds}
    print(MARK + json.dumps(record), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
