"""``audit --source`` under torchrun: every rank's shards after the load, against their slices of
the checkpoint the model came from (the clean twin of tests/ranks/test_source.py's faults)."""

from __future__ import annotations

from pathlib import Path

from conftest import QUIET_ENV, read_report, run_plain, torchrun_fsdpcheck


def test_audit_model_dir_with_its_own_source_is_clean_under_torchrun(
    tmp_path: Path, llama_checkpoint: Path
) -> None:
    out = tmp_path / "report.json"
    args = ["audit", "--model", str(llama_checkpoint), "--init", "all"]
    args += ["--source", str(llama_checkpoint), "--timeout", "120", "--json", str(out)]
    result = run_plain(torchrun_fsdpcheck(2, *args), env=QUIET_ENV, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    report = read_report(out)
    assert (report["verdict"], report["exit_code"]) == ("consistent", 0)
    checked = report["source_check"]
    assert checked["ran"] and checked["passed"] and checked["mismatches"] == []
    assert checked["checked"] > 10
    assert report["verify"]["passed"] is True  # rank 0's own full-state-dict path still runs
    assert "source" in report["timings"]
    assert "(--source): passed" in result.stdout
