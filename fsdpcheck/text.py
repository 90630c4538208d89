"""Small text helpers shared by analysis, errors and rendering (no torch, no rich)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

T = TypeVar("T")


def int_ranges(values: Iterable[int], sep: str = ",") -> str:
    """``[1, 2, 3, 5, 7, 8]`` → ``"1-3,5,7,8"``: runs of three or more collapse."""
    ordered = sorted(set(values))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{ordered[i]}-{ordered[j]}")
        else:
            parts.extend(str(v) for v in ordered[i : j + 1])
        i = j + 1
    return sep.join(parts)


def ranks_label(ranks: Iterable[int]) -> str:
    """``rank 1``, ``ranks 1,3``, ``ranks 1-7,9``."""
    ordered = sorted(set(ranks))
    return ("rank " if len(ordered) == 1 else "ranks ") + int_ranges(ordered)


# What an error message says when the rank it names only waited on another rank's failure
# (stuck waiting, gave up waiting, or raised only after another rank's step had raised): a
# headline names a rank that failed on its own first.
STUCK = "is stuck in stage"
RAISED_AFTER = "raised only after"
GAVE_UP = "gave up:"


def waited_on_another(message: str) -> bool:
    return message.startswith(GAVE_UP) or STUCK in message or RAISED_AFTER in message


def name_list(names: Sequence[str], limit: int = 8) -> str:
    """The first ``limit`` names, then how many more."""
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def clauses(items: Sequence[T], show: Callable[[T], str], limit: int) -> str:
    """``show`` of the first ``limit`` items, parted by semicolons (a clause may hold commas of
    its own), then how many more: ``a; b; c; and 4 more``."""
    shown = "; ".join(show(item) for item in items[:limit])
    return shown + (f"; and {len(items) - limit} more" if len(items) > limit else "")


def size_label(n: int) -> str:
    """Bytes as ``96 MiB`` or ``1.50 GiB``."""
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.0f} MiB"
