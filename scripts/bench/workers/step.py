"""One rank of the step benchmark: a Gemma3-shaped model (``--quick``: a small one), FSDP2 on
every decoder layer and the root, the same token batch on every run. Times plain steps and the
same step under ``fsdpcheck.check_step``, alternating, in this process; under
TORCH_DISTRIBUTED_DEBUG=DETAIL (set by the caller for the whole job) only plain steps run. Also
one step under the bare watch, for its counts (collectives, exchanges, side-channel bytes), and
small all_reduces plain and under the watch (under DETAIL: plain), for the cost per collective.
Prints one line ``@bench {json}`` per rank; run by scripts/bench (the step row).

float32, not bfloat16: on CPU a bfloat16 matmul has no fast kernel (40x slower than float32
here), so a bfloat16 step of the 1B shape takes minutes and measures the emulation, not the
watch. SGD, not AdamW: AdamW's two float32 states of the 1B shape do not fit two ranks in this
machine's 23 GiB, and SGD's cheaper update makes the watched/plain ratio stricter, not easier."""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist

MARK = "@bench "
SMALL = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4, "vocab_size": 8192}


def build(quick: bool):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from shapes import GEMMA3_1B

    shape = {k: v for k, v in GEMMA3_1B.items() if k not in ("architectures", "model_type")}
    shape.pop("torch_dtype")
    if quick:
        shape.update(SMALL)
    config = Gemma3TextConfig(**shape)
    with torch.device("meta"):  # sharded before it is materialised, as 1B+ FSDP2 jobs are built
        model = Gemma3ForCausalLM(config)
    return model, config


def peak_mib() -> int:
    """This process's peak resident memory so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


SMALL_N = 200  # small all_reduces per run of the per-collective measurement


def small_collectives(model, repeats: int = 5, *, watch: bool = True) -> dict:
    """The watch's cost per collective, measured directly: ``SMALL_N`` all_reduces of 16
    floats, plain and under the watch (as ``check_step`` runs it, each run in a context of its
    own, as each ``check_step`` call is), alternating. ``watch=False`` (the DETAIL job): plain
    only, where DETAIL's own check of each collective is what a plain one costs more."""
    from fsdpcheck.distributed import setup
    from fsdpcheck.step.session import watched_step

    def many():
        t = torch.ones(16)
        for _ in range(SMALL_N):
            dist.all_reduce(t)

    plain, watched, record = [], [], None
    many()
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        many()
        plain.append(time.perf_counter() - start)
        if not watch:
            continue
        ctx = setup.init("auto", 300)
        dist.barrier()
        start = time.perf_counter()
        record, _ = watched_step(ctx, model, many)
        watched.append(time.perf_counter() - start)
    return {
        "n": SMALL_N,
        "plain": plain,
        "watched": watched,
        "exchanges": record.exchanges if record else 0,
        "channel_bytes": record.channel_bytes if record else 0,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()

    from torch.distributed.fsdp import fully_shard

    import fsdpcheck
    from fsdpcheck.step.session import watched_step

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    model, config = build(args.quick)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights()  # the config's init, on each rank's shards; RoPE buffers too
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
    generator = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, config.vocab_size, (1, args.tokens), generator=generator)

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    detail = os.environ.get("TORCH_DISTRIBUTED_DEBUG") == "DETAIL"
    peak = {"built": peak_mib()}
    step()  # warm-up: FSDP2's lazy init
    peak["plain"] = peak_mib()
    seconds = {"plain": [], "check_step": []}
    for _ in range(args.repeats):
        dist.barrier()
        start = time.perf_counter()
        step()
        seconds["plain"].append(time.perf_counter() - start)
        if detail:
            continue
        dist.barrier()
        start = time.perf_counter()
        result = fsdpcheck.check_step(model, step, timeout=300)
        seconds["check_step"].append(time.perf_counter() - start)
        assert result.exit_code == 0, result.headline
        peak["check_step"] = peak_mib()
        print(f"step bench: rank {rank} peak MiB {peak}", file=sys.stderr, flush=True)
    counts = {}
    if not detail:
        from fsdpcheck.distributed import setup

        ctx = setup.init("auto", 300)
        record, _ = watched_step(ctx, model, step)
        counts = {
            "collectives": record.collectives,
            "exchanges": record.exchanges,
            "channel_bytes": record.channel_bytes,
            "watch_seconds": record.watch_seconds,
        }
        counts["small"] = small_collectives(model)
    else:
        counts["small"] = small_collectives(model, watch=False)
    params = sum(p.numel() for p in model.parameters())
    out = {"rank": rank, "detail": detail, "seconds": seconds, "params": params, "peak_mib": peak}
    out.update(counts)
    print(MARK + json.dumps(out), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
