"""A training script that loads its own sharded model from a checkpoint with its own loader, then
``check_model(source=...)``. One case per argv (``--cases``, see ``recorded.main_with_cases``):

- ``--format``: the checkpoint this case writes and checks against: ``safetensors`` (one file),
  ``index`` (two files and ``model.safetensors.index.json``) or ``dcp`` (``dcp.save`` of the
  sharded model: one ``__R_0.distcp`` per rank);
- ``--fault``: what the script's loader does wrong, the same on every rank: ``permute-qk`` (q/k
  rows reordered within each head, as a rotary permutation does), ``shard-dim`` (o_proj's slice
  cut along dim 1, laid into the dim-0 shard), ``transpose`` (o_proj loaded transposed),
  ``cast`` (a bfloat16 checkpoint loaded into the float32 model), ``swap`` (layer 0's q_proj
  loaded from its k_proj), ``fused-permute`` (with ``--fused``: each rank's wqkv rows rolled);
- ``--fused``: each layer also holds torchtitan's fused ``wqkv`` (``fused_qkv.py``), saved as
  ``wq``/``wk``/``wv`` by its state-dict hooks;
- ``--no-source``: ``check_model`` without ``source=`` (the ranks are compared only with each
  other); ``--missing-on-rank N``: rank N is given a path that does not exist.

Rank 0 writes the report; every rank writes its record (with ``check_model``'s exit code).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from fused_qkv import FusedQKVLinear
from recorded import main_with_cases
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fsdpcheck
from fsdpcheck.loader.shards import expected_shard
from fsdpcheck.process import exit_skipping_teardown
from fsdpcheck.records import to_dict

HEADS, HEAD_DIM = 2, 4
DIM = HEADS * HEAD_DIM


class Attention(nn.Module):
    def __init__(self, fused: bool) -> None:
        super().__init__()
        if fused:
            self.qkv = FusedQKVLinear("fused")
        self.q_proj = nn.Linear(DIM, DIM, bias=False)
        self.k_proj = nn.Linear(DIM, DIM, bias=False)
        self.o_proj = nn.Linear(DIM, DIM)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, DIM))


class Tiny(nn.Module):
    def __init__(self, fused: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Attention(fused), Attention(fused)])
        self.head = nn.Linear(DIM, 2 * DIM)
        self.odd = nn.Linear(DIM, 5)  # uneven shards: rows 0:3 on rank 0, 3:5 on rank 1


def _permute(w: torch.Tensor) -> torch.Tensor:
    """HF's rotary permutation of q/k rows: each head's halves interleaved (within the head)."""
    return w.view(HEADS, 2, HEAD_DIM // 2, DIM).transpose(1, 2).reshape(DIM, DIM)


def _write(full: dict[str, torch.Tensor], fmt: str, folder: Path, model: nn.Module) -> Path:
    from safetensors.torch import save_file

    rank = dist.get_rank()
    folder.mkdir(parents=True, exist_ok=True)
    if fmt == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.save(model.state_dict(), checkpoint_id=str(folder))
        return folder
    if rank == 0:
        if fmt == "safetensors":
            save_file(full, str(folder / "model.safetensors"))
        else:
            names = sorted(full)
            halves = {"part-1.safetensors": names[::2], "part-2.safetensors": names[1::2]}
            weight_map = {}
            for file, keys in halves.items():
                save_file({k: full[k] for k in keys}, str(folder / file))
                weight_map.update(dict.fromkeys(keys, file))
            (folder / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {}, "weight_map": weight_map})
            )
    dist.barrier()
    return folder if fmt == "index" else folder / "model.safetensors"


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if hasattr(param, "to_local") else param.data


def _load(model: nn.Module, full: dict[str, torch.Tensor], fault: str) -> None:
    """The script's own loader: each rank copies its slice of ``full`` (by module path) into
    its shards."""
    rank = dist.get_rank()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in params.items():
            want = full[name].to(param.dtype)
            local = _local(param)
            if fault == "permute-qk" and name.endswith(("q_proj.weight", "k_proj.weight")):
                want = _permute(want)
            if fault == "transpose" and name.endswith("o_proj.weight"):
                want = want.T
            if fault == "swap" and name == "layers.0.q_proj.weight":
                want = full["layers.0.k_proj.weight"].to(param.dtype)
            if fault == "fused-permute" and name.endswith("wqkv.weight"):
                local.copy_(expected_shard(want, param, rank).roll(1, dims=0))
                continue
            if fault == "shard-dim" and name.endswith("o_proj.weight"):
                local.copy_(want.chunk(dist.get_world_size(), dim=1)[rank].reshape(local.shape))
                continue
            local.copy_(expected_shard(want, param, rank))
        for name, buf in model.named_buffers():
            buf.copy_(full[name].to(buf.dtype))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--format", choices=("safetensors", "index", "dcp"), required=True)
    parser.add_argument("--fault", default="")
    parser.add_argument("--no-source", action="store_true")
    parser.add_argument("--fused", action="store_true")
    parser.add_argument("--tp", action="store_true", help="tensor parallelism, no FSDP2")
    parser.add_argument("--missing-on-rank", type=int, default=-1, help="its path: no file")
    args = parser.parse_args(argv)
    started = time.monotonic()
    out = Path(args.out)
    torch.manual_seed(0)
    model = Tiny(args.fused)
    # What the loader places (by module path) and what the checkpoint holds (the state dict,
    # through its hooks: wqkv saved as wq/wk/wv)
    raw = {k: v.detach().clone() for k, v in [*model.named_parameters(), *model.named_buffers()]}
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if args.fault == "cast":  # the model's float32 values are the bfloat16 checkpoint's, cast
        full = {k: v.to(torch.bfloat16) for k, v in full.items()}
        raw = {k: v.to(torch.bfloat16) for k, v in raw.items()}
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if args.tp:  # q/k/head column-wise (Shard(0)), o_proj row-wise (Shard(1)); the rest whole
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        plan = {"head": ColwiseParallel()}
        for i in range(len(model.layers)):
            plan[f"layers.{i}.q_proj"] = ColwiseParallel()
            plan[f"layers.{i}.k_proj"] = ColwiseParallel()
            plan[f"layers.{i}.o_proj"] = RowwiseParallel()
        parallelize_module(model, mesh, plan)
    else:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    with torch.no_grad():  # nothing left from the build: the loader must place every value
        for param in model.parameters():
            _local(param).zero_()
    _load(model, raw, "")  # the checkpoint is written from a cleanly loaded model
    path = _write(full, args.format, out / "checkpoint", model)
    if args.fault:
        with torch.no_grad():
            for param in model.parameters():
                _local(param).zero_()
        _load(model, raw, args.fault)
    if dist.get_rank() == args.missing_on_rank:
        path = path.parent / "missing.safetensors"
    result = fsdpcheck.check_model(model, timeout=60, source=None if args.no_source else path)
    record = {"rank": dist.get_rank(), "exit_code": result.exit_code}
    record["elapsed"] = round(time.monotonic() - started, 3)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
    if result.report is not None:
        (out / "report.json").write_text(json.dumps(to_dict(result.report)))
    return result.exit_code


if __name__ == "__main__":
    # torch's teardown aborts now and then after a DTensor job: skip it (see fsdpcheck.process)
    exit_skipping_teardown(main_with_cases(main))
