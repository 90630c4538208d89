"""One rank of the source-verify benchmark, one process per rank: a stack of bfloat16 linear
layers (every rank seeded alike, so its shards equal the checkpoint), saved once by rank 0 as
one safetensors file and sharded with ``fully_shard``. Side by side in turns, from a warm page
cache: rank 0 reading the whole checkpoint file once into memory (one ``read()``: faster than
faulting in ``load_file``'s mapping page by page), and
``verify_source`` on every rank (each reads and compares only its own slices), wall time from
the barrier before to the barrier after. Rank 0 prints one line ``@bench {json}``; run by
scripts/bench (the source row) through fsdpcheck.children.launch."""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

MARK = "@bench "


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scratch", default=None)
    args = parser.parse_args()

    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fsdpcheck.loader.source import verify_source

    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(
        *(nn.Linear(args.width, 2 * args.width, bias=True) for _ in range(args.layers))
    ).to(torch.bfloat16)
    scratch = Path(args.scratch or tempfile.gettempdir())
    path = scratch / "source-bench.safetensors"
    if rank == 0:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    dist.barrier()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    import torch.distributed.checkpoint as dcp

    saved = scratch / "source-bench-dcp"
    dcp.save(model.state_dict(), checkpoint_id=str(saved))  # one __R_0.distcp per rank
    dist.barrier()

    def read_dcp_once() -> None:
        if rank == 0:
            for file in sorted(saved.iterdir()):
                with open(file, "rb") as handle:
                    handle.read()

    def verify_dcp() -> None:
        checked = verify_source(model, saved)
        if rank == 0 and not checked.passed:
            raise RuntimeError(f"source verify (DCP) failed: {checked.mismatches[:2]}")

    def read_once() -> None:
        if rank == 0:  # every byte into memory, as a loader must hold it: one read
            with open(path, "rb") as handle:
                handle.read()

    def verify() -> None:
        checked = verify_source(model, path)
        if rank == 0 and not checked.passed:
            raise RuntimeError(f"source verify failed: {checked.mismatches[:2]}")

    variants = {
        "read the checkpoint once": read_once,
        "source verify": verify,
        "read the DCP checkpoint once": read_dcp_once,
        "source verify (DCP)": verify_dcp,
    }
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for run in variants.values():  # warm-up: the page cache holds the file for both
        run()
    for turn in range(args.repeats):
        names = list(variants)[turn % 4 :] + list(variants)[: turn % 4]
        for name in names:
            dist.barrier()
            start = time.perf_counter()
            variants[name]()
            dist.barrier()
            seconds[name].append(time.perf_counter() - start)
    if rank == 0:
        record = {
            "seconds": seconds,
            "checkpoint_bytes": path.stat().st_size,
            "dcp_bytes": sum(f.stat().st_size for f in saved.iterdir()),
            "world_size": dist.get_world_size(),
            "tensors": len(model.state_dict()),
        }
        print(MARK + json.dumps(record), flush=True)
        path.unlink()
        shutil.rmtree(saved)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
