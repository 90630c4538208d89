"""Classifying what a real loader did, from its ranks' exits, stage marks and records (pure)."""

from __future__ import annotations

import json
from dataclasses import replace

from fsdpcheck.checks.observed import LOADING, Observation, RankRun, classify, with_observations
from fsdpcheck.records import LoaderPrediction, LoaderRecord, from_dict


def t(digest, kind="param", persistent=None, dtype="float32"):
    return {
        "kind": kind,
        "persistent": persistent,
        "dtype": dtype,
        "shape": [4],
        "placements": None,
        "digest": digest,
    }


def rank_run(rank, record=None, code=0, stage="done", sig=None, last=""):
    # As the parent reads a child's line back: JSON into the typed record.
    typed = from_dict(LoaderRecord, {"loader": "x", **record}) if record is not None else None
    return RankRun(rank, code, sig, stage, last, typed, hash_seed=rank)


def finished(rank, tensors, expected=None, reference=None, meta=False):
    record = {
        "rank": rank,
        "error": None,
        "tensors": tensors,
        "reference": reference or {},
        "meta_built": meta,
    }
    if expected is not None:
        record["expected"] = expected
    return rank_run(rank, record)


def error(rank, kind, message, stage=LOADING, code=3):
    record = {"rank": rank, "error": {"kind": kind, "stage": stage, "message": message}}
    return rank_run(rank, record, code=code)


W = "w.weight"
FULL, SLIDE = "rope.full", "rope.slide"
EXPECTED = {str(r): {W: {"float32": "w0"}} for r in (0, 1)}


def test_every_rank_holds_rank_0s_values_is_ok():
    runs = [
        finished(0, {W: t("w0"), FULL: t("f", "buffer", False)}, EXPECTED, {FULL: "f"}),
        finished(1, {W: t("w0"), FULL: t("f", "buffer", False)}, reference={FULL: "f"}),
    ]
    seen = classify("x", runs)
    assert (seen.verdict, seen.detail["differing"]) == ("ok", [])


def test_swapped_buffers_are_silent_corruption_naming_what_they_hold():
    buffers0 = {FULL: t("f", "buffer", False), SLIDE: t("s", "buffer", False)}
    buffers1 = {FULL: t("s", "buffer", False), SLIDE: t("f", "buffer", False)}
    buffers0[FULL]["values"], buffers0[SLIDE]["values"] = [1.0], [2.0]
    buffers1[FULL]["values"], buffers1[SLIDE]["values"] = [2.0], [1.0]
    refs = {FULL: "f", SLIDE: "s"}
    runs = [finished(0, buffers0, {}, refs), finished(1, buffers1, reference=refs, meta=True)]
    runs[1] = replace(runs[1], record=replace(runs[1].record, order=(SLIDE, FULL)))
    seen = classify("named-buffers-order", runs)
    assert seen.verdict == "silent-corruption"
    assert seen.detail["differing"][0]["state"] == f"holds {SLIDE}'s values"
    # Value by value: rank 0 as it was, rank 1 in its own order, each holding the other's.
    rank0, rank1 = seen.detail["buffers"]
    assert rank0["swapped"] == [] and {b["state"] for b in rank0["buffers"].values()} == {"ok"}
    assert rank1["order"] == [SLIDE, FULL]
    assert rank1["swapped"] == [{"buffer": SLIDE, "holds": FULL}, {"buffer": FULL, "holds": SLIDE}]
    slide = rank1["buffers"][SLIDE]
    assert (slide["values"], slide["expected_values"]) == ([1.0], [2.0])


def test_a_buffer_holding_nobodys_values_is_corrupted_in_the_value_detail():
    runs = [
        finished(0, {FULL: t("f", "buffer", False)}, {}, {FULL: "f"}),
        finished(1, {FULL: t("junk", "buffer", False)}, reference={FULL: "f"}),
    ]
    assert classify("ddp-sync", runs).detail["buffers"][1]["corrupted"] == [FULL]


def test_garbage_on_a_meta_built_rank_is_uninitialized():
    refs = {FULL: "f"}
    runs = [
        finished(0, {FULL: t("f", "buffer", False)}, {}, refs),
        finished(1, {FULL: t("junk", "buffer", False)}, reference=refs, meta=True),
    ]
    assert classify("dcp-broadcast", runs).verdict == "uninitialized"
    # The same bytes on a rank built for real came from the loader: that is corruption.
    runs[1] = finished(1, {FULL: t("junk", "buffer", False)}, reference=refs, meta=False)
    assert classify("ddp-sync", runs).verdict == "silent-corruption"


def test_a_parameter_that_is_not_its_expected_shard_is_silent_corruption():
    runs = [finished(0, {W: t("w0")}, EXPECTED), finished(1, {W: t("w1")})]
    seen = classify("state-dict-order", runs)
    assert seen.verdict == "silent-corruption"
    assert "differs from rank 0's source" in seen.detail["summary"]


def test_a_converted_dtype_matches_its_cast():
    expected = {str(r): {W: {"float32": "w0", "bfloat16": "w0-bf16"}} for r in (0, 1)}
    runs = [finished(0, {W: t("w0")}, expected), finished(1, {W: t("w0-bf16", dtype="bfloat16")})]
    assert classify("dcp-broadcast", runs).verdict == "ok"


def test_a_gloo_abort_inside_the_loader_is_a_hang_even_if_a_peer_refused():
    runs = [
        error(0, "refused", "RuntimeError: boom"),
        rank_run(1, None, code=-6, stage=LOADING, sig="SIGABRT", last="op.preamble.length"),
    ]
    seen = classify("named-buffers-order", runs)
    assert seen.verdict == "hang"
    assert "SIGABRT" in seen.detail["summary"]
    assert seen.detail["ranks"][1]["exit"] == "SIGABRT"
    assert seen.detail["ranks"][1]["hash_seed"] == 1
    assert "buffers" not in seen.detail  # nobody got through the loader


