"""No false alarms across the architectures transformers ships (issue 19): a default 2-rank audit
of a tiny config of each (dense, mixture of experts, latent attention, sliding window, linear
attention, state-space hybrids), and of fsdpcheck's own tiny presets, is ``consistent``, exit 0
on both ranks, with the load verified, though each rank has its own hash seed. One launched job
audits them all in turn (tests/workers/architectures_worker.py)."""

from __future__ import annotations

from pathlib import Path

import transformers
from conftest import QUIET_ENV, REPO, read_report

from fsdpcheck.children.launch import launch

WORKER = "tests/workers/architectures_worker.py"
# The worker's list was written against this transformers, which ships every class it names;
# an older one may lack some, and the worker names each it skipped and why.
WRITTEN_AGAINST = (5, 24)
AT_LEAST = 20


def _version() -> tuple[int, int]:
    major, minor = transformers.__version__.split(".")[:2]
    return int(major), int(minor)


def test_default_audit_of_every_tiny_architecture_is_consistent(tmp_path: Path) -> None:
    out = tmp_path / "architectures.json"
    result = launch(
        [WORKER, "--out", str(out)],
        2,
        env={**QUIET_ENV, "OMP_NUM_THREADS": "1"},
        rank_env=lambda r: {"PYTHONHASHSEED": str(r)},  # whatever the seeds
        cwd=str(REPO),
        timeout=300,
    )
    assert out.is_file(), result.output(0) + result.output(1)
    sweep = read_report(out)
    ran, skipped = sweep["ran"], sweep["skipped"]
    if _version() >= WRITTEN_AGAINST:
        assert skipped == {}
    assert len(ran) >= AT_LEAST, f"only {sorted(ran)} ran; skipped: {skipped}"

    alarms = {
        name: (
            entry.get("verdict"),
            entry["exit_codes"],
            entry.get("findings"),
            entry.get("errors"),
        )
        for name, entry in ran.items()
        if entry.get("verdict") != "consistent" or entry["exit_codes"] != [0, 0]
    }
    assert alarms == {}
    # Each audit really built its model, loaded it from rank 0 and verified every rank.
    assert all(entry["verified"] is True for entry in ran.values())
    assert all(
        entry["architecture"].endswith(("ForCausalLM", "LMHeadModel")) for entry in ran.values()
    )
    llama = ran["tiny-llama"]  # the preset, by name: its decoder layers and the root wrapped
    assert llama["architecture"] == "LlamaForCausalLM"
    assert llama["wrap"]["found"] == ["LlamaDecoderLayer"]
    assert llama["wrap"]["wrapped"][-1] == "<root>"
    assert llama["probe"]["verdict"] == "consistent"  # --probe 2: its order is stable
    assert result.codes == [0, 0]
