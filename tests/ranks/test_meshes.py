"""Which ranks must agree comes from the real device meshes, and NaN/Inf is never silent: a
training script's own layouts (tests/workers/mesh_worker.py) under check_model, each failure
with its clean twin."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import QUIET_ENV, REPO

from fsdpcheck.children.launch import launch

MESH_CASES = (
    *("ep", "ep-drift", "ep-collapsed", "hsdp", "hsdp-drift", "tp", "tp-drift"),
    *("mesh-2d", "mesh-shape-on-3", "mesh-dims-on-3"),
    *("ep-step", "ep-step-undispatched-on-rank-3"),
)
TP_EXAMPLE = "examples/builders/llama_fsdp_tp.py:build"
TP_MESH = {"mesh": [2, 2], "mesh_dims": ["dp_shard", "tp"]}
# Whole audits in the same 4-rank job (issue 21): named meshes, --tp, a 2-D builder, their twins.
AUDITS = {
    "named-hsdp": {"mesh": [2, 2], "mesh_dims": ["dp_replicate", "dp_shard"]},
    "tp": {"tp": 2, "step": True},
    "tp-example": {"builder": TP_EXAMPLE, **TP_MESH},
    "tp-skipped-on-rank-3": {
        "builder": "tests/workers/builders.py:tp_skipped_on_rank_3",
        **TP_MESH,
    },
    "tp-plain-builder": {"builder": "tests/workers/builders.py:plain_for_tp", "tp": 2},
    "tp-norm-drift-on-rank-1": {
        "builder": "tests/workers/builders.py:norm_drift_on_rank_1",
        "tp": 2,
    },
    "tp-prewrapped": {"builder": "tests/workers/builders.py:tp_prewrapped", **TP_MESH},
    "tp-prewrapped-norm-drift-on-rank-1": {
        "builder": "tests/workers/builders.py:tp_prewrapped_norm_drift_on_rank_1",
        **TP_MESH,
    },
    "tp-no-plan": {"tp": 2, "model": "hazard"},
    "tp-splits-no-head": {"tp": 4},
    "ep-no-plan": {"ep": 2},
    # --ep 2: transformers' own EP plan on the MoE preset, then FSDP2 (dp_shard=2, ep=2).
    "ep-moe": {"model": "tiny-qwen3-moe", "ep": 2, "step": True},
    "ep-moe-builder": {"builder": "tests/workers/builders.py:moe_plain", "ep": 2},
    "ep-moe-collapsed": {"builder": "tests/workers/builders.py:moe_collapsed", "ep": 2},
    "ep-with-tp": {"model": "tiny-qwen3-moe", "ep": 2, "tp": 2},
}


def _run(out: Path, ranks: int, cases: tuple[str, ...], audits: dict | None = None) -> dict:
    argv = [str(REPO / "tests" / "workers" / "mesh_worker.py"), "--out", str(out)]
    if audits:
        specs = {
            # A builder builds its own model: no --model beside it (refused, as on the CLI).
            name: {
                "model": options.pop("model", None if "builder" in options else "tiny-llama"),
                "options": options,
            }
            for name, options in ((n, {"timeout": 60, **o}) for n, o in audits.items())
        }
        (out.parent / "audits.json").write_text(json.dumps(specs))
        argv += ["--audit-cases", str(out.parent / "audits.json")]
    result = launch(
        argv + [a for case in cases for a in ("--case", case)],
        ranks,
        env={**QUIET_ENV, "OMP_NUM_THREADS": "1"},
        rank_env=lambda r: {"PYTHONHASHSEED": "0"},
        timeout=300,
        cwd=str(REPO),
    )
    everything = "".join(result.output(r) for r in range(ranks))
    assert not result.timed_out and result.codes == [0] * ranks, everything
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def meshes(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One 4-rank job (gloo) for every mesh case: check_model once per case, then the audits."""
    return _run(tmp_path_factory.mktemp("meshes") / "reports.json", 4, MESH_CASES, AUDITS)


def _findings(report: dict) -> list[tuple]:
    return [
        (f["kind"], f["ranks"], f["reference_rank"], f["tensors"], f["details"].get("compared"))
        for f in report["findings"]
    ]


def test_expert_groups_with_fsdp2_over_each_dp_sub_mesh_are_consistent(meshes: dict) -> None:
    # (ep=2, dp=2): ranks 0,1 and 2,3 hold different experts and routers, by design.
    assert meshes["ep"]["verdict"] == "consistent", meshes["ep"]["findings"]


def test_a_rank_that_differs_from_its_dp_peer_is_named_within_its_group(meshes: dict) -> None:
    report = meshes["ep-drift"]
    assert report["verdict"] == "inconsistent"
    assert _findings(report) == [("value", [3], 2, ["router.weight"], [2, 3])]


def test_every_ep_group_holding_one_groups_experts_is_an_expert_finding(meshes: dict) -> None:
    # Its clean twin is "ep" above: each EP group its own experts.
    report = meshes["ep-collapsed"]
    assert report["verdict"] == "inconsistent"
    assert _findings(report) == [
        ("expert", [2, 3], 0, ["experts.up.weight", "experts.down.weight"], None)
    ]
    details = report["findings"][0]["details"]
    assert details["collapsed"] == [[0, 2], [1, 3]] and details["slots"] == [[0, 1], [2, 3]]