def test_a_clear_exception_beats_the_peers_broken_connection():
    runs = [
        error(0, "collective", "RuntimeError: Connection closed by peer", code=124),
        error(1, "refused", "RuntimeError: params[2] ... appears not to match sizes"),
    ]
    seen = classify("ddp-sync", runs)
    assert seen.verdict == "refused"
    assert seen.detail["summary"].startswith("rank 1 raised RuntimeError: params[2]")


def test_a_rank_killed_inside_the_loader_hangs_one_killed_before_it_says_nothing():
    inside = [finished(0, {}), rank_run(1, None, code=None, stage=LOADING)]
    assert classify("x", inside).verdict == "hang"
    slow = [finished(0, {}), rank_run(1, None, code=None, stage="build")]
    seen = classify("x", slow)
    assert seen.verdict is None
    assert "did not get through the loader" in seen.detail["summary"]
    bad_input = [error(0, "refused", "InputError: no such model", stage="build"), finished(1, {})]
    assert classify("x", bad_input).verdict is None


def test_a_rank_that_failed_before_its_loader_says_nothing_even_if_a_peer_waits_inside():
    runs = [
        error(0, "collective", "RuntimeError: Connection closed by peer", code=124),
        error(1, "refused", "InputError: rank 1: the checkpoint does not fit", stage="build"),
    ]
    seen = classify("ddp-sync", runs)
    assert seen.verdict is None
    assert seen.detail["summary"].startswith("rank 1 did not get through the loader (stage")
    assert "the checkpoint does not fit" in seen.detail["summary"]


def test_observations_fold_into_rows_and_disagreements_become_findings():
    rows = (
        LoaderPrediction("ddp-sync", "hang", "…", on_gloo="ok"),
        LoaderPrediction("dcp-broadcast", "ok", "…"),
        LoaderPrediction("sorted-names", "ok", "…"),
    )
    seen = {
        "ddp-sync": Observation("ddp-sync", "ok", {"summary": "fine"}),
        "dcp-broadcast": Observation("dcp-broadcast", "refused", {"summary": "rank 1 raised X"}),
    }
    out, findings = with_observations(rows, seen)
    assert [r.observed for r in out] == ["ok", "refused", None]
    assert out[2].observed_detail is None  # not run
    assert [f.details["loader"] for f in findings] == ["dcp-broadcast"]  # gloo said ok for DDP
    assert findings[0].kind == "prediction"
    assert "rank 1 raised X" in findings[0].summary


def test_a_wrong_prediction_is_in_the_headline_but_not_the_verdict():
    from rich.console import Console

    from fsdpcheck.console import render
    from fsdpcheck.records import Report, from_dict, to_dict
    from fsdpcheck.report import report_headline, verdict

    rows = (LoaderPrediction("dcp-broadcast", "ok", "keyed by name", products="torch"),)
    seen = {"dcp-broadcast": Observation("dcp-broadcast", "refused", {"summary": "rank 1 raised"})}
    loaders, findings = with_observations(rows, seen)
    assert verdict(findings, ()) == ("consistent", 0)  # the ranks agree; fsdpcheck was wrong
    report = Report("consistent", 0, 2, None, None, (), findings, (), loaders=loaders)
    assert from_dict(Report, to_dict(report)) == report
    line = report_headline(report)
    assert line.startswith("all 2 ranks consistent; PREDICTION WRONG (a bug in fsdpcheck)")
    assert "dcp-broadcast predicted ok, observed refused" in line
    console = Console(record=True, width=200, color_system=None)
    render(report, console)
    text = console.export_text()
    assert "observed (gloo)" in text and "refused" in text
    assert "dcp-broadcast for real (child job): refused — rank 1 raised" in text


# ---------------------------------------------------------------- who the job's ranks stand for


def _audited(rank, hash_seed, canonical, path=None):
    from dataclasses import replace

    from synthetic import state_record

    from fsdpcheck.model.config_record import config_record
    from fsdpcheck.records import SourceRecord

    record = state_record(rank)
    return replace(
        record,
        env=replace(record.env, hash_seed=hash_seed),
        config=config_record(canonical),
        source=SourceRecord("acme/tiny", path, "bfloat16"),
    )


def test_the_other_rank_stands_in_with_its_own_seed_directory_dtype_and_config(tmp_path):
    from fsdpcheck.children.observe import stand_ins_for

    node1 = tmp_path / "node1"
    node1.mkdir()
    (node1 / "config.json").write_text("{}")
    base = {"hidden_size": 8, "intermediate_size": 32, "rope": {"theta": 1e4}}
    stale = {**base, "intermediate_size": 48}
    records = {0: _audited(0, "3", base, "/elsewhere"), 2: _audited(2, "5", stale, str(node1))}
    first, other = stand_ins_for(records)
    assert (first.rank, first.hash_seed, first.model, first.config) == (0, 3, None, {})
    assert (other.rank, other.hash_seed, other.model) == (2, 5, str(node1))
    assert other.config == {"intermediate_size": 48} and other.dtype == "bfloat16"
    assert json.loads(other.env()["FSDPCHECK_STANDS_FOR"])["config"] == {"intermediate_size": 48}


def test_ranks_that_agree_stand_in_alike():
    from fsdpcheck.children.observe import stand_ins_for

    base = {"hidden_size": 8}
    first, other = stand_ins_for({0: _audited(0, "random", base)})
    assert (first.hash_seed, other.hash_seed) == (0, 0)
    assert other.config == {} and other.model is None
