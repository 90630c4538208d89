"""The review's analysis defects, each over a synthetic gather built as the audit builds it
(every rank's digests; full records from the representatives and the value senders), with its
clean twin: what used to end ``consistent`` over a real difference, or never said that a check
the user asked for did not run."""

from __future__ import annotations

import io
from dataclasses import replace

from rich.console import Console
from synthetic import env

from fsdpcheck.checks.gather_view import gathered_from
from fsdpcheck.checks.hash_seed import ProbeResult, SeedError
from fsdpcheck.options import AuditOptions, mesh_problem
from fsdpcheck.records import ConfigRecord, Fingerprint, RankRecord, TensorRecord
from fsdpcheck.report import AuditOutcome, assemble, report_headline
from fsdpcheck.vocab import Verdict

ROPE = "model.rotary_emb.inv_freq"
EMBED = "model.embed_tokens.weight"


def _record(rank, *, rope_device="cpu", keys=(), config="c", stage="post-wrap"):
    buffers = (TensorRecord(ROPE, (4,), "float32", rope_device, persistent=False, digest="rope"),)
    params = (TensorRecord(EMBED, (8, 4), "float32", "cpu", digest="embed", requires_grad=True),)
    fp = Fingerprint(stage, buffers, params, state_dict_keys=(EMBED, *keys))
    return RankRecord(
        env=env(rank),
        pre_wrap=fp if stage == "pre-wrap" else None,
        post_wrap=fp if stage == "post-wrap" else None,
        config=None if config is None else ConfigRecord(config, {"hidden_size": 8}),
    )


def _report(records, options=None, **outcome):
    return assemble(AuditOutcome(gathered_from(records), **outcome), options)


# ---------------------------------------------------------------- device, across every rank


def test_a_buffer_on_another_device_on_one_rank_is_a_device_finding() -> None:
    """Device is no part of the group digest (ranks on meta must not split off): one group,
    yet the device check sees rank 1, whose value digest (with each tensor's device) differs."""
    report = _report({0: _record(0), 1: _record(1, rope_device="cuda")})
    assert len(report.groups) == 1
    [finding] = report.findings
    assert (finding.kind, finding.ranks, finding.tensors) == ("device", (1,), (ROPE,))
    assert f"{ROPE} is on cpu on rank 0 but on cuda on rank 1" in finding.summary
    assert report.verdict == Verdict.INCONSISTENT
    before = _report(
        {r: _record(r, rope_device="cuda" if r else "cpu", stage="pre-wrap") for r in (0, 1)}
    )
    assert [(f.kind, f.snapshot, f.cause) for f in before.findings] == [
        ("device", "pre-wrap", "construction-time")
    ]


def test_the_clean_twin_every_rank_on_one_device_or_on_meta_is_consistent() -> None:
    assert _report({r: _record(r, rope_device="cuda") for r in (0, 1)}).verdict == "consistent"
    on_meta = replace(
        _record(1),
        post_wrap=replace(
            _record(1).post_wrap,
            buffers=(TensorRecord(ROPE, (4,), "float32", "meta", persistent=False),),
        ),
    )
    assert _report({0: _record(0), 1: on_meta}).verdict == "consistent"


# ---------------------------------------------------------------- state-dict keys


def test_a_state_dict_key_that_is_no_tensor_is_a_state_dict_keys_finding() -> None:
    extra = "model.layers.0.mlp._extra_state"  # get_extra_state: TransformerEngine's fp8 scales
    report = _report({0: _record(0), 1: _record(1, keys=(extra,))})
    [finding] = report.findings
    assert (finding.kind, finding.ranks, finding.tensors) == ("state-dict-keys", (1,), (extra,))
    assert finding.details == {"only_reference": [], "only_other": [extra]}
    assert f"only rank 1 has {extra}" in finding.summary
    twin = _report({r: _record(r, keys=(extra,)) for r in (0, 1)})
    assert twin.verdict == "consistent"


# ---------------------------------------------------------------- config on one side only


def test_a_config_recorded_on_one_side_only_is_a_config_finding() -> None:
    report = _report({0: _record(0), 1: _record(1, config=None)})
    [finding] = report.findings
    assert (finding.kind, finding.ranks, finding.details) == (
        "config",
        (1,),
        {"unrecorded": "other"},
    )
    assert "rank 1 recorded no config" in finding.summary
    assert _report({r: _record(r, config=None) for r in (0, 1)}).verdict == "consistent"


