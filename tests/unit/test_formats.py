"""CI formats are pure: synthetic reports in, JUnit XML / workflow commands / SARIF out."""

from __future__ import annotations

import dataclasses
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from synthetic import EMBED, FULL, SLIDING, tensor

from fsdpcheck.checks.hash_seed import (
    ModuleReorder,
    OrderVariant,
    ProbeResult,
    SeedError,
    TensorShape,
)
from fsdpcheck.checks.set_order import find_sites
from fsdpcheck.children.scan import ScanResult, ScanRow
from fsdpcheck.formats import annotations, junit, sarif
from fsdpcheck.formats.junit import FINDING_KINDS
from fsdpcheck.records import EnvRecord, Fingerprint, Gathered, RankError, RankRecord, Report
from fsdpcheck.report import AuditOutcome, assemble, error_report

pytestmark = pytest.mark.timeout(60)


def _record(rank: int, buffers: list[str], seed: str) -> RankRecord:
    sizes = {FULL: (8,), SLIDING: (4,)}
    fp = Fingerprint(
        "pre-wrap",
        buffers=tuple(tensor(n, sizes[n], persistent=False) for n in buffers),
        params=(tensor(EMBED, (16, 8)),),
    )
    env = EnvRecord(rank, rank, 2, "node0", "gloo", "3.11.0", "2.13.0", "5.24.0", seed)
    return RankRecord(env=env, pre_wrap=fp)


def _report(divergent: bool) -> Report:
    second = [SLIDING, FULL] if divergent else [FULL, SLIDING]
    records = {0: _record(0, [FULL, SLIDING], "0"), 1: _record(1, second, "1")}
    digests = {r: rec.group_digest() for r, rec in records.items()}
    reps = {}
    for r, d in digests.items():
        reps.setdefault(d, r)
    gathered = Gathered(
        digests=digests,
        hosts={0: "node0", 1: "node0"},
        records={r: records[r] for r in reps.values()},
        bytes_sent=0,
    )
    return assemble(AuditOutcome(gathered, timings={"gather": 0.01}), None)


def _cases(xml_text: str) -> dict[tuple[str, str], ET.Element]:
    root = ET.fromstring(xml_text)
    assert root.tag == "testsuites"
    (suite,) = root.findall("testsuite")
    return {(c.get("classname"), c.get("name")): c for c in suite.findall("testcase")}


# ---------------------------------------------------------------- JUnit, audit


def test_junit_has_one_case_per_check_family_and_fails_the_divergent_one() -> None:
    report = _report(divergent=True)
    assert report.exit_code == 1
    text = junit.report_to_junit(report)
    root = ET.fromstring(text)
    suite = root.find("testsuite")
    cases = _cases(text)
    for kind in FINDING_KINDS:
        assert ("fsdpcheck.audit.checks", kind) in cases
    order = cases[("fsdpcheck.audit.checks", "buffer-order")]
    failures = order.findall("failure")
    expected = [f.summary for f in report.findings if f.kind == "buffer-order"]
    assert [f.get("message") for f in failures] == expected and expected
    assert cases[("fsdpcheck.audit.checks", "param-set")].find("failure") is None
    # pytest's counters: every testcase once; a case with failures counts once.
    assert int(suite.get("tests")) == len(cases)
    failed = sum(1 for c in cases.values() if c.find("failure") is not None)
    assert int(suite.get("failures")) == failed == int(root.get("failures"))
    assert int(suite.get("errors")) == 0
    for case in cases.values():
        float(case.get("time"))
    # The hang / corruption predictions fail their loader's case.
    loaders = {n: c for (cls, n), c in cases.items() if cls == "fsdpcheck.audit.loaders"}
    assert loaders["named-buffers-order"].find("failure").get("type") == "hang"
    assert loaders["sorted-names"].find("failure") is None


