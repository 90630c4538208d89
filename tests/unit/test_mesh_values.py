"""Issue 21's mesh rows on synthetic records (pure): local shards of what tensor parallelism
left whole are compared across TP ranks after wrapping (the sibling key and digest), and a
parameter on a mesh of another shape, other dim names or another rank list is a
``param-placement`` finding, each with its clean twin."""

from __future__ import annotations

from dataclasses import replace

from synthetic import env

from fsdpcheck.checks.gather_view import gathered_from
from fsdpcheck.checks.groups import Pair
from fsdpcheck.checks.layout import layout_findings
from fsdpcheck.distributed.gather import SLOT_BYTES, _pack_slot, _unpack_slot
from fsdpcheck.model.fingerprint import mesh_id
from fsdpcheck.model.keys import comparisons, replica_keys, sibling_key
from fsdpcheck.records import Fingerprint, Group, MeshRecord, RankRecord, TensorRecord
from fsdpcheck.report import AuditOutcome, assemble

NORM, Q_PROJ, UP = "model.norm.weight", "model.layers.0.self_attn.q_proj.weight", "up.weight"
COLWISE = ("_S(0, 2)", "S(0)")  # FSDP2 over dp_shard on top of TP's Shard(0) over tp
WORLD = (0, 1, 2, 3)


def _mesh(shape, ranks, coordinate, names, family=None) -> MeshRecord:
    return MeshRecord(mesh_id(shape, ranks), shape, ranks, coordinate, names, family)


def _param(name, mesh, placements, digest) -> TensorRecord:
    return TensorRecord(
        name, (8, 4), "float32", "cpu", placements=placements, digest=digest, mesh=mesh.id
    )


def _record(rank, params, meshes, world=4) -> RankRecord:
    record = RankRecord(env=env(rank, world), post_wrap=Fingerprint("post-wrap", (), params))
    shard, peers = replica_keys(record.post_wrap.params, meshes)
    siblings = sibling_key(record.post_wrap.params, meshes)
    return replace(record, shard_key=shard, peer_key=peers, sibling_key=siblings, meshes=meshes)


def _fsdp_tp(rank, norm=None, q_proj=None) -> RankRecord:
    """FSDP2 x TP on (dp_shard=2, tp=2): q_proj Colwise on the root mesh (each rank its own
    shard), the final norm FSDP2-sharded on this TP rank's dp_shard sub-mesh (ranks 0,2 or
    1,3), whose shard along dp_shard ranks 0,1 (and 2,3) share."""
    dp, tp = divmod(rank, 2)
    root = _mesh((2, 2), WORLD, (dp, tp), ("dp_shard", "tp"))
    sub = _mesh((2,), (tp, tp + 2), (dp,), ("dp_shard",), family="f-dp_shard")
    params = (
        _param(Q_PROJ, root, COLWISE, q_proj or f"q-shard-{rank}"),
        _param(NORM, sub, ("S(0)",), norm or f"norm-half-{dp}"),
    )
    return _record(rank, params, (root, sub))


def _report(records):
    return assemble(AuditOutcome(gathered_from(records)), None)


def _compared(ranks, gathered):
    keys = gathered.value_keys
    return comparisons(ranks, keys.shard_keys, keys.peer_keys, keys.sibling_keys)


def _findings(report):
    return [(f.kind, f.ranks, f.reference_rank, f.tensors) for f in report.findings]


# ---------------------------------------------------------------- values across TP ranks


def test_fsdp_by_tp_compares_the_tp_replicated_norm_across_tp_ranks_only():
    records = {r: _fsdp_tp(r) for r in WORLD}
    g = gathered_from(records)
    # Every rank its own Colwise shard: no replica set; the norm's halves: 0,1 and 2,3.
    assert _compared(WORLD, g) == {
        "unsharded": [[0, 1, 2, 3]],
        "shards": [],
        "siblings": [[0, 1], [2, 3]],
    }
    assert _report(records).verdict == "consistent"


def test_a_norm_that_drifted_on_one_tp_rank_after_wrapping_is_named_against_its_tp_peer():
    records = {r: _fsdp_tp(r, norm="drifted" if r == 1 else None) for r in WORLD}
    report = _report(records)
    assert _findings(report) == [("value", (1,), 0, (NORM,))]
    (finding,) = report.findings
    assert finding.details["compared"] == [0, 1] and finding.snapshot == "post-wrap"
    assert "tensor-parallel replicas" in finding.summary


