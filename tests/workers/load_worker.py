"""One rank of a load test: build (rank 0 real, others meta), fully_shard, load, verify; write
``rank<N>.json`` (and, on rank 0, gathered full tensors as safetensors) into ``--out``."""

from __future__ import annotations

import time
from pathlib import Path

import fused_qkv
import torch
from recorded import main_with_cases, run_recorded, worker_parser
from torch import nn

from fsdpcheck.distributed import setup as distributed
from fsdpcheck.loader.load import broadcast_buffers, load_full_state_dict
from fsdpcheck.loader.verify import expect_ahead, verify_load
from fsdpcheck.model import wrap
from fsdpcheck.model.build import build
from fsdpcheck.model.resolve import resolve
from fsdpcheck.process import exit_skipping_teardown
from fsdpcheck.records import to_dict


def _register(model: nn.Module, name: str, value: torch.Tensor, *, real: bool) -> None:
    """A non-persistent buffer on the root, on meta where the rank builds on meta."""
    tensor = value if real else torch.empty_like(value, device="meta")
    model.register_buffer(name, tensor, persistent=False)


def _dcp_only(model: nn.Module, source: dict | None) -> None:
    """set_model_state_dict alone: non-persistent buffers keep to_empty()'s garbage."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        model.to_empty(device="cpu")
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, dict(source) if source is not None else {}, options=options)


def _ahead(args, ctx, model: nn.Module, source: dict | None, record: dict):
    """``--ahead``: verify's digests of the other ranks' slices started before the load, as the
    audit does; whether rank 0 started them goes into the record."""
    ahead = expect_ahead(model, source, group=ctx.side_channel) if args.ahead else None
    record["ahead_started"] = ahead is not None
    return ahead


def _fused(args, ctx, record: dict) -> None:
    """The torchtitan-style model (tests/workers/fused_qkv.py): every parameter filled with 7.0
    on every rank, each block and the root fully_shard-ed, then rank 0's full state dict (its
    own ``state_dict()``, split by its hooks, of other weights) loaded."""
    from torch.distributed.fsdp import fully_shard

    model = fused_qkv.build(args.fused)
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(7.0)
    for layer in model.layers:
        fully_shard(layer, mesh=ctx.mesh)
    fully_shard(model, mesh=ctx.mesh)
    source = fused_qkv.build(args.fused, seed=1).state_dict() if ctx.rank == 0 else None
    record["source_keys"] = sorted(source) if source is not None else None
    ahead = None
    if args.loader == "dcp":  # DCP's own loader, as a training script calls it
        try:
            _dcp_only(model, source)
        except Exception as exc:
            record["dcp_error"] = f"{type(exc).__name__}: {exc}"
    else:
        ahead = _ahead(args, ctx, model, source, record)
        loaded = load_full_state_dict(model, source, group=ctx.side_channel, method=args.method)
        record["load"] = to_dict(loaded)
    record["verify"] = to_dict(verify_load(model, source, group=ctx.side_channel, ahead=ahead))
    # Read back through the model's own state dict (its hooks split wqkv again), full tensors.
    state = {
        k: v.full_tensor() if hasattr(v, "full_tensor") else v
        for k, v in model.state_dict().items()
    }
    record["still_seven"] = sorted(k for k, v in state.items() if bool((v == 7.0).all()))
    if source is not None:
        record["differ_from_source"] = sorted(
            k for k in source if k not in state or not torch.equal(state[k], source[k])
        )


def main(argv: list[str]) -> int:
    parser = worker_parser()
    parser.add_argument("--extra-buffer-on-rank", type=int, default=None)
    parser.add_argument("--int-buffer", action="store_true", help="an int64 buffer on every rank")
    parser.add_argument(
        "--big-buffer", action="store_true", help="an 80 KB buffer: too big to ride with the check"
    )
    parser.add_argument("--odd-params", action="store_true", help="(3, 4) and (1, 4) params")
    parser.add_argument("--odd-on-meta", action="store_true", help="rank 0's odd params too")
    parser.add_argument("--loader", choices=("safe", "dcp"), default="safe")
    parser.add_argument(
        "--fused", choices=fused_qkv.VARIANTS, default=None, help="the torchtitan-style model"
    )
    parser.add_argument("--method", choices=("bucketed", "dcp"), default="bucketed")
    parser.add_argument("--ahead", action="store_true", help="verify's digests ahead of the load")
    parser.add_argument("--tamper", default=None, help="rank 1 adds 1.0 to this param's shard")
    parser.add_argument(
        "--tamper-one", default=None, help="flips the lowest bit of one element of this param"
    )
    parser.add_argument("--tamper-rank", type=int, default=1, help="the rank --tamper-one edits")
    parser.add_argument("--dump", action="append", default=[], help="gather this param's full")
    parser.add_argument(
        "--break-verify-source", default=None, help="rank 0 verifies against a non-tensor here"
    )
    args = parser.parse_args(argv)

    out = Path(args.out)
    start = time.monotonic()
    ctx = distributed.init("gloo", args.timeout)

    def work(record: dict) -> None:
        if args.fused:
            _fused(args, ctx, record)
            return
        built = build(resolve(args.model, rank=ctx.rank), rank=ctx.rank, init=args.init)
        model, source = built.model, built.full_state_dict
        real = built.materialised
        if args.int_buffer:
            _register(model, "step_ids", torch.arange(5, dtype=torch.int64), real=real)
        if args.big_buffer:
            _register(model, "big_table", torch.arange(20_000, dtype=torch.float32), real=real)
        if args.extra_buffer_on_rank == ctx.rank:
            _register(model, "extra_inv_freq", torch.ones(4), real=real)
        if args.odd_params:
            # Over 2 ranks, dim 0 of 3 shards as 2 + 1 rows, dim 0 of 1 as 1 + 0 (rank 1 empty).
            for name, rows in (("odd_rows3", 3), ("odd_rows1", 1)):
                value = torch.arange(rows * 4.0).reshape(rows, 4) + 0.5
                on_meta = args.odd_on_meta or not real
                odd = torch.empty(rows, 4, device="meta") if on_meta else value
                model.register_parameter(name, nn.Parameter(odd))
                if source is not None:
                    source[name] = value.clone()
        targets = wrap.plan(model).modules
        wrap.apply(targets, ctx.mesh)

        ahead = None
        if args.loader == "dcp":
            # set_model_state_dict alone, checked, then the buffers alone, checked again.
            _dcp_only(model, source)
            record["verify_dcp_only"] = to_dict(verify_load(model, source, group=ctx.side_channel))
            record["broadcast"] = to_dict(broadcast_buffers(model, group=ctx.side_channel))
        else:
            ahead = _ahead(args, ctx, model, source, record)
            record["load"] = to_dict(load_full_state_dict(model, source, group=ctx.side_channel))
        if args.tamper and ctx.rank == 1:
            with torch.no_grad():
                dict(model.named_parameters())[args.tamper].to_local().add_(1.0)
        if args.tamper_one and ctx.rank == args.tamper_rank:
            local = dict(model.named_parameters())[args.tamper_one].to_local()
            words = local.detach().view(-1).view(torch.int16)  # bfloat16/float16/float32 alike
            words[words.numel() // 2 + 1] ^= 1  # one element, its least significant bit
        if args.break_verify_source and source is not None:
            source = {**source, args.break_verify_source: "not a tensor"}
        result = verify_load(model, source, group=ctx.side_channel, ahead=ahead)
        record["verify"] = to_dict(result)
        record["n_params"] = len(list(model.named_parameters()))
        record["n_buffers"] = len(list(model.named_buffers()))
        record["buffers"] = {n: b.tolist() for n, b in model.named_buffers()}
        record["buffer_dtypes"] = {n: str(b.dtype) for n, b in model.named_buffers()}
        record["buffer_order"] = [n for n, _ in model.named_buffers()]
        params = dict(model.named_parameters())
        full = {name: params[name].full_tensor() for name in args.dump}  # collective
        if ctx.rank == 0 and full:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in full.items()}, str(out / "full.safetensors"))

    return run_recorded(out, ctx, work, started=start)


if __name__ == "__main__":
    exit_skipping_teardown(main_with_cases(main))