def test_junit_fails_a_loader_on_what_nccl_would_do_when_gloo_would_not_fail() -> None:
    # A CPU CI job auditing an NCCL training job (issue 37): rank 1's larger RoPE table would be
    # filled in front on gloo (silent) but block NCCL; the row fails on the worse of the two.
    report = _report(divergent=True)
    row = next(p for p in report.loaders if p.name == "named-buffers-order")
    gentle = dataclasses.replace(row, verdict="ok", backend="gloo", on_nccl="hang")
    loaders = tuple(gentle if p is row else p for p in report.loaders)
    text = junit.report_to_junit(dataclasses.replace(report, loaders=loaders))
    case = _cases(text)[("fsdpcheck.audit.loaders", "named-buffers-order")]
    assert case.find("failure").get("type") == "hang"
    assert "ok on gloo (NCCL: hang)" in case.find("failure").text
    clean = dataclasses.replace(gentle, on_nccl=None)  # its twin: ok on both, no failure
    loaders = tuple(clean if p is row else p for p in report.loaders)
    text = junit.report_to_junit(dataclasses.replace(report, loaders=loaders))
    assert _cases(text)[("fsdpcheck.audit.loaders", "named-buffers-order")].find("failure") is None


def test_the_report_s_predictions_are_for_the_backend_the_ranks_recorded() -> None:
    report = _report(divergent=True)  # both ranks recorded gloo
    assert {p.backend for p in report.loaders} == {"gloo"}
    assert all(p.on_gloo is None for p in report.loaders)


def test_junit_of_the_consistent_twin_has_no_failure() -> None:
    report = _report(divergent=False)
    assert report.exit_code == 0
    text = junit.report_to_junit(report)
    root = ET.fromstring(text)
    assert root.get("failures") == "0" and root.get("errors") == "0"
    assert junit.failures(text) == []
    assert len(_cases(text)) >= len(FINDING_KINDS) + len(report.loaders)


def test_junit_of_a_failed_rank_is_an_error_and_skips_the_checks() -> None:
    errors = [RankError(1, "build", "unknown preset 'x'; choose from hazard", "input")]
    text = junit.report_to_junit(error_report(errors, 2, None))
    cases = _cases(text)
    error = cases[("fsdpcheck.audit.ranks", "rank 1")].find("error")
    assert error.get("message") == errors[0].message
    assert cases[("fsdpcheck.audit.checks", "buffer-order")].find("skipped") is not None
    assert ET.fromstring(text).get("errors") == "1"


def test_junit_escapes_markup_and_strips_control_characters() -> None:
    errors = [RankError(0, "resolve", 'bad <model> & "quotes"\x1b[31m', "input")]
    text = junit.report_to_junit(error_report(errors, 1, None))
    error = _cases(text)[("fsdpcheck.audit.ranks", "rank 0")].find("error")
    assert error.get("message").startswith('bad <model> & "quotes"')
    assert "\x1b" not in text


def test_junit_diff_suite_name() -> None:
    text = junit.report_to_junit(_report(True), suite="fsdpcheck.diff")
    assert ET.fromstring(text).find("testsuite").get("name") == "fsdpcheck.diff"
    assert ("fsdpcheck.diff.checks", "buffer-order") in _cases(text)


