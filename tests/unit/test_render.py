"""What rank 0 prints for a report: rendering is pure, so plain records drive it."""

from __future__ import annotations

from rich.console import Console

from fsdpcheck.console import render
from fsdpcheck.records import Finding, LoadOutcome, Report, VerifyResult, from_dict, to_dict


def _printed(load: LoadOutcome) -> str:
    report = Report(
        verdict="consistent",
        exit_code=0,
        world_size=2,
        model=None,
        wrap=None,
        groups=(),
        findings=(),
        errors=(),
        load=load,
        verify=VerifyResult(ran=True, passed=True, checked=13),
    )
    assert from_dict(Report, to_dict(report)) == report  # the JSON report carries it as is
    console = Console(record=True, width=200, color_system=None)
    render(report, console)
    return console.export_text()


def test_bucketed_load_says_how_the_state_dict_moved() -> None:
    load = LoadOutcome(
        ran=True,
        outcome="loaded",
        params_loaded=11,
        buffers_broadcast=2,
        collectives=3,
        method="bucketed",
        state_messages=4,
        state_bytes=1536,
    )
    text = _printed(load)
    assert "11 state-dict entries in 4 point-to-point buckets (1,536 bytes)" in text
    assert "verification passed: 13 tensors checked on 2 ranks" in text


def test_a_dcp_fallback_is_said_with_its_reason() -> None:
    reason = "not covered by the bucketed path: rank 1: w is placed as _StridedShard(dim=0)"
    load = LoadOutcome(
        ran=True, outcome="loaded", params_loaded=11, method="dcp", fallback_reason=reason
    )
    text = _printed(load)
    assert f"11 state-dict entries via DCP (fell back: {reason})" in text


def _step_printed(findings: tuple[Finding, ...], timings: dict[str, float]) -> str:
    report = Report(
        verdict="inconsistent" if findings else "consistent",
        exit_code=1 if findings else 0,
        world_size=2,
        model=None,
        wrap=None,
        groups=(),
        findings=findings,
        errors=(),
        timings=timings,
    )
    console = Console(record=True, width=200, color_system=None)
    render(report, console)
    return console.export_text()


def _step_finding(kind: str, **details) -> Finding:
    return Finding(kind, (1,), 0, "step", "divergent", "…", details=details)


def test_audit_step_says_in_one_line_how_the_step_went() -> None:
    timings = {"step": 0.4123, "step-watch": 0.0211}
    clean = _step_printed((), timings)
    assert "step: consistent · finished; every collective the same on every rank" in clean
    assert "(0.412 s, watch 0.021 s)" in clean
    diverged = _step_printed((_step_finding("step", seq=3),), timings)
    assert "step: inconsistent · stopped at collective #3: the ranks differ" in diverged
    nan = _step_printed((_step_finding("non-finite"),), timings)
    assert "step: inconsistent · finished; non-finite after it" in nan
    assert "step:" not in _step_printed((), {})  # no --step, no line


def test_warnings_are_printed() -> None:
    # e.g. a --wrap-class the model lacks (tests/ranks/test_audit_inputs.py has the real one)
    warning = "--wrap-class SiglipEncoderLayer matches no module: wrapping by size instead"
    report = Report(
        verdict="consistent",
        exit_code=0,
        world_size=2,
        model=None,
        wrap=None,
        groups=(),
        findings=(),
        errors=(),
        warnings=(warning,),
    )
    console = Console(record=True, width=200, color_system=None)
    render(report, console)
    assert warning in console.export_text()
