"""Everything fsdpcheck shows with rich: the report, probe and scan tables, the commands'
one-line messages (as rich markup), stage progress.

Only the CLI calls this, on rank 0; library modules never print."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table
from rich.text import Text

from fsdpcheck.checks.memory import held
from fsdpcheck.records import LoadOutcome, MemoryRecord, RankError, RankRecord, Report
from fsdpcheck.report import report_headline
from fsdpcheck.text import int_ranges, ranks_label, size_label
from fsdpcheck.vocab import (
    FindingKind,
    LoaderVerdict,
    LoadMethod,
    LoadStatus,
    ScanVerdict,
    Snapshot,
    Stage,
    Verdict,
)

if TYPE_CHECKING:
    from fsdpcheck.checks.hash_seed import ProbeResult, SeedError
    from fsdpcheck.children.scan import ScanResult
    from fsdpcheck.model.presets import Preset

_VERDICT_STYLE = {
    Verdict.CONSISTENT: "bold green",
    Verdict.INCONSISTENT: "bold red",
    Verdict.LATENT: "bold yellow",
    Verdict.ERROR: "bold red",
}


def render(report: Report, console: Console, *, title: str = "fsdpcheck audit") -> None:
    model = report.model
    title = Text(title, style="bold")
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
            "hosts: " + ", ".join(f"{h} (ranks {int_ranges(r)})" for h, r in report.hosts.items()),
            highlight=False,
        )

    if report.groups:
        table = Table(title="rank groups (identical fingerprints)", title_justify="left")
        columns = ["group", "ranks", "hosts", "hash seed", "digest"]
        if report.memory:
            columns.append("memory held")
        for column in columns:
            table.add_column(column)
        seeds = {env.rank: env.hash_seed for env in report.environment}
        for i, group in enumerate(report.groups):
            row = [
                str(i),
                int_ranges(group.ranks),
                ", ".join(group.hosts),
                seeds.get(group.ranks[0], "?"),
                group.digest[:12],
            ]
            if report.memory:
                row.append(memory_cell(report.memory, group.ranks))
            table.add_row(*row)
        console.print(table)

    for finding in report.findings:
        who = (
            f"ranks {int_ranges(finding.ranks)} vs rank {finding.reference_rank}"
            if finding.ranks
            else "on rank 0's host, across hash seeds"
        )
        console.print(
            f"[bold red]✗ {finding.kind}[/] {who} · {finding.snapshot} · [italic]{finding.cause}[/]"
        )
        console.print(f"  {escape(finding.summary)}", highlight=False)

    if report.not_compared:
        console.print(
            f"values not compared on {ranks_label(report.not_compared)}: every tensor on meta "
            "(nothing to compare before the load)",
            style="dim",
            highlight=False,
        )
    _render_loaders(report, console)
    _render_load(report, console)
    _render_step(report, console)

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


def memory_cell(memory: Sequence[MemoryRecord], ranks: Sequence[int]) -> str:
    """The host memory the group's ranks held for the model (the least and the most, with its
    rank), and CUDA's highest peak where they used CUDA: ``+96 MiB … +1.50 GiB (rank 0)``."""
    mine = [m for m in memory if m.rank in set(ranks)]
    held_by = {m.rank: h for m in mine if (h := held(m)) is not None}
    if not held_by:
        return "-"
    top = max(held_by, key=lambda r: held_by[r])
    low, high = size_label(min(held_by.values())), size_label(held_by[top])
    cell = f"+{high}" if low == high else f"+{low} … +{high} (rank {top})"
    cuda = [m.cuda_peak for m in mine if m.cuda_peak is not None]
    cuda += [s.cuda_peak for m in mine for s in m.stages if s.cuda_peak is not None]
    return cell + (f"; CUDA peak {size_label(max(cuda))}" if cuda else "")


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
    if all(p.worst == LoaderVerdict.OK and p.observed in (None, "ok") for p in report.loaders):
        ran = sum(p.observed == LoaderVerdict.OK for p in report.loaders)
        tail = f" ({ran} run for real: ok)" if ran else ""
        count = len(report.loaders)
        console.print(f"loaders: all {count} known loaders would load these ranks{tail}")
        return
    observed = any(p.observed_detail is not None for p in report.loaders)
    table = Table(title="what each loader would do on these ranks", title_justify="left")
    backend = next((p.backend for p in report.loaders if p.backend), "")
    beside = any(p.beside for p in report.loaders)
    table.add_column("loader", style="bold")
    table.add_column(f"verdict ({backend})" if backend and beside else "verdict")
    if beside:
        table.add_column("other backend")
    if observed:
        table.add_column("observed (gloo)")
    table.add_column("why", overflow="fold")
    for p in report.loaders:
        cells = [p.name, Text(p.verdict, style=_LOADER_STYLE.get(p.verdict, ""))]
        if beside:
            other = p.on_nccl or p.on_gloo
            cells.append(Text(p.beside, style=_LOADER_STYLE.get(other, "")) if other else "same")
        if observed:
            seen = p.observed or "not run"
            cells.append(Text(seen, style=_LOADER_STYLE.get(seen, "dim")))
        cells.append(p.summary)
        table.add_row(*cells)
    console.print(table)
    for p in report.loaders:
        why = escape(str((p.observed_detail or {}).get("summary", "")))
        if p.observed_detail is not None and p.observed is None:
            console.print(f"{p.name} not run for real: {why}", style="dim")
        elif p.observed not in (None, LoaderVerdict.OK):
            console.print(f"{p.name} for real (child job): [bold]{p.observed}[/] — {why}")