# ---------------------------------------------------------------- the probe never silent


def _probe(errors=(), seeds=8):
    verdict = Verdict.ERROR if errors else Verdict.CONSISTENT
    return ProbeResult(
        "hazard",
        None,
        tuple(range(seeds)),
        verdict,
        3 if errors else 0,
        (),
        tuple(errors),
        orders=0 if errors else 1,
    )


def test_a_probe_whose_every_seed_failed_is_an_error_and_the_console_says_so() -> None:
    from fsdpcheck.console import render

    records = {r: _record(r) for r in (0, 1)}
    options = AuditOptions(model="hazard", probe=8)
    failed = _probe([SeedError(s, "timeout", "timed out after 30 s") for s in range(8)])
    report = _report(records, options, probe=failed)
    assert (report.verdict, report.exit_code) == ("error", 3)
    [error] = report.errors
    assert (error.rank, error.stage) == (0, "probe")
    assert "--probe 8: 8 of 8 hash seeds did not build (seed 0, timeout" in error.message
    out = io.StringIO()
    render(report, Console(file=out, width=200))
    assert "--probe 8: 8 of 8 hash seeds did not build" in out.getvalue()
    assert "failed at probe" in report_headline(report)

    late = _report(records, options, probe_failure="--probe did not finish: timed out")
    assert (late.verdict, late.exit_code) == ("error", 3)
    assert "--probe 8 did not run: --probe did not finish: timed out" in late.errors[0].message


def test_the_clean_twin_a_probe_that_answered_or_was_not_asked_for() -> None:
    records = {r: _record(r) for r in (0, 1)}
    options = AuditOptions(model="hazard", probe=8)
    assert _report(records, options, probe=_probe()).verdict == "consistent"
    assert _report(records, AuditOptions(model="hazard")).verdict == "consistent"


# ---------------------------------------------------------------- --reproduce never silent


def test_a_reproduce_that_ran_no_loader_is_an_error_and_the_console_says_so() -> None:
    from fsdpcheck.checks.observed import Observation
    from fsdpcheck.console import render

    records = {r: _record(r) for r in (0, 1)}
    options = AuditOptions(model="hazard", reproduce=True)
    why = "not run for real: rank 0 did not get through the loader (stage init)"
    none_ran = {n: Observation(n, None, {"summary": why}) for n in ("dcp-broadcast", "ddp-sync")}
    report = _report(records, options, observed=none_ran)
    assert (report.verdict, report.exit_code) == ("error", 3)
    [error] = report.errors
    assert (error.rank, error.stage) == (0, "reproduce")
    assert f"--reproduce ran no loader for real (dcp-broadcast: {why})" == error.message
    out = io.StringIO()
    render(report, Console(file=out, width=200))
    assert "--reproduce ran no loader for real" in out.getvalue()

    failed = _report(records, options, observed={}, reproduce_failure="no time left (1.0 s)")
    assert "--reproduce ran no loader for real (no time left (1.0 s))" in failed.errors[0].message


def test_the_clean_twin_a_reproduce_that_observed_a_loader_or_was_not_asked_for() -> None:
    from fsdpcheck.checks.observed import Observation

    records = {r: _record(r) for r in (0, 1)}
    options = AuditOptions(model="hazard", reproduce=True)
    skipped = Observation("state-dict-order", None, {"summary": "accelerate is not installed"})
    seen = {"dcp-broadcast": Observation("dcp-broadcast", "ok"), "state-dict-order": skipped}
    assert _report(records, options, observed=seen).verdict == "consistent"
    assert _report(records, AuditOptions(model="hazard")).verdict == "consistent"


# ---------------------------------------------------------------- --mesh


def test_a_mesh_fsdpcheck_cannot_build_says_what_is_wrong() -> None:
    assert "3 sizes, but fsdpcheck builds a mesh of one dim (FSDP) or two" in mesh_problem(
        (2, 2, 2), 8
    )
    assert "every size must be a positive number of ranks, not -1, -2" in mesh_problem((-1, -2))
    assert "covers 6 ranks but WORLD_SIZE is 8" in mesh_problem((2, 3), 8)
    assert mesh_problem((2, 4), 8) == mesh_problem((8,), 8) == mesh_problem((2, 4)) == ""
