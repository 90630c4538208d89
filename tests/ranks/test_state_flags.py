"""The state checks on real ranks: a training script's FSDP2 setup that differs on one rank
(a frozen parameter, another mixed-precision policy, a stale config) and the clean twins, and
the audit reading each rank's own Hugging Face cache."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from conftest import QUIET_ENV, REPO, read_report

from fsdpcheck.children.launch import launch
from fsdpcheck.records import Report, from_dict
from fsdpcheck.report import report_headline

WORKER = "tests/workers/state_flags_worker.py"


def _worker(tmp_path: Path, *args: str) -> tuple[list, dict]:
    out = tmp_path / "report.json"
    result = launch(
        [WORKER, "--out", str(out), *args],
        2,
        env={**QUIET_ENV, "OMP_NUM_THREADS": "1"},
        cwd=str(REPO),
        timeout=180,
    )
    assert out.is_file(), result.output(0) + result.output(1)
    return result.codes, read_report(out)


def _kinds(report: dict) -> list[str]:
    return [f["kind"] for f in report["findings"]]


def test_one_rank_froze_a_parameter_casts_to_bf16_and_read_another_config(
    tmp_path: Path,
) -> None:
    # Three independent faults on rank 1, one launch: each is named by its own kind.
    faults = ("--fault", "freeze", "--fault", "mixed-precision", "--fault", "config")
    codes, report = _worker(tmp_path, *faults)
    assert codes == [1, 1]
    # Another rope_theta also gives other inv_freq values: a value check may name those too.
    assert [k for k in _kinds(report) if k != "value"] == ["requires-grad", "wrap-plan", "config"]
    by_kind = {f["kind"]: f for f in report["findings"]}
    assert all(f["ranks"] == [1] for f in report["findings"])

    frozen = by_kind["requires-grad"]
    assert frozen["tensors"] == ["model.layers.0.mlp.up_proj.weight"]
    assert "trainable on rank 0 but frozen on rank 1" in frozen["summary"]

    policies = by_kind["wrap-plan"]["details"]["policies"]
    assert {(p["field"], p["reference"], p["other"]) for p in policies} == {
        ("param_dtype", None, "bfloat16")
    }
    assert {p["group"] for p in policies} == {"<root>", "model.layers.0", "model.layers.1"}

    config = by_kind["config"]
    assert config["details"]["differences"] == [
        {"path": "rope_parameters.rope_theta", "reference": 10000.0, "other": 500000.0}
    ]
    assert "rope_parameters.rope_theta: 10000.0 on rank 0, 500000.0 on rank 1" in config["summary"]


def test_clean_twin_with_mixed_precision_and_cpu_offload_everywhere(tmp_path: Path) -> None:
    codes, report = _worker(tmp_path, "--bf16-everywhere", "--cpu-offload")
    assert codes == [0, 0], report["findings"]
    assert report["verdict"] == "consistent" and len(report["groups"]) == 1


def _per_rank_homes(
    tmp_path: Path, hf_home: Path, rope_theta: float | None, **stale: object
) -> list[Path]:
    """Two nodes' caches of acme/tiny-llama; node 1's config.json gets ``rope_theta`` and the
    ``stale`` top-level keys."""
    homes = []
    for rank in range(2):
        home = tmp_path / f"node{rank}"
        shutil.copytree(hf_home, home, symlinks=True)
        homes.append(home)
    if rope_theta is not None or stale:
        config = next((homes[1] / "hub").glob("models--acme--tiny-llama/snapshots/*/config.json"))
        data = json.loads(config.read_text())
        if rope_theta is not None:
            data["rope_parameters"]["rope_theta"] = rope_theta
        config.write_text(json.dumps({**data, **stale}))
    return homes


def _audit_per_node(
    tmp_path: Path, homes: list[Path], *args: str, init: str = "all", timeout: float = 180
):
    out = tmp_path / "report.json"
    result = launch(
        ["-m", "fsdpcheck", "audit", "--model", "acme/tiny-llama", "--init", init]
        + ["--json", str(out), *args],
        2,
        env={**QUIET_ENV, "OMP_NUM_THREADS": "1"},
        rank_env=lambda r: {"HF_HOME": str(homes[r])},
        cwd=str(REPO),
        timeout=timeout,
    )
    assert out.is_file(), result.output(0) + result.output(1)
    return result.codes, read_report(out)


def test_audit_names_the_stale_config_key_on_one_node(tmp_path: Path, hf_home: Path) -> None:
    homes = _per_rank_homes(tmp_path, hf_home, rope_theta=500000.0)
    codes, report = _audit_per_node(tmp_path, homes)
    assert codes == [1, 1]
    config = [f for f in report["findings"] if f["kind"] == "config"]
    assert len(config) == 1 and config[0]["ranks"] == [1]
    assert (
        "rope_parameters.rope_theta: 10000.0 on rank 0, 500000.0 on rank 1"
        in (config[0]["summary"])
    )


def test_reproduce_builds_each_rank_from_its_own_node(tmp_path: Path, hf_home: Path) -> None:
    # A stale node: rank 1's config.json has another intermediate_size, so its MLP weights have
    # other shapes. Each loader job's rank 1 must build what audit rank 1 built (its own
    # directory and config), so that what is observed is what was predicted (issue 30: with
    # rank 0's config, accelerate's state-dict-order was observed as silent-corruption where
    # the ranks' real shapes make it hang). Two loaders, as --loader chooses (every one runs
    # under torchrun in tests/cli/test_torchrun.py).
    homes = _per_rank_homes(tmp_path, hf_home, rope_theta=None, intermediate_size=96)
    chosen = ["sorted-names", "state-dict-order"]
    args = ["--reproduce", "--timeout", "300", *(a for name in chosen for a in ("--loader", name))]
    codes, report = _audit_per_node(tmp_path, homes, *args, init="rank0", timeout=420)
    assert codes == [1, 1]
    config = next(f for f in report["findings"] if f["kind"] == "config")
    assert config["details"]["differences"][0]["path"] == "intermediate_size"
    rows = {row["name"]: row for row in report["loaders"]}
    assert rows["sorted-names"]["verdict"] == "refused"
    # Rank 1's buffers are the smaller: gloo aborts it (32768 vs 24576 bytes), NCCL blocks.
    assert rows["state-dict-order"]["verdict"] == "hang"
    assert rows["state-dict-order"]["backend"] == "gloo"
    assert rows["state-dict-order"]["on_nccl"] is None
    assert report["options"]["loaders"] == chosen
    for name, row in rows.items():
        if name not in chosen:  # predicted, not run
            assert row["observed"] is None and row["observed_detail"] is None, row
            continue
        assert row["observed"] is not None, row["observed_detail"]
        assert row["observed"] == (row["on_gloo"] or row["verdict"]), row
        assert [r["stands_for"] for r in row["observed_detail"]["ranks"]] == [0, 1]
    assert not [f for f in report["findings"] if f["kind"] == "prediction"]


def test_reproduce_a_stale_node_with_larger_buffers_predicts_gloo_and_nccl(
    tmp_path: Path, hf_home: Path
) -> None:
    # Rank 1's intermediate_size doubled (issue 37): every MLP broadcast lands in a larger buffer
    # there. gloo fills its front and both ranks finish (silent-corruption, observed for real);
    # NCCL would block on the count mismatch (hang), said beside it for a CPU audit of an NCCL job.
    homes = _per_rank_homes(tmp_path, hf_home, rope_theta=None, intermediate_size=256)
    args = ["--reproduce", "--timeout", "300", "--loader", "state-dict-order"]
    codes, report = _audit_per_node(tmp_path, homes, *args, init="rank0", timeout=420)
    assert codes == [1, 1]
    row = next(r for r in report["loaders"] if r["name"] == "state-dict-order")
    assert (row["backend"], row["verdict"], row["on_nccl"]) == ("gloo", "silent-corruption", "hang")
    assert "gloo fills its first bytes" in row["summary"]
    assert row["observed"] == "silent-corruption", row["observed_detail"]
    assert [r["exit"] for r in row["observed_detail"]["ranks"]] == ["exit 0", "exit 0"]
    assert not [f for f in report["findings"] if f["kind"] == "prediction"]
    headline = report_headline(from_dict(Report, report))
    assert "state-dict-order → silent-corruption on gloo (NCCL: hang)" in headline


def test_audit_per_node_caches_hsdp_cpu_offload_clean_twin(tmp_path: Path, hf_home: Path) -> None:
    # Each node reads the same model from its own path: not a config difference. HSDP on a
    # 1x2 mesh with CPU offload: every rank's plan agrees, offloaded parameters on CPU are
    # where they belong, and the loader and its verification run on them.
    homes = _per_rank_homes(tmp_path, hf_home, rope_theta=None)
    codes, report = _audit_per_node(tmp_path, homes, "--mesh", "1,2", "--cpu-offload")
    assert codes == [0, 0], report["findings"]
    assert report["verdict"] == "consistent" and len(report["groups"]) == 1
    assert report["options"]["cpu_offload"] is True and report["verify"]["passed"] is True
