"""``env``: the ranks run different software (interpreter, torch, transformers, backend, ...)."""

from __future__ import annotations

from fsdpcheck.checks.groups import Pair
from fsdpcheck.records import Finding
from fsdpcheck.text import ranks_label
from fsdpcheck.vocab import Cause, FindingKind, Snapshot

ENV_FIELDS = ("python", "torch", "transformers", "backend", "accelerate", "nccl", "cuda")


def env_findings(pair: Pair) -> list[Finding]:
    """One finding naming every version that differs between the group and the reference."""
    ref, other = pair.ref.env, pair.other.env
    diffs = [
        {"field": name, "reference": a, "other": b}
        for name, a, b in zip(ENV_FIELDS, ref.versions(), other.versions(), strict=True)
        if a != b
    ]
    if not diffs:
        return []
    mine, theirs = f"rank {pair.ref_rank}", ranks_label(pair.group.ranks)
    text = "; ".join(
        f"{d['field']} {d['reference']} on {mine} but {d['other']} on {theirs}" for d in diffs
    )
    return [
        Finding(
            kind=FindingKind.ENV,
            ranks=tuple(pair.group.ranks),
            reference_rank=pair.ref_rank,
            snapshot=Snapshot.PRE_WRAP,
            cause=Cause.ENVIRONMENT,
            summary=f"{FindingKind.ENV.phrase}: {text}",
            tensors=(),
            details={"differences": diffs},
        )
    ]
