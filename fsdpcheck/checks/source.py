"""``--source``: a rank's tensor that differs from its slice of the checkpoint on disk becomes a
``source`` finding, one per tensor and look (pure)."""

from __future__ import annotations

from typing import Any

from fsdpcheck.records import Finding, VerifyResult
from fsdpcheck.text import ranks_label
from fsdpcheck.vocab import FindingKind, SourceLook


def source_findings(checked: VerifyResult) -> list[Finding]:
    """One ``source`` finding per mismatch: the tensor, its ranks, each rank's slice and first
    differing element, and what it looks like where that could be told."""
    if not checked.ran or checked.passed:
        return []
    findings = []
    for mismatch in checked.mismatches:
        ranks = tuple(mismatch.get("ranks", ()))
        per_rank = list(mismatch.get("per_rank", ()))
        name = str(mismatch.get("name"))
        if name == "*":  # the rank read nothing: no tensor to name
            summary = f"{ranks_label(ranks)} could not check against the checkpoint: " + str(
                mismatch.get("reason", "")
            ).removeprefix("could not be read on this rank: ")
        else:
            summary = (
                f"{mismatch.get('kind')} {name} differs from the checkpoint on "
                f"{ranks_label(ranks)}: {mismatch.get('reason', '')}"
                f"{_where(per_rank[0] if per_rank else {})}"
            )
        reference, tensors = ranks[0] if ranks else 0, () if name == "*" else (name,)
        kind, details = FindingKind.SOURCE, dict(mismatch)
        findings.append(
            Finding.about(kind, ranks, reference, summary, tensors=tensors, details=details)
        )
    return findings


def _where(first: dict[str, Any]) -> str:
    """Where on the first rank: its slice and first differing element."""
    if first.get("looks_like") == SourceLook.UNREADABLE:
        return ""
    parts = []
    if first.get("slice"):
        parts.append(f"rank {first.get('rank')}'s slice {first['slice']}")
    diff = first.get("first")
    if diff:
        parts.append(
            f"first difference at {diff['full_index']}: {diff['model']!r} here, "
            f"{diff['checkpoint']!r} in the checkpoint"
        )
    return f" ({'; '.join(parts)})" if parts else ""