def test_colwise_shards_that_differ_across_tp_ranks_are_never_compared():
    # The clean twin's TP shards already differ per rank; equal ones on two ranks are no
    # finding either: nothing compares them across tp.
    records = {r: _fsdp_tp(r, q_proj="same" if r < 2 else None) for r in WORLD}
    assert _report(records).verdict == "consistent"


def test_a_sequence_parallel_norm_on_the_root_mesh_is_compared_across_tp_ranks_too():
    # torchtitan's layout: the norm a Replicate DTensor over tp, then FSDP2 over dp_shard on
    # the root mesh: [S(0), R], its shard the same on both TP ranks of a data shard.
    def rank_record(rank, drift=False):
        dp, tp = divmod(rank, 2)
        root = _mesh((2, 2), WORLD, (dp, tp), ("dp_shard", "tp"))
        params = (
            _param(Q_PROJ, root, COLWISE, f"q-shard-{rank}"),
            _param(NORM, root, ("S(0)", "R"), "drift" if drift else f"norm-half-{dp}"),
        )
        return _record(rank, params, (root,))

    clean = {r: rank_record(r) for r in WORLD}
    g = gathered_from(clean)
    assert _compared(WORLD, g)["siblings"] == [
        [0, 1],
        [2, 3],
    ]
    assert _report(clean).verdict == "consistent"
    drifted = {**clean, 3: rank_record(3, drift=True)}
    assert _findings(_report(drifted)) == [("value", (3,), 2, (NORM,))]