def test_write_junit_is_atomic_and_readable(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "junit.xml"
    junit.write_junit(junit.report_to_junit(_report(False)), path)
    assert ET.parse(path).getroot().tag == "testsuites"
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    assert [p.name for p in path.parent.iterdir()] == ["junit.xml"]


# ---------------------------------------------------------------- JUnit, probe and scan


def _probe(latent: bool, errors: tuple[SeedError, ...] = ()) -> ProbeResult:
    reorders = ()
    if latent:
        shapes = (TensorShape(FULL, (8,), "float32"), TensorShape(SLIDING, (4,), "float32"))
        variants = (
            OrderVariant((0, 2), (FULL, SLIDING), (0, 1)),
            OrderVariant((1, 3), (SLIDING, FULL), (0, 1)),
        )
        reorders = (ModuleReorder("buffer", "model.rotary_emb", shapes, variants, True),)
    return ProbeResult(
        model="hazard", architecture="HazardForCausalLM", seeds=(0, 1, 2, 3),
        verdict="latent" if latent else ("error" if errors else "consistent"),
        exit_code=1 if latent else (3 if errors else 0), reorders=reorders, errors=errors,
        orders=2 if latent else 1, timings={"total": 1.5},
    )  # fmt: skip


def test_probe_junit_fails_the_module_that_reorders_and_passes_its_twin() -> None:
    text = junit.probe_to_junit(_probe(latent=True))
    cases = _cases(text)
    assert ("fsdpcheck.probe.seeds", "PYTHONHASHSEED=3") in cases
    failure = cases[("fsdpcheck.probe.orders", "buffer order")].find("failure")
    assert "model.rotary_emb" in failure.get("message") and failure.get("type") == "hang"
    assert cases[("fsdpcheck.probe.orders", "parameter order")].find("failure") is None
    assert junit.failures(junit.probe_to_junit(_probe(latent=False))) == []


def test_probe_junit_seed_errors() -> None:
    text = junit.probe_to_junit(_probe(False, (SeedError(2, "timeout", "timed out after 9 s"),)))
    error = _cases(text)[("fsdpcheck.probe.seeds", "PYTHONHASHSEED=2")].find("error")
    assert error.get("message") == "timed out after 9 s"


def _scan(rows: tuple[ScanRow, ...], filters: tuple[str, ...] = ("llama",)) -> ScanResult:
    return ScanResult(
        rows=rows, seeds=(0, 1), filters=filters, families=("causal-lm",),
        exit_code=1 if any(r.verdict in ("hang", "silent-corruption") for r in rows) else 0,
        transformers="5.24.0", started="2026-01-01T00:00:00+00:00", elapsed=2.0,
    )  # fmt: skip


HAZARD_ROW = ScanRow(
    id="preset:hazard", model_type="hazard", architecture="HazardForCausalLM", family="preset",
    verdict="hang", tensors=(FULL, SLIDING), seeds_built=(0, 1),
)  # fmt: skip
LLAMA_ROW = ScanRow(
    id="llama", model_type="llama", architecture="LlamaForCausalLM", family="causal-lm",
    verdict="ok", seeds_built=(0, 1),
)  # fmt: skip
SKIPPED_ROW = ScanRow(
    id="odd", model_type="odd", architecture="OddForCausalLM", family="causal-lm",
    verdict="skipped", reason="needs a vision config",
)  # fmt: skip


def test_scan_junit_one_case_per_architecture() -> None:
    text = junit.scan_to_junit(_scan((HAZARD_ROW, LLAMA_ROW, SKIPPED_ROW)))
    cases = _cases(text)
    assert cases[("fsdpcheck.scan.preset", "preset:hazard")].find("failure").get("type") == "hang"
    assert cases[("fsdpcheck.scan.causal-lm", "llama")].find("failure") is None
    skipped = cases[("fsdpcheck.scan.causal-lm", "odd")].find("skipped")
    assert skipped.get("message") == "needs a vision config"
    suite = ET.fromstring(text).find("testsuite")
    assert (suite.get("failures"), suite.get("skipped"), suite.get("tests")) == ("1", "1", "5")


# ---------------------------------------------------------------- annotations


def test_workflow_command_escaping() -> None:
    line = annotations.command("error", "50% done\r\nnext", title="a: b, c")
    assert line == "::error title=a%3A b%2C c::50%25 done%0D%0Anext"
    assert annotations.command("warning", "w") == "::warning::w"
    assert annotations.command("error", "m", file="x,y.py", line=3) == (
        "::error file=x%2Cy.py,line=3::m"
    )


def test_annotations_mode() -> None:
    assert annotations.enabled("auto", {"GITHUB_ACTIONS": "true"})
    assert not annotations.enabled("auto", {})
    assert annotations.enabled("github", {})
    assert not annotations.enabled("none", {"GITHUB_ACTIONS": "true"})
    with pytest.raises(ValueError):
        annotations.enabled("gitlab", {})


def test_report_annotations_errors_for_findings_warnings_for_warnings() -> None:
    report = _report(divergent=True)
    lines = annotations.report_annotations(report)
    errors = [ln for ln in lines if ln.startswith("::error")]
    assert len(errors) == len(report.findings)
    assert all("\n" not in ln for ln in lines)
    clean = annotations.report_annotations(_report(divergent=False))
    assert not [ln for ln in clean if ln.startswith("::error")]


def test_probe_and_scan_annotations() -> None:
    assert annotations.probe_annotations(_probe(latent=True))[0].startswith("::error title=")
    assert annotations.probe_annotations(_probe(latent=False)) == []
    lines = annotations.scan_annotations(_scan((HAZARD_ROW, LLAMA_ROW)))
    assert len(lines) == 1 and "preset%3Ahazard" in lines[0]


# ---------------------------------------------------------------- the set-order locator


COHERE_STYLE = """
class Rotary(nn.Module):
    def __init__(self, config):
        self.layer_types = list(set(config.layer_types))
        for layer_type in self.layer_types:
            setattr(self, f"{layer_type}_inv_freq", nn.Buffer(x, persistent=False))
            setattr(self, f"{layer_type}_scaling", 1.0)
"""

FIXED = COHERE_STYLE.replace("list(set(", "sorted(set(")

FORWARD_ONLY = """
class Model(nn.Module):
    def forward(self, x):
        out = {}
        for layer_type in set(self.config.layer_types):
            out[layer_type] = self.rotary_emb(x, layer_type)
        return out
"""

DIRECT = """
class R(nn.Module):
    def __init__(self, config):
        for t in set(config.layer_types):
            self.register_buffer(f"{t}_inv_freq", make(t), persistent=False)
        self.params = nn.ParameterDict({t: nn.Parameter(w) for t in {"a", "b"}})
"""


def test_locator_finds_the_two_step_pattern_and_not_its_fix() -> None:
    (site,) = find_sites(COHERE_STYLE, "m.py")
    assert (site.line, site.origin_line, site.function) == (5, 4, "Rotary.__init__")
    assert site.iterable == "self.layer_types" and "nn.Buffer" in site.registers
    assert find_sites(FIXED) == ()
    assert find_sites(FORWARD_ONLY) == ()


def test_locator_direct_loop_and_comprehension() -> None:
    sites = find_sites(DIRECT)
    assert [(s.line, s.iterable) for s in sites] == [
        (4, "set(config.layer_types)"),
        (6, "{'a', 'b'}"),
    ]


# ---------------------------------------------------------------- SARIF


def _check_sarif(log: dict) -> None:
    json.dumps(log)  # JSON-ready
    assert log["version"] == "2.1.0" and log["$schema"].endswith("sarif-2.1.0.json")
    (run,) = log["runs"]
    driver = run["tool"]["driver"]
    assert driver["name"] == "fsdpcheck"
    ids = [rule["id"] for rule in driver["rules"]]
    for result in run["results"]:
        assert result["ruleId"] == ids[result["ruleIndex"]]
        assert result["level"] in ("error", "warning", "note")
        assert result["message"]["text"]
        for loc in result.get("locations", []):
            phys = loc["physicalLocation"]
            assert phys["artifactLocation"]["uri"].startswith("file:///")
            assert phys["region"]["startLine"] >= 1


def test_sarif_points_at_the_hazard_loop_and_the_latent_cohere_compass_line() -> None:
    import importlib.util

    hazard_file = Path(importlib.util.find_spec("fsdpcheck.model.hazard").origin)  # not imported
    log = sarif.scan_to_sarif(_scan((HAZARD_ROW, LLAMA_ROW), filters=("cohere_compass",)))
    _check_sarif(log)
    results = log["runs"][0]["results"]
    seen = [r for r in results if r["level"] == "error"]
    (hang,) = seen
    assert hang["ruleId"] == "FSDPCHECK001"
    loc = hang["locations"][0]["physicalLocation"]
    assert loc["artifactLocation"]["uri"] == hazard_file.resolve().as_uri()
    source = hazard_file.read_text().splitlines()
    assert "in set(config.layer_types)" in source[loc["region"]["startLine"] - 1]
    latent = [r for r in results if r["level"] == "warning"]
    (cohere,) = latent  # llama has none; cohere_compass 5.24 is the one latent site
    loc = cohere["locations"][0]["physicalLocation"]
    assert loc["artifactLocation"]["uri"].endswith("/modeling_cohere_compass.py")
    path = Path(loc["artifactLocation"]["uri"].removeprefix("file://"))
    lines = path.read_text().splitlines()
    assert lines[loc["region"]["startLine"] - 1].strip().startswith("for layer_type in")
    origin = cohere["relatedLocations"][0]["physicalLocation"]["region"]["startLine"]
    assert "list(set(config.layer_types))" in lines[origin - 1]


def test_sarif_of_a_clean_scan_has_no_results(tmp_path: Path) -> None:
    log = sarif.scan_to_sarif(_scan((LLAMA_ROW,), filters=("llama",)))
    _check_sarif(log)
    assert log["runs"][0]["results"] == []
    sarif.write_sarif(log, tmp_path / "scan.sarif")
    assert json.loads((tmp_path / "scan.sarif").read_text())["version"] == "2.1.0"
