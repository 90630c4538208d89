"""How figures are written in the report."""

from __future__ import annotations

from collections.abc import Iterable

from bench.settings import MIB


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def fmt_s(seconds: float) -> str:
    return f"{seconds:.3f} s" if seconds < 10 else f"{seconds:.1f} s"


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


def fmt_mib(nbytes: float) -> str:
    return f"{nbytes / MIB:.0f} MiB"


def mark(met: bool | None) -> str:
    return {True: "met", False: "**not met**", None: "—"}[met]


def byte_size(measured: Iterable[int]) -> str:
    """A measured size as an adjective: ``121-byte``, or the range where the figures differ."""
    sizes = sorted(set(measured))
    return f"{sizes[0]}-byte" if len(sizes) == 1 else f"{sizes[0]}- to {sizes[-1]}-byte"
