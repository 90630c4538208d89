"""``check_model(source=...)`` on real ranks: a training script's own loader, wrong the same way
on every rank (so the ranks agree with each other), is found against the checkpoint on disk, and
said what it looks like; each clean twin passes, from each checkpoint format. One launch."""

from __future__ import annotations

import pytest
from conftest import run_worker_cases

FIRST = ("layers.0.q_proj.weight", "layers.0.k_proj.weight")
CASES = {
    "safetensors-clean": ["--format", "safetensors"],
    "index-clean": ["--format", "index"],
    "dcp-clean": ["--format", "dcp"],
    "fused-clean": ["--format", "safetensors", "--fused"],
    "permute-unchecked": ["--format", "safetensors", "--fault", "permute-qk", "--no-source"],
    "permute": ["--format", "safetensors", "--fault", "permute-qk"],
    "dcp-permute": ["--format", "dcp", "--fault", "permute-qk"],
    "shard-dim": ["--format", "safetensors", "--fault", "shard-dim"],
    "transpose": ["--format", "index", "--fault", "transpose"],
    "cast": ["--format", "safetensors", "--fault", "cast"],
    "swap": ["--format", "dcp", "--fault", "swap"],
    "fused-permute": ["--format", "safetensors", "--fused", "--fault", "fused-permute"],
    "tp-clean": ["--format", "safetensors", "--tp"],
    "tp-dcp-clean": ["--format", "dcp", "--tp"],
    "tp-transpose": ["--format", "index", "--tp", "--fault", "transpose"],
    "missing-on-1": ["--format", "safetensors", "--missing-on-rank", "1"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("source")
    return {
        case: (run, root / case)
        for case, (run, _) in run_worker_cases("source_worker.py", root, CASES, timeout=240).items()
    }


def _report(runs: dict, case: str) -> tuple[list[int], dict]:
    import json

    run, folder = runs[case]
    return run.codes, json.loads((folder / "report.json").read_text())


def _found(report: dict) -> dict[str, dict]:
    """The source findings by tensor."""
    return {f["tensors"][0]: f for f in report["findings"] if f["kind"] == "source"}


@pytest.mark.parametrize(
    "case",
    ["safetensors-clean", "index-clean", "dcp-clean", "fused-clean", "tp-clean", "tp-dcp-clean"],
)
def test_a_clean_load_passes_against_each_format(runs: dict, case: str) -> None:
    codes, report = _report(runs, case)
    assert codes == [0, 0], report["findings"]
    assert report["findings"] == []
    checked = report["source_check"]
    assert checked["ran"] and checked["passed"] and checked["checked"] >= 12


def test_qk_rows_permuted_on_every_rank_are_found_only_against_the_source(runs: dict) -> None:
    codes, unchecked = _report(runs, "permute-unchecked")
    assert codes == [0, 0] and unchecked["findings"] == []  # the ranks agree with each other
    for case in ("permute", "dcp-permute"):
        codes, report = _report(runs, case)
        assert codes == [1, 1]
        found = _found(report)
        assert set(found) == {f"layers.{i}.{p}_proj.weight" for i in (0, 1) for p in "qk"}
        finding = found[FIRST[0]]
        assert finding["ranks"] == [0, 1]
        assert finding["details"]["looks_like"] == "permuted-rows"
        per_rank = {r["rank"]: r for r in finding["details"]["per_rank"]}
        assert per_rank[0]["slice"] == "[0:4, 0:8]" and per_rank[1]["slice"] == "[4:8, 0:8]"
        first = per_rank[1]["first"]
        assert first["full_index"][0] >= 4 and first["model"] != first["checkpoint"]


def test_the_wrong_shard_dim_and_a_transpose_are_named(runs: dict) -> None:
    for case, look in (("shard-dim", "shard-dim"), ("transpose", "transposed")):
        codes, report = _report(runs, case)
        assert codes == [1, 1]
        found = _found(report)
        assert set(found) == {"layers.0.o_proj.weight", "layers.1.o_proj.weight"}, case
        assert {f["details"]["looks_like"] for f in found.values()} == {look}
        assert all(f["ranks"] == [0, 1] for f in found.values())


def test_a_transpose_under_tensor_parallelism_names_each_ranks_column_slice(runs: dict) -> None:
    codes, report = _report(runs, "tp-transpose")
    assert codes == [1, 1]
    found = _found(report)
    assert set(found) == {"layers.0.o_proj.weight", "layers.1.o_proj.weight"}
    finding = found["layers.0.o_proj.weight"]
    assert finding["details"]["looks_like"] == "transposed"
    per_rank = {r["rank"]: r for r in finding["details"]["per_rank"]}
    assert (per_rank[0]["slice"], per_rank[1]["slice"]) == ("[0:8, 0:4]", "[0:8, 4:8]")
    assert per_rank[1]["placements"] == ["S(1)"]


def test_a_cast_on_load_names_both_dtypes(runs: dict) -> None:
    codes, report = _report(runs, "cast")
    assert codes == [1, 1]
    found = _found(report)
    assert "layers.0.scale" in found and FIRST[0] in found  # buffers too
    uneven = {r["rank"]: r["slice"] for r in found["odd.weight"]["details"]["per_rank"]}
    assert uneven == {0: "[0:3, 0:8]", 1: "[3:5, 0:8]"}  # 5 rows over 2 ranks
    for finding in found.values():
        assert finding["details"]["looks_like"] == "cast"
        rank = finding["details"]["per_rank"][0]
        assert (rank["checkpoint_dtype"], rank["model_dtype"]) == ("bfloat16", "float32")


def test_another_entrys_bytes_and_a_fused_weight_through_its_hooks(runs: dict) -> None:
    codes, report = _report(runs, "swap")
    assert codes == [1, 1]
    found = _found(report)
    assert set(found) == {FIRST[0]}
    assert found[FIRST[0]]["details"]["looks_like"] == "other-tensor"
    assert FIRST[1] in found[FIRST[0]]["summary"]
    codes, report = _report(runs, "fused-permute")
    assert codes == [1, 1]
    found = _found(report)
    assert set(found) == {"layers.0.qkv.wqkv.weight", "layers.1.qkv.wqkv.weight"}
    assert {f["details"]["looks_like"] for f in found.values()} == {"permuted-rows"}
    per_rank = {r["rank"]: r for r in found["layers.0.qkv.wqkv.weight"]["details"]["per_rank"]}
    assert per_rank[1]["slice"] == "[32:64, 0:32]"  # its rows of the fused tensor


def test_a_rank_that_cannot_read_the_source_says_so_and_nobody_waits(runs: dict) -> None:
    codes, report = _report(runs, "missing-on-1")
    assert codes == [1, 1]
    (finding,) = report["findings"]
    assert finding["kind"] == "source" and finding["ranks"] == [1]
    assert finding["details"]["looks_like"] == "unreadable"
    assert "could not check against the checkpoint" in finding["summary"]
    assert "missing.safetensors" in finding["summary"]
    assert report["source_check"]["checked"] >= 12  # rank 0 checked its own
