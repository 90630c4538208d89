"""A small FSDP2 (or DDP) training loop for tests/ranks/test_run.py, run under ``fsdpcheck run``:
what the script itself sees of fsdpcheck after each step, and its own ways to end.

    fsdpcheck run tests/workers/run_probe.py --out DIR [--steps N] [--ddp]
        [--raise-at STEP] [--exit-code N] [--die-at STEP] [--sigint-at STEP]

``--out``: each rank writes ``rank<r>.json``: its losses, and after each step what is on its
path (global module and optimizer hooks, dispatch modes, the files ``fully_shard``,
``to_empty`` and FSDP2's ``FSDPState.init`` come from, the keys in the job's store).
``--raise-at``, ``--die-at``, ``--sigint-at`` and ``--stall-at`` (a sleep of ``--stall-seconds``
before the forward) act on rank 1 only, at that step (0-based).
"""

import argparse
import json
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.fsdp as fsdp
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
from torch.nn.modules import module as module_hooks
from torch.optim import optimizer as optimizer_hooks
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack


def origin(fn) -> str:
    """Where a callable was defined: a function's file, else its class's module."""
    code = getattr(fn, "__code__", None)
    return code.co_filename if code is not None else type(fn).__module__


def fsdpcheck_on_path() -> dict:
    import safetensors.torch
    import torch.distributed.checkpoint as dcp

    return {
        "forward_pre_hooks": len(module_hooks._global_forward_pre_hooks),
        "optimizer_pre_hooks": len(optimizer_hooks._global_optimizer_pre_hooks),
        "optimizer_post_hooks": len(optimizer_hooks._global_optimizer_post_hooks),
        "dispatch_modes": [type(m).__name__ for m in _get_current_dispatch_mode_stack()],
        "fully_shard": fsdp.fully_shard.__code__.co_filename,
        "to_empty": nn.Module.to_empty.__code__.co_filename,
        "fsdp_state_init": FSDPState.init.__code__.co_filename,
        # what the watch and the session patch while they run, and their threads
        "patched": {
            "isend": origin(dist.isend),
            "irecv": origin(dist.irecv),
            "batch_isend_irecv": origin(dist.batch_isend_irecv),
            "dcp.load": origin(dcp.load),
            "safetensors.load_file": origin(safetensors.torch.load_file),
        },
        "threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("fsdpcheck")),
        # keys in the job's store: what fsdpcheck left there (the launcher's own are constant)
        "store_keys": dist.distributed_c10d._get_default_store().num_keys(),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--ddp", action="store_true")
    parser.add_argument("--raise-at", type=int, default=None)
    parser.add_argument("--exit-code", type=int, default=None)
    parser.add_argument("--die-at", type=int, default=None)
    parser.add_argument("--sigint-at", type=int, default=None)
    parser.add_argument("--stall-at", type=int, default=None)
    parser.add_argument("--stall-seconds", type=float, default=5.0)
    args = parser.parse_args()
    if args.exit_code is not None:
        sys.exit(args.exit_code)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    if args.ddp:
        model = nn.parallel.DistributedDataParallel(model)
    else:
        for layer in (model[0], model[2]):
            fsdp.fully_shard(layer)
        fsdp.fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(rank)
    store_keys = dist.distributed_c10d._get_default_store().num_keys()
    record = {"losses": [], "path": [], "store_keys_at_start": store_keys}
    for step in range(args.steps):
        if rank == 1 and step == args.die_at:
            os._exit(9)
        if rank == 1 and step == args.sigint_at:
            os.kill(os.getpid(), signal.SIGINT)
        if rank == 1 and step == args.stall_at:  # late, alive: a slow data loader
            time.sleep(args.stall_seconds)
        x = torch.randn(8, 16, generator=data)
        loss = model(x).square().mean()
        loss.backward()
        if rank == 1 and step == args.raise_at:
            raise ValueError(f"rank 1 broke at step {step}")
        optimizer.step()
        optimizer.zero_grad()
        record["losses"].append(loss.item())
        record["path"].append(fsdpcheck_on_path())
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    # Rank 0 serves the store under env:// ranks: it waits for every rank's last look at the
    # store (fsdpcheck_on_path, after the last step's collectives) before its process ends.
    dist.barrier()
    # DDP's reducer destroyed after its process group hangs on gloo now and then (torch's own,
    # seen without fsdpcheck): the model goes first.
    del model, optimizer
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
