"""Loader predictions on synthetic fingerprints (no torch, no processes)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from synthetic import EMBED, FULL, K_PROJ, Q_PROJ, SCALE, SLIDING, tensor

from fsdpcheck.checks.groups import group_ranks
from fsdpcheck.checks.predict import (
    DDP_BUCKET_BYTES,
    LOADERS,
    backend_of,
    itemsize,
    predict_loaders,
    products,
)
from fsdpcheck.checks.predict.ddp_sync import buckets
from fsdpcheck.records import (
    EnvRecord,
    Fingerprint,
    Group,
    LoaderPrediction,
    RankError,
    RankRecord,
    from_dict,
    to_dict,
)

MiB = 1024 * 1024


def buffers(order=(SCALE, FULL, SLIDING), sliding=(8,), device="cpu"):
    """Hazard layout: global RoPE (16,) and sliding RoPE (``sliding``), both non-persistent."""
    base = {
        SCALE: tensor(SCALE, (1,), persistent=True, device=device),
        FULL: tensor(FULL, (16,), persistent=False, device=device),
        SLIDING: tensor(SLIDING, sliding, persistent=False, device=device),
    }
    return tuple(base[name] for name in order)


def params(order=(EMBED, Q_PROJ, K_PROJ), device="cpu"):
    shapes = {EMBED: (32, 8), Q_PROJ: (8, 8), K_PROJ: (8, 8)}
    return tuple(tensor(name, shapes[name], device=device) for name in order)


def fingerprint(stage, bufs, prms, keys=None):
    if keys is None:
        keys = tuple(p.name for p in prms) + tuple(b.name for b in bufs if b.persistent)
    return Fingerprint(snapshot=stage, buffers=bufs, params=prms, state_dict_keys=keys)


def record(rank, bufs=None, prms=None, keys=None, meta=False, error=None):
    """A rank's record; ``meta``: built on meta (pre-wrap devices), materialised afterwards."""
    bufs = buffers() if bufs is None else bufs
    prms = params() if prms is None else prms
    on = [dataclasses.replace(t, device="meta") if meta else t for t in (*bufs, *prms)]
    pre = fingerprint("pre-wrap", tuple(on[: len(bufs)]), tuple(on[len(bufs) :]), keys)
    env = EnvRecord(rank, rank, 8, "node0", "gloo", "3.11.9", "2.13.0+cpu", "5.12.1", str(rank))
    post = fingerprint("post-wrap", bufs, prms, keys)
    return RankRecord(env=env, pre_wrap=pre, post_wrap=post, error=error)


def predict(per_rank, **kwargs):
    groups = group_ranks({r: rec.group_digest() for r, rec in per_rank.items()})
    records = {g.representative: per_rank[g.representative] for g in groups}
    return {p.name: p for p in predict_loaders(groups, records, **kwargs)}


def verdicts(predictions):
    return {name: p.verdict for name, p in predictions.items()}


HAZARD = (SCALE, SLIDING, FULL)  # rank 1's iteration order of the rotary buffers


# ---------------------------------------------------------------- agreement


def test_all_ranks_agree_so_every_loader_is_ok():
    out = predict({r: record(r) for r in range(4)})
    assert list(out) == list(LOADERS)
    assert set(verdicts(out).values()) == {"ok"}
    assert all(p.ranks == () and p.first_issue is None and p.summary for p in out.values())


# ---------------------------------------------------------------- the hazard: swapped RoPE buffers


