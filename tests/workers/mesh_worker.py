"""One rank of a mesh test: a training script's own layout on its own meshes, then check_model.

Cases (``--case``, repeatable, run in turn in one process group), each writing rank 0's report
into ``--out`` as ``{case: report}``:

- ``ep`` (4 ranks): world mesh (ep=2, dp=2); each EP group's weights seeded by its EP index;
  FSDP2 over the group's own ``dp`` sub-mesh for the experts, the router left a plain tensor.
- ``ep-drift``: the same, then rank 3's router holds other values than its dp peer's (rank 2).
- ``ep-collapsed``: the same layout, but every EP group holds EP group 0's experts (a resume
  that copied one rank's experts everywhere); each group keeps its own router.
- ``hsdp`` (4 ranks): FSDP2 on a (replicate=2, shard=2) mesh, every rank seeded alike.
- ``hsdp-drift``: the same, then rank 3's local shard of one weight differs from rank 1's.
- ``tp`` (any ranks): tensor parallel on its own: a Colwise-sharded linear, a Replicate norm.
- ``tp-drift``: the same, then rank 1's Replicate norm differs.
- ``mesh-2d`` (4 ranks): the experts' weights as [Shard(0), Replicate()] DTensors on a
  (dp_shard=2, tp=2) mesh on every rank. ``mesh-shape-on-3``: rank 3 puts the same placements
  on a (4, 1) mesh; ``mesh-dims-on-3``: on a (2, 2) mesh named (tp, dp_shard). Every rank
  builds every mesh (a mesh is a collective); each rank's own values, no communication.
- ``nan`` (any ranks): FSDP2 over every rank, then rank 1's loader leaves NaN in its local
  shard of one weight. ``finite``: the same without the NaN (the clean twin).
- ``ep-step`` (4 ranks): the tiny-qwen3-moe preset wrapped by fsdpcheck's own ``--ep`` wrap
  (dp_shard=2, ep=2), then one training step under ``check_step``: the EP all-to-alls' split
  sizes follow each rank's routing and differ across ranks, by design.
- ``ep-step-undispatched-on-rank-3``: the same, but rank 3's layer-1 experts lost the token
  dispatch transformers installed (its forward reset to the class's): rank 3's experts raise on
  their DTensor weights (``aten._grouped_mm`` got mixed Tensor and DTensor) while ranks 0-2
  enter the all-to-all, where its EP peer would wait until the timeout, unwatched.

``--audit-cases FILE`` (tests/workers/audit_cases_worker.py's case format): after those, the same
job runs each as a whole ``run_audit`` on this group (named meshes, ``--tp``, 2-D builders),
rank 0's results under ``"audits"`` in ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fsdpcheck
from fsdpcheck.process import exit_skipping_teardown
from fsdpcheck.records import to_dict


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16, bias=False)
        self.down = nn.Linear(16, 8, bias=False)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(8, 4, bias=False)
        self.experts = Experts()
        self.norm = nn.LayerNorm(8)
        self.register_buffer("scale", torch.tensor([0.5, 2.0]), persistent=False)


def _tiny(seed: int) -> Tiny:
    torch.manual_seed(seed)
    return Tiny()


def _ep(drift: bool, collapsed: bool = False) -> nn.Module:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "dp"))
    ep_index = dist.get_rank() // 2
    model = _tiny(seed=ep_index)  # each EP group holds its own experts
    if collapsed:
        model.experts.load_state_dict(_tiny(seed=0).experts.state_dict())
    fully_shard(model.experts, mesh=mesh["dp"])
    if drift and dist.get_rank() == 3:
        with torch.no_grad():
            model.router.weight.add_(1.0)
    return model


def _hsdp(drift: bool) -> nn.Module:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _tiny(seed=0)
    fully_shard(model.experts, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if drift and dist.get_rank() == 3:  # rank 1 holds the same shard
        with torch.no_grad():
            model.experts.up.weight.to_local().add_(1.0)
    return model


def _tp(drift: bool) -> nn.Module:
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    model = _tiny(seed=0)
    parallelize_module(model.experts, mesh, {"up": ColwiseParallel()})
    weight = distribute_tensor(model.norm.weight.detach(), mesh, [Replicate()])
    model.norm.weight = nn.Parameter(weight)
    if drift and dist.get_rank() == 1:
        with torch.no_grad():
            model.norm.weight.to_local().add_(1.0)
    return model


@functools.cache
def _device_mesh(shape: tuple[int, int], names: tuple[str, str]):
    # Built once per job (every rank, in the same order: a mesh is a collective).
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _mesh_on_3(shape: tuple[int, int], names: tuple[str, str]) -> nn.Module:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    usual = _device_mesh((2, 2), ("dp_shard", "tp"))
    other = _device_mesh(shape, names)
    mesh = other if dist.get_rank() == 3 else usual
    model = _tiny(seed=0)
    rows = mesh.size(0)
    for linear in (model.experts.up, model.experts.down):
        local = linear.weight.detach().chunk(rows)[mesh.get_coordinate()[0]].clone()
        placed = DTensor.from_local(local, mesh, [Shard(0), Replicate()], run_check=False)
        linear.weight = nn.Parameter(placed)
    return model


def _nan(leave_nan: bool) -> nn.Module:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _tiny(seed=0)
    fully_shard(model.experts, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if leave_nan and dist.get_rank() == 1:  # an empty_like placeholder the loader never filled
        with torch.no_grad():
            model.experts.down.weight.to_local()[0, :3] = float("nan")
    return model


def _ep_step(undispatched: bool):
    """(model, step) for ``check_step``: fsdpcheck's --ep wrap on the MoE preset."""
    from builders import _moe  # this script's folder is on sys.path

    from fsdpcheck.model import parallel, wrap

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "ep"))
    model = _moe()
    targets = wrap.plan(model).modules
    parallel.shard(model, targets, mesh, ep_meshes=parallel.ep_meshes(mesh))
    if undispatched and dist.get_rank() == 3:
        del model.model.layers[1].mlp.experts.forward  # the instance's EP forward
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(dist.get_rank())
    tokens = torch.randint(0, 256, (2, 16))

    def step():
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        return loss

    return model, step