def _render_load(report: Report, console: Console) -> None:
    load, verified = report.load, report.verify
    if verified is not None:
        status = "[green]passed[/]" if verified.passed else "[bold red]FAILED[/]"
        ranks = f"{report.world_size} rank{'s' if report.world_size != 1 else ''}"
        outcome = f"{status}: {verified.checked} tensors checked on {ranks}"
    if load is not None and load.method == LoadMethod.RESUME and verified is not None:
        console.print(
            f"resume: {load.params_loaded} state-dict entries {escape(load.message)} "
            f"({load.seconds:.2f}s); verification against rank 0's checkpoint {outcome}"
        )
    elif load is not None and load.outcome == LoadStatus.LOADED and verified is not None:
        console.print(
            f"sorted loader: {load.params_loaded} state-dict entries {_load_method(load)}, "
            f"{load.buffers_broadcast} non-persistent buffers in {load.collectives} collectives "
            f"({load.seconds:.2f}s); verification {outcome}"
        )
    elif load is not None and load.outcome == LoadStatus.REFUSED:
        console.print(f"[yellow]sorted loader refused[/] (no rank hung): {escape(load.message)}")
    elif load is not None and load.outcome == LoadStatus.SKIPPED and not report.errors:
        console.print(f"sorted loader not run: {escape(load.message)}", style="dim")
    checked = report.source_check
    if checked is not None and checked.ran:  # --source: every rank against the checkpoint
        status = "[green]passed[/]" if checked.passed else "[bold red]FAILED[/]"
        console.print(
            f"against the checkpoint (--source): {status}: each rank read its own slices, "
            f"{checked.checked} tensors checked per rank"
        )


def _render_step(report: Report, console: Console) -> None:
    """``audit --step``: one line saying how the step went; its findings are listed above."""
    if "step" not in report.timings:
        return
    found = [f for f in report.findings if f.snapshot == Snapshot.STEP]
    raised = sorted(e.rank for e in report.errors if e.stage in (Stage.STEP, Stage.STEP_REPORT))
    diverged = [f for f in found if f.kind == FindingKind.STEP]
    if diverged:
        what = f"stopped at collective #{diverged[0].details.get('seq', '?')}: the ranks differ"
    elif raised:
        what = f"failed on {ranks_label(raised)}"
    elif found:
        what = f"finished; {', '.join(sorted({str(f.kind) for f in found}))} after it"
    else:
        what = "finished; every collective the same on every rank"
    verdict = "inconsistent" if found else "error" if raised else "consistent"
    seconds = f"{report.timings['step']:.3f} s"
    if "step-watch" in report.timings:
        seconds += f", watch {report.timings['step-watch']:.3f} s"
    console.print(f"step: {verdict} · {what} ({seconds})", style="dim", highlight=False)
    if report.step is not None:
        console.print(f"  ran {report.step.description}", style="dim", highlight=False)


def _load_method(load: LoadOutcome) -> str:
    if load.method == LoadMethod.BUCKETED:
        return f"in {load.state_messages} point-to-point buckets ({load.state_bytes:,} bytes)"
    if load.fallback_reason:
        return f"via DCP [yellow](fell back: {escape(load.fallback_reason)})[/]"
    return "via DCP"


# ---------------------------------------------------------------- messages


def command_error(title: str, message: str) -> str:
    """A command's explained failure: ``fsdpcheck probe: <the paragraph>``."""
    return f"[bold red]{escape(title)}[/]: {escape(message)}"


def rank_error(error: RankError) -> str:
    """A rank's failure before any gather (bad input, an unreachable rendezvous)."""
    return f"[bold red]fsdpcheck: rank {error.rank}: {error.stage}[/]: {escape(error.message)}"


def rank_failed(error: RankError) -> str:
    """A rank's own failure when no report reached it (the others' report is on rank 0)."""
    return (
        f"[bold red]fsdpcheck: rank {error.rank} failed at {error.stage}[/]: "
        f"{escape(error.message)}"
    )