def test_hsdp_by_tp_compares_each_norm_shard_across_replicas_and_tp_ranks():
    # (dp_replicate=2, dp_shard=2, tp=2) on 8 ranks: the norm on (dp_replicate, dp_shard) as
    # [R, S(0)]; its shard along dp_shard is the same on the 4 ranks at one dp_shard place.
    world = tuple(range(8))

    def rank_record(rank, drift=False):
        rep, dp, tp = rank // 4, rank // 2 % 2, rank % 2
        root = _mesh((2, 2, 2), world, (rep, dp, tp), ("dp_replicate", "dp_shard", "tp"))
        sub_ranks = tuple(r for r in world if r % 2 == tp)
        sub = _mesh((2, 2), sub_ranks, (rep, dp), ("dp_replicate", "dp_shard"), family="f")
        params = (
            _param(Q_PROJ, root, ("R", *COLWISE), f"q-{dp}-{tp}"),
            _param(NORM, sub, ("R", "S(0)"), "drift" if drift else f"norm-{dp}"),
        )
        return _record(rank, params, (root, sub), world=8)

    clean = {r: rank_record(r) for r in world}
    g = gathered_from(clean)
    assert _compared(world, g)["siblings"] == [
        [0, 1, 4, 5],
        [2, 3, 6, 7],
    ]
    assert _compared(world, g)["shards"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert _report(clean).verdict == "consistent"
    drifted = {**clean, 5: rank_record(5, drift=True)}
    assert _findings(_report(drifted)) == [("value", (5,), 0, (NORM,))]


def test_the_slot_carries_the_sibling_key_and_digest():
    raw = _pack_slot("ab" * 16, "node", 0, None, None, None, None, None, "34" * 8, "56" * 16)
    assert len(raw) == SLOT_BYTES == 185
    assert _unpack_slot(raw)[-2:] == ("34" * 8, "56" * 16)
    assert _unpack_slot(_pack_slot("ab" * 16, "node", 0))[-2:] == (None, None)


# ---------------------------------------------------------------- meshes per parameter


def _on_mesh(rank, shape=(2, 2), names=("dp_shard", "tp"), ranks=WORLD) -> RankRecord:
    """One weight, [S(0), R] on a mesh over every rank (its coordinate from ``ranks``)."""
    at = ranks.index(rank)
    mesh = _mesh(shape, ranks, (at // shape[1], at % shape[1]), names)
    return _record(rank, (_param(UP, mesh, ("S(0)", "R"), "w"),), (mesh,))


def _placement(report):
    (finding,) = report.findings
    assert (finding.kind, finding.ranks, finding.reference_rank) == ("param-placement", (3,), 0)
    return finding


def test_the_same_placements_on_a_mesh_of_another_shape_are_a_placement_finding():
    assert _report({r: _on_mesh(r) for r in WORLD}).verdict == "consistent"  # the clean twin
    records = {**{r: _on_mesh(r) for r in WORLD}, 3: _on_mesh(3, shape=(4, 1))}
    finding = _placement(_report(records))
    assert finding.summary == (
        "parameter placements differ: up.weight is [S(0), R] on mesh (2, 2) (dp_shard, tp) on "
        "rank 0 but [S(0), R] on mesh (4, 1) (dp_shard, tp) on rank 3"
    )
    (diff,) = finding.details["differences"]
    assert diff["reference_mesh"] == {"shape": [2, 2], "dim_names": ["dp_shard", "tp"]}
    assert diff["other_mesh"] == {"shape": [4, 1], "dim_names": ["dp_shard", "tp"]}


def test_swapped_mesh_dim_names_are_a_placement_finding():
    records = {**{r: _on_mesh(r) for r in WORLD}, 3: _on_mesh(3, names=("tp", "dp_shard"))}
    finding = _placement(_report(records))
    assert "(tp, dp_shard) on rank 3" in finding.summary and finding.tensors == (UP,)


def test_a_mesh_over_every_rank_with_another_rank_order_is_a_placement_finding():
    records = {**{r: _on_mesh(r) for r in WORLD}, 3: _on_mesh(3, ranks=(0, 2, 1, 3))}
    finding = _placement(_report(records))
    assert "of ranks [0, 1, 2, 3] on rank 0 but [S(0), R] on mesh (2, 2)" in finding.summary
    assert finding.details["differences"][0]["other_mesh"]["ranks"] == [0, 2, 1, 3]


def test_sub_meshes_whose_rank_lists_differ_by_design_stay_consistent():
    # Each TP rank's sibling sub-mesh (above), and each expert group's own dp sub-mesh.
    assert _report({r: _fsdp_tp(r) for r in WORLD}).verdict == "consistent"

    def expert_group(rank):
        group = (0, 1) if rank < 2 else (2, 3)
        mesh = _mesh((2,), group, (rank % 2,), ("dp",))
        return _record(
            rank, (_param(UP, mesh, ("S(0)",), f"group-{rank // 2}-{rank % 2}"),), (mesh,)
        )

    assert _report({r: expert_group(r) for r in WORLD}).verdict == "consistent"


def test_a_sub_mesh_two_ranks_share_but_list_differently_is_a_finding_between_them():
    # Rank 2 is on rank 0's sibling sub-mesh (0, 2) and lists it as (2, 0): one mesh, two
    # views. (A sub-mesh's rank list is not in the group digest, so this compares the records
    # rank 0 holds; a mesh over every rank is, above.) Rank 3's (1, 3) is another mesh.
    def listed_backwards(rank):
        record = _fsdp_tp(rank)
        root, sub = record.meshes
        odd = replace(sub, ranks=sub.ranks[::-1], id=mesh_id((2,), sub.ranks[::-1]))
        params = tuple(
            replace(t, mesh=odd.id) if t.mesh == sub.id else t for t in record.post_wrap.params
        )
        return _record(rank, params, (root, odd))

    ref = _fsdp_tp(0)

    def pair(other):
        rank = other.env.rank
        return Pair(Group((0,), "a"), Group((rank,), "b"), ref, other)

    (finding,) = layout_findings(pair(listed_backwards(2)))
    assert (finding.kind, finding.ranks, finding.tensors) == ("param-placement", (2,), (NORM,))
    assert "of ranks [0, 2] on rank 0 but [S(0)] on mesh (2,) (dp_shard) of ranks [2, 0]" in (
        finding.summary
    )
    assert layout_findings(pair(listed_backwards(3))) == []
    assert layout_findings(pair(_fsdp_tp(3))) == []


# ---------------------------------------------------------------- --step's batches


class _Mesh:
    """What batch_index reads of a DeviceMesh: its rank grid, dim names, this rank's place."""

    def __init__(self, shape, names, coordinate):
        import torch

        self.mesh = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
        self.mesh_dim_names = names
        self._coordinate = coordinate

    def get_coordinate(self):
        return self._coordinate


def test_tp_ranks_of_one_data_shard_draw_one_batch_and_data_ranks_their_own():
    from fsdpcheck.step.synthetic import batch_index

    names = ("dp_replicate", "dp_shard", "tp")
    batches = {
        rank: batch_index(_Mesh((2, 2, 2), names, (rank // 4, rank // 2 % 2, rank % 2)), rank)
        for rank in range(8)
    }
    assert batches == {0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2, 6: 3, 7: 3}
    # No tp dim (1-D, HSDP, expert groups): every rank its own batch, as before.
    assert batch_index(_Mesh((2, 2), ("dp_replicate", "dp_shard"), (1, 0)), 2) == 2
    assert batch_index(None, 3) == 3
