"""The audit end to end, on real processes (CPU, gloo)."""

from __future__ import annotations

from pathlib import Path

from conftest import read_report, run_ranks


def test_hazard_with_different_hash_seeds_reports_buffer_order(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    result = run_ranks(["audit", "--model", "hazard", "--json", str(out)], seeds=[0, 1])
    assert result.codes == [1, 1], result.output(0) + result.output(1)
    report = read_report(out)
    assert report["schema"] == "fsdpcheck.report/2"
    assert report["verdict"] == "inconsistent"
    assert [g["ranks"] for g in report["groups"]] == [[0], [1]]
    [finding] = [f for f in report["findings"] if f["kind"] == "buffer-order"]
    assert finding["ranks"] == [1]
    assert finding["cause"] == "construction-time"
    first = finding["details"]["first_divergence"]
    assert first["index"] == 0
    # Under PYTHONHASHSEED=0 the set yields full_attention first, under 1 sliding_attention.
    assert first["reference"]["name"] == "model.rotary_emb.full_attention_inv_freq"
    assert first["reference"]["shape"] == [16]
    assert first["other"]["name"] == "model.rotary_emb.sliding_attention_inv_freq"
    assert first["other"]["shape"] == [8]
    assert "buffer-order" in result.ranks[0].stdout
    assert result.ranks[1].stdout == ""  # only rank 0 renders
    # What each loader would do with these ranks, then the sorted loader, proven.
    loaders = {p["name"]: p for p in report["loaders"]}
    assert loaders["named-buffers-order"]["verdict"] == "hang"
    assert loaders["named-buffers-order"]["first_issue"]["reference_shape"] == [16]
    assert loaders["named-buffers-order"]["first_issue"]["other_shape"] == [8]
    assert loaders["state-dict-order"]["verdict"] == "ok"  # non-persistent: not in state_dict
    assert loaders["sorted-names"]["verdict"] == "ok"
    assert report["load"]["outcome"] == "loaded"
    # The state dict moved point to point, rank 1 receiving only its own shards.
    assert report["load"]["method"] == "bucketed" and report["load"]["fallback_reason"] is None
    assert report["load"]["state_messages"] >= 1 and report["load"]["state_bytes"] > 0
    assert report["verify"]["passed"] is True
    assert report["verify"]["checked"] == 11 + 2  # parameters + buffers
    assert "named-buffers-order → hang" in result.ranks[0].stdout
    assert "sorted loader verified on 2 ranks" in result.ranks[0].stdout


def test_vary_hash_seed_turns_hazard_into_a_divergence(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    result = run_ranks(
        ["audit", "--model", "hazard", "--vary-hash-seed", "--json", str(out)], seeds=[7, 7]
    )
    assert result.codes == [1, 1], result.output(0)
    report = read_report(out)
    assert [env["hash_seed"] for env in report["environment"]] == ["0", "1"]
    assert [f["kind"] for f in report["findings"]] == ["buffer-order"]


def test_single_process_without_launcher(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    result = run_ranks(["audit", "--model", "hazard", "--json", str(out)], nprocs=1)
    assert result.codes == [0], result.output(0)
    assert read_report(out)["world_size"] == 1


def test_check_model_from_a_training_script(tmp_path: Path) -> None:
    from conftest import REPO

    from fsdpcheck.children.launch import launch

    out = tmp_path / "report.json"
    result = launch(
        ["tests/workers/check_model_worker.py", str(out)],
        2,
        cwd=str(REPO),
        timeout=120,
        rank_env=lambda r: {"PYTHONHASHSEED": str(r)},
    )
    assert result.codes == [1, 1], result.output(0) + result.output(1)
    report = read_report(out)
    assert [f["kind"] for f in report["findings"]] == ["buffer-order"]
    assert report["findings"][0]["snapshot"] == "post-wrap"
    loaders = {p["name"]: p["verdict"] for p in report["loaders"]}
    assert loaders["named-buffers-order"] == "hang"


def test_check_model_names_a_peer_that_died(tmp_path: Path) -> None:
    # A training script's rank dies during the check: the others are not left waiting, and
    # rank 0's report names the rank and where it stopped.
    from conftest import REPO

    from fsdpcheck.children.launch import launch
    from fsdpcheck.faults import FAULT_ENV

    out = tmp_path / "report.json"
    result = launch(
        ["tests/workers/check_model_worker.py", str(out), "20"],
        2,
        cwd=str(REPO),
        timeout=120,
        env={FAULT_ENV: "1:gather:kill"},
    )
    assert result.codes == [3, -9], result.output(0) + result.output(1)
    report = read_report(out)
    assert report["verdict"] == "error" and report["exit_code"] == 3
    assert report["errors"][0]["rank"] == 1 and "gather" in report["errors"][0]["message"]
