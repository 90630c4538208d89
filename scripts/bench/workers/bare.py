"""The bare job the audit is compared with: what a trainer does before loading weights, and
nothing else: import torch and transformers, join the process group, build the model (on meta,
as ``audit --init meta`` does), ``fully_shard`` each decoder layer and the root, exit.

``--materialise rank0``: the floor of ``audit --init rank0 --no-load``. Rank 0 gives its
parameters memory and writes a value into each (one pass of writes, with every core, as the
audit's fill), so ``fully_shard`` copies its shards out of real tensors, as in a trainer; the
other ranks stay on meta. ``--materialise rank0-load``: the floor of the default audit: then
every other rank gives its shards memory and receives them from rank 0's tensors point to
point, straight into place (no validation, no packing; Shard(0) on 2 ranks only), and each
rank reads once what any verify must read (its shards; rank 0 its source too), as plain sums.
Neither checks anything: no fingerprint, gather, digest, comparison or report; both end as the
audit does.

``--model`` is an fsdpcheck preset name or a directory holding a ``config.json``."""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--materialise", choices=("none", "rank0", "rank0-load"), default="none")
    args = parser.parse_args()

    from fsdpcheck.model.presets import PRESETS  # the preset's config, nothing else of fsdpcheck

    preset = PRESETS.get(args.model)
    if preset is not None:
        config = preset.make_config()
    else:
        config = transformers.AutoConfig.from_pretrained(args.model)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rank = dist.get_rank()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    source = None
    threads = torch.get_num_threads()
    if args.materialise != "none" and rank == 0:
        from fsdpcheck.model.threads import all_cores  # the threads the audit's fill takes

        torch.set_num_threads(all_cores())
        model.to_empty(device="cpu")
        model.tie_weights()  # to_empty() gives tied parameters storage of their own
        with torch.no_grad():
            for param in model.parameters():
                param.fill_(0.01)
        source = dict(model.named_parameters())
    layers = set(getattr(model, "_no_split_modules", None) or ())
    for module in reversed(list(model.modules())):
        if type(module).__name__ in layers:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    torch.set_num_threads(threads)
    if args.materialise == "rank0-load":
        receive_shards(model, source, rank)
        # The default audit verifies: any verify reads once what each rank holds (rank 0 its
        # source too), the full load row's floor of verify, with verify's threads.
        from load import read_once  # workers/load.py, beside this file

        read_once(model, source if rank == 0 else None)
    dist.destroy_process_group()
    if args.materialise != "none":
        # A floor ends as the audit does: the interpreter's teardown of gigabytes of tensors
        # skipped (the OS frees them), exit handlers (workers/rss.py's) still run.
        from fsdpcheck.process import exit_skipping_teardown

        exit_skipping_teardown(0)
    return 0


def receive_shards(model: torch.nn.Module, source: dict | None, rank: int) -> None:
    """Rank 1's shards, sent point to point from views of rank 0's full tensors straight into
    rank 1's fresh local shards, a few in flight (as workers/load.py ``p2p_floor``), their pages
    populated ahead of the receives by the loader's own ``Prefault``: the fastest way to fresh
    memory this machine has, so that the floor is one."""
    from fsdpcheck.loader.transfer import Prefault

    params = sorted(model.named_parameters())
    prefault = None
    if rank != 0:
        model.to_empty(device="cpu")
        params = sorted(model.named_parameters())
        prefault = Prefault([p.to_local() for _, p in params])
        prefault.start()
    pending = []
    for tag, (name, param) in enumerate(params):
        if rank == 0:
            part = source[name].detach().chunk(2)[1].reshape(-1).view(torch.uint8)
            pending.append(dist.isend(part.contiguous(), 1, tag=tag))
        else:
            local = param.to_local().detach().reshape(-1).view(torch.uint8)
            pending.append(dist.irecv(local, 0, tag=tag))
        if len(pending) > 8:
            pending.pop(0).wait()
    for work in pending:
        work.wait()
    if prefault is not None:
        prefault.join()


if __name__ == "__main__":
    sys.exit(main())
