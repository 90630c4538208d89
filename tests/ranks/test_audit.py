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


def test_hazard_with_equal_hash_seeds_is_consistent(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    result = run_ranks(["audit", "--model", "hazard", "--json", str(out)], seeds=[1, 1])
    assert result.codes == [0, 0], result.output(0)
    report = read_report(out)
    assert report["verdict"] == "consistent"
    assert report["findings"] == []
    assert len(report["groups"]) == 1 and report["groups"][0]["ranks"] == [0, 1]
    # Rank 1 built on meta: DCP alone would leave its RoPE buffers uninitialised ...
    loaders = {p["name"]: p["verdict"] for p in report["loaders"]}
    assert loaders["dcp-broadcast"] == "uninitialized"
    assert loaders["named-buffers-order"] == "ok"
    # ... the project's loader fills them, and the verification proves it.
    assert report["load"]["buffers_broadcast"] == 2
    assert report["verify"] == {"ran": True, "passed": True, "checked": 13, "mismatches": []}


def test_init_meta_audits_without_loading(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    result = run_ranks(["audit", "--model", "tiny-gemma3", "--init", "meta", "--json", str(out)])
    assert result.codes == [0, 0], result.output(0)
    report = read_report(out)
    assert report["load"]["outcome"] == "skipped" and report["verify"] is None


def test_vary_hash_seed_turns_hazard_into_a_divergence(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    result = run_ranks(
        ["audit", "--model", "hazard", "--vary-hash-seed", "--json", str(out)], seeds=[7, 7]
    )
    assert result.codes == [1, 1], result.output(0)
    report = read_report(out)
    assert [env["hash_seed"] for env in report["environment"]] == ["0", "1"]
    assert [f["kind"] for f in report["findings"]] == ["buffer-order"]


def test_local_safetensors_directory(tmp_path: Path, llama_checkpoint: Path) -> None:
    out = tmp_path / "report.json"
    result = run_ranks(["audit", "--model", str(llama_checkpoint), "--json", str(out)])
    assert result.codes == [0, 0], result.output(0)
    model = read_report(out)["model"]
    assert model["kind"] == "local"
    assert model["checkpoint"] is True
    assert model["path"] == str(llama_checkpoint)
    verify = read_report(out)["verify"]
    assert verify["passed"] is True and verify["checked"] > 10


def test_hub_id_from_local_cache(tmp_path: Path, hf_home: Path) -> None:
    out = tmp_path / "report.json"
    result = run_ranks(
        ["audit", "--model", "acme/tiny-llama", "--json", str(out)], env={"HF_HOME": str(hf_home)}
    )
    assert result.codes == [0, 0], result.output(0)
    model = read_report(out)["model"]
    assert model["kind"] == "hub"
    assert model["checkpoint"] is True
    assert "models--acme--tiny-llama" in model["path"]


def test_hub_id_missing_from_cache_is_bad_input(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    home = tmp_path / "empty-home"
    result = run_ranks(
        ["audit", "--model", "acme/absent-model", "--json", str(out)],
        env={"HF_HOME": str(home)},
        timeout=60,
    )
    assert result.codes == [2, 2], result.output(0)
    report = read_report(out)
    assert report["verdict"] == "error"
    assert {e["rank"] for e in report["errors"]} == {0, 1}
    message = report["errors"][0]["message"]
    assert "acme/absent-model" in message and str(home / "hub") in message


def test_missing_wrap_class_warns_and_falls_back(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    result = run_ranks(
        [
            "audit",
            "--model",
            "tiny-qwen3",
            "--wrap-class",
            "SiglipEncoderLayer",
            "--min-params",
            "10000",
            "--json",
            str(out),
        ]
    )
    assert result.codes == [0, 0], result.output(0)
    report = read_report(out)
    wrap = report["wrap"]
    assert wrap["missing"] == ["SiglipEncoderLayer"] and wrap["found"] == []
    assert wrap["fallback"] is True
    assert len(wrap["wrapped"]) > 1  # size-based targets, then the root
    assert any("SiglipEncoderLayer" in w for w in report["warnings"])
    assert "SiglipEncoderLayer" in result.ranks[0].stdout


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


def test_audit_probe_reports_latent_when_ranks_agree_today(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    result = run_ranks(
        ["audit", "--model", "hazard", "--probe", "2", "--json", str(out)], seeds=[1, 1]
    )
    assert result.codes == [1, 1], result.output(0)
    report = read_report(out)
    assert report["verdict"] == "latent" and report["exit_code"] == 1
    [finding] = report["findings"]
    assert finding["kind"] == "hash-seed" and finding["snapshot"] == "probe"
    assert finding["details"]["modules"] == ["model.rotary_emb"]
    assert set(finding["tensors"]) == {
        "model.rotary_emb.full_attention_inv_freq",
        "model.rotary_emb.sliding_attention_inv_freq",
    }
    assert report["verify"]["passed"] is True  # today's ranks still load fine
    assert "latent" in result.ranks[0].stdout


def test_text_only_builds_the_text_model_of_a_multimodal_config(
    tmp_path: Path, multimodal_config: Path
) -> None:
    out = tmp_path / "report.json"
    args = [
        "audit",
        "--model",
        str(multimodal_config),
        "--text-only",
        "--json",
        str(out),
        "--wrap-class",
        "SiglipEncoderLayer",
        "--wrap-class",
        "Gemma3DecoderLayer",
    ]
    result = run_ranks(args)
    assert result.codes == [0, 0], result.output(0)
    report = read_report(out)
    assert report["model"]["text_only"] is True
    assert report["model"]["architecture"] == "Gemma3ForCausalLM"
    # The vision layer class is a warning, not a crash; the text layers are still wrapped.
    assert report["wrap"]["missing"] == ["SiglipEncoderLayer"]
    assert report["wrap"]["fallback"] is False
    assert report["verify"]["passed"] is True


def test_sharded_checkpoint_every_rank_materialised_in_bfloat16(
    tmp_path: Path, llama_checkpoint: Path
) -> None:
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(llama_checkpoint))
    model.load_state_dict(load_file(str(llama_checkpoint / "model.safetensors")), strict=False)
    model.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()

    out = tmp_path / "report.json"
    args = [
        "audit",
        "--model",
        str(sharded),
        "--init",
        "all",
        "--dtype",
        "bfloat16",
        "--json",
        str(out),
    ]
    result = run_ranks(args)
    assert result.codes == [0, 0], result.output(0)
    report = read_report(out)
    assert report["model"]["checkpoint"] is True and report["model"]["dtype"] == "bfloat16"
    assert report["model"]["init"] == "all"
    assert report["verify"]["passed"] is True
