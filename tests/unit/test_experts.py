"""``expert``: expert-parallel slots that hold identical experts (collapsed) and expert counts
the config does not match, over synthetic records of the (ep=2, dp=2) layout of
tests/workers/mesh_worker.py, each with its clean twin."""

from __future__ import annotations

from synthetic import env

from fsdpcheck.checks.expert import config_counts
from fsdpcheck.checks.gather_view import gathered_from
from fsdpcheck.model.keys import expert_key
from fsdpcheck.records import ConfigRecord, Fingerprint, MeshRecord, RankRecord, TensorRecord
from fsdpcheck.report import AuditOutcome, assemble
from fsdpcheck.vocab import Verdict

WORLD = 4


def _mesh(ranks: tuple[int, ...], rank: int, names: tuple[str, ...] = ("dp",)) -> MeshRecord:
    return MeshRecord(f"m{ranks}", (len(ranks),), ranks, (ranks.index(rank),), names)


def _param(name, digest, mesh=None, shape=(4, 8), placements=("S(0)",)):
    return TensorRecord(
        name=name,
        shape=shape,
        dtype="float32",
        device="cpu",
        digest=digest,
        placements=placements if mesh else None,
        local_shape=(shape[0] // 2, *shape[1:]) if mesh else None,
        requires_grad=True,
        mesh=mesh.id if mesh else None,
    )


def _ep_rank(rank: int, expert_values: str, *, fused: bool = False, config=None) -> RankRecord:
    """(ep=2, dp=2): each EP group's experts FSDP2-sharded over its own dp sub-mesh; the router
    a plain tensor, alike everywhere."""
    group = (0, 1) if rank < 2 else (2, 3)
    mesh = _mesh(group, rank)
    place = group.index(rank)  # each dp rank holds its own shard
    shape = (2, 8, 4) if fused else (4, 8)
    params = (
        _param("router.weight", "router"),
        _param("mlp.experts.up", f"{expert_values}-{place}", mesh, shape),
        _param("mlp.experts.down", f"{expert_values}-{place}-d", mesh, shape),
    )
    fp = Fingerprint("post-wrap", (), params)
    return RankRecord(
        env=env(rank, WORLD),
        post_wrap=fp,
        meshes=(mesh,),
        peer_key=f"peers{group}",
        config=config,
    )


def _report(records: dict[int, RankRecord]):
    return assemble(AuditOutcome(gathered_from(records)), None)


def test_each_ep_group_with_its_own_experts_is_consistent() -> None:
    records = {r: _ep_rank(r, f"slot{r // 2}") for r in range(WORLD)}
    report = _report(records)
    assert report.verdict == Verdict.CONSISTENT, [f.summary for f in report.findings]
    keys = {r: expert_key(records[r]) for r in records}
    assert keys[0].place == keys[2].place and keys[0].slot != keys[2].slot
    assert keys[0].slot == keys[1].slot and keys[0].place != keys[1].place


def test_every_ep_slot_holding_one_slots_experts_is_a_finding() -> None:
    records = {r: _ep_rank(r, "slot0") for r in range(WORLD)}  # a resume copied slot 0 everywhere
    report = _report(records)
    assert [f.kind for f in report.findings] == ["expert"], [f.summary for f in report.findings]
    (finding,) = report.findings
    assert (finding.ranks, finding.reference_rank) == ((2, 3), 0)
    assert finding.details["collapsed"] == [[0, 2], [1, 3]]
    assert finding.details["slots"] == [[0, 1], [2, 3]]
    assert finding.tensors == ("mlp.experts.up", "mlp.experts.down")
    assert "ranks 2,3 hold the same experts as ranks 0,1" in finding.summary


def test_ranks_on_meta_hold_no_expert_values_and_are_not_compared() -> None:
    records = {r: _ep_rank(r, "slot0") for r in range(WORLD)}
    for r in (2, 3):
        fp = records[r].post_wrap
        params = tuple(
            TensorRecord(**{**t.__dict__, "digest": None, "device": "meta"}) for t in fp.params
        )
        records[r] = RankRecord(
            **{**records[r].__dict__, "post_wrap": Fingerprint(fp.snapshot, (), params)}
        )
    assert "expert" not in [f.kind for f in _report(records).findings]


def test_the_expert_count_is_held_against_the_config() -> None:
    def config(count: int) -> ConfigRecord:
        return ConfigRecord(digest=f"c{count}", canonical={"num_experts": count, "hidden": 8})

    # Fused experts: 2 per slot on its own dp sub-mesh, 2 slots: 4 in all.
    clean = {r: _ep_rank(r, f"slot{r // 2}", fused=True, config=config(4)) for r in range(WORLD)}
    report = _report(clean)
    assert report.verdict == Verdict.CONSISTENT, [f.summary for f in report.findings]
    wrong = {r: _ep_rank(r, f"slot{r // 2}", fused=True, config=config(8)) for r in range(WORLD)}
    (finding,) = _report(wrong).findings
    assert finding.kind == "expert" and finding.ranks == (0, 1, 2, 3)
    assert finding.details["count"] == [{"module": "mlp.experts", "experts": 4}]
    assert finding.details["config"] == {"num_experts": 8}


def test_config_counts_read_the_top_level_and_the_text_config() -> None:
    assert config_counts({"num_local_experts": 8, "num_experts_per_tok": 2}) == {
        "num_local_experts": 8
    }
    assert config_counts({"text_config": {"n_routed_experts": 16}}) == {"n_routed_experts": 16}
    assert config_counts({"num_experts": None, "use_moe": True}) == {}


def test_experts_on_one_mesh_for_every_rank_name_one_slot() -> None:
    # HSDP or plain FSDP over every rank: one slot, nothing to collapse, whatever the values.
    mesh_of = {r: _mesh((0, 1, 2, 3), r) for r in range(WORLD)}
    records = {
        r: RankRecord(
            env=env(r, WORLD),
            post_wrap=Fingerprint(
                "post-wrap", (), (_param("mlp.experts.up", "zeros", mesh_of[r]),)
            ),
            meshes=(mesh_of[r],),
            peer_key="all",
        )
        for r in range(WORLD)
    }
    assert len({expert_key(rec).slot for rec in records.values()}) == 1
    assert "expert" not in [f.kind for f in _report(records).findings]


def test_a_mesh_dim_named_ep_is_the_slot() -> None:
    # torchtitan: experts Shard(0) on an "ep" dim; ranks at other ep coordinates are other slots.
    def rank(r: int, values: str) -> RankRecord:
        mesh = MeshRecord("ep", (2,), (0, 1), (r,), ("ep",))
        t = _param("layers.0.moe.experts.w1", values, mesh, shape=(4, 8, 8))
        return RankRecord(
            env=env(r, 2), post_wrap=Fingerprint("post-wrap", (), (t,)), meshes=(mesh,)
        )

    assert _report({0: rank(0, "a"), 1: rank(1, "b")}).verdict == Verdict.CONSISTENT
    (finding,) = _report({0: rank(0, "a"), 1: rank(1, "a")}).findings
    assert finding.kind == "expert" and finding.details["collapsed"] == [[0, 1]]
