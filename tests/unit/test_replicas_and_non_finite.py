"""Replica sets from device meshes, and NaN/Inf counted in the digest pass (pure and local)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from synthetic import EMBED, SCALE, env, state_record, valued
from torch import nn

from fsdpcheck.checks.non_finite import non_finite_findings
from fsdpcheck.checks.value import value_findings
from fsdpcheck.model.checksum import checksums, checksums_and_non_finite, non_finite_counts
from fsdpcheck.model.fingerprint import fingerprint, mesh_id
from fsdpcheck.model.keys import comparisons, replica_keys, value_digests, value_keys
from fsdpcheck.model.state import garbage, non_finite_tensors
from fsdpcheck.records import BufferProblem, Group, MeshRecord, NonFinite, RankRecord, ValueKeys
from fsdpcheck.vocab import FindingKind, Snapshot

SHARD, HSDP, REPLICATE = ("S(0)",), ("R", "S(0)"), ("R",)


def _mesh(shape, ranks, coordinate):
    return MeshRecord(mesh_id(shape, ranks), shape, ranks, coordinate)


def _rank(rank, digest, mesh, placements=SHARD, plain="same"):
    """A rank with one sharded parameter on ``mesh`` and one plain parameter."""
    params = [
        replace(valued(EMBED, digest, [digest], placements=placements), mesh=mesh.id),
        valued("router.weight", plain, [plain]),
    ]
    record = state_record(rank, post=([], params))
    shard, peers = replica_keys(record.post_wrap.params, (mesh,))
    return replace(record, shard_key=shard, peer_key=peers, meshes=(mesh,))


def _ep(rank, digest, plain):
    group = (0, 1) if rank < 2 else (2, 3)  # (ep=2, dp=2): FSDP2 over each group's dp sub-mesh
    return _rank(rank, digest, _mesh((2,), group, (rank % 2,)), plain=plain)


def _check(records):
    keys = value_keys(records)
    return value_findings(records, keys), keys.shard_keys, keys.peer_keys


def test_ranks_of_different_expert_groups_are_never_compared():
    # The same dp coordinate on meshes of other ranks: not replicas, not peers.
    records = {r: _ep(r, f"shard{r}", plain=f"group{r // 2}") for r in range(4)}
    assert records[0].shard_key != records[2].shard_key
    assert records[0].peer_key == records[1].peer_key != records[2].peer_key
    findings, keys, peers = _check(records)
    assert findings == []
    assert comparisons(range(4), keys, peers) == {
        "unsharded": [[0, 1], [2, 3]],
        "shards": [],
        "siblings": [],
    }


def test_a_rank_that_differs_from_its_group_is_compared_with_its_group_only():
    plain = {0: "g0", 1: "g0", 2: "g1", 3: "bad"}
    records = {r: _ep(r, f"shard{r}", plain=plain[r]) for r in range(4)}
    (finding,) = _check(records)[0]
    assert (finding.ranks, finding.reference_rank, finding.tensors) == ((3,), 2, ("router.weight",))
    assert finding.details["compared"] == [2, 3] and finding.details["replicas"] == []


def test_hsdp_replicas_are_the_ranks_at_the_same_place_on_the_shard_dim():
    ranks = (0, 1, 2, 3)
    mesh = {r: _mesh((2, 2), ranks, (r // 2, r % 2)) for r in ranks}
    shards = {0: "a", 1: "b", 2: "a", 3: "drift"}
    records = {r: _rank(r, shards[r], mesh[r], placements=HSDP) for r in ranks}
    findings, keys, peers = _check(records)
    assert comparisons(ranks, keys, peers) == {
        "unsharded": [[0, 1, 2, 3]],
        "shards": [[0, 2], [1, 3]],
        "siblings": [],
    }
    (finding,) = findings
    assert (finding.ranks, finding.reference_rank) == ((3,), 1)
    assert finding.details["replicas"] == finding.details["compared"] == [1, 3]


def test_tensor_parallel_shards_differ_by_design_and_replicated_values_must_agree():
    mesh = {r: _mesh((2,), (0, 1), (r,)) for r in (0, 1)}
    records = {r: _rank(r, f"colwise{r}", mesh[r]) for r in (0, 1)}
    assert _check(records)[0] == []
    replicated = {r: _rank(r, "norm" if r == 0 else "other", mesh[r], REPLICATE) for r in (0, 1)}
    assert {rec.shard_key for rec in replicated.values()} == {None}  # Replicate: not a shard
    (finding,) = _check(replicated)[0]
    assert finding.ranks == (1,) and finding.details["compared"] == [0, 1]


def test_without_peer_keys_every_rank_is_compared_as_before():
    records = {r: state_record(r, pre=([valued(SCALE, f"v{r}")], [])) for r in (0, 1)}
    values = {r: value_digests(rec)[0] for r, rec in records.items()}
    (finding,) = value_findings(records, ValueKeys(values, {}, {}))
    assert finding.details["compared"] == [0, 1]


# ---------------------------------------------------------------- non-finite


def _group(ranks, record):
    return Group(ranks=tuple(ranks), digest=record.group_digest())


def test_a_tensor_with_nan_splits_its_rank_off_and_is_named():
    clean = state_record(0, post=([], [valued(EMBED, "a", placements=SHARD)]))
    tensor = replace(valued(EMBED, "b", placements=SHARD), non_finite=3)
    dirty = state_record(1, post=([], [tensor]))
    assert clean.group_digest() != dirty.group_digest()  # so rank 1 sends its record
    groups = [_group([0], clean), _group([1], dirty)]
    (finding,) = non_finite_findings(groups, {0: clean, 1: dirty})
    assert (finding.kind, finding.ranks, finding.tensors) == (
        FindingKind.NON_FINITE,
        (1,),
        (EMBED,),
    )
    assert finding.details["tensors"] == [
        {"name": EMBED, "kind": "param", "snapshot": "post-wrap", "count": 3}
    ]


def test_non_finite_counted_after_the_load_is_a_finding_and_buffers_already_told_are_not():
    problem = BufferProblem(SCALE, Snapshot.LOAD, "nan", ("nan",))
    record = RankRecord(
        env=env(1),
        uninitialized=(problem,),
        non_finite=(
            NonFinite(SCALE, Snapshot.LOAD, 4, buffer=True),
            NonFinite(EMBED, Snapshot.LOAD, 1),
        ),
    )
    (finding,) = non_finite_findings([_group([1], record)], {1: record})
    assert finding.tensors == (EMBED,) and finding.snapshot == Snapshot.LOAD
    assert finding.cause == "loading"


def test_counts_agree_with_torch_and_leave_the_checksum_as_it_was():
    big = torch.randn(3_000_000)
    big[2_999_999] = float("inf")
    big[7] = float("nan")
    half = torch.randn(1000).bfloat16()
    half[3] = float("-inf")
    cplx = torch.randn(6, dtype=torch.complex64)
    cplx[2] = complex(0, float("nan"))
    tensors = [big, half, torch.arange(5), cplx, torch.zeros(3, device="meta"), torch.ones(4)]
    counted = checksums_and_non_finite(tensors, threads=2)
    assert [n for _, n in counted] == [2, 1, 0, 1, None, 0]
    assert [d for d, _ in counted] == checksums(tensors)
    assert non_finite_counts(tensors) == [2, 1, 0, 1, None, 0]


class _Buffers(nn.Module):
    def __init__(self, mask_value=float("-inf")):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))
        mask = torch.zeros(4)
        mask[2:] = mask_value
        self.register_buffer("mask", mask, persistent=False)


def test_an_attention_mask_of_zeros_and_inf_is_not_non_finite():
    fp = fingerprint(_Buffers(), "post-wrap", param_values=True)
    assert [b.non_finite for b in fp.buffers] == [0]
    assert non_finite_tensors(_Buffers(), Snapshot.LOAD) == ()
    fp = fingerprint(_Buffers(float("nan")), "post-wrap", param_values=True)
    assert [b.non_finite for b in fp.buffers] == [2]
    assert [p.non_finite for p in fp.params] == [0]


def test_parameters_not_digested_are_not_counted():
    fp = fingerprint(_Buffers(), "pre-wrap")
    assert [p.non_finite for p in fp.params] == [None]


@pytest.mark.parametrize(
    ("part", "reason"),
    [(None, None), (float("nan"), "nan"), (float("inf"), "inf"), (1e-40, "denormal")],
)
def test_complex_buffers_get_the_garbage_test(part, reason):
    freqs = torch.polar(torch.ones(8), torch.linspace(0, 1, 8))  # RoPE's freqs_cis, complex64
    if part is not None:
        freqs[3] = complex(0.5, part)
    assert garbage(freqs) == reason


def test_the_step_scan_names_nan_and_inf_but_not_a_sum_that_overflows() -> None:
    from fsdpcheck.step.session import _non_finite

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    with torch.no_grad():
        model[1].weight.fill_(3e38)  # finite: only its sum overflows (the scan's fast path)
    clean = _non_finite(model, 1.0)
    assert (clean.params, clean.param_count, clean.grads) == ((), 0, ())
    with torch.no_grad():
        model[0].bias[1] = float("nan")
        model[2].weight[0, 0] = float("-inf")
    model[0].weight.grad = torch.full((4, 4), float("inf"))
    found = _non_finite(model, 1.0)
    assert found.params == ("0.bias", "2.weight") and found.param_count == 2
    assert found.grads == ("0.weight",) and found.grad_count == 1
