"""One rank of a bucketed-loader test: build (rank 0 real, others meta), shape the model as asked
(uneven or dim-1 shards, tied weights, a persistent buffer, CPU offload, a 2-D mesh), fully_shard,
load with ``load_full_state_dict``, verify; write ``rank<N>.json`` into ``--out``."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from recorded import main_with_cases, run_recorded, worker_parser
from torch import nn

from fsdpcheck.distributed import setup as distributed
from fsdpcheck.loader.verify import verify_load
from fsdpcheck.model import wrap
from fsdpcheck.model.build import build
from fsdpcheck.model.resolve import resolve
from fsdpcheck.process import exit_skipping_teardown
from fsdpcheck.records import to_dict


def _mesh(text: str | None) -> tuple[int, ...] | None:
    return tuple(int(p) for p in text.split(",")) if text else None


def _shard_fn(dim1: bool):
    if not dim1:
        return None
    from torch.distributed.tensor import Shard

    # FSDP2 needs even shards off dim 0: dim 1 where it divides by 2, FSDP2's default elsewhere.
    return lambda p: Shard(1) if p.ndim == 2 and p.shape[1] % 2 == 0 else None


def main(argv: list[str]) -> int:
    parser = worker_parser()
    parser.add_argument("--method", default=None, help="default: load_full_state_dict's own")
    parser.add_argument("--dcp-on-rank", type=int, default=None, help="this rank asks for dcp")
    parser.add_argument("--bucket-bytes", type=int, default=None)
    parser.add_argument("--bucket-bytes-rank1", type=int, default=None)
    parser.add_argument("--dtype", default=None, help="the model's dtype")
    parser.add_argument("--source-dtype", default=None, help="rank 0's source dtype")
    parser.add_argument("--odd-params", action="store_true", help="(3, 4) and (1, 4) params")
    parser.add_argument("--tie", action="store_true", help="lm_head.weight is embed_tokens'")
    parser.add_argument("--persistent-buffer", action="store_true")
    parser.add_argument("--cpu-offload", action="store_true", help="FSDP2 CPUOffloadPolicy")
    parser.add_argument("--shard-dim1", action="store_true")
    parser.add_argument("--mesh", default=None, help="REPLICATE,SHARD (HSDP)")
    parser.add_argument("--fail-materialise-on-rank", type=int, default=None)
    args = parser.parse_args(argv)

    out = Path(args.out)
    start = time.monotonic()
    ctx = distributed.init("gloo", args.timeout, mesh_shape=_mesh(args.mesh))

    def work(record: dict) -> None:
        resolved = resolve(args.model, rank=ctx.rank)
        built = build(resolved, rank=ctx.rank, init=args.init, dtype=args.dtype)
        model, real = built.model, built.materialised
        source = None
        if ctx.rank == 0:
            if args.source_dtype or not real:  # rank 0's weights from elsewhere (same seed)
                other = build(resolved, rank=0, init="all", dtype=args.source_dtype)
                source = other.full_state_dict
            else:
                source = built.full_state_dict
        extra: dict[str, nn.Parameter | torch.Tensor] = {}
        if args.odd_params:
            # Over 2 ranks, dim 0 of 3 shards as 2 + 1 rows, dim 0 of 1 as 1 + 0 (rank 1 empty).
            for name, rows in (("odd_rows3", 3), ("odd_rows1", 1)):
                value = torch.arange(rows * 4.0).reshape(rows, 4) + 0.5
                param = nn.Parameter(value if real else torch.empty(rows, 4, device="meta"))
                model.register_parameter(name, param)
                extra[name] = value
        if args.persistent_buffer:
            value = torch.arange(6, dtype=torch.int64).reshape(2, 3) * 7
            model.register_buffer("step_table", value if real else value.to("meta"))
            extra["step_table"] = value
        if args.tie:
            model.lm_head.weight = model.model.embed_tokens.weight
        if source is not None:
            source = {**source, **{k: v.clone() for k, v in extra.items()}}
            if args.tie:
                source["lm_head.weight"] = source["model.embed_tokens.weight"]
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        kwargs: dict = {"shard_placement_fn": _shard_fn(args.shard_dim1)}
        if args.cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
        targets = wrap.plan(model).modules
        for _, module in targets:
            fully_shard(module, mesh=ctx.mesh, **kwargs)

        if args.fail_materialise_on_rank == ctx.rank:
            import fsdpcheck.loader.load

            def broken(model: nn.Module) -> bool:
                raise MemoryError("injected: no memory for the shards")

            fsdpcheck.loader.load.materialise = broken
        load_kwargs: dict = {}
        if args.method:
            load_kwargs["method"] = args.method
        if args.dcp_on_rank == ctx.rank:
            load_kwargs["method"] = "dcp"
        size = args.bucket_bytes_rank1 if ctx.rank == 1 else None
        if size or args.bucket_bytes:
            load_kwargs["bucket_bytes"] = size or args.bucket_bytes
        from fsdpcheck.loader.load import load_full_state_dict

        result = load_full_state_dict(model, source, group=ctx.side_channel, **load_kwargs)
        record["load"] = to_dict(result)
        record["verify"] = to_dict(verify_load(model, source, group=ctx.side_channel))
        params = dict(model.named_parameters())
        record["n_params"] = len(params)
        record["n_buffers"] = len(list(model.named_buffers()))
        record["placements"] = {
            n: [str(p) for p in getattr(t, "placements", ())] for n, t in params.items()
        }
        record["local_bytes"] = sum(
            t.to_local().numel() * t.element_size() if hasattr(t, "placements") else 0
            for t in params.values()
        )
        record["devices"] = sorted({t.to_local().device.type for t in params.values()})
        if args.tie:
            record["tied"] = model.lm_head.weight is model.model.embed_tokens.weight

    return run_recorded(out, ctx, work, started=start)


if __name__ == "__main__":
    exit_skipping_teardown(main_with_cases(main))
