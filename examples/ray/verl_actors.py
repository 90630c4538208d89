"""fsdpcheck inside Ray actors, in verl's FSDP worker order (OpenRLHF, SkyRL and NeMo-RL start
their FSDP2 workers the same way): the driver creates one actor per rank; each actor sets its
own rendezvous variables and calls ``init_process_group``; then every actor builds the model
(rank 0 with real weights, the others on meta), shards it with ``fully_shard``, loads rank 0's
weights with verl's ``fsdp2_load_full_state_dict``, and calls ``fsdpcheck.check_model`` and,
for its first update, ``fsdpcheck.check_step``. No torchrun anywhere.

    python examples/ray/verl_actors.py                  # 2 actors on 2 CPUs, gloo: consistent
    python examples/ray/verl_actors.py --break-rank 1   # rank 1 builds with another rope_theta

Ray starts its workers with hash randomisation on and no PYTHONHASHSEED: a model whose tensor
order follows a set's order differs between actors only when the draws differ. Run
``fsdpcheck.probe`` (or ``fsdpcheck probe``) on such a model; see docs/ray.md.
"""

from __future__ import annotations

import argparse
import os
import socket
from contextlib import nullcontext
from datetime import timedelta

import ray
import torch
import torch.distributed as dist

import fsdpcheck

CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
ROPE_THETA = 10000.0


def fsdp2_load_full_state_dict(model: torch.nn.Module, full_state: dict) -> None:
    """verl's loader (verl/utils/fsdp_utils.py, 0.4 to 0.9): DCP broadcasts rank 0's full
    state dict into the other ranks' shards, then the buffers (not all in the state dict) go
    one by one in ``named_buffers()`` order: the loader verl#6365 was about."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if dist.get_rank() != 0:
        model.to_empty(device="cpu")
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full_state, options=options)
    for _, buf in model.named_buffers():
        dist.broadcast(buf, src=0)


@ray.remote(num_cpus=1)
class FSDPWorker:
    """One rank, as verl's ``ActorRolloutRefWorker``: Ray knows nothing of ranks; the actor
    sets them itself."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.model = None

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0's address and a free port on its node (verl asks its rank-0 worker)."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return "127.0.0.1", s.getsockname()[1]

    def init_process_group(self, master_addr: str, master_port: int) -> None:
        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(self.rank),  # one node here; verl sets the rank on its node
        )
        dist.init_process_group(
            "gloo", rank=self.rank, world_size=self.world_size, timeout=timedelta(seconds=120)
        )

    def build_and_check(self, rope_theta: float = ROPE_THETA) -> dict:
        """Build, shard, load, ``check_model``; when it passes, the first update under
        ``check_step``. Returns what the driver shows."""
        from accelerate import init_empty_weights
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            **CONFIG, rope_parameters={"rope_type": "default", "rope_theta": rope_theta}
        )
        torch.manual_seed(0)
        # verl: rank 0 real, the others on meta (accelerate's init_empty_weights: buffers stay real)
        with init_empty_weights() if self.rank != 0 else nullcontext():
            model = LlamaForCausalLM(config)
        full_state = model.state_dict() if self.rank == 0 else {}
        mesh = init_device_mesh("cpu", (self.world_size,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        fsdp2_load_full_state_dict(model, full_state)

        checked = fsdpcheck.check_model(model, timeout=60)
        summary = _summary(self.rank, checked)
        summary["step"] = None
        if checked.exit_code == 0:  # a trainer would raise here instead of training on
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            tokens = torch.randint(0, CONFIG["vocab_size"], (2, 16), generator=_rank_rng(self.rank))

            def first_update():
                loss = model(input_ids=tokens, labels=tokens).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                return loss

            summary["step"] = _summary(
                self.rank, fsdpcheck.check_step(model, first_update, timeout=60)
            )
        self.model = model
        return summary

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _rank_rng(rank: int) -> torch.Generator:
    return torch.Generator().manual_seed(rank)


def _summary(rank: int, result) -> dict:
    """What the driver needs from an ``AuditResult`` (the full report is on rank 0)."""
    report = result.report
    return {
        "rank": rank,
        "exit_code": result.exit_code,
        "headline": result.headline,
        "verdict": None if report is None else str(report.verdict.value),
        "findings": None if report is None else [
            {"kind": f.kind.value, "ranks": list(f.ranks), "summary": f.summary}
            for f in report.findings
        ],
    }  # fmt: skip


def start_workers(world_size: int = 2) -> list:
    """The actors, their process group formed."""
    workers = [FSDPWorker.remote(rank, world_size) for rank in range(world_size)]
    addr, port = ray.get(workers[0].rendezvous.remote(), timeout=120)
    ray.get([w.init_process_group.remote(addr, port) for w in workers], timeout=180)
    return workers


def check(workers: list, break_rank: int | None = None) -> list[dict]:
    """Every actor builds, loads and checks; ``break_rank`` builds with another rope_theta."""
    calls = [
        w.build_and_check.remote(ROPE_THETA * (2 if rank == break_rank else 1))
        for rank, w in enumerate(workers)
    ]
    return ray.get(calls, timeout=300)


def stop_workers(workers: list) -> None:
    try:
        ray.get([w.shutdown.remote() for w in workers], timeout=60)
    finally:
        for w in workers:
            ray.kill(w)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--break-rank", type=int, default=None)
    args = parser.parse_args()
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 1024**2)
    workers = start_workers(2)
    try:
        results = check(workers, args.break_rank)
    finally:
        stop_workers(workers)
        ray.shutdown()
    rank0 = results[0]
    print(f"check_model: {rank0['headline']} (exit {rank0['exit_code']})")
    for finding in rank0["findings"] or []:
        print(f"  {finding['kind']}: {finding['summary']}")
    if rank0["step"] is not None:
        print(f"check_step: {rank0['step']['headline']} (exit {rank0['step']['exit_code']})")
    return max(r["exit_code"] for r in results)


if __name__ == "__main__":
    raise SystemExit(main())
