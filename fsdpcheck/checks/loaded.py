"""After the project's loader: a failed proof of equality becomes ``verify`` findings (pure)."""

from __future__ import annotations

from fsdpcheck.records import Finding, VerifyResult
from fsdpcheck.text import ranks_label
from fsdpcheck.vocab import Cause, FindingKind, Snapshot


def verify_findings(verified: VerifyResult) -> list[Finding]:
    """One ``verify`` finding per tensor that differs from rank 0's source after the load."""
    if not verified.ran or verified.passed:
        return []
    findings = []
    for mismatch in verified.mismatches:
        ranks = tuple(mismatch.get("ranks", ()))
        findings.append(
            Finding(
                kind=FindingKind.VERIFY,
                ranks=ranks,
                reference_rank=0,
                stage=Snapshot.LOAD,
                cause=Cause.LOADING,
                summary=f"after the sorted loader, {mismatch.get('kind', 'tensor')} "
                f"{mismatch.get('name')} differs from rank 0's source on "
                f"{ranks_label(ranks)}: {mismatch.get('reason', '')}",
                tensors=(str(mismatch.get("name")),),
                details=dict(mismatch),
            )
        )
    return findings
