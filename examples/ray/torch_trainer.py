"""fsdpcheck inside Ray Train: ``TorchTrainer`` starts the workers and their process group
(gloo here, 2 CPU workers); ``train_loop_per_worker`` builds the model, shards it with
``fully_shard`` and calls ``fsdpcheck.check_model`` before its first step.

    python examples/ray/torch_trainer.py                  # consistent
    python examples/ray/torch_trainer.py --break-rank 1   # rank 1 builds with another rope_theta

Every worker writes its result to ``--out`` (rank<N>.json), since Ray Train reports only rank 0's
metrics. Ray's workers run with hash randomisation on and no PYTHONHASHSEED: see docs/ray.md.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

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


def build(rank: int, world_size: int, rope_theta: float = ROPE_THETA) -> torch.nn.Module:
    """Every worker builds the same seeded model (no load needed) and shards it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {"rope_type": "default", "rope_theta": rope_theta}
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG, rope_parameters=rope))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train_loop_per_worker(config: dict) -> None:
    """``config``: ``break_ranks``, one check per entry on the same process group (None: every
    rank alike; N: rank N builds with another rope_theta); ``out``: where each rank writes its
    results."""
    import ray.train

    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    results = []
    for break_rank in config.get("break_ranks", [None]):
        theta = ROPE_THETA * (2 if rank == break_rank else 1)
        model = build(rank, world_size, theta)
        checked = fsdpcheck.check_model(model, timeout=60)
        report = checked.report
        results.append(
            {
                "rank": rank,
                "exit_code": checked.exit_code,
                "headline": checked.headline,
                "verdict": None if report is None else report.verdict.value,
                "findings": None
                if report is None
                else [
                    {"kind": f.kind.value, "ranks": list(f.ranks), "summary": f.summary}
                    for f in report.findings
                ],
            }  # fmt: skip
        )
        # a trainer raises on a non-zero exit_code (fsdpcheck's headline says why); train here
    Path(config["out"], f"rank{rank}.json").write_text(json.dumps(results, indent=1))


def fit(out: Path, break_ranks: list[int | None], storage: Path) -> list[list[dict]]:
    """One ``TorchTrainer.fit`` on 2 CPU workers; each rank's results, per check."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    out.mkdir(parents=True, exist_ok=True)
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"break_ranks": break_ranks, "out": str(out)},
        torch_config=TorchConfig(backend="gloo", timeout_s=120),
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(storage_path=str(storage), name="fsdpcheck-example"),
    )
    trainer.fit()
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def main() -> int:
    import ray

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--break-rank", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="fsdpcheck-ray-train-"))
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 1024**2)
    try:
        ranks = fit(args.out or scratch / "out", [args.break_rank], scratch / "storage")
    finally:
        ray.shutdown()
    rank0 = ranks[0][0]
    print(f"check_model: {rank0['headline']} (exit {rank0['exit_code']})")
    for finding in rank0["findings"] or []:
        print(f"  {finding['kind']}: {finding['summary']}")
    return max(r[0]["exit_code"] for r in ranks)


if __name__ == "__main__":
    raise SystemExit(main())