def test_swapped_buffers_of_different_sizes():
    out = predict({0: record(0), 1: record(1, buffers(HAZARD))})
    assert verdicts(out) == {
        "named-buffers-order": "hang",
        # accelerate: SCALE is a persistent buffer, a plain tensor without a device_mesh
        "state-dict-order": "refused",
        "ddp-sync": "silent-corruption",  # same total bytes, scrambled inside the bucket
        "dcp-broadcast": "ok",
        "sorted-names": "ok",
    }
    no_scale = (FULL, SLIDING)
    calm = predict({0: record(0, buffers(no_scale)), 1: record(1, buffers(HAZARD[1:]))})
    # Non-persistent buffers are not in the state dict, and accelerate keeps each rank's own.
    assert calm["state-dict-order"].verdict == "ok"
    hang = out["named-buffers-order"]
    assert hang.ranks == (1,)
    assert hang.first_issue == {
        "index": 1,
        "reference_name": FULL,
        "other_name": SLIDING,
        "reference_shape": [16],
        "other_shape": [8],
        "reference_dtype": "float32",
        "other_dtype": "float32",
        "rank": 1,
    }
    assert hang.summary == (
        f"index 1: rank 0 sends {FULL} (16,) float32 while rank 1 receives into {SLIDING} (8,) "
        "float32 → smaller receiving buffer: gloo aborts the receiving rank "
        "(op.preamble.length <= op.nbytes), NCCL blocks until its watchdog"
    )
    ddp = out["ddp-sync"]
    assert (ddp.first_issue["reference_name"], ddp.first_issue["other_name"]) == (FULL, SLIDING)
    assert "values scrambled, no error" in ddp.summary


def test_swapped_buffers_on_a_meta_built_rank_are_left_uninitialised_by_dcp():
    out = predict({0: record(0), 1: record(1, buffers(HAZARD), meta=True)})
    dcp = out["dcp-broadcast"]
    assert dcp.verdict == "uninitialized"
    assert dcp.ranks == (1,)
    assert dcp.first_issue["reference_name"] == SLIDING  # rank 1's first meta buffer
    assert "built it on meta" in dcp.summary
    assert out["named-buffers-order"].verdict == "hang"
    assert out["sorted-names"].verdict == "ok"


def test_meta_ranks_grouped_with_a_real_rank_0_need_meta_ranks():
    # Device is not in the group digest, so ranks 1-3 on meta share rank 0's group.
    per_rank = {0: record(0), **{r: record(r, meta=True) for r in (1, 2, 3)}}
    assert predict(per_rank)["dcp-broadcast"].verdict == "ok"
    dcp = predict(per_rank, meta_ranks=[1, 2, 3])["dcp-broadcast"]
    assert (dcp.verdict, dcp.ranks) == ("uninitialized", (1, 2, 3))
    assert dcp.first_issue["reference_name"] == FULL


def test_all_ranks_on_meta_are_all_uninitialised():
    dcp = predict({r: record(r, meta=True) for r in range(2)})["dcp-broadcast"]
    assert (dcp.verdict, dcp.ranks) == ("uninitialized", (0, 1))


def test_equal_size_swap_is_silent_corruption():
    # Gemma3-style: both RoPE tables (16,), different bases.
    out = predict({0: record(0, buffers(sliding=(16,))), 1: record(1, buffers(HAZARD, (16,)))})
    named = out["named-buffers-order"]
    assert named.verdict == "silent-corruption"
    assert "same byte size, wrong tensor" in named.summary
    assert out["ddp-sync"].verdict == "silent-corruption"
    assert out["sorted-names"].verdict == "ok"


# ---------------------------------------------------------------- set, count and dtype differences


def test_buffer_set_difference():
    out = predict({0: record(0), 1: record(1, buffers((SCALE, FULL)))})
    named = out["named-buffers-order"]
    assert named.verdict == "hang"
    assert named.summary.startswith("count mismatch: rank 0 makes 3 buffer broadcasts, rank 1")
    assert named.first_issue["index"] == 2
    assert (named.first_issue["reference_name"], named.first_issue["other_name"]) == (SLIDING, None)
    refused = out["sorted-names"]
    assert refused.verdict == "refused"
    assert f"buffer {SLIDING} (8,) float32 exists only on rank 0" in refused.summary
    assert out["dcp-broadcast"].verdict == "ok"  # the missing buffer is not in the state dict
    ddp = out["ddp-sync"]
    assert ddp.verdict == "hang"
    assert (ddp.first_issue["reference_name"], ddp.first_issue["other_name"]) == (SLIDING, None)


