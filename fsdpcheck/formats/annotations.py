"""GitHub Actions workflow commands (``::error title=…::message``): findings as annotations.

Pure: records in, lines out; the CLI prints them on rank 0. Escaping follows the runner's
rules: in the message ``%``, ``\\r`` and ``\\n`` become ``%25``, ``%0D`` and ``%0A``; in a
property value (``title=``, ``file=``) also ``:`` and ``,`` (``%3A``, ``%2C``), which would
otherwise end the value.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from fsdpcheck.records import Report
from fsdpcheck.vocab import Annotations, ExitCode, LoaderVerdict, ScanVerdict

if TYPE_CHECKING:
    from fsdpcheck.checks.hash_seed import ProbeResult, SeedError
    from fsdpcheck.children.scan import ScanResult

WARNING_LOADER_VERDICTS = frozenset({LoaderVerdict.UNINITIALIZED})


def escape_data(text: str) -> str:
    return str(text).replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_property(text: str) -> str:
    return escape_data(text).replace(":", "%3A").replace(",", "%2C")


def command(
    level: str, message: str, *, title: str | None = None, file: str | None = None,
    line: int | None = None,
) -> str:  # fmt: skip
    """One workflow command: ``level`` is ``error``, ``warning`` or ``notice``."""
    if level not in ("error", "warning", "notice"):
        raise ValueError(f"unknown annotation level {level!r}")
    props = []
    if file:
        props.append(f"file={escape_property(file)}")
    if line:
        props.append(f"line={int(line)}")
    if title:
        props.append(f"title={escape_property(title)}")
    head = f"::{level}" + (" " + ",".join(props) if props else "")
    return f"{head}::{escape_data(message)}"


def enabled(mode: str, environ: Mapping[str, str]) -> bool:
    """``github``: always; ``none``: never; ``auto``: when ``GITHUB_ACTIONS`` is ``true``."""
    if mode not in Annotations._value2member_map_:
        choices = ", ".join(m.value for m in Annotations)
        raise ValueError(f"--annotations {str(mode)!r}: choose one of {choices}")
    if mode == Annotations.AUTO:
        return environ.get("GITHUB_ACTIONS", "").lower() == "true"
    return mode == Annotations.GITHUB


def report_annotations(report: Report, *, tool: str = "fsdpcheck audit") -> list[str]:
    """Errors for rank failures and findings, warnings for the report's warnings and for loader
    predictions that are not cross-rank differences (``uninitialized``)."""
    lines = []
    for error in report.errors:
        title = f"{tool}: rank {error.rank} failed at {error.stage}"
        lines.append(command("error", error.message, title=title))
    for finding in report.findings:
        lines.append(command("error", finding.summary, title=f"{tool}: {finding.kind}"))
    for prediction in report.loaders:
        if prediction.verdict in WARNING_LOADER_VERDICTS:
            title = f"{tool}: loader {prediction.name} → {prediction.verdict}"
            lines.append(command("warning", prediction.summary, title=title))
    for warning in report.warnings:
        lines.append(command("warning", warning, title=f"{tool}: warning"))
    return lines


def probe_annotations(result: ProbeResult) -> list[str]:
    lines = []
    seeds = f"{result.seeds[0]}..{result.seeds[-1]}" if result.seeds else "-"
    for r in result.reorders:
        names = ", ".join(t.name for t in r.tensors)
        message = (
            f"{result.model}: {r.kind}s {names} change order with PYTHONHASHSEED (seeds "
            f"{seeds}); a loader pairing them by local order would {r.outcome}"
        )
        lines.append(command("error", message, title=f"fsdpcheck probe: {r.kind} order"))
    level = "error" if not result.reorders else "warning"
    return lines + _seed_failures("probe", result.errors, level)


def scan_annotations(result: ScanResult) -> list[str]:
    lines = []
    for row in result.rows:
        if row.verdict in (ScanVerdict.HANG, ScanVerdict.SILENT_CORRUPTION):
            message = (
                f"{row.architecture}: {len(row.tensors)} tensor(s) change order with "
                f"PYTHONHASHSEED ({', '.join(row.tensors[:8])}) → {row.verdict}"
            )
            lines.append(command("error", message, title=f"fsdpcheck scan: {row.id}"))
    # Seed failures fail the scan only when no child produced anything (exit 3).
    level = "error" if result.exit_code == ExitCode.RUNTIME else "warning"
    return lines + _seed_failures("scan", result.errors, level)


def _seed_failures(tool: str, errors: Sequence[SeedError], level: str) -> list[str]:
    return [
        command(level, e.message, title=f"fsdpcheck {tool}: seed {e.seed} failed") for e in errors
    ]
