"""``run_audit`` called again and again in one process (issue 37): ``fsdpcheck run`` and Ray
actors do. Each call's model is freed before it returns (FSDP2 ties it into reference cycles
that only the cyclic collector frees) and its gloo side channel is destroyed, so a rank's RSS
and open descriptors stay flat over calls. A 120 MB Llama config on 2 ranks, 5 calls: before,
rank 0 grew 35 to 60 MiB and 5 descriptors a call."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import QUIET_ENV, REPO, launch

MIB = 2**20


def test_repeated_audits_in_one_process_stay_flat(tmp_path: Path) -> None:
    from transformers import LlamaConfig

    model = tmp_path / "llama"
    LlamaConfig(
        vocab_size=16000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
    ).save_pretrained(model)  # no weights: rank 0 fills, rank 1 builds on meta
    out = tmp_path / "calls.json"
    job = launch(
        [str(REPO / "tests/workers/repeat_audit_worker.py"), "--out", str(out)]
        + ["--model", str(model)],
        2,
        env={**QUIET_ENV, "OMP_NUM_THREADS": "1"},
        timeout=400,
        cwd=str(REPO),
    )
    assert job.codes == [0, 0] and out.is_file(), job.output(0)[-3000:] + job.output(1)[-3000:]
    for rank, calls in enumerate(json.loads(out.read_text())):
        assert [c["exit_code"] for c in calls] == [0] * 5, calls
        if rank == 0:  # the report is rank 0's
            assert [c["verdict"] for c in calls] == ["consistent"] * 5, calls
        # The first call imports and warms caches; from the second on nothing accumulates.
        rss = [c["rss"] for c in calls]
        assert rss[-1] - rss[1] < 16 * MIB, (rank, [round(r / MIB, 1) for r in rss])
        assert len({c["fds"] for c in calls[1:]}) == 1, (rank, [c["fds"] for c in calls])
