"""NCCL smoke check for a host with CUDA (run by scripts/gpu_check.sh): one rank per GPU on the
default NCCL group, the library's loader and buffer broadcast on CUDA tensors.

Prints one ``@gpu {json}`` line per rank. Launch with torchrun, one process per GPU."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch import nn


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(2))
        self.head = nn.Linear(64, 8, bias=False)
        self.register_buffer("rope_inv_freq", torch.arange(16.0) + 1, persistent=False)
        self.register_buffer("mask_bool", torch.arange(5) % 2 == 0, persistent=False)


def build(rank: int, dtype: torch.dtype) -> tuple[nn.Module, dict | None]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    if rank == 0:
        model = Tiny().to(dtype)
        source = {k: v.clone() for k, v in model.state_dict().items()}
    else:
        with torch.device("meta"):
            model = Tiny().to(dtype)
        source = None
    mesh = dist.device_mesh.init_device_mesh("cuda", (dist.get_world_size(),))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, source


def checksums_agree(device: torch.device) -> dict:
    """The value checksum and a shard's share of it, on CUDA against the CPU, for the same
    bytes: sizes across 1 MiB blocks and CUDA's many-block kernels, short rows, unaligned
    starts and cuts inside words (what verify and state_digests rely on across devices)."""
    from fsdpcheck.model.checksum import checksum, share

    gen = torch.Generator().manual_seed(0)
    words_per_block = 8192 * 16
    cases = {
        "bf16 3 blocks + 5 words": torch.randn(4 * (3 * words_per_block + 5), generator=gen).to(
            torch.bfloat16
        ),
        "fp32 300 blocks": torch.randn(2 * 300 * words_per_block, generator=gen),
        "int8 odd": torch.randint(-128, 127, (1_000_003,), dtype=torch.int8, generator=gen),
        "bf16 from element 3": torch.randn(40_001, generator=gen).to(torch.bfloat16)[3:],
    }
    result = {}
    for name, cpu in cases.items():
        cuda = cpu.to(device)
        cut = cpu.numel() // 3 + 1  # inside a word for 1- and 2-byte elements
        parts = {}
        for label, tensor in (("cpu", cpu), ("cuda", cuda)):
            parts[label] = [
                share(tensor[:cut].clone(), [0], [cut]),
                share(tensor[cut:].clone(), [cut], [tensor.numel() - cut]),
            ]
        result[name] = {
            "whole": checksum(cpu) == checksum(cuda),
            "shares": parts["cpu"] == parts["cuda"],
        }
    return result


def main() -> int:
    from fsdpcheck.distributed import setup as distributed
    from fsdpcheck.loader.load import broadcast_buffers, load_full_state_dict
    from fsdpcheck.loader.verify import verify_load
    from fsdpcheck.records import to_dict

    ctx = distributed.init("nccl", 60.0)
    out: dict = {"rank": ctx.rank, "device": str(ctx.device), "torch": torch.__version__}
    for dtype in (torch.float32, torch.bfloat16):
        key = str(dtype).removeprefix("torch.")
        for label, group in (("nccl-default", None), ("gloo-channel", ctx.side_channel)):
            model, source = build(ctx.rank, dtype)
            try:
                result = load_full_state_dict(model, source, group=group)
                verified = verify_load(model, source, group=ctx.side_channel)
                on_cuda = all(p.to_local().is_cuda for p in model.parameters())
                out[f"load/{key}/{label}"] = {
                    "result": to_dict(result),
                    "verified": verified.passed,
                    "params_on_cuda": on_cuda,
                }
            except Exception as exc:
                out[f"load/{key}/{label}"] = {"error": f"{type(exc).__name__}: {exc}"}
        model, _ = build(ctx.rank, dtype)
        if ctx.rank != 0:
            model.to_empty(device=ctx.device)  # garbage, until rank 0's values arrive
        try:
            moved = broadcast_buffers(model, group=None)  # CUDA buffers on the NCCL group
            expected = (torch.arange(16.0) + 1).to(dtype)
            out[f"buffers/{key}"] = {
                **to_dict(moved),
                "values_ok": torch.equal(model.rope_inv_freq.cpu(), expected)
                and model.rope_inv_freq.is_cuda,
            }
        except Exception as exc:
            out[f"buffers/{key}"] = {"error": f"{type(exc).__name__}: {exc}"}
    out["checksum/cpu-vs-cuda"] = checksums_agree(ctx.device)
    print("@gpu " + json.dumps(out), flush=True)
    distributed.shutdown(ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
