"""The audit's inputs and options end to end (CPU, gloo): each case a real ``run_audit`` in one
2-rank job (tests/workers/audit_cases_worker.py), both ranks under PYTHONHASHSEED=1 and one
Hugging Face cache. The CLI's own parsing, exit codes and rendering are tested by the launches
in test_audit.py, tests/cli/test_torchrun.py and tests/cli/."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import hub_cache, run_audit_cases


@pytest.fixture(scope="module")
def audited(
    tmp_path_factory: pytest.TempPathFactory, llama_checkpoint: Path, multimodal_config: Path
) -> dict:
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    root = tmp_path_factory.mktemp("audit-inputs")
    home = hub_cache(root / "hf-home", llama_checkpoint)
    sharded = root / "sharded"
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(llama_checkpoint))
    model.load_state_dict(load_file(str(llama_checkpoint / "model.safetensors")), strict=False)
    model.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    cases = {
        "hazard-equal-seeds": {"model": "hazard"},
        "init-meta": {"model": "tiny-gemma3", "options": {"init": "meta"}},
        "local": {"model": str(llama_checkpoint)},
        "hub": {"model": "acme/tiny-llama"},
        "hub-missing": {"model": "acme/absent-model"},
        "missing-wrap-class": {
            "model": "tiny-qwen3",
            "options": {"wrap_classes": ["SiglipEncoderLayer"], "min_params": 10000},
        },
        "probe": {"model": "hazard", "options": {"probe": 2}},
        "text-only": {
            "model": str(multimodal_config),
            "options": {
                "text_only": True,
                "wrap_classes": ["SiglipEncoderLayer", "Gemma3DecoderLayer"],
            },
        },
        "sharded-bf16": {"model": str(sharded), "options": {"init": "all", "dtype": "bfloat16"}},
    }
    done = run_audit_cases(
        root, cases, rank_env=lambda r: {"PYTHONHASHSEED": "1", "HF_HOME": str(home)}
    )
    return {**done, "paths": {"home": home, "local": llama_checkpoint, "sharded": sharded}}


def _report(audited: dict, case: str, codes: list[int]) -> dict:
    done = audited[case]
    assert done["exit_codes"] == codes, done
    return done["report"]


def test_hazard_with_equal_hash_seeds_is_consistent(audited: dict) -> None:
    report = _report(audited, "hazard-equal-seeds", [0, 0])
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


def test_init_meta_audits_without_loading(audited: dict) -> None:
    report = _report(audited, "init-meta", [0, 0])
    assert report["load"]["outcome"] == "skipped" and report["verify"] is None


def test_local_safetensors_directory(audited: dict) -> None:
    report = _report(audited, "local", [0, 0])
    model = report["model"]
    assert model["kind"] == "local"
    assert model["checkpoint"] is True
    assert model["path"] == str(audited["paths"]["local"])
    assert report["verify"]["passed"] is True and report["verify"]["checked"] > 10


def test_hub_id_from_local_cache(audited: dict) -> None:
    model = _report(audited, "hub", [0, 0])["model"]
    assert model["kind"] == "hub"
    assert model["checkpoint"] is True
    assert "models--acme--tiny-llama" in model["path"]


def test_hub_id_missing_from_cache_is_bad_input(audited: dict) -> None:
    report = _report(audited, "hub-missing", [2, 2])
    assert report["verdict"] == "error"
    assert {e["rank"] for e in report["errors"]} == {0, 1}
    message = report["errors"][0]["message"]
    assert "acme/absent-model" in message and str(audited["paths"]["home"] / "hub") in message


def test_missing_wrap_class_warns_and_falls_back(audited: dict) -> None:
    report = _report(audited, "missing-wrap-class", [0, 0])
    wrap = report["wrap"]
    assert wrap["missing"] == ["SiglipEncoderLayer"] and wrap["found"] == []
    assert wrap["fallback"] is True
    assert len(wrap["wrapped"]) > 1  # size-based targets, then the root
    assert any("SiglipEncoderLayer" in w for w in report["warnings"])


def test_audit_probe_reports_latent_when_ranks_agree_today(audited: dict) -> None:
    report = _report(audited, "probe", [1, 1])
    assert report["verdict"] == "latent" and report["exit_code"] == 1
    [finding] = report["findings"]
    assert finding["kind"] == "hash-seed" and finding["snapshot"] == "probe"
    assert finding["details"]["modules"] == ["model.rotary_emb"]
    assert set(finding["tensors"]) == {
        "model.rotary_emb.full_attention_inv_freq",
        "model.rotary_emb.sliding_attention_inv_freq",
    }
    assert report["verify"]["passed"] is True  # today's ranks still load fine


def test_text_only_builds_the_text_model_of_a_multimodal_config(audited: dict) -> None:
    report = _report(audited, "text-only", [0, 0])
    assert report["model"]["text_only"] is True
    assert report["model"]["architecture"] == "Gemma3ForCausalLM"
    # The vision layer class is a warning, not a crash; the text layers are still wrapped.
    assert report["wrap"]["missing"] == ["SiglipEncoderLayer"]
    assert report["wrap"]["fallback"] is False
    assert report["verify"]["passed"] is True


def test_sharded_checkpoint_every_rank_materialised_in_bfloat16(audited: dict) -> None:
    report = _report(audited, "sharded-bf16", [0, 0])
    assert report["model"]["checkpoint"] is True and report["model"]["dtype"] == "bfloat16"
    assert report["model"]["path"] == str(audited["paths"]["sharded"])
    assert report["model"]["init"] == "all"
    assert report["verify"]["passed"] is True
