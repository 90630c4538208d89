"""One rank of the full-load benchmark: build a Llama-shaped model (rank 0 real, others on meta),
``fully_shard`` it, then time one load and measure this process's peak RSS during it.

Methods: ``bucketed`` (fsdpcheck's loader, default path), ``p2p-floor`` (see :func:`p2p_floor`),
``dcp`` (what trainers use today: ``to_empty`` + ``set_model_state_dict(...,
full_state_dict=True, broadcast_from_rank0=True)``), ``accelerate`` (accelerate's own
``fsdp2_load_full_state_dict``, the real function: one broadcast of every full tensor,
``distribute_tensor`` on every rank), ``raw`` (one ``dist.broadcast`` of the same bytes from a
flat tensor on rank 0 into a freshly allocated one on the others; then, untimed for the peak, a
second broadcast into the memory the first one touched: the wire alone, ``seconds_warm``) and
``raw-warm`` (only the latter).
Prints one line ``@bench {json}``; run by scripts/bench (the load row) through
fsdpcheck.children.launch.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

MARK = "@bench "


class Layer(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.input_layernorm = nn.LayerNorm(hidden)
        self.post_attention_layernorm = nn.LayerNorm(hidden)


class LlamaShaped(nn.Module):
    """Llama's tensor shapes (untied embeddings, a RoPE buffer) without importing transformers."""

    def __init__(self, vocab: int, hidden: int, inter: int, layers: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Layer(hidden, inter) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        inv_freq = 1.0 / 10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)
        self.register_buffer("inv_freq", inv_freq, persistent=False)


SIZES = {  # vocab, hidden, intermediate, layers
    "full": (32000, 1024, 4096, 26),  # 502M params: 1.87 GiB fp32
    "quick": (8000, 512, 2048, 8),  # 33.6M params: 0.13 GiB fp32
}


