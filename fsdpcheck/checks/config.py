"""``config``: the resolved model config must be the same on every rank.

A stale ``config.json`` on one node (another ``rope_theta``, another ``sliding_window``) builds
a model with the right layout and different behaviour; some loaders then hide it by
broadcasting rank 0's buffers, others keep each rank's own. Ranks compare a digest of the
canonical config (see :mod:`fsdpcheck.model.config_record`); only representatives of differing
groups send the config itself, and this module names every differing key path.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from fsdpcheck.records import ConfigRecord, Finding
from fsdpcheck.text import clauses, ranks_label
from fsdpcheck.vocab import FindingKind

_LISTED = 3
_MAX_PATHS = 200  # details stay bounded whatever the config's size
_MISSING = object()


def config_findings(
    ref_rank: int, ref: ConfigRecord | None, ranks: Sequence[int], other: ConfigRecord | None
) -> list[Finding]:
    """At most one finding naming every key path whose value differs, or the side that recorded
    no config while the other did (its config had no dict form, or could not be read). Nothing
    when neither side has one (a model without a config) or the digests agree."""
    if ref is None and other is None:
        return []
    if ref is None or other is None:
        return [_unrecorded(ref_rank, ranks, reference_missing=ref is None)]
    if ref.digest == other.digest:
        return []
    diffs = config_differences(ref.canonical, other.canonical)
    if not diffs:  # equal content, different digests: nothing a person could act on
        return []
    ref_label, other_label = f"rank {ref_rank}", ranks_label(ranks)
    text = clauses(
        diffs,
        lambda d: (
            f"{d['path']}: {_show(d['reference'])} on {ref_label}, {_show(d['other'])} on "
            f"{other_label}"
        ),
        _LISTED,
    )
    summary = f"{FindingKind.CONFIG.phrase}: {text}"
    details = {"differences": diffs[:_MAX_PATHS], "count": len(diffs)}
    return [Finding.about(FindingKind.CONFIG, ranks, ref_rank, summary, details=details)]


def _unrecorded(ref_rank: int, ranks: Sequence[int], *, reference_missing: bool) -> Finding:
    without, holder = f"rank {ref_rank}", ranks_label(ranks)
    if not reference_missing:
        without, holder = holder, without
    summary = (
        f"{FindingKind.CONFIG.phrase}: {without} recorded no config (none, or it could not be "
        f"read there) while {holder} did, so the configs could not be compared"
    )
    details = {"unrecorded": "reference" if reference_missing else "other"}
    return Finding.about(FindingKind.CONFIG, ranks, ref_rank, summary, details=details)


def config_differences(a: Any, b: Any, path: str = "") -> list[dict[str, Any]]:
    """``[{"path", "reference", "other"}]`` for every leaf that differs; a key present on one
    side only has ``None`` on the other and ``"missing"`` naming that side."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        out = []
        for key in sorted(set(a) | set(b), key=str):
            sub = f"{path}.{key}" if path else str(key)
            x, y = a.get(key, _MISSING), b.get(key, _MISSING)
            if x is _MISSING or y is _MISSING:
                out.append(
                    {
                        "path": sub,
                        "reference": None if x is _MISSING else x,
                        "other": None if y is _MISSING else y,
                        "missing": "reference" if x is _MISSING else "other",
                    }
                )
            else:
                out.extend(config_differences(x, y, sub))
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        out = []
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            out.extend(config_differences(x, y, f"{path}[{i}]"))
        return out
    if a == b:  # 10000 == 10000.0: the digest treats them alike too
        return []
    return [{"path": path or "<config>", "reference": a, "other": b}]


def _show(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 60 else text[:57] + "..."
