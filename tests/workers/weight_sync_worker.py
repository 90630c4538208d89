"""One rank of the weight-sync test (3 ranks, gloo): ranks 0 and 1 train a small bfloat16 model
under FSDP2 (``fully_shard`` over a 2-rank mesh) for one step; rank 2 is the rollout engine and
receives the weights from rank 0 as trl's and verl's NCCL weight sync send them: rank 0 gathers
each whole tensor (``full_tensor()``, a collective of ranks 0 and 1), advertises every name,
dtype and shape first, then broadcasts each tensor over a group of rank 0 and the receiver,
which allocates what was advertised and receives into it.

Ranks 0 and 1 digest their shards with ``fsdpcheck.state_digests`` (combined over a gloo group of
the two) and also digest the whole tensors, and a Shard(1) DTensor (tensor parallelism's cut) two
ways; rank 2 digests what it received, once per case. Each rank writes ``rank<N>.json``: the
test compares them (``compare_digests`` is pure).

Cases (one broadcast round each): ``clean``; ``dtype`` (one tensor advertised as float16 but
sent as the bfloat16 it is: the same bytes, read as float16); ``skipped`` (one tensor neither
advertised nor sent); ``stale`` (one tensor sent as it was before the step)."""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import fsdpcheck
from fsdpcheck.model.threads import worker_threads
from fsdpcheck.process import exit_skipping_teardown
from fsdpcheck.records import to_dict

CASES = ("clean", "dtype", "skipped", "stale")
SILENT_TIMEOUT = 5.0
ADVERTISED_WRONG = "layers.0.weight"  # the dtype case's tensor
SKIPPED = "layers.1.bias"
STALE = "big.weight"


class Small(nn.Module):
    """Odd sizes (rows of 12 and 14 bytes: shards start inside 64-bit words, uneven chunks),
    and one weight of 3 MiB whose second shard covers a whole 1 MiB block of the checksum."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.layers = nn.ModuleList([nn.Linear(6, 7), nn.Linear(7, 6)])
        self.big = nn.Linear(1024, 1536)
        self.register_buffer("scale", torch.full((6,), 0.5))  # persistent: synced
        self.register_buffer("inv_freq", torch.arange(3.0), persistent=False)  # never synced

    def forward(self, tokens: torch.Tensor, wide: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) * self.scale
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.float().pow(2).mean() + self.big(wide).float().pow(2).mean()


def train(mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Small().to(torch.bfloat16)
    for layer in [*model.layers, model.big]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def step(model: nn.Module, rank: int) -> None:
    gen = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randint(0, 11, (4, 5), generator=gen)
    wide = torch.randn(2, 1024, generator=gen).to(torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model(tokens, wide).backward()
    optimizer.step()
    optimizer.zero_grad()


def sender_round(case: str, full: dict, stale: dict, sync) -> None:
    """Rank 0's side of one sync: advertise (name, dtype, shape), then send each tensor."""
    advertised, sent = [], []
    for name, tensor in full.items():
        if case == "skipped" and name == SKIPPED:
            continue
        dtype = torch.float16 if case == "dtype" and name == ADVERTISED_WRONG else tensor.dtype
        if case == "stale" and name == STALE:
            tensor = stale[name]
        advertised.append((name, str(dtype).removeprefix("torch."), tuple(tensor.shape)))
        sent.append(tensor)
    dist.broadcast_object_list([advertised], src=0, group=sync)
    for tensor in sent:  # the bytes, as NCCL moves them
        dist.broadcast(tensor.contiguous().view(-1).view(torch.uint8), src=0, group=sync)


def receiver_round(sync) -> dict[str, torch.Tensor]:
    """Rank 2's side: allocate what was advertised, receive into it."""
    box: list = [None]
    dist.broadcast_object_list(box, src=0, group=sync)
    received = {}
    for name, dtype, shape in box[0]:
        buffer = torch.empty(shape, dtype=getattr(torch, dtype))
        dist.broadcast(buffer.view(-1).view(torch.uint8), src=0, group=sync)
        received[name] = buffer
    return received


def shard1_digests(mesh, side) -> dict:
    """A Shard(1) DTensor (tensor parallelism's row-wise cut: one run per row), digested from
    its shards and whole: bfloat16 of 41 columns (runs cut inside words) and float32 of 64
    (word-aligned runs, weighed in one pass)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    found = {}
    for label, shape, dtype in (("bf16-41", (37, 41), torch.bfloat16), ("f32-64", (40, 64), None)):
        torch.manual_seed(7)
        whole = torch.randn(shape).to(dtype or torch.float32)
        sharded = distribute_tensor(whole, mesh, [Shard(1)])
        found[label] = {
            "sharded": to_dict(fsdpcheck.state_digests([("t", sharded)], group=side)),
            "whole": to_dict(fsdpcheck.state_digests([("t", whole)])),
        }
    return found


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    # Every rank creates every group, in one order (new_group is collective over the world).
    trainers = dist.new_group([0, 1], backend="gloo")
    side = dist.new_group([0, 1], backend="gloo", timeout=timedelta(seconds=30))
    sync = dist.new_group([0, 2], backend="gloo")
    record: dict = {"rank": rank}
    if rank in (0, 1):
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh.from_group(trainers, "cpu")
        model = train(mesh)
        stale = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
        step(model, rank)
        record["sender"] = to_dict(fsdpcheck.state_digests(model, group=side))
        # As one rank alone on its host: the shards spread over this host's cores (threads).
        local_ranks = os.environ["LOCAL_WORLD_SIZE"]
        os.environ["LOCAL_WORLD_SIZE"] = "1"
        record["threads"] = worker_threads()
        record["sender_threaded"] = to_dict(fsdpcheck.state_digests(model, group=side))
        os.environ["LOCAL_WORLD_SIZE"] = local_ranks
        full = {n: p.full_tensor() for n, p in model.named_parameters()}
        full["scale"] = model.scale
        record["whole"] = to_dict(fsdpcheck.state_digests(full.items()))
        record["shard1"] = shard1_digests(mesh, side)
        if rank == 0:
            for case in CASES:
                sender_round(case, full, stale, sync)
    else:
        record["cases"] = {
            case: to_dict(fsdpcheck.state_digests(receiver_round(sync))) for case in CASES
        }
        model = Small()  # the engine's own model: no DTensor
    # As the docs show, on every rank of the world, no group given (issue 37): the trainers
    # combine over their mesh's group, the receiver holds nothing sharded and waits for no one.
    started = time.monotonic()
    record["default"] = to_dict(fsdpcheck.state_digests(model, timeout=30))
    record["default_seconds"] = time.monotonic() - started
    dist.barrier()
    if rank == 0:  # rank 1 stays away: a timeout that names it, never a raw store error
        started = time.monotonic()
        try:
            fsdpcheck.state_digests(model, timeout=SILENT_TIMEOUT)
            record["silent"] = {"raised": None}
        except Exception as exc:  # what the test inspects
            record["silent"] = {
                "raised": f"{type(exc).__module__}.{type(exc).__name__}",
                "message": str(exc),
                "ranks": list(getattr(exc, "ranks", ())),
            }
        record["silent"]["seconds"] = time.monotonic() - started
    dist.barrier()
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(record, indent=2))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # torch's teardown aborts now and then after a DTensor job: skip it (see fsdpcheck.process)
    exit_skipping_teardown(main())
