"""``save_fingerprint`` inside a real 2-rank job: no collective, then ``diff`` of the files."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import QUIET_ENV, REPO

from fsdpcheck.children.launch import launch
from fsdpcheck.offline.diff import diff_fingerprints


@pytest.mark.parametrize("seeds, code", [((0, 1), 1), ((1, 1), 0)])
def test_save_fingerprint_on_real_ranks_without_a_collective(tmp_path: Path, seeds, code) -> None:
    """Rank 0 saves only after rank 1's file exists: were saving a collective, rank 1 would
    wait for rank 0 forever and the launch would time out."""
    result = launch(
        [str(REPO / "tests" / "workers" / "save_fingerprint_worker.py"), str(tmp_path)],
        2,
        env={**QUIET_ENV, "OMP_NUM_THREADS": "1"},
        rank_env=lambda r: {"PYTHONHASHSEED": str(seeds[r])},
        timeout=120,
        cwd=str(REPO),
    )
    assert result.codes == [0, 0], result.output(0) + result.output(1)
    post = diff_fingerprints([tmp_path / "post"])
    pre = diff_fingerprints([tmp_path / "pre"])
    assert (pre.exit_code, post.exit_code) == (code, code)
    assert post.model.architecture == "HazardForCausalLM"
    if code:
        assert (pre.findings[0].kind, pre.findings[0].cause) == (
            "buffer-order",
            "construction-time",
        )
        # Saved after wrapping only: no pre-wrap print to tell construction from wrapping.
        assert (post.findings[0].kind, post.findings[0].cause) == ("buffer-order", "unknown")
        assert post.findings[0].snapshot == "post-wrap"