STEP_CASES = {
    "ep-step": lambda: _ep_step(False),
    "ep-step-undispatched-on-rank-3": lambda: _ep_step(True),
}

CASES = {
    "ep": lambda: _ep(False),
    "ep-drift": lambda: _ep(True),
    "ep-collapsed": lambda: _ep(False, collapsed=True),
    "hsdp": lambda: _hsdp(False),
    "hsdp-drift": lambda: _hsdp(True),
    "tp": lambda: _tp(False),
    "tp-drift": lambda: _tp(True),
    "mesh-2d": lambda: _mesh_on_3((2, 2), ("dp_shard", "tp")),
    "mesh-shape-on-3": lambda: _mesh_on_3((4, 1), ("dp_shard", "tp")),
    "mesh-dims-on-3": lambda: _mesh_on_3((2, 2), ("tp", "dp_shard")),
    "nan": lambda: _nan(True),
    "finite": lambda: _nan(False),
}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", action="append")
    parser.add_argument("--out", required=True)
    parser.add_argument("--audit-cases")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    reports, code = {}, 0
    for case in args.case or ():
        if case in STEP_CASES:
            result = fsdpcheck.check_step(*STEP_CASES[case](), timeout=60)
        else:
            result = fsdpcheck.check_model(CASES[case](), timeout=60)
        # A step case whose step raises on a rank ends with exit 3 by design; only a lost
        # peer elsewhere fails the job.
        if result.exit_code == 3 and case not in STEP_CASES:
            code = 3
        if result.report is not None:
            reports[case] = to_dict(result.report)
    if args.audit_cases:
        from audit_cases_worker import run_cases  # this script's folder is on sys.path

        reports["audits"] = run_cases(json.loads(Path(args.audit_cases).read_text()))
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(reports))
    dist.barrier()
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    exit_skipping_teardown(main())
