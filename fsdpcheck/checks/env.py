"""``env``: the ranks run different software (interpreter, torch, transformers, backend, ...)."""

from __future__ import annotations

from fsdpcheck.checks.groups import Pair
from fsdpcheck.records import Finding
from fsdpcheck.text import ranks_label
from fsdpcheck.vocab import FindingKind

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
    summary, details = f"{FindingKind.ENV.phrase}: {text}", {"differences": diffs}
    ranks, ref_rank = pair.group.ranks, pair.ref_rank
    return [Finding.about(FindingKind.ENV, ranks, ref_rank, summary, details=details)]
