"""What a row produces: its lines (one per comparison in the main table), notes and raw figures."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Line:
    """One measured comparison: the main table shows one line each."""

    what: str
    result: str  # the ratio or value, as shown
    goal: str
    met: bool | None  # None: informational (an estimate is never a goal met)
    figures: str  # the raw figures behind it
    value: float | None = None


@dataclass
class Row:
    """A row as it is measured: the runner adds lines, notes and raw figures as it goes, and
    the command stamps when and how long (so not frozen)."""

    name: str
    title: str
    compare: str
    lines: list[Line] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    raw: dict = field(default_factory=dict)
    seconds: float = 0.0
    error: str | None = None
    date: str | None = None  # when this row was measured
    load: list[float] | None = None  # the load average as it started


def floor_met(within: bool, above: Line) -> bool | None:
    """A floor line's verdict: its goal holds only where the line above it (the row's own
    goal) is not met; where that one is met, the floor decides nothing (None, shown as —)."""
    return None if above.met else within
