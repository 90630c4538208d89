"""JUnit XML in the shape pytest writes, for CI test-report viewers. Pure: records in, text out.

``<testsuites>`` → one ``<testsuite>`` → ``<testcase classname=… name=… time=…>``. The test
cases have stable names, so a CI history lines up run after run:

- audit (and ``diff``, which makes the same :class:`Report`): one case per check family (each
  finding kind of :data:`fsdpcheck.records.FINDING_KINDS`, plus any other kind a report holds)
  with one ``<failure>`` per finding, its summary as the message; one case per loader
  prediction; one for the project's loader; one ``<error>`` case per rank that failed (then the
  checks are ``<skipped>``: they did not run).
- probe: one case per hash seed (an ``<error>`` when its build failed) and one each for buffer
  and parameter order, with a ``<failure>`` per module whose order follows the seed.
- scan: one case per architecture row (``<failure>`` for hang / silent-corruption,
  ``<skipped>`` with the reason) and one per hash seed.

The JUnit file never disagrees with the exit code: failures and errors appear exactly when the
command exits non-zero. A loader prediction of ``uninitialized`` (DCP leaves non-persistent
buffers of ranks built on meta as garbage) is a property of that loader, not a difference
between ranks, so it passes here, with the prediction in the case's ``<system-out>``.
"""

from __future__ import annotations

import re
import socket
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdpcheck.output import write_text
from fsdpcheck.records import Finding, Report
from fsdpcheck.text import int_ranges
from fsdpcheck.vocab import FindingKind, LoaderVerdict, LoadStatus, ScanVerdict

if TYPE_CHECKING:
    from fsdpcheck.checks.hash_seed import ProbeResult, SeedError
    from fsdpcheck.children.scan import ScanResult

FINDING_KINDS = tuple(kind.value for kind in FindingKind)
# Loader predictions that fail their test case; anything else that is not "ok" passes with a note.
FAILING_LOADER_VERDICTS = frozenset(
    {LoaderVerdict.HANG, LoaderVerdict.SILENT_CORRUPTION, LoaderVerdict.REFUSED}
)
SCAN_FAILURES = frozenset({ScanVerdict.HANG, ScanVerdict.SILENT_CORRUPTION})

# XML 1.0 cannot carry most control characters (ANSI colours in an error message, say).
_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def clean(text: object) -> str:
    """``text`` as a string XML 1.0 can hold: other control characters become U+FFFD."""
    return _NOT_XML.sub("\ufffd", str(text))


class _Suite:
    """One ``<testsuite>`` being filled in, with pytest's counters."""

    def __init__(self, name: str, *, time: float = 0.0, timestamp: str = ""):
        self.element = ET.Element("testsuite", name=name)
        self.time = time
        self.timestamp = timestamp
        self.counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}

    def case(self, classname: str, name: str, *, time: float = 0.0) -> ET.Element:
        self.counts["tests"] += 1
        return ET.SubElement(
            self.element, "testcase", classname=clean(classname), name=clean(name), time=_t(time)
        )

    def fail(self, case: ET.Element, message: str, kind: str, text: str = "") -> None:
        self._outcome(case, "failure", message, kind, text, "failures")

    def error(self, case: ET.Element, message: str, kind: str, text: str = "") -> None:
        self._outcome(case, "error", message, kind, text, "errors")

    def skip(self, case: ET.Element, message: str) -> None:
        if case.find("skipped") is None:
            self.counts["skipped"] += 1
            ET.SubElement(case, "skipped", type="pytest.skip", message=clean(message)).text = clean(
                message
            )

    def _outcome(self, case, tag: str, message: str, kind: str, text: str, counter: str) -> None:
        # pytest counts a test case once, however many <failure> elements it holds.
        if case.find("failure") is None and case.find("error") is None:
            self.counts[counter] += 1
        element = ET.SubElement(case, tag, message=clean(message), type=clean(kind))
        element.text = clean(text or message)

    def output(self, case: ET.Element, text: str) -> None:
        ET.SubElement(case, "system-out").text = clean(text)

    def properties(self, values: Mapping[str, Any]) -> None:
        props = ET.SubElement(self.element, "properties")
        for key, value in values.items():
            if value not in (None, ""):
                ET.SubElement(props, "property", name=clean(key), value=clean(value))

    def to_xml(self) -> str:
        for key, value in self.counts.items():
            self.element.set(key, str(value))
        self.element.set("time", _t(self.time))
        if self.timestamp:
            self.element.set("timestamp", self.timestamp)
        self.element.set("hostname", clean(socket.gethostname()))
        # The <properties> block goes first, as in pytest's output.
        props = self.element.find("properties")
        if props is not None:
            self.element.remove(props)
            self.element.insert(0, props)
        root = ET.Element("testsuites", name="fsdpcheck")
        for key in ("tests", "failures", "errors", "skipped"):
            root.set(key, str(self.counts[key]))
        root.set("time", _t(self.time))
        root.append(self.element)
        ET.indent(root)
        return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, "unicode") + "\n"


