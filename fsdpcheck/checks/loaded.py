"""After the project's loader: a failed proof of equality becomes ``verify`` findings (pure)."""

from __future__ import annotations

import re

from fsdpcheck.records import Finding, LoadOutcome, RankError, VerifyResult
from fsdpcheck.text import ranks_label
from fsdpcheck.vocab import ErrorKind, FindingKind, LoadMethod, LoadStatus, Stage


def load_findings(load: LoadOutcome, world_size: int) -> list[Finding]:
    """A refused load is a ``verify`` finding on every rank: nothing moved, and a report that
    says ``consistent`` would let the job start on a model nobody loaded."""
    if load.outcome != LoadStatus.REFUSED:
        return []
    lines = load.message.strip().splitlines()
    summary = "the sorted loader refused to load (nothing moved): " + (
        lines[0] if lines else "no reason given"
    )
    details = {"outcome": LoadStatus.REFUSED, "message": load.message}
    return [Finding.about(FindingKind.VERIFY, range(world_size), 0, summary, details=details)]


def load_errors(load: LoadOutcome) -> tuple[RankError, ...]:
    """A load that failed mid-transfer (partly loaded): one error per rank its message names
    (``- rank N: ...``), else one on rank 0; bad input where the load says so (a ``--resume``
    checkpoint a rank cannot read), else a runtime failure."""
    if load.outcome != LoadStatus.FAILED:
        return ()
    ranks = sorted({int(r) for r in re.findall(r"^\s*- rank (\d+):", load.message, re.M)})
    loader = "the resume (dcp.load)" if load.method == LoadMethod.RESUME else "the sorted loader"
    message = f"{loader} failed: {load.message}"
    kind = load.error_kind or ErrorKind.RUNTIME
    return tuple(RankError(r, Stage.LOAD, message, kind) for r in ranks or [0])


def verify_findings(verified: VerifyResult, loader: str = "the sorted loader") -> list[Finding]:
    """One ``verify`` finding per tensor that differs from rank 0's source after the load
    (``loader``: what loaded it, for the summary)."""
    if not verified.ran or verified.passed:
        return []
    findings = []
    for mismatch in verified.mismatches:
        ranks = tuple(mismatch.get("ranks", ()))
        name = str(mismatch.get("name"))
        summary = (
            f"after {loader}, {mismatch.get('kind', 'tensor')} {name} differs from rank 0's "
            f"source on {ranks_label(ranks)}: {mismatch.get('reason', '')}"
        )
        details = dict(mismatch)
        findings.append(
            Finding.about(FindingKind.VERIFY, ranks, 0, summary, tensors=(name,), details=details)
        )
    return findings
