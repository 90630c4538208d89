"""The collective comparison on synthetic Flight Recorder traces (pure), and the dump reader's
refusals (files in tmp_path)."""

from __future__ import annotations

import json
import pickle
from dataclasses import replace
from pathlib import Path

import pytest
from synthetic import FULL, SLIDING, state_record, tensor

from fsdpcheck.checks.collectives import (
    Collective,
    RankTrace,
    collective_findings,
    divergences,
)
from fsdpcheck.errors import InputError
from fsdpcheck.offline.explain import explain
from fsdpcheck.offline.traces import read_traces
from fsdpcheck.records import FsdpGroupRecord, FsdpPlanRecord


def op(seq, name="broadcast", size=(16,), dtype="float32", group="0", desc="default_pg"):
    return Collective(group, seq, name, (tuple(size),), (dtype,), (tuple(size),), desc)


def trace(rank, *collectives, truncated=False):
    return RankTrace(rank, tuple(collectives), truncated=truncated)


def buffers_record(rank, *order):
    """A rank whose named_buffers() are ``order`` ((name, numel) pairs)."""
    return state_record(rank, pre=([tensor(n, (k,), persistent=False) for n, k in order], []))


HAZARD_0 = ((FULL, 16), (SLIDING, 8))  # PYTHONHASHSEED=0
HAZARD_1 = ((SLIDING, 8), (FULL, 16))  # PYTHONHASHSEED=1


def test_same_collectives_agree():
    traces = {r: trace(r, op(1, "all_reduce", (4,)), op(2), op(3, size=(8,))) for r in (0, 1)}
    assert divergences(traces) == []
    assert collective_findings(traces) == []


def test_per_buffer_broadcasts_in_each_ranks_order_are_named():
    traces = {
        0: trace(0, op(1, "all_reduce", (4,)), op(2, size=(16,)), op(3, size=(8,))),
        1: trace(1, op(1, "all_reduce", (4,)), op(2, size=(8,)), op(3, size=(16,))),
    }
    records = {0: buffers_record(0, *HAZARD_0), 1: buffers_record(1, *HAZARD_1)}
    (finding,) = collective_findings(traces, records)
    assert finding.kind == "collective" and finding.snapshot == "trace"
    assert (finding.ranks, finding.reference_rank) == ((1,), 0)
    assert finding.cause == "construction-time"
    assert finding.details["reason"] == "size" and finding.details["seq"] == 2
    assert finding.summary.startswith(
        f"rank 1 broadcast `{SLIDING}` (8,) float32 while rank 0 broadcast `{FULL}` (16,) float32"
    )
    assert finding.tensors == (FULL, SLIDING)  # by rank


def test_one_fingerprint_names_the_other_rank_by_size_alone():
    traces = {
        0: trace(0, op(1, size=(16,)), op(2, size=(8,))),
        1: trace(1, op(1, size=(8,)), op(2, size=(16,))),
    }
    (finding,) = collective_findings(traces, {0: buffers_record(0, *HAZARD_0)})
    assert finding.details["issued"]["1"]["tensors"] == [SLIDING]
    assert finding.details["issued"]["1"]["named_by"] == "size"
    assert finding.details["issued"]["0"]["named_by"] == "order"


def test_an_extra_collective_on_one_rank_is_missing_on_the_other():
    common = (op(1, "all_reduce", (4,)), op(2))
    for extra in (0, 1):
        traces = {r: trace(r, *common) for r in (0, 1)}
        traces[extra] = trace(extra, *common, op(3, "all_reduce", (1,)))
        (d,) = divergences(traces)
        assert (d.seq, d.reason) == (3, "missing")
        assert d.issued[1 - extra] is None and d.last[1 - extra].seq == 2
        (finding,) = collective_findings(traces)
        assert finding.ranks == (1,) and finding.cause == "divergent"
        assert f"rank {extra} issued all_reduce (1,) float32" in finding.summary
        assert f"which rank {1 - extra} never issued" in finding.summary


def test_op_and_dtype_differences():
    traces = {0: trace(0, op(1, "all_gather")), 1: trace(1, op(1, "reduce_scatter"))}
    assert [d.reason for d in divergences(traces)] == ["op"]
    traces = {0: trace(0, op(1)), 1: trace(1, op(1, dtype="bfloat16"))}
    assert [d.reason for d in divergences(traces)] == ["dtype"]


def test_each_process_group_reports_its_own_first_divergence():
    sub = {"group": "1", "desc": "undefined"}
    traces = {
        0: trace(0, op(1), op(1, "all_gather", (4,), **sub), op(2, "all_gather", (4,), **sub)),
        1: trace(1, op(1), op(1, "all_gather", (4,), **sub), op(2, "all_gather", (6,), **sub)),
    }
    (d,) = divergences(traces)
    assert (d.group, d.seq, d.reason) == ("1", 2, "size")
    assert "as collective #2 of process group 1:" in collective_findings(traces)[0].summary


def test_a_wrapped_buffer_is_compared_from_what_every_rank_holds():
    # Rank 1's buffer dropped seqs 1-2; rank 0 still has seq 1 with another size: not compared.
    traces = {
        0: trace(0, op(1, size=(99,)), op(2), op(3)),
        1: trace(1, op(3), truncated=True),
    }
    assert divergences(traces) == []


