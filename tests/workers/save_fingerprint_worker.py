"""A training script that saves its fingerprints on every rank with no collective: before and
after fully_shard, rank 1 first while rank 0 waits for rank 1's files (not in any collective)."""

import sys
import time
from pathlib import Path

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fsdpcheck
from fsdpcheck.model.hazard import HazardConfig, HazardForCausalLM

out = Path(sys.argv[1])
dist.init_process_group("gloo")
rank = dist.get_rank()
model = HazardForCausalLM(HazardConfig())
mesh = init_device_mesh("cpu", (dist.get_world_size(),))


def wait_for(path: Path) -> None:
    deadline = time.monotonic() + 60
    while not path.exists():
        assert time.monotonic() < deadline, f"rank 1 never wrote {path}"
        time.sleep(0.05)


if rank == 0:
    wait_for(out / "pre" / "rank1.json")
fsdpcheck.save_fingerprint(model, out / "pre" / "rank{rank}.json")
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
if rank == 0:
    wait_for(out / "post" / "rank1.json")
fsdpcheck.save_fingerprint(model, out / "post" / "rank{rank}.json")
dist.barrier()  # the script's own group is untouched
dist.destroy_process_group()