def test_hsdp_on_four_ranks_compares_each_shard_with_its_replica_only(meshes: dict) -> None:
    assert meshes["hsdp"]["verdict"] == "consistent", meshes["hsdp"]["findings"]
    report = meshes["hsdp-drift"]
    assert _findings(report) == [("value", [3], 1, ["experts.up.weight"], [1, 3])]
    assert report["findings"][0]["details"]["replicas"] == [1, 3]


def test_tensor_parallel_compares_only_what_is_replicated(meshes: dict) -> None:
    # Colwise shards differ by design; the Replicate norm must agree on every rank of the mesh.
    assert meshes["tp"]["verdict"] == "consistent", meshes["tp"]["findings"]
    assert _findings(meshes["tp-drift"]) == [("value", [1], 0, ["norm.weight"], [0, 1, 2, 3])]


def test_nan_left_in_one_ranks_shard_after_the_load_is_a_finding(tmp_path: Path) -> None:
    reports = _run(tmp_path / "reports.json", 2, ("nan", "finite"))
    assert reports["finite"]["verdict"] == "consistent", reports["finite"]["findings"]
    report = reports["nan"]
    assert report["verdict"] == "inconsistent"
    (finding,) = report["findings"]
    assert (finding["kind"], finding["ranks"], finding["tensors"]) == (
        "non-finite",
        [1],
        ["experts.down.weight"],
    )
    assert finding["details"]["tensors"] == [
        {"name": "experts.down.weight", "kind": "param", "snapshot": "post-wrap", "count": 3}
    ]


def _audit(meshes: dict, case: str) -> dict:
    done = meshes["audits"][case]
    report = done["report"]
    assert report is not None, done["raised"]
    return done | {"report": report}


def test_a_named_hsdp_mesh_and_tp_on_four_ranks_load_and_verify_consistent(meshes: dict) -> None:
    for case in ("named-hsdp", "tp", "tp-example"):
        done = _audit(meshes, case)
        report = done["report"]
        assert done["exit_codes"] == [0] * 4, (case, report["findings"], report["errors"])
        assert report["verdict"] == "consistent", case
        # The sorted loader moved every TP slice of every FSDP shard; verify checked each one.
        assert report["load"]["outcome"] == "loaded", (case, report["load"])
        assert report["load"]["method"] == "bucketed", (case, report["load"])
        assert report["verify"]["passed"] is True, (case, report["verify"])
    assert "step" in _audit(meshes, "tp")["report"]["timings"]  # --step ran on the 2-D model


def test_one_rank_that_leaves_a_module_out_of_its_tp_plan_is_a_placement_finding(
    meshes: dict,
) -> None:
    done = _audit(meshes, "tp-skipped-on-rank-3")
    assert done["exit_codes"] == [1] * 4
    [finding] = done["report"]["findings"]
    assert (finding["kind"], finding["ranks"], finding["tensors"]) == (
        "param-placement",
        [3],
        ["model.layers.0.mlp.down_proj.weight"],
    )


def test_a_tp_replicated_norm_that_differs_on_one_tp_rank_is_named_against_every_rank(
    meshes: dict,
) -> None:
    # Each TP rank's norm lives on its own dp_shard sub-mesh after wrapping; they are one tensor.
    clean = _audit(meshes, "tp-plain-builder")
    assert clean["exit_codes"] == [0] * 4, clean["report"]["findings"]
    assert clean["report"]["load"]["message"] == "the builder returned no state dict to load"
    drift = _audit(meshes, "tp-norm-drift-on-rank-1")
    assert drift["exit_codes"] == [1] * 4
    assert _findings(drift["report"]) == [("value", [1], 0, ["model.norm.weight"], [0, 1, 2, 3])]
    assert drift["report"]["findings"][0]["snapshot"] == "pre-wrap"


def test_a_tp_replicated_norm_drifting_on_one_tp_rank_of_a_prewrapped_model_is_named(
    meshes: dict,
) -> None:
    # Nothing loaded, no pre-wrap look: only the local shards after wrapping tell. Rank 1's
    # dp_shard shard of the norm is rank 0's (the same data shard, the other TP rank); the
    # Colwise/Rowwise shards differ on every rank by design and are never compared.
    clean = _audit(meshes, "tp-prewrapped")
    assert clean["exit_codes"] == [0] * 4, clean["report"]["findings"]
    assert clean["report"]["load"]["message"] == "the builder returned no state dict to load"
    drift = _audit(meshes, "tp-prewrapped-norm-drift-on-rank-1")
    assert drift["exit_codes"] == [1] * 4
    assert _findings(drift["report"]) == [("value", [1], 0, ["model.norm.weight"], [0, 1])]
    finding = drift["report"]["findings"][0]
    assert finding["snapshot"] == "post-wrap" and finding["details"]["replicas"] == [0, 1]