def test_a_same_size_swap_shows_only_with_both_fingerprints():
    traces = {r: trace(r, op(1, size=(8,)), op(2, size=(8,))) for r in (0, 1)}
    assert collective_findings(traces) == []
    swapped = {
        0: buffers_record(0, (FULL, 8), (SLIDING, 8)),
        1: buffers_record(1, (SLIDING, 8), (FULL, 8)),
    }
    (finding,) = collective_findings(traces, swapped)
    assert finding.details["reason"] == "same-size-pairing" and finding.ranks == (1,)
    assert f"rank 1 broadcast `{SLIDING}` (8,) float32 while rank 0 broadcast `{FULL}`" in (
        finding.summary
    )
    same = {0: swapped[0], 1: buffers_record(1, (FULL, 8), (SLIDING, 8))}
    assert collective_findings(traces, same) == []


def test_an_fsdp_all_gather_is_named_by_its_groups_padded_shards():
    params = [tensor("layers.0.w", (5, 4)), tensor("layers.1.w", (3, 2)), tensor("norm", (3,))]
    plan = FsdpPlanRecord(
        (
            FsdpGroupRecord(("layers.0",), ("layers.0.w",)),
            FsdpGroupRecord(("layers.1",), ("layers.1.w",)),
            FsdpGroupRecord(("",), ("norm",)),
        )
    )
    record = replace(state_record(0, post=([], params)), fsdp_plan=plan)
    # Over 2 ranks: layers.0 sends ceil(5/2)*4 = 12 elements, layers.1 ceil(3/2)*2 = 4.
    traces = {
        0: trace(0, op(1, "all_gather", (12,))),
        1: trace(1, op(1, "all_gather", (4,))),
    }
    (finding,) = collective_findings(traces, {0: record, 1: replace(record, env=record.env)})
    assert "rank 1 issued all_gather FSDP group `layers.1` (4,)" in finding.summary
    assert "rank 0 issued all_gather FSDP group `layers.0` (12,)" in finding.summary


# ---------------------------------------------------------------- reading dumps


def entry(seq, size=16, record_id=None, **extra):
    return {
        "record_id": seq - 1 if record_id is None else record_id,
        "collective_seq_id": seq,
        "process_group": ["0", "default_pg"],
        "profiling_name": "gloo:broadcast",
        "input_sizes": [[size]],
        "input_dtypes": ["Float"],
        "output_sizes": [[size]],
        "is_p2p": False,
        **extra,
    }


def write_dump(path: Path, entries: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"version": "2.10", "pg_config": {}, "entries": entries}))
    return path


def test_reader_takes_ranks_from_file_names_and_skips_foreign_files(tmp_path: Path):
    write_dump(tmp_path / "trace_rank_0.json", [entry(1, 16)])
    write_dump(tmp_path / "trace_rank_1.json", [entry(1, 8)])
    (tmp_path / "report.json").write_text(json.dumps({"schema": "fsdpcheck.report/2"}))
    (tmp_path / ".rank2.json.tmp").write_text("half")
    inputs = read_traces([tmp_path])
    assert [f.trace.rank for f in inputs.files] == [0, 1]
    assert inputs.files[0].trace.collectives[0].input_dtypes == ("float32",)
    assert [s.split(":")[0] for s in inputs.skipped] == ["report.json"]
    report = explain([tmp_path])
    assert report.exit_code == 1 and report.findings[0].details["reason"] == "size"


def test_reader_refuses_pickle_unless_allowed_and_then_only_plain_values(tmp_path: Path):
    dump = {"version": "2.10", "pg_config": {}, "entries": [entry(1)]}
    for rank in (0, 1):
        (tmp_path / f"nccl_trace_rank_{rank}").write_bytes(pickle.dumps(dump))
    with pytest.raises(InputError, match="--allow-pickle"):
        read_traces([tmp_path])
    assert len(read_traces([tmp_path], allow_pickle=True).files) == 2
    (tmp_path / "nccl_trace_rank_1").write_bytes(pickle.dumps({"entries": Path("x")}))
    with pytest.raises(InputError, match="names pathlib"):
        read_traces([tmp_path], allow_pickle=True)


@pytest.mark.parametrize(
    ("files", "phrase"),
    [
        ({"rank0.json": [entry(1)]}, "only one dump"),
        ({"rank0.json": [entry(1)], "a/rank0.json": [entry(1)]}, "both end in rank number 0"),
        ({"rank0.json": [entry(1)], "rank1.json": [{"record_id": 0}]}, "malformed"),
        ({"rank0.json": [entry(1)], "rankless.json": [entry(1)]}, "cannot tell which rank"),
    ],
)
def test_reader_bad_input(tmp_path: Path, files: dict, phrase: str):
    for name, entries in files.items():
        write_dump(tmp_path / name, entries)
    paths = sorted({tmp_path / Path(n).parts[0] if "/" in n else tmp_path / n for n in files})
    with pytest.raises(InputError, match=phrase):
        read_traces(paths)


def test_ring_buffer_wrap_is_detected(tmp_path: Path):
    write_dump(tmp_path / "rank0.json", [entry(5, record_id=9)])
    write_dump(tmp_path / "rank1.json", [entry(1), entry(5)])
    report = explain([tmp_path])
    assert report.exit_code == 0
    assert any("buffer wrapped on rank 0" in w for w in report.warnings)