def _t(seconds: float) -> str:
    return f"{float(seconds):.3f}"


def _ranks(ranks: Iterable[int]) -> str:
    return int_ranges(ranks) or "-"


# ---------------------------------------------------------------- audit / diff


def report_to_junit(report: Report, *, suite: str = "fsdpcheck.audit") -> str:
    """An audit (or ``diff``) report as JUnit XML. ``suite`` names the testsuite and prefixes
    every classname (``diff`` passes ``fsdpcheck.diff``)."""
    timings = dict(report.timings or {})
    out = _Suite(suite, time=sum(float(v) for v in timings.values()))
    model = report.model
    out.properties(
        {
            "verdict": report.verdict,
            "exit_code": report.exit_code,
            "world_size": report.world_size,
            "model": model.spec if model else None,
            "architecture": model.architecture if model else None,
            "schema": report.schema,
        }
    )
    not_checked = "not checked: a rank failed before the records could be compared"
    for error in report.errors:
        case = out.case(f"{suite}.ranks", f"rank {error.rank}")
        out.error(case, error.message, f"{error.kind} error at stage {error.stage}")

    by_kind: dict[str, list[Finding]] = {}
    for finding in report.findings:
        by_kind.setdefault(finding.kind, []).append(finding)
    kinds = [*FINDING_KINDS, *(k for k in by_kind if k not in FINDING_KINDS)]
    for kind in kinds:
        case = out.case(f"{suite}.checks", kind, time=_check_time(kind, timings))
        for finding in by_kind.get(kind, ()):
            out.fail(case, finding.summary, kind, _finding_text(finding))
        if kind not in by_kind and report.errors:
            out.skip(case, not_checked)

    for prediction in report.loaders:
        case = out.case(f"{suite}.loaders", prediction.name)
        text = f"{prediction.verdict_text()}: {prediction.summary}"
        if prediction.ranks:
            text += f" (ranks {_ranks(prediction.ranks)})"
        # A CPU job auditing an NCCL one fails on what NCCL would do, too.
        if prediction.worst in FAILING_LOADER_VERDICTS:
            out.fail(case, prediction.summary, prediction.worst, text)
        else:
            out.output(case, text)
    if not report.loaders and report.errors:
        out.skip(out.case(f"{suite}.loaders", "predictions"), not_checked)

    if report.load is not None:
        load = report.load
        case = out.case(f"{suite}.load", "sorted-loader", time=load.seconds)
        if load.outcome == LoadStatus.FAILED:
            out.error(case, load.message or "the loader failed", "load failed")
        elif load.outcome in (LoadStatus.SKIPPED, LoadStatus.REFUSED):
            out.skip(case, f"{load.outcome}: {load.message}")
        elif report.verify is not None and report.verify.ran:
            out.output(case, f"loaded; verified {report.verify.checked} tensors on every rank")
    if report.warnings:
        case = out.case(f"{suite}", "warnings")
        out.output(case, "\n".join(report.warnings))
    return out.to_xml()


def _check_time(kind: str, timings: Mapping[str, float]) -> float:
    return float(timings.get("verify", 0.0)) if kind == "verify" else 0.0


def _finding_text(finding: Finding) -> str:
    lines = [finding.summary, f"stage: {finding.snapshot}", f"cause: {finding.cause}"]
    if finding.ranks:
        lines.append(f"ranks: {_ranks(finding.ranks)} (reference rank {finding.reference_rank})")
    if finding.tensors:
        shown = ", ".join(finding.tensors[:20])
        more = len(finding.tensors) - 20
        lines.append(f"tensors: {shown}{f' (+{more} more)' if more > 0 else ''}")
    return "\n".join(lines)