def output_failed(option: str, path: Path, exc: OSError) -> str:
    return (
        f"[bold red]fsdpcheck[/]: {option} {escape(str(path))} could not be written "
        f"({escape(exc.strerror or str(exc))}); pass a path in a folder with room."
    )


def note(text: str) -> str:
    return f"[yellow]! {escape(text)}[/]"


def presets_table(presets: Iterable[Preset]) -> Table:
    table = Table(title="fsdpcheck presets")
    table.add_column("name", style="bold")
    table.add_column("architecture")
    table.add_column("what it shows")
    for preset in presets:
        table.add_row(preset.name, preset.architecture, preset.description)
    return table


def fingerprint_written(record: RankRecord, path: Path) -> str:
    stages = [
        f"{fp.snapshot} {len(fp.buffers)} buffers, {len(fp.params)} params"
        for fp in record.fingerprints()
    ]
    return (
        f"fsdpcheck fingerprint: rank {record.env.rank} ({'; '.join(stages)}) → {escape(str(path))}"
    )


def fingerprint_failed(record: RankRecord, path: Path) -> str:
    assert record.error is not None
    return (
        f"[bold red]fsdpcheck fingerprint: rank {record.env.rank} failed at "
        f"{record.error.stage}[/]: {escape(record.error.message)}\n"
        f"(the error is recorded in {escape(str(path))}, so `fsdpcheck diff` names it)"
    )


def diff_inputs(report: Report) -> list[str]:
    """One dim line per fingerprint diff read: its rank, file, host and creation time."""
    lines = []
    for item in report.options.get("inputs", ()):
        recorded = item["recorded_rank"]
        moved = f" (recorded as rank {recorded})" if recorded != item["rank"] else ""
        created = f" · {escape(item['created'])}" if item["created"] else ""
        lines.append(
            f"[dim]rank {item['rank']}{moved} ← {escape(item['path'])} · "
            f"{escape(item['host'])}{created}[/]"
        )
    return lines


def trace_inputs(report: Report) -> list[str]:
    """One dim line per dump ``explain`` read (rank, file, collectives), then per fingerprint."""
    lines = []
    for item in report.options.get("inputs", ()):
        wrapped = " · buffer wrapped" if item["truncated"] else ""
        lines.append(
            f"[dim]rank {item['rank']} ← {escape(item['path'])} · {item['format']} · "
            f"{item['collectives']} collectives{wrapped}[/]"
        )
    for item in report.options.get("fingerprints", ()):
        lines.append(
            f"[dim]rank {item['rank']} fingerprint ← {escape(item['path'])} · "
            f"{escape(item['host'])}[/]"
        )
    return lines


# ---------------------------------------------------------------- probe


def probe_header(model: str, result: ProbeResult) -> str:
    architecture = f" ({result.architecture})" if result.architecture else ""
    return (
        f"[bold]fsdpcheck probe[/] · {escape(model)}{architecture} · "
        f"PYTHONHASHSEED {result.seeds[0]}..{result.seeds[-1]} · "
        f"transformers {result.transformers or '-'}"
    )


def probe_table(result: ProbeResult) -> Any:
    """A rich Table of the reordering modules: one row per (module, order variant)."""

    table = Table(title="tensor orders under each PYTHONHASHSEED", title_justify="left")
    for column in ("module", "kind", "seeds", "order", "shapes", "loader outcome"):
        table.add_column(column, overflow="fold")
    for r in result.reorders:
        shapes = {t.name: t.shape for t in r.tensors}
        for i, v in enumerate(r.variants):
            short = [n.rpartition(".")[2] for n in v.order]
            table.add_row(
                (r.module or "<root>") if i == 0 else "",
                r.kind if i == 0 else "",
                int_ranges(v.seeds),
                ", ".join(short),
                ", ".join(str(list(shapes[n])) for n in v.order),
                (
                    "[red]hang (sizes differ)[/]"
                    if r.sizes_differ
                    else "[red]silent corruption (same sizes)[/]"
                )
                if i == 0
                else "",
            )
    return table


def probe_summary(result: ProbeResult) -> str:
    """The verdict line, as rich markup."""
    style = {Verdict.LATENT: "bold red", Verdict.CONSISTENT: "bold green"}.get(
        result.verdict, "bold red"
    )
    what = {
        Verdict.LATENT: (
            f"{len(result.tensors)} tensor(s) change order with the hash seed "
            f"({result.orders} distinct orders over {len(result.seeds)} seeds); a loader pairing "
            f"them by local order would {'hang' if result.sizes_differ else 'corrupt silently'}"
        ),
        Verdict.CONSISTENT: (
            f"the same buffer and parameter order under all {len(result.seeds)} hash seeds"
        ),
        Verdict.ERROR: f"{len(result.errors)} of {len(result.seeds)} seeds failed",
    }[result.verdict]
    return f"[bold]verdict:[/] [{style}]{result.verdict}[/] (exit {result.exit_code}) · {what}"