def test_extra_state_dict_entry_is_a_count_mismatch():
    bufs = buffers((FULL, SLIDING))
    extra = tensor("model.norm.bias", (4,))
    out = predict({0: record(0, bufs), 1: record(1, bufs, (*params(), extra))})
    sd = out["state-dict-order"]
    assert sd.verdict == "hang"
    assert sd.summary.startswith(
        "count mismatch: rank 0 makes 3 state-dict broadcasts, rank 1 makes 4"
    )
    assert sd.first_issue["other_name"] == "model.norm.bias"
    assert out["dcp-broadcast"].verdict == "refused"
    assert "extra state-dict key model.norm.bias" in out["dcp-broadcast"].summary
    assert out["ddp-sync"].verdict == "refused"  # the parameter counts differ: DDP checks first


def test_state_dict_order_refuses_a_persistent_buffer():
    # accelerate's fsdp2_load_full_state_dict reads .device_mesh of every state-dict entry.
    sd = predict(
        {r: record(r) for r in (0, 1)} | {1: record(1, prms=params((EMBED, K_PROJ, Q_PROJ)))}
    )
    assert sd["state-dict-order"].verdict == "refused"
    assert "no device_mesh" in sd["state-dict-order"].summary


def test_state_dict_order_swap_of_equal_sized_params():
    order = (EMBED, K_PROJ, Q_PROJ)
    bufs = buffers((FULL, SLIDING))
    out = predict({0: record(0, bufs), 1: record(1, bufs, params(order))})
    sd = out["state-dict-order"]
    assert sd.verdict == "silent-corruption"
    assert (sd.first_issue["index"], sd.first_issue["reference_name"]) == (1, Q_PROJ)
    assert sd.first_issue["other_name"] == K_PROJ
    assert out["named-buffers-order"].verdict == "ok"
    assert out["dcp-broadcast"].verdict == "ok"  # keyed by name
    assert out["sorted-names"].verdict == "ok"
    assert out["ddp-sync"].verdict == "silent-corruption"


def test_same_name_different_dtype_same_bytes():
    bufs = (tensor(FULL, (16,), dtype="int32", persistent=False), *buffers()[::2])
    ref = (buffers()[1], *buffers()[::2])
    out = predict({0: record(0, ref), 1: record(1, bufs)})
    named = out["named-buffers-order"]
    assert named.verdict == "silent-corruption"
    assert "reinterpreted" in named.summary
    assert out["sorted-names"].verdict == "refused"
    assert out["dcp-broadcast"].verdict == "ok"  # non-persistent: not compared by DCP


def test_shape_difference_is_refused_by_ddp_and_by_name_keyed_loaders():
    wide = tensor(EMBED, (64, 8))
    bufs = buffers((FULL, SLIDING))
    out = predict({0: record(0, bufs), 1: record(1, bufs, (wide, *params()[1:]))})
    ddp = out["ddp-sync"]
    assert (ddp.verdict, ddp.ranks) == ("refused", (1,))  # DDP checks shapes before broadcasting
    assert "params[0]" in ddp.summary
    # Rank 0 sends 1 KiB into rank 1's 2 KiB: NCCL blocks; gloo fills half and carries on.
    assert (out["state-dict-order"].verdict, out["state-dict-order"].on_gloo) == (
        "hang",
        "silent-corruption",
    )
    assert out["dcp-broadcast"].verdict == "refused"
    assert "(32, 8) float32 on rank 0 but (64, 8) float32 on rank 1" in out["dcp-broadcast"].summary
    assert out["named-buffers-order"].verdict == "refused"  # its DCP step raises first
    assert out["sorted-names"].verdict == "refused"


# ---------------------------------------------------------------- many ranks, references


