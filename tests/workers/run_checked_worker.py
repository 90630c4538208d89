"""``fsdpcheck.run_checked`` on a training function (as a Ray actor would call it), on env://
ranks: ``clean``, ``extra`` (rank 1 all-reduces its loss once, a collective rank 0 never
issues) or ``dies`` (rank 1's process ends in its first forward). Each rank that lives writes
``rank<r>.json``: the outcome's exit code, whether it holds the report, and its headline; a rank
the call raised on writes nothing."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import fsdpcheck

out, variant = Path(sys.argv[1]), sys.argv[2]


def train(steps: int) -> list[float]:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        if variant == "dies" and dist.get_rank() == 1:
            os._exit(9)  # inside the watched step: rank 0 waits in its first all-gather
        loss = model(torch.randn(4, 8)).square().mean()
        loss.backward()
        if variant == "extra" and dist.get_rank() == 1:
            dist.all_reduce(loss.detach().clone())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


dist.init_process_group("gloo")
outcome = fsdpcheck.run_checked(train, 3, timeout=20)
record = {
    "exit_code": outcome.exit_code,
    "report": outcome.report is not None,
    "headline": outcome.headline,
}
out.mkdir(parents=True, exist_ok=True)
(out / f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
dist.destroy_process_group()