def status(field: str) -> int:
    """A /proc/self/status memory field, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0), so the peak covers the load alone."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def build(size: str, rank: int) -> tuple[nn.Module, dict | None]:
    vocab, hidden, inter, layers = SIZES[size]
    with torch.device("meta"):
        model = LlamaShaped(vocab, hidden, inter, layers)
    source = None
    if rank == 0:
        inv_freq = model.inv_freq
        model.to_empty(device="cpu")
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for param in model.parameters():
                param.uniform_(-0.05, 0.05, generator=gen)
            model.inv_freq.copy_(1.0 / 10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
        assert inv_freq.shape == model.inv_freq.shape
        source = dict(model.state_dict())
    return model, source


def p2p_floor(model: nn.Module, source: dict | None, rank: int, group) -> None:
    """The least any loader of rank 1's shards can do: ``to_empty()``, then each rank-1 shard
    sent point-to-point from a view of rank 0's source straight into rank 1's local shard,
    while a thread of rank 1 faults the fresh pages in ahead of the receives (the loader's
    ``Prefault``: no byte changes, so it overlaps them; without it gloo's receive thread
    faults each page in itself, which on this VM costs several times more). No validation,
    no packing, no dtype conversion, rank 0's own shards left as fully_shard made them;
    correct only for this model (2 ranks, Shard(0) everywhere)."""
    from fsdpcheck.loader.transfer import Prefault

    params = sorted(model.named_parameters())
    prefault = None
    if rank != 0:
        model.to_empty(device="cpu")
        prefault = Prefault([param.to_local() for _, param in params])
        prefault.start()
    pending = []
    for tag, (name, param) in enumerate(params):
        if rank == 0:
            part = source[name].chunk(2)[1].reshape(-1).view(torch.uint8)
            pending.append(dist.isend(part, 1, group=group, tag=tag))
        else:
            local = param.to_local().detach().reshape(-1).view(torch.uint8)
            pending.append(dist.irecv(local, 0, group=group, tag=tag))
        if len(pending) > 8:
            pending.pop(0).wait()
    for work in pending:
        work.wait()
    if prefault is not None:
        prefault.join()


def read_once(model, source: dict | None) -> None:
    """The floor of any verify: each rank reads what it holds once (its local shards; rank 0
    also the whole source, which only it holds), summed as 64-bit words (no arithmetic worth
    the name), with the threads verify_load gives each rank."""
    from fsdpcheck.model.threads import lead_threads, worker_threads

    tensors = [getattr(p, "_local_tensor", p) for p in model.parameters()]
    tensors += list(source.values()) if source is not None else []
    threads = torch.get_num_threads()
    torch.set_num_threads(lead_threads() if source is not None else worker_threads())
    try:
        for tensor in tensors:
            raw = tensor.detach().reshape(-1).view(torch.uint8)
            try:
                raw[: raw.numel() // 8 * 8].view(torch.int64).sum()
            except RuntimeError:  # not 8-byte aligned: in its own dtype
                tensor.detach().sum()
    finally:
        torch.set_num_threads(threads)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--method",
        choices=("bucketed", "dcp", "accelerate", "raw", "raw-warm", "p2p-floor"),
        required=True,
    )
    parser.add_argument("--size", choices=tuple(SIZES), default="full")
    parser.add_argument("--bucket-mib", type=int, default=256)
    parser.add_argument(
        "--verify", action="store_true", help="verify_load afterwards, timed apart from the load"
    )
    args = parser.parse_args()

    from fsdpcheck.distributed import setup as distributed

    ctx = distributed.init("gloo", 300.0)
    rank = ctx.rank
    model, source = build(args.size, rank)
    params = sum(p.numel() for p in model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    flat = None
    if args.method.startswith("raw"):
        if rank == 0:  # the same bytes, already flat: the wire's best case
            flat = torch.cat([t.reshape(-1) for t in source.values()]).view(torch.uint8)
        elif args.method == "raw-warm":
            flat = torch.ones(nbytes, dtype=torch.uint8)
        del model, source
        model = source = None
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer, mesh=ctx.mesh)
        fully_shard(model, mesh=ctx.mesh)
    gc.collect()
    rss_before = status("VmRSS")
    reset = reset_peak()
    dist.barrier(group=ctx.side_channel)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    extra: dict = {}
    if args.method == "bucketed":
        from fsdpcheck.loader.load import load_full_state_dict
        from fsdpcheck.records import to_dict

        result = load_full_state_dict(
            model,
            source,
            group=ctx.side_channel,
            method="bucketed",
            bucket_bytes=args.bucket_mib * 2**20,
        )
        extra = {k: v for k, v in to_dict(result).items() if k != "dtypes"}
    elif args.method == "p2p-floor":
        p2p_floor(model, source, rank, ctx.side_channel)
    elif args.method == "dcp":
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        if rank != 0:
            model.to_empty(device="cpu")
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, dict(source) if source else {}, options=options)
    elif args.method == "accelerate":
        from accelerate.utils.fsdp_utils import fsdp2_load_full_state_dict

        # The function reads `accelerator.is_main_process` and nothing else of it.
        class Accelerator:
            is_main_process = rank == 0

        fsdp2_load_full_state_dict(Accelerator(), model, dict(source) if source else {})
    else:
        if flat is None:
            flat = torch.empty(nbytes, dtype=torch.uint8)
        dist.broadcast(flat, src=0, group=ctx.side_channel)
    dist.barrier(group=ctx.side_channel)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    # Where the time goes: first touch of fresh pages shows as kernel time and minor faults.
    kernel = {
        "user_seconds": after.ru_utime - usage.ru_utime,
        "system_seconds": after.ru_stime - usage.ru_stime,
        "minor_faults": after.ru_minflt - usage.ru_minflt,
    }
    peak = status("VmHWM")
    if args.method == "raw":  # again, into the buffer the first broadcast touched: the wire alone
        dist.barrier(group=ctx.side_channel)
        begin = time.perf_counter()
        dist.broadcast(flat, src=0, group=ctx.side_channel)
        dist.barrier(group=ctx.side_channel)
        extra["seconds_warm"] = time.perf_counter() - begin
    # The machine's price for first touching fresh memory, now: as many bytes as this rank's
    # shards (what a meta rank must fault in, whatever the loader), into a new allocation.
    touch = None
    if rank != 0:
        local = sum(
            p.to_local().numel() * p.element_size()
            for p in (model.parameters() if model is not None else ())
        )
        fresh = torch.empty(local or nbytes // 2, dtype=torch.uint8)
        begin = time.perf_counter()
        fresh.fill_(1)
        touch = {"bytes": fresh.numel(), "seconds": time.perf_counter() - begin}
        del fresh
    verified = verify_seconds = read_seconds = None
    if args.verify and model is not None:
        from fsdpcheck.loader.verify import verify_load

        dist.barrier(group=ctx.side_channel)
        begin = time.perf_counter()
        verified = verify_load(model, source, group=ctx.side_channel).passed
        dist.barrier(group=ctx.side_channel)
        verify_seconds = time.perf_counter() - begin
        dist.barrier(group=ctx.side_channel)
        begin = time.perf_counter()
        read_once(model, source if rank == 0 else None)
        dist.barrier(group=ctx.side_channel)
        read_seconds = time.perf_counter() - begin
    record = {
        "rank": rank,
        "method": args.method,
        "size": args.size,
        "params": params,
        "bytes": nbytes,
        "seconds": seconds,
        "rss_before": rss_before,
        "peak_rss_load": peak if reset else None,
        "peak_rss_process": status("VmHWM") if not reset else None,
        "verified": verified,
        "verify_seconds": verify_seconds,
        "read_seconds": read_seconds,
        "first_touch": touch,
        "rusage": kernel,
        **extra,
    }
    print(MARK + json.dumps(record), flush=True)
    distributed.shutdown(ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