def test_worst_verdict_over_groups_names_its_first_offender():
    per_rank = {r: record(r, buffers(sliding=(16,))) for r in (0, 1)}
    per_rank.update({r: record(r, buffers(HAZARD, (16,))) for r in (2, 3)})  # equal sizes
    per_rank.update({r: record(r, buffers((FULL, SCALE, SLIDING), (16,))) for r in (4, 5, 6, 7)})
    named = predict(per_rank)["named-buffers-order"]
    assert named.verdict == "hang"
    assert named.first_issue["rank"] == 4
    assert named.ranks == (2, 3, 4, 5, 6, 7)
    assert named.first_issue["index"] == 0
    assert "ranks 4-7 receive into" in named.summary


def test_failed_rank_0_moves_the_reference():
    boom = RankError(rank=0, stage="build", message="boom")
    out = predict({0: record(0, error=boom), 1: record(1), 2: record(2, buffers(HAZARD))})
    named = out["named-buffers-order"]
    assert (named.verdict, named.ranks) == ("hang", (2,))
    assert named.summary.startswith("index 1: rank 1 sends")


def test_no_usable_group_predicts_nothing():
    boom = RankError(rank=0, stage="build", message="boom")
    assert predict({0: record(0, error=boom)}) == {}


# ---------------------------------------------------------------- building blocks


@pytest.mark.parametrize(
    ("dtype", "size"),
    [("float32", 4), ("torch.bfloat16", 2), ("float16", 2), ("int64", 8), ("bool", 1)],
)
def test_itemsize(dtype, size):
    assert itemsize(dtype) == size


