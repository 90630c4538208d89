"""verl's FSDP2 actor start-up, step for step, with fsdpcheck's calls where they go.

    torchrun --nproc-per-node 2 examples/verl_worker.py            # the checks, then one step
    torchrun --nproc-per-node 2 -m fsdpcheck audit \\
        --builder examples/verl_worker.py:build_actor --probe 4     # the same model, probed

The order is verl's ``fsdp_workers.py`` (``_build_model_optimizer``) with its FSDP2 strategy:
rank 0 builds the model with real weights and the other ranks on ``meta``, every decoder layer
and the root go through ``fully_shard``, then ``fsdp2_load_full_state_dict`` (verl/utils/
fsdp_utils.py, copied below from verl 0.8.0) loads rank 0's weights: DCP's
``set_model_state_dict`` for the state dict, then one ``broadcast`` per buffer for what the
state dict does not carry (RoPE ``inv_freq``). Then ``fsdpcheck.check_model`` compares every
rank's model after the load, and the first update runs under ``fsdpcheck.check_step``.

The model is fsdpcheck's ``hazard`` model: its rotary module registers one buffer per attention
type while iterating a ``set`` of names, as several transformers releases did (DESIGN fact 1),
so its buffer order follows ``PYTHONHASHSEED``. Under verl 0.7.1's unsorted buffer loop two ranks
with different seeds abort (gloo) or deadlock (NCCL); verl 0.8.0 sorts by name (its PR #6405), as
the copy below does, so the values load right either way. Run without a common
``PYTHONHASHSEED`` (as torchrun and Ray leave it), ``check_model`` reports the order difference
(exit 1) on the runs where the two ranks draw different orders, and on the others passes with
the report's no-common-seed note; ``--probe`` (or ``fsdpcheck.probe(build_actor)`` from the
driver) shows the dependence on every run. With ``PYTHONHASHSEED=0`` on every rank it passes.
"""

# ruff: noqa: E501, B007
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from packaging import version
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fsdpcheck
from fsdpcheck.model.hazard import HazardConfig, HazardForCausalLM


def get_device_id():
    """verl.utils.device.get_device_id on a host without CUDA: ``torch.cpu.current_device()``."""
    return torch.cuda.current_device() if torch.cuda.is_available() else "cpu"


# Copied from verl 0.8.0, verl/utils/fsdp_utils.py (Apache-2.0, Copyright 2024 Bytedance Ltd.
# and/or its affiliates); only the torch < 2.7 branch (verl's own third_party copy) is left out.
# Kept as verl wrote it (its line length, its unused loop name): hence fmt off and the noqa.
# fmt: off
def fsdp2_load_full_state_dict(model: torch.nn.Module, full_state: dict, device_mesh=None, cpu_offload=None):
    """
    Loads the full state dict (could be only on rank 0) into the sharded model. This is done by broadcasting the
    parameters from rank 0 to all other ranks. This function modifies the model in-place.

    Args:
        model (`torch.nn.Module`): The model to load the state dict into
        full_state (`dict`): The full state dict to load, can only be on rank 0
    """
    assert version.parse(torch.__version__) >= version.parse("2.7.0")
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    # To broadcast, it needs to be instantiated in the GPU.
    if dist.get_rank() == 0:
        model = model.to(device=get_device_id(), non_blocking=True)
    else:
        model = model.to_empty(device=get_device_id())

    cpu_offload = cpu_offload is not None
    options = StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload, broadcast_from_rank0=True)
    set_model_state_dict(model, full_state, options=options)

    # rotary_emb is not in state_dict, so we need to broadcast it manually
    # Sort by name to ensure deterministic order across ranks. FSDP2 can return
    # named_buffers() in different order on different ranks. Gemma4 has heterogeneous
    # rotary embedding buffers (256 vs 128 elements) so mismatched order = size
    # mismatch on the same broadcast collective = NCCL deadlock.
    bufs = sorted(model.named_buffers(), key=lambda x: x[0])
    for name, buf in bufs:
        dist.broadcast(buf, src=0)

    if cpu_offload:
        model.to("cpu", non_blocking=True)
        for buf in model.buffers():
            buf.data = buf.data.to(get_device_id())
# fmt: on


def build_actor(ctx):
    """The actor module as verl builds it: rank 0 real (seeded), the others on meta, then
    ``fully_shard`` per decoder layer and on the root. Returns the model and rank 0's full state
    dict, so it is also an ``audit --builder`` builder (and ``fsdpcheck.probe``'s)."""
    config = HazardConfig()
    if ctx.rank == 0:
        torch.manual_seed(0)
        model = HazardForCausalLM(config)
        full_state = {k: v.clone() for k, v in model.state_dict().items()}
    else:
        with torch.device("meta"):
            model = HazardForCausalLM(config)
        full_state = {}
    mesh = ctx.mesh or init_device_mesh("cpu", (ctx.world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, full_state if ctx.rank == 0 else None


class _Ctx:
    def __init__(self):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.local_rank, self.device, self.mesh = self.rank, torch.device("cpu"), None


def main() -> int:
    dist.init_process_group("gloo")
    ctx = _Ctx()
    model, full_state = build_actor(ctx)
    fsdp2_load_full_state_dict(model, full_state or {})

    loaded = fsdpcheck.check_model(model, timeout=60)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(ctx.rank))

    def update():
        optimizer.zero_grad()
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
        loss.backward()
        optimizer.step()
        return loss

    stepped = fsdpcheck.check_step(model, update, timeout=60)
    if ctx.rank == 0:
        print(f"check_model: {loaded.headline} (exit {int(loaded.exit_code)})")
        print(f"check_step: {stepped.headline} (exit {int(stepped.exit_code)})")
        print(f"PYTHONHASHSEED on rank 0: {os.environ.get('PYTHONHASHSEED', 'random')}")
        for warning in loaded.report.warnings if loaded.report is not None else ():
            print(f"note: {warning}")
    dist.destroy_process_group()
    return max(int(loaded.exit_code), int(stepped.exit_code))


if __name__ == "__main__":
    sys.exit(main())