def test_the_same_placements_on_a_mesh_of_another_shape_or_dim_names_are_named(
    meshes: dict,
) -> None:
    assert meshes["mesh-2d"]["verdict"] == "consistent", meshes["mesh-2d"]["findings"]
    for case, other in (
        ("mesh-shape-on-3", {"shape": [4, 1], "dim_names": ["dp_shard", "tp"]}),
        ("mesh-dims-on-3", {"shape": [2, 2], "dim_names": ["tp", "dp_shard"]}),
    ):
        report = meshes[case]
        assert _findings(report) == [
            ("param-placement", [3], 0, ["experts.up.weight", "experts.down.weight"], None)
        ], case
        differences = report["findings"][0]["details"]["differences"]
        assert [d["other_mesh"] for d in differences] == [other] * 2, case
        assert differences[0]["reference_mesh"] == {
            "shape": [2, 2],
            "dim_names": ["dp_shard", "tp"],
        }


def test_tp_and_ep_a_model_cannot_take_are_bad_input_on_every_rank(meshes: dict) -> None:
    for case, words in (
        ("tp-no-plan", "HazardConfig has no tensor-parallel plan"),
        ("tp-splits-no-head", "num_key_value_heads is 2, which 4 tensor-parallel ranks"),
        ("ep-no-plan", "LlamaConfig has no expert-parallel plan"),
        ("ep-with-tp", "--ep 2 with --tp 2: fsdpcheck's own wrap applies expert parallelism"),
    ):
        done = _audit(meshes, case)
        assert done["exit_codes"] == [2] * 4, (case, done["report"]["errors"])
        errors = done["report"]["errors"]
        assert [e["rank"] for e in errors] == [0, 1, 2, 3], case
        assert all(words in e["message"] and e["kind"] == "input" for e in errors), errors


def test_ep_applies_the_models_own_plan_and_load_verify_and_step_hold(meshes: dict) -> None:
    # transformers' grouped_gemm / ep_dispatch_experts on dp_shard=2, ep=2: experts Shard(0)
    # over ep then FSDP2 over dp_shard; the rest FSDP2 over dp_shard and ep flattened.
    for case in ("ep-moe", "ep-moe-builder"):
        done = _audit(meshes, case)
        report = done["report"]
        assert done["exit_codes"] == [0] * 4, (case, report["findings"], report["errors"])
        assert report["verdict"] == "consistent", case
    report = _audit(meshes, "ep-moe")["report"]
    # The sorted loader cut each expert shard (FSDP2 over EP's Shard(0)); verify checked each.
    assert report["load"]["outcome"] == "loaded", report["load"]
    assert report["load"]["method"] == "bucketed", report["load"]
    assert report["verify"]["passed"] is True, report["verify"]
    assert "step" in report["timings"]  # --step ran on the expert-parallel model
    experts = [f"model.layers.{i}.mlp.experts" for i in range(2)]
    assert report["wrap"]["wrapped"] == [*experts, "model.layers.1", "model.layers.0", "<root>"]


def test_ep_slots_that_hold_the_same_experts_are_an_expert_finding(meshes: dict) -> None:
    # Its clean twin is "ep-moe-builder": the same builder with four distinct experts.
    done = _audit(meshes, "ep-moe-collapsed")
    assert done["exit_codes"] == [1] * 4
    [finding] = done["report"]["findings"]
    assert (finding["kind"], finding["ranks"], finding["reference_rank"]) == ("expert", [1, 3], 0)
    assert finding["tensors"][:2] == [
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.0.mlp.experts.down_proj",
    ]
    # Slots from the ep dim (ranks 0,2 are EP rank 0); each dp_shard place pairs across slots.
    assert finding["details"]["slots"] == [[0, 2], [1, 3]]
    assert finding["details"]["collapsed"] == [[0, 1], [2, 3]]


def test_ep_all_to_alls_of_uneven_splits_agree_and_one_rank_leaving_them_is_named(
    meshes: dict,
) -> None:
    # Each rank's routing decides its split sizes: they differ across ranks, by design.
    assert meshes["ep-step"]["verdict"] == "consistent", meshes["ep-step"]["findings"]
    # Agreed within each all-to-all's own EP group (issue 31): rank 3 runs on until its own
    # step raises (its experts left undispatched); its EP peer, rank 2, is stopped before the
    # all-to-all rank 3 never joins. Ranks 0 and 1 (the other EP group) never wait for it.
    undispatched = meshes["ep-step-undispatched-on-rank-3"]
    [finding] = undispatched["findings"]
    assert (finding["kind"], finding["ranks"]) == ("step", [3])
    assert finding["details"]["group_ranks"] == [2, 3]
    issued = finding["details"]["ranks"]["rank 2"]
    assert (issued["op"], issued["group"], issued["numel"]) == ("all_to_all_single", "mesh_ep", -1)
    assert [e["rank"] for e in undispatched["errors"]] == [3]  # its own step's error
    assert finding["details"]["caught"].startswith("before the collective was issued")
    assert any("all-to-all" in c for c in finding["details"]["agreed_before"])