def test_ddp_buckets_follow_c10d_assignment():
    t = [
        tensor("a", (200 * MiB // 4,)),  # float32, 200 MiB
        tensor("b", (10,), dtype="bfloat16"),
        tensor("c", (100 * MiB // 4,)),  # float32 bucket reaches 300 MiB: closes
        tensor("d", (1,)),
    ]
    assert buckets(t) == [[0, 2], [1], [3]]
    assert DDP_BUCKET_BYTES == 250 * MiB


def test_loader_prediction_round_trips_through_json():
    out = predict({0: record(0), 1: record(1, buffers(HAZARD), meta=True)})
    for prediction in out.values():
        again = from_dict(LoaderPrediction, json.loads(json.dumps(to_dict(prediction))))
        assert again == prediction


# ---------------------------------------------------------------- what the real loaders do
# Each case below is also run for real in tests/test_loaders_real.py.


def test_ddp_takes_the_worst_bucket_not_the_first():
    # Bucket 0 (float32): an equal-size swap. Bucket 1 (bfloat16): 8 bytes sent into 4.
    table = tensor("model.table", (4,), dtype="bfloat16", persistent=False)
    small = tensor("model.table", (2,), dtype="bfloat16", persistent=False)
    bufs = buffers((FULL, SLIDING))
    ref = record(0, (*bufs, table))
    other = record(1, (*bufs, small), params((EMBED, K_PROJ, Q_PROJ)))
    ddp = predict({0: ref, 1: other})["ddp-sync"]
    assert ddp.verdict == "hang"
    assert ddp.summary.startswith("bucket 1: rank 0 broadcasts 8 bytes")


def _wider_on_rank_1(width):
    """Rank 1's embedding ``width`` rows where rank 0's has 32: a stale node's other config."""
    bufs = buffers((FULL, SLIDING))
    wide = (tensor(EMBED, (width, 8)), *params()[1:])
    return {0: record(0, bufs), 1: record(1, bufs, wide)}


def test_a_larger_receiver_is_predicted_for_the_backend_in_use_and_for_nccl_beside_it():
    # A CPU job auditing an NCCL one: gloo's verdict first, NCCL's beside it.
    on_gloo = predict(_wider_on_rank_1(64), backend="gloo")["state-dict-order"]
    assert (on_gloo.backend, on_gloo.verdict, on_gloo.on_nccl) == (
        "gloo",
        "silent-corruption",
        "hang",
    )
    assert on_gloo.on_gloo is None and on_gloo.gloo_verdict == "silent-corruption"
    assert on_gloo.worst == "hang"
    assert on_gloo.verdict_text() == "silent-corruption on gloo (NCCL: hang)"
    assert "gloo fills its first bytes" in on_gloo.summary
    on_nccl = predict(_wider_on_rank_1(64), backend="nccl")["state-dict-order"]
    assert (on_nccl.backend, on_nccl.verdict, on_nccl.on_gloo, on_nccl.on_nccl) == (
        "nccl",
        "hang",
        "silent-corruption",
        None,
    )
    assert "NCCL blocks on the count mismatch" in on_nccl.summary


def test_a_smaller_receiver_stops_the_job_on_both_backends():
    for backend in ("gloo", "nccl"):
        sd = predict(_wider_on_rank_1(16), backend=backend)["state-dict-order"]
        assert (sd.verdict, sd.on_gloo, sd.on_nccl) == ("hang", None, None), backend
        assert "gloo aborts the receiving rank" in sd.summary
        assert sd.verdict_text() == "hang"


def test_the_backend_is_the_reference_rank_s():
    gloo = {0: record(0), 1: record(1)}
    assert backend_of(gloo) == "gloo"
    nccl = {
        r: dataclasses.replace(rec, env=dataclasses.replace(rec.env, backend="nccl"))
        for r, rec in gloo.items()
    }
    assert backend_of(nccl) == "nccl"
    mixed = {
        0: dataclasses.replace(
            gloo[0], env=dataclasses.replace(gloo[0].env, backend="cpu:gloo,cuda:nccl")
        )
    }
    assert backend_of(mixed) == "nccl"
    assert backend_of({}) == "nccl"


def test_ddp_on_gloo_leaves_a_longer_tail_alone():
    # Rank 1's extra buffer at the end of its bucket: NCCL blocks on the count, gloo receives
    # rank 0's shorter message into the front and the extra buffer keeps its own values.
    bufs = buffers((FULL, SLIDING))
    extra = tensor("model.extra", (4,), persistent=False)
    ddp = predict({0: record(0, bufs), 1: record(1, (*bufs, extra))})["ddp-sync"]
    assert (ddp.verdict, ddp.on_gloo) == ("hang", "ok")


def test_dcp_loads_a_key_missing_on_rank_1_and_a_dtype_only_difference():
    bufs = buffers((FULL, SLIDING))
    missing = predict({0: record(0, bufs), 1: record(1, bufs, params()[:2])})
    assert missing["dcp-broadcast"].verdict == "ok"  # DCP follows rank 0's keys
    assert missing["ddp-sync"].verdict == "refused"  # parameter counts differ
    assert missing["state-dict-order"].verdict == "hang"  # rank 0 makes one more broadcast
    half = (tensor(EMBED, (32, 8), dtype="bfloat16"), *params()[1:])
    dtype = predict({0: record(0, bufs), 1: record(1, bufs, half)})
    assert dtype["dcp-broadcast"].verdict == "ok"  # DCP converts to the receiver's dtype
    assert dtype["sorted-names"].verdict == "refused"


def test_dcp_refuses_only_on_the_ranks_that_differ():
    bufs = buffers((FULL, SLIDING))
    wide = (tensor(EMBED, (64, 8)), *params()[1:])
    per_rank = {0: record(0, bufs), 1: record(1, bufs), 2: record(2, bufs, wide)}
    dcp = predict(per_rank)["dcp-broadcast"]
    assert (dcp.verdict, dcp.ranks) == ("refused", (2,))
    assert dcp.summary.endswith("set_model_state_dict raises on rank 2")


def tied(rank, first=EMBED):
    """Embedding and lm_head tied; ``first``: the name named_parameters() keeps."""
    head = "lm_head.weight"
    alias = head if first == EMBED else EMBED
    prms = (tensor(first, (32, 8)), *params()[1:])
    keys = (EMBED, Q_PROJ, K_PROJ, head) if first == EMBED else (head, EMBED, Q_PROJ, K_PROJ)
    bufs = buffers((FULL, SLIDING))
    base = record(rank, bufs, prms, keys)
    return dataclasses.replace(
        base,
        pre_wrap=dataclasses.replace(base.pre_wrap, aliases=((alias, first),)),
        post_wrap=dataclasses.replace(base.post_wrap, aliases=((alias, first),)),
    )


def test_tied_weights_are_known_by_both_names():
    out = predict({0: tied(0), 1: tied(1, first="lm_head.weight")})
    sd = out["state-dict-order"]
    assert "size unknown" not in sd.summary
    # The tied pair trades places harmlessly; Q_PROJ (8, 8) then lands in EMBED (32, 8).
    assert sd.verdict == "hang"
    assert (sd.first_issue["reference_name"], sd.first_issue["other_name"]) == (Q_PROJ, EMBED)
    assert sd.on_gloo is None  # gloo aborts too, two broadcasts later (1 KiB into 256 B)
    assert out["ddp-sync"].verdict == "ok"  # the same tensor under another name
    assert out["sorted-names"].verdict == "ok"  # both names on both ranks
    assert out["dcp-broadcast"].verdict == "ok"


def test_unknown_item_size_with_another_shape_is_not_ok():
    odd = tensor(FULL, (16,), dtype="float2_e1m1_fake", persistent=False)
    odder = tensor(FULL, (8,), dtype="float2_e1m1_fake", persistent=False)
    out = predict({0: record(0, (odd,)), 1: record(1, (odder,))})
    assert out["named-buffers-order"].verdict == "hang"  # same dtype: sizes follow elements
    mixed = tensor(FULL, (8,), dtype="float32", persistent=False)
    out = predict({0: record(0, (odd,)), 1: record(1, (mixed,))})
    assert out["named-buffers-order"].verdict == "hang"
    assert "size unknown" in out["named-buffers-order"].summary
    assert itemsize("float4_e2m1fn_x2") == 1


def test_accelerate_keeps_each_ranks_buffer_values():
    bufs = buffers((FULL, SLIDING))
    ours = tuple(dataclasses.replace(b, digest=f"d-{b.name}") for b in bufs)
    theirs = (dataclasses.replace(bufs[0], digest="other"), ours[1])
    # Values are not part of a group's digest: ranks that differ only there need their own
    # group (as a value-aware gather gives them) for their records to be compared at all.
    groups = [Group((0,), "a"), Group((1,), "b")]
    records = {0: record(0, ours), 1: record(1, theirs)}
    out = {p.name: p for p in predict_loaders(groups, records)}
    sd = out["state-dict-order"]
    assert sd.verdict == "silent-corruption"
    assert "kept per rank" in sd.summary
    assert out["dcp-broadcast"].verdict == "silent-corruption"  # DCP leaves them alone too
    assert out["named-buffers-order"].verdict == "ok"  # broadcast from rank 0
    unknown = (dataclasses.replace(bufs[0], digest=None), ours[1])
    records[1] = record(1, unknown)
    assert predict_loaders(groups, records)[1].verdict == "ok"  # not recorded: not judged


def test_rows_name_products_and_installed_versions():
    env = EnvRecord(0, 0, 2, "h", "gloo", "3.11", "2.13.0+cpu", "5.24.0", "0", accelerate="1.15.0")
    assert "verl before PR #6405" in products("named-buffers-order")
    assert "lmms-engine" in products("named-buffers-order")
    assert products("state-dict-order", env).endswith("installed: accelerate 1.15.0")
    assert "PR #3982" in products("state-dict-order", env)
    gone = dataclasses.replace(env, accelerate=None)
    assert products("state-dict-order", gone).endswith("accelerate is not installed here")
    assert products("ddp-sync", env).endswith("torch 2.13.0+cpu")
    out = predict({0: record(0), 1: record(1)})
    assert all(p.products for p in out.values())
