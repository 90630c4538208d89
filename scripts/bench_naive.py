"""The naive loader the time-to-verdict row measures: build the hazard preset (rank 0 real,
others on meta, ``to_empty()``), then broadcast the buffers one by one in each rank's own
``named_buffers()`` order, as loaders did before sorting (``broadcast_each_buffer``, the loop the
named-buffers-order loader job runs). Run with a different PYTHONHASHSEED per rank, the orders
differ and the i-th broadcasts pair tensors of different sizes: on gloo the receiving process
aborts (SIGABRT, ``op.preamble.length <= op.nbytes``); on NCCL it would wait for the watchdog
instead."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist


def main() -> int:
    from fsdpcheck.children.loaders import broadcast_each_buffer
    from fsdpcheck.model.build import build
    from fsdpcheck.model.resolve import resolve

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build(resolve("hazard", rank=rank), rank=rank, init="rank0").model
    if rank != 0:
        model.to_empty(device="cpu")
    with torch.no_grad():
        broadcast_each_buffer(model, src=0)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