def probe_errors(result: ProbeResult) -> list[str]:
    return seed_errors(result.errors)


def seed_errors(errors: Sequence[SeedError]) -> list[str]:
    """The failed seeds (probe, scan) as rich markup lines, one per distinct message."""
    grouped: dict[tuple[str, str], list[int]] = {}
    for e in errors:
        grouped.setdefault((e.kind, e.message), []).append(e.seed)
    return [
        f"[bold red]✗ seed{'s' if len(s) > 1 else ''} {int_ranges(s)} ({kind})[/]: {escape(msg)}"
        for (kind, msg), s in grouped.items()
    ]


# ---------------------------------------------------------------- scan


_SCAN_STYLE = {
    ScanVerdict.OK: "green",
    ScanVerdict.HANG: "bold red",
    ScanVerdict.SILENT_CORRUPTION: "bold red",
    ScanVerdict.SKIPPED: "yellow",
}


def scan_table(result: ScanResult, *, all_rows: bool = True) -> Any:
    """A rich Table: architecture, hash-seed-dependent tensors, verdict (non-ok rows first)."""

    table = Table(
        title=f"hash-seed scan · transformers {result.transformers} · "
        f"{len(result.seeds)} seeds · {len(result.rows)} architectures",
        title_justify="left",
    )
    table.add_column("architecture")
    table.add_column("class")
    table.add_column("hash-seed-dependent tensors", overflow="fold")
    table.add_column("verdict")
    order = {v: i for i, v in enumerate(ScanVerdict)}
    for row in sorted(result.rows, key=lambda r: (order.get(r.verdict, 9), r.id)):
        if not all_rows and row.verdict == ScanVerdict.OK:
            continue
        tensors = "; ".join(
            f"{r.module or '<root>'}: "
            + ", ".join(f"{t.name.rpartition('.')[2]} {list(t.shape)}" for t in r.tensors)
            for r in row.reorders
        )
        style = _SCAN_STYLE.get(row.verdict, "")
        table.add_row(row.id, row.architecture, escape(tensors), f"[{style}]{escape(row.label)}[/]")
    return table


def scan_errors(result: ScanResult) -> list[str]:
    return seed_errors(result.errors)


def scan_summary(result: ScanResult) -> str:
    """One line of counts, as rich markup."""
    c = result.counts
    return (
        f"[bold]{len(result.rows)} architectures[/] in {result.elapsed:.0f} s: "
        f"[green]{c.get(ScanVerdict.OK, 0)} ok[/] · "
        f"[bold red]{c.get(ScanVerdict.HANG, 0)} hang[/] · "
        f"[bold red]{c.get(ScanVerdict.SILENT_CORRUPTION, 0)} silent-corruption[/] · "
        f"[yellow]{c.get(ScanVerdict.SKIPPED, 0)} skipped[/] (exit {result.exit_code})"
    )


# ---------------------------------------------------------------- progress


def stdout_console() -> Console:
    # Logs and CI capture are not terminals: give tables room instead of rich's 80 columns.
    return Console(soft_wrap=True, width=None if sys.stdout.isatty() else 120)


def stderr_console() -> Console:
    return Console(stderr=True, soft_wrap=True)


class StageStatus:
    """A spinner on rank 0's terminal naming the stage in progress; silent in logs and CI."""

    def __init__(self, rank: int):
        self._status = None
        if rank == 0 and sys.stderr.isatty():
            self._status = stderr_console().status("fsdpcheck: starting", spinner="dots")

    def __enter__(self) -> StageStatus:
        if self._status is not None:
            self._status.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._status is not None:
            self._status.stop()

    def update(self, stage: str) -> None:
        if self._status is not None:
            self._status.update(f"fsdpcheck: {stage}")


class CountProgress:
    """A bar with counts (probe seeds, scan builds) on a terminal; nothing in logs and CI."""

    def __init__(self, title: str, console: Console | None = None):
        self._bar = None
        active = console.is_terminal if console is not None else sys.stderr.isatty()
        if active:
            columns = (
                TextColumn(f"[bold]{escape(title)}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.description}"),
            )
            self._bar = Progress(*columns, console=console or stderr_console(), transient=True)
            self._task = self._bar.add_task("starting", total=None)

    def __enter__(self) -> CountProgress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()

    def update(self, done: int, total: int, label: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=done, total=total, description=escape(label))
