"""Two gloo ranks issue one collective unwatched, with sizes that differ: what a ``step``
finding on a size skew says gloo does (``checks/step.py``'s ``_SKEW``), run for real.

    python gloo_skew_worker.py CASE OUT_DIR

Cases (``rank 1's size`` against rank 0's 4 elements): ``broadcast-larger`` and
``broadcast-smaller`` (rank 0 the source), ``send-larger`` (rank 0 sends, rank 1 receives),
``all-gather-larger`` (``all_gather_into_tensor``, rank 1's shard 8 elements). A rank that
comes back writes ``rank<r>.json``: the values it holds after the collective."""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

SIZES = {"larger": 8, "smaller": 2}


def main() -> None:
    case, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    rank = dist.get_rank()
    op, _, skew = case.rpartition("-")
    size = 4 if rank == 0 else SIZES[skew]
    # rank 0 sends 1, 2, 3, 4; a receiver's buffer starts as -1s, so what it kept shows
    mine = (
        torch.arange(1, size + 1, dtype=torch.float32) if rank == 0 else torch.full((size,), -1.0)
    )
    if op == "broadcast":
        dist.broadcast(mine, src=0)
        held = mine
    elif op == "send":
        if rank == 0:
            dist.send(mine, dst=1)
        else:
            dist.recv(mine, src=0)
        held = mine
    elif op == "all-gather":
        held = torch.full((2 * size,), -1.0)
        dist.all_gather_into_tensor(held, mine)
    else:
        raise SystemExit(f"unknown case {case!r}")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({"held": held.tolist()}))
    dist.destroy_process_group()


main()