# ---------------------------------------------------------------- probe


def probe_to_junit(result: ProbeResult) -> str:
    """``fsdpcheck probe``'s result: a case per hash seed, one per order (buffers, params)."""
    suite = "fsdpcheck.probe"
    out = _Suite(suite, time=float((result.timings or {}).get("total", 0.0)))
    out.properties(
        {
            "verdict": result.verdict,
            "exit_code": result.exit_code,
            "model": result.model,
            "architecture": result.architecture,
            "transformers": result.transformers,
        }
    )
    failed = _seed_cases(out, suite, result.seeds, result.errors)
    seeds = f"{result.seeds[0]}..{result.seeds[-1]}" if result.seeds else "-"
    for kind, label in (("buffer", "buffer order"), ("param", "parameter order")):
        case = out.case(f"{suite}.orders", label)
        reorders = [r for r in result.reorders if r.kind == kind]
        for r in reorders:
            where = r.module or "<root>"
            names = ", ".join(t.name for t in r.tensors)
            message = (
                f"{len(r.tensors)} {kind}(s) in {where} change order with PYTHONHASHSEED "
                f"(seeds {seeds}); a loader pairing them by local order would {r.outcome}"
            )
            variants = "\n".join(
                f"seeds {','.join(map(str, v.seeds))}: {', '.join(v.order)}" for v in r.variants
            )
            out.fail(case, message, r.outcome, f"{message}\ntensors: {names}\n{variants}")
        if not reorders and len(failed) == len(result.seeds):
            out.skip(case, "not compared: no seed built the model")
    return out.to_xml()


def _seed_cases(
    out: _Suite, suite: str, seeds: Sequence[int], errors: Sequence[SeedError]
) -> dict[int, SeedError]:
    """A case per hash seed (probe, scan): an ``<error>`` where its child failed."""
    failed = {e.seed: e for e in errors}
    for seed in seeds:
        case = out.case(f"{suite}.seeds", f"PYTHONHASHSEED={seed}")
        if seed in failed:
            out.error(case, failed[seed].message, f"{failed[seed].kind} error")
    return failed


# ---------------------------------------------------------------- scan


def scan_to_junit(result: ScanResult) -> str:
    """``fsdpcheck scan``'s table: a case per architecture row, one per hash seed."""
    suite = "fsdpcheck.scan"
    out = _Suite(suite, time=result.elapsed, timestamp=result.started)
    out.properties(
        {
            "exit_code": result.exit_code,
            "transformers": result.transformers,
            "torch": result.torch,
            "python": result.python,
            "filters": " ".join(result.filters),
        }
    )
    _seed_cases(out, suite, result.seeds, result.errors)
    for row in result.rows:
        case = out.case(f"{suite}.{row.family}", row.id, time=row.seconds)
        if row.verdict in SCAN_FAILURES:
            shown = ", ".join(row.tensors[:8]) + (" …" if len(row.tensors) > 8 else "")
            message = (
                f"{row.architecture}: {len(row.tensors)} tensor(s) change order with "
                f"PYTHONHASHSEED ({shown}); a loader pairing them by local order would "
                f"{'hang' if row.verdict == ScanVerdict.HANG else 'corrupt them silently'}"
            )
            out.fail(case, message, row.verdict, _scan_text(row, message))
        elif row.verdict == ScanVerdict.SKIPPED:
            out.skip(case, row.reason or "skipped")
    return out.to_xml()


def _scan_text(row: Any, message: str) -> str:
    lines = [message]
    for r in row.reorders:
        for v in r.variants:
            lines.append(f"{r.module or '<root>'} seeds {','.join(map(str, v.seeds))}: "
                         f"{', '.join(v.order)}")  # fmt: skip
    return "\n".join(lines)


# ---------------------------------------------------------------- writing


def write_junit(text: str, path: str | Path) -> None:
    """Write atomically (a reader never sees half a file), readable by CI artifact collectors."""
    write_text(text, path)


def failures(xml_text: str) -> Sequence[tuple[str, str, str]]:
    """``(classname, name, message)`` of every failure and error: handy for tests and tools."""
    root = ET.fromstring(xml_text)
    out = []
    for case in root.iter("testcase"):
        for tag in ("failure", "error"):
            for element in case.findall(tag):
                out.append(
                    (case.get("classname", ""), case.get("name", ""), element.get("message", ""))
                )
    return out
