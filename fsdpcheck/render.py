"""Console rendering of a :class:`Report` with rich. Only the CLI calls this, on rank 0."""

from __future__ import annotations

from collections.abc import Iterable

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from fsdpcheck.records import LoadOutcome, Report

_VERDICT_STYLE = {
    "consistent": "bold green",
    "inconsistent": "bold red",
    "latent": "bold yellow",
    "error": "bold red",
}


def rank_ranges(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` → ``"0-2,5"``."""
    ordered = sorted(set(ranks))
    parts: list[str] = []
    start = prev = None
    for r in ordered + [None]:
        if start is not None and (r is None or r != prev + 1):
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = None
        if r is not None and start is None:
            start = r
        prev = r
    return ",".join(parts)


def render(report: Report, console: Console) -> None:
    model = report.model
    title = Text("fsdpcheck audit", style="bold")
    if model is not None:
        title.append(f" · {model.name} ({model.architecture}, {model.kind})")
        title.append(f" · init {model.init} · {model.dtype}")
    title.append(f" · {report.world_size} rank{'s' if report.world_size != 1 else ''}")
    console.print(title)

    if report.wrap is not None:
        w = report.wrap
        line = (
            f"wrap: {len(w.wrapped)} fully_shard calls"
            f" ({'size-based fallback' if w.fallback else ', '.join(w.found)}"
            f"{'' if w.fallback else ' + root'}); classes from {w.source}"
        )
        if w.missing:
            line += f"; missing: {', '.join(w.missing)}"
        console.print(line, style="dim")

    if len(report.hosts) > 1:
        console.print(
            "hosts: " + ", ".join(f"{h} (ranks {rank_ranges(r)})" for h, r in report.hosts.items()),
            highlight=False,
        )

    if report.groups:
        table = Table(title="rank groups (identical fingerprints)", title_justify="left")
        for column in ("group", "ranks", "hosts", "hash seed", "digest"):
            table.add_column(column)
        seeds = {env.rank: env.hash_seed for env in report.environment}
        for i, group in enumerate(report.groups):
            table.add_row(
                str(i),
                rank_ranges(group.ranks),
                ", ".join(group.hosts),
                seeds.get(group.ranks[0], "?"),
                group.digest[:12],
            )
        console.print(table)

    for finding in report.findings:
        who = (
            f"ranks {rank_ranges(finding.ranks)} vs rank {finding.reference_rank}"
            if finding.ranks
            else "on rank 0's host, across hash seeds"
        )
        console.print(
            f"[bold red]✗ {finding.kind}[/] {who} · {finding.stage} · [italic]{finding.cause}[/]"
        )
        console.print(f"  {escape(finding.summary)}", highlight=False)

    _render_loaders(report, console)
    _render_load(report, console)

    for warning in report.warnings:
        console.print(f"[yellow]! {escape(warning)}[/]", highlight=False)

    for error in report.errors:
        where = f"rank {error.rank} failed at {escape(error.stage)}"
        console.print(f"[bold red]✗ {where}[/]: {escape(error.message)}", highlight=False)

    style = _VERDICT_STYLE.get(report.verdict, "bold")
    console.print(
        Text.assemble(("verdict: ", "bold"), (report.verdict, style), f" (exit {report.exit_code})")
    )
    headline = report_headline(report)
    if headline:
        console.print(escape(headline), highlight=False)


_LOADER_STYLE = {
    "ok": "green",
    "uninitialized": "yellow",
    "silent-corruption": "bold red",
    "refused": "yellow",
    "hang": "bold red",
}


def _render_loaders(report: Report, console: Console) -> None:
    if not report.loaders or (report.errors and not report.findings):
        return
    if all(p.verdict == "ok" and p.observed in (None, "ok") for p in report.loaders):
        ran = sum(p.observed == "ok" for p in report.loaders)
        tail = f" ({ran} run for real: ok)" if ran else ""
        count = len(report.loaders)
        console.print(f"loaders: all {count} known loaders would load these ranks{tail}")
        return
    observed = any(p.observed_detail is not None for p in report.loaders)
    table = Table(title="what each loader would do on these ranks", title_justify="left")
    table.add_column("loader", style="bold")
    table.add_column("verdict")
    if observed:
        table.add_column("observed (gloo)")
    table.add_column("why", overflow="fold")
    for p in report.loaders:
        cells = [p.name, Text(p.verdict, style=_LOADER_STYLE.get(p.verdict, ""))]
        if observed:
            seen = p.observed or "not run"
            cells.append(Text(seen, style=_LOADER_STYLE.get(seen, "dim")))
        cells.append(p.summary)
        table.add_row(*cells)
    console.print(table)


def _render_load(report: Report, console: Console) -> None:
    load, verified = report.load, report.verify
    if load is not None and load.outcome == "loaded" and verified is not None:
        status = "[green]passed[/]" if verified.passed else "[bold red]FAILED[/]"
        console.print(
            f"sorted loader: {load.params_loaded} state-dict entries {_load_method(load)}, "
            f"{load.buffers_broadcast} non-persistent buffers in {load.collectives} collectives "
            f"({load.seconds:.2f}s); verification {status}: {verified.checked} tensors checked "
            f"on {report.world_size} rank{'s' if report.world_size != 1 else ''}"
        )
    elif load is not None and load.outcome == "refused":
        console.print(f"[yellow]sorted loader refused[/] (no rank hung): {escape(load.message)}")
    elif load is not None and load.outcome == "skipped" and not report.errors:
        console.print(f"sorted loader not run: {escape(load.message)}", style="dim")
    for p in report.loaders:
        if p.observed_detail is not None and p.observed is None:
            why = escape(str(p.observed_detail.get("summary", "")))
            console.print(f"{p.name} not run for real: {why}", style="dim")


def _load_method(load: LoadOutcome) -> str:
    if load.method == "bucketed":
        return f"in {load.state_messages} point-to-point buckets ({load.state_bytes:,} bytes)"
    if load.fallback_reason:
        return f"via DCP [yellow](fell back: {escape(load.fallback_reason)})[/]"
    return "via DCP"


def report_headline(report: Report) -> str:
    """The one line a person can act on."""
    from fsdpcheck.analyse import headline

    line = headline(report.findings, report.errors, report.world_size)
    bad = [f"{p.name} → {p.verdict}" for p in report.loaders if p.verdict != "ok"]
    if bad and any(f.kind != "prediction" for f in report.findings):
        line += ": " + ", ".join(bad)
    wrong = [f.details for f in report.findings if f.kind == "prediction"]
    if wrong:
        line += "; PREDICTION WRONG (a bug in fsdpcheck): " + ", ".join(
            f"{w['loader']} predicted {w['predicted']}, observed {w['observed']}" for w in wrong
        )
    load, verified = report.load, report.verify
    ranks = f"{report.world_size} rank{'s' if report.world_size != 1 else ''}"
    if load is not None and load.outcome == "loaded" and verified is not None:
        state = "verified" if verified.passed else "left ranks different"
        line += f"; sorted loader {state} on {ranks}"
    elif load is not None and load.outcome == "refused":
        line += "; sorted loader refused (names, shapes or dtypes differ)"
    return line
