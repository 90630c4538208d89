"""``launch``: every rank must be started alike.

One rank started with an extra flag (vllm #26187), or with another NCCL or allocator variable,
runs other code paths with the same model: nothing in the tensors shows it until the job hangs
or diverges. Each rank records its command line (secret-looking values redacted) and an
allowlist of launch variables (:class:`fsdpcheck.records.LaunchRecord`); this check names the
argument positions and variable names that differ from the reference. Pure.

Each rank replaced its own rank numbers with ``<rank>`` and its host name with ``<host>``
before any digest (:func:`fsdpcheck.distributed.environment.launch_record`), so ``r0.json`` and
``r1.json`` are one word. Where a constant happens to be one rank's own (``step_0.pt`` on rank
0, ``--dist-url tcp://node-1:29500`` on node-1's ranks), the two records differ; here they are
compared word by word, and a placeholder on one side matches what it stood for on that side
(its own numbers, its host): the raw words were equal.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from difflib import SequenceMatcher
from typing import Any

from fsdpcheck.checks.groups import reference_group, usable_groups
from fsdpcheck.records import HOST_WORD, RANK_WORD, Finding, Group, LaunchRecord, RankRecord
from fsdpcheck.text import name_list, ranks_label
from fsdpcheck.vocab import FindingKind

_UNSET = "<unset>"
_PARTS = re.compile(r"(<rank>|\d+)")


@dataclass(frozen=True)
class Own:
    """What one rank's placeholders stood for: its own numbers and its host."""

    numbers: Collection[int] = ()
    host: str | None = None


def own(record: RankRecord) -> Own:
    return Own(record.launch.numbers if record.launch else (), record.env.host)


def launch_findings(groups: Sequence[Group], records: Mapping[int, RankRecord]) -> list[Finding]:
    """At most one finding: every group whose command line or launch variables differ from the
    reference group's, with the differing argument positions and variable names. Ranks without
    a launch record (an older fsdpcheck, an offline record) are not compared."""
    reference = reference_group(groups, records)
    if reference is None:
        return []
    ref_rank = reference.representative
    ref = records[ref_rank].launch
    if ref is None:
        return []
    differing = []
    for group in usable_groups(groups, records):
        other = records[group.representative].launch
        if group is reference or other is None:
            continue
        sides = own(records[ref_rank]), own(records[group.representative])
        argv = argv_differences(ref.argv, other.argv, *sides)
        env = env_differences(ref, other, *sides)
        if argv or env:
            differing.append({"ranks": list(group.ranks), "argv": argv, "env": env})
    if not differing:
        return []
    parts = []
    for entry in differing:
        said = []
        if entry["argv"]:
            said.append("argv " + ", ".join(_argv_said(d, ref_rank) for d in entry["argv"][:3]))
        if entry["env"]:
            said.append("environment " + name_list([d["key"] for d in entry["env"]]))
        parts.append(f"{ranks_label(entry['ranks'])}: {'; '.join(said)}")
    ranks = sorted(r for entry in differing for r in entry["ranks"])
    summary = (
        f"{FindingKind.LAUNCH.phrase} from rank {ref_rank}'s: {' | '.join(parts)}: these ranks "
        "run other code paths with the same model (a hang or a silent divergence)"
    )
    details = {"groups": differing}
    return [Finding.about(FindingKind.LAUNCH, ranks, ref_rank, summary, details=details)]


def launch_alike(a: RankRecord, b: RankRecord) -> bool:
    """The two ranks were started alike: every word and variable the same, up to what each
    rank's placeholders stood for (None where either has no launch record)."""
    if a.launch is None or b.launch is None:
        return a.launch is b.launch
    sides = own(a), own(b)
    return not argv_differences(a.launch.argv, b.launch.argv, *sides) and not env_differences(
        a.launch, b.launch, *sides
    )


def argv_differences(
    ref: Sequence[str], other: Sequence[str], ref_own: Own = Own(), other_own: Own = Own()
) -> list[dict[str, Any]]:
    """Each run of arguments where the command lines differ, by its position in ``other``: an
    extra flag is one difference, not a shift of every argument after it. ``reference`` and
    ``other`` are the words each side has there (empty: none). Words alike up to what each
    side's placeholders stood for (:func:`words_alike`) do not differ."""
    matcher = SequenceMatcher(a=list(ref), b=list(other), autojunk=False)
    return [
        {"position": j1, "reference": list(ref[i1:i2]), "other": list(other[j1:j2])}
        for tag, i1, i2, j1, j2 in matcher.get_opcodes()
        if tag != "equal"
        and not (
            i2 - i1 == j2 - j1
            and all(
                words_alike(x, ref_own, y, other_own)
                for x, y in zip(ref[i1:i2], other[j1:j2], strict=True)
            )
        )
    ]


def words_alike(a: str, a_own: Own, b: str, b_own: Own) -> bool:
    """``a`` (from the rank ``a_own`` describes) and ``b`` could have been one word: equal but
    where one says ``<rank>`` and the other has one of the first one's own numbers, or where
    one says ``<host>`` and the other has the first one's host name."""
    if _numbers_alike(a, a_own, b, b_own):
        return True
    if HOST_WORD not in a and HOST_WORD not in b:
        return False
    a, b = (w.replace(HOST_WORD, o.host) if o.host else w for w, o in ((a, a_own), (b, b_own)))
    return _numbers_alike(a, a_own, b, b_own)


def _numbers_alike(a: str, a_own: Own, b: str, b_own: Own) -> bool:
    if a == b:
        return True
    left, right = _PARTS.split(a), _PARTS.split(b)
    if len(left) != len(right):
        return False
    # A bare number is a value (``--seed 0`` vs ``--seed 1`` is a difference); a number inside a
    # name where each side has one of its own numbers is that name per rank, whatever its form
    # (``report.0.json`` and ``report.1.json``), beyond what the record's normalising saw.
    in_name = len(left) > 1 and not (a.isdigit() or b.isdigit())
    for x, y in zip(left, right, strict=True):
        if x == y:
            continue
        if x == RANK_WORD and y.isdigit() and int(y) in a_own.numbers:
            continue
        if y == RANK_WORD and x.isdigit() and int(x) in b_own.numbers:
            continue
        if in_name and _own_number(x, a_own) and _own_number(y, b_own):
            continue
        return False
    return True


def _own_number(part: str, own: Own) -> bool:
    return part.isdigit() and int(part) in own.numbers


def env_differences(
    ref: LaunchRecord, other: LaunchRecord, ref_own: Own = Own(), other_own: Own = Own()
) -> list[dict[str, Any]]:
    """Each allowlisted variable set differently (``<unset>`` where one side has none)."""
    keys = sorted({*ref.env, *other.env}, key=str)
    return [
        {"key": key, "reference": ref.env.get(key, _UNSET), "other": other.env.get(key, _UNSET)}
        for key in keys
        if not words_alike(
            str(ref.env.get(key, _UNSET)), ref_own, str(other.env.get(key, _UNSET)), other_own
        )
    ]


def _words(words: Sequence[str]) -> str:
    return " ".join(words) if words else "nothing"


def _argv_said(difference: Mapping[str, Any], ref_rank: int) -> str:
    theirs, mine = _words(difference["other"]), _words(difference["reference"])
    return f"[{difference['position']}] {theirs} (rank {ref_rank}: {mine})"
