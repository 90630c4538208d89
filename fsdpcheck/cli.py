"""The command line: parse, call the library, render. Nothing here runs collectives itself."""

from __future__ import annotations

import gc
import os
import signal
import sys
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.markup import escape

if TYPE_CHECKING:
    from fsdpcheck.records import RankError, Report

app = typer.Typer(
    help="Find cross-rank buffer/parameter mismatches before FSDP2 training does.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
)

_REEXEC_MARK = "FSDPCHECK_HASH_SEED_VARIED"

AUDIT_EPILOG = """
[bold]Examples[/]

  torchrun --nproc-per-node 2 -m fsdpcheck audit --model tiny-gemma4 --json report.json

  torchrun --nproc-per-node 2 -m fsdpcheck audit --model hazard --vary-hash-seed

  torchrun --nproc-per-node 8 -m fsdpcheck audit --model /ckpt/my-model --dtype bfloat16

  fsdpcheck audit --model google/gemma-3-1b-it --init meta   [dim](one rank, from the HF cache)[/]

[bold]Exit codes[/]: 0 consistent · 1 findings · 2 bad usage or input · 3 runtime failure.
"""


class Backend(str, Enum):
    auto = "auto"
    nccl = "nccl"
    gloo = "gloo"


class Init(str, Enum):
    rank0 = "rank0"
    meta = "meta"
    all = "all"


class DType(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


@app.command(epilog=AUDIT_EPILOG)
def audit(
    model: str = typer.Option(
        "hazard", "--model", "-m", help="Preset name, local model directory, or cached hub id."
    ),
    backend: Backend = typer.Option(
        Backend.auto, help="Process-group backend (auto: nccl with CUDA, else gloo)."
    ),
    timeout: float = typer.Option(
        60.0, min=1.0, help="Seconds any collective may wait before the audit gives up."
    ),
    init: Init = typer.Option(
        Init.rank0, help="rank0: rank 0 real, others meta (as verl); meta: all meta; all: all real."
    ),
    dtype: DType | None = typer.Option(None, help="Build dtype \\[default: the config's]."),
    seed: int = typer.Option(0, help="Random-init seed when the model has no checkpoint."),
    wrap_class: list[str] = typer.Option(
        [],
        "--wrap-class",
        help="Layer class to fully_shard (repeatable) \\[default: _no_split_modules].",
    ),
    min_params: int = typer.Option(
        100_000_000, help="Size-based wrapping threshold, used when no wrap class is present."
    ),
    text_only: bool = typer.Option(False, help="Build only the text model of a multimodal config."),
    trust_remote_code: bool = typer.Option(
        False, help="Allow the model's own Python code (off: never runs remote code)."
    ),
    allow_pickle: bool = typer.Option(
        False, help="Allow pickle weights (*.bin, *.pt); safetensors only by default."
    ),
    vary_hash_seed: bool = typer.Option(
        False,
        help="Give each rank its own PYTHONHASHSEED (= its rank), so a hash-order dependence "
        "shows up as a real cross-rank divergence every run.",
    ),
    probe: int = typer.Option(
        0,
        min=0,
        help="Rank 0 also builds the model under this many fixed hash seeds (8 is a good "
        "choice) and reports a hash-seed dependence as verdict 'latent' even when every rank "
        "agrees now.",
    ),
    download: bool = typer.Option(
        False,
        help="Let rank 0 download a hub id into the HF cache first (config and safetensors "
        "only); the other ranks wait, then read the cache. Off: never touches the network.",
    ),
    load: bool = typer.Option(
        True, help="Run the sorted, validated loader and verify every rank afterwards."
    ),
    reproduce: bool = typer.Option(
        False,
        help="Also run the unsafe named-buffers-order loader in an isolated 2-rank child job "
        "(bounded by --timeout) to show its real failure.",
    ),
    mesh: str | None = typer.Option(
        None, help="REPLICATE,SHARD for HSDP (a 2-D mesh whose product is the world size)."
    ),
    json_path: Path | None = typer.Option(
        None, "--json", help="Write the machine-readable report here (rank 0)."
    ),
) -> None:
    """Build MODEL on every rank, fully_shard it, and compare every rank's buffers and params."""
    if vary_hash_seed and os.environ.get(_REEXEC_MARK) != "1":
        _reexec_with_rank_hash_seed()

    from fsdpcheck.audit import run_audit
    from fsdpcheck.console import StageStatus, render
    from fsdpcheck.errors import FsdpcheckError
    from fsdpcheck.options import AuditOptions
    from fsdpcheck.output import write_json
    from fsdpcheck.records import RankError
    from fsdpcheck.vocab import Stage

    options = AuditOptions(
        model=model,
        backend=backend.value,
        timeout=timeout,
        init=init.value,
        dtype=dtype.value if dtype else None,
        seed=seed,
        text_only=text_only,
        trust_remote_code=trust_remote_code,
        allow_pickle=allow_pickle,
        wrap_classes=tuple(wrap_class),
        min_params=min_params,
        mesh=_parse_mesh(mesh),
        load=load,
        reproduce=reproduce,
        probe=probe,
        download=download,
    )
    rank = int(os.environ.get("RANK", "0") or 0)

    def publish(report: Report) -> None:
        render(report, _stdout())
        if json_path is not None:
            write_json(report, json_path)

    signal.signal(signal.SIGTERM, _terminated)
    # A short-lived process that imports torch and transformers and builds a model: with the
    # default thresholds, Python runs full collections over that whole heap several times
    # (about 0.6 s of CPU per rank on a 70B-shaped config); far fewer young ones do the job.
    gc.set_threshold(50_000, 100, 100)
    try:
        with StageStatus(rank) as status:
            result = run_audit(options, progress=status.update, publish=publish)
    except FsdpcheckError as exc:  # raised before any gather: bad input, unreachable rendezvous
        _fail(RankError(rank, Stage.LAUNCH, str(exc), exc.kind), exc.exit_code, json_path, options)

    if result.report is None and result.own_error is not None:
        _stderr().print(
            f"[bold red]fsdpcheck: rank {rank} failed at {result.own_error.stage}[/]: "
            f"{escape(result.own_error.message)}",
            highlight=False,
        )
    if result.exit_code != 0:
        _tell_torchrun(result.headline or "fsdpcheck audit failed; see rank 0's report")
    raise typer.Exit(result.exit_code)


def _parse_mesh(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(part) for part in text.replace("x", ",").split(","))
    except ValueError:
        raise typer.BadParameter(f"{text!r}: expected REPLICATE,SHARD, e.g. 2,4") from None


def _stdout() -> Console:
    from fsdpcheck.console import stdout_console

    return stdout_console()


def _stderr() -> Console:
    from fsdpcheck.console import stderr_console

    return stderr_console()


def _fail(error: RankError, exit_code: int, json_path: Path | None, options: object) -> None:
    from fsdpcheck.output import write_json
    from fsdpcheck.report import error_report

    _stderr().print(
        f"[bold red]fsdpcheck: rank {error.rank}: {error.stage}[/]: {escape(error.message)}",
        highlight=False,
    )
    if json_path is not None and error.rank == 0:
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        write_json(error_report([error], world, options), json_path)
    _tell_torchrun(error.message)
    raise typer.Exit(exit_code)


class Terminated(Exception):
    """SIGTERM, e.g. torchrun stopping the job because another rank exited."""


def _terminated(signum: int, frame: object) -> None:
    # An exception, not an exit: the audit's failure path still names the cause and, on
    # rank 0, writes the report before the launcher's follow-up SIGKILL.
    raise Terminated("stopped by SIGTERM (the launcher is ending the job)")


def _tell_torchrun(message: str) -> None:
    """Write torch elastic's error file, so torchrun's summary names the cause, not exit codes.

    Its plain form (a message and a timestamp, no traceback): the summary shows the one-line
    cause as it is, where a recorded exception would show a Python traceback."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    import json
    import time

    try:
        with open(path, "w") as file:
            json.dump({"message": f"fsdpcheck: {message}", "timestamp": int(time.time())}, file)
    except OSError:  # a summary without the cause is worse, but never a reason to fail
        pass


def _reexec_with_rank_hash_seed() -> None:
    """Restart this interpreter with PYTHONHASHSEED = RANK, before anything is hashed for real."""
    env = dict(os.environ)
    env["PYTHONHASHSEED"] = env.get("RANK", "0")
    env[_REEXEC_MARK] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "fsdpcheck", *sys.argv[1:]], env)


@app.command()
def presets() -> None:
    """List the built-in models."""
    from rich.table import Table

    from fsdpcheck.model.presets import PRESETS

    table = Table(title="fsdpcheck presets")
    table.add_column("name", style="bold")
    table.add_column("architecture")
    table.add_column("what it shows")
    for preset in PRESETS.values():
        table.add_row(preset.name, preset.architecture, preset.description)
    Console().print(table)


PROBE_EPILOG = """
[bold]Examples[/]

  fsdpcheck probe --model hazard --json probe.json

  fsdpcheck probe --model /ckpt/my-model --text-only --seeds 16

[bold]Exit codes[/]: 0 consistent · 1 latent (order follows the seed) · 2 bad input · 3 failure.
"""


@app.command(epilog=PROBE_EPILOG)
def probe(
    model: str = typer.Option(
        ..., "--model", "-m", help="Preset name, local model directory, or cached hub id."
    ),
    seeds: int | None = typer.Option(
        None,
        min=2,
        help="Hash seeds to try, 0..K-1 \\[default: 8, missing a 2-way set order "
        "with probability 1/128].",
    ),
    json_path: Path | None = typer.Option(None, "--json", help="Write the result as JSON here."),
    text_only: bool = typer.Option(False, help="Build only the text model of a multimodal config."),
    trust_remote_code: bool = typer.Option(
        False, help="Allow the model's own Python code (off: never runs remote code)."
    ),
    jobs: int | None = typer.Option(None, min=1, help="Children at a time \\[default: CPU count]."),
    timeout: float = typer.Option(180.0, min=1.0, help="Seconds each child may take (killed)."),
) -> None:
    """Show whether MODEL's buffer/parameter order depends on PYTHONHASHSEED (no ranks needed).

    Builds the model on meta in K child interpreters with PYTHONHASHSEED = 0..K-1 (in parallel,
    each with a deadline) and compares their buffer and parameter orders. A two-element set
    iterates in one of 2 orders with probability ~1/2 per seed, so with the default 8 seeds all
    agree by chance with probability 2·2⁻⁸ = 1/128 (< 1%); seeds 0 and 1 already differ for
    {"sliding_attention", "full_attention"}.
    """
    from fsdpcheck.children.probe import DEFAULT_SEEDS
    from fsdpcheck.children.probe import probe as run_probe
    from fsdpcheck.console import probe_errors, probe_summary, probe_table
    from fsdpcheck.errors import FsdpcheckError
    from fsdpcheck.output import write_json

    try:
        result = run_probe(
            model,
            seeds=seeds or DEFAULT_SEEDS,
            text_only=text_only,
            trust_remote_code=trust_remote_code,
            jobs=jobs,
            timeout=timeout,
        )
    except FsdpcheckError as exc:
        _stderr().print(f"[bold red]fsdpcheck probe[/]: {escape(str(exc))}", highlight=False)
        raise typer.Exit(exc.exit_code) from None
    console = _stdout()
    console.print(
        f"[bold]fsdpcheck probe[/] · {escape(model)}"
        f"{f' ({result.architecture})' if result.architecture else ''} · "
        f"PYTHONHASHSEED {result.seeds[0]}..{result.seeds[-1]} · "
        f"transformers {result.transformers or '-'}",
        highlight=False,
    )
    if result.reorders:
        console.print(probe_table(result))
    for line in probe_errors(result):
        console.print(line, highlight=False)
    console.print(probe_summary(result), highlight=False)
    if json_path is not None:
        write_json(result, json_path)
    raise typer.Exit(result.exit_code)


SCAN_EPILOG = """
[bold]Examples[/]

  fsdpcheck scan --json scan.json          [dim](every causal LM of the installed transformers)[/]

  fsdpcheck scan --filter gemma --filter 'qwen3*' --seeds 4

  fsdpcheck scan --filter LlamaForCausalLM --preset hazard --preset hazard-equal

[bold]Exit codes[/]: 0 none found · 1 a row would hang or corrupt · 2 bad input · 3 no result.
"""


@app.command(epilog=SCAN_EPILOG)
def scan(
    filters: list[str] = typer.Option(
        [],
        "--filter",
        "-f",
        help="Case-insensitive substring, or glob with *?[, on model_type "
        "or class name (repeatable; any may match) \\[default: all].",
    ),
    seeds: int | None = typer.Option(None, min=2, help="Hash seeds, 0..K-1 \\[default: 8]."),
    json_path: Path | None = typer.Option(None, "--json", help="Write the table as JSON here."),
    timeout: float = typer.Option(
        1800.0, min=1.0, help="Seconds each child (one seed, all architectures) may take."
    ),
    arch_timeout: float = typer.Option(
        60.0, min=1.0, help="Seconds one architecture may take to build (else skipped)."
    ),
    masked_lm: bool = typer.Option(False, help="Also scan the masked-LM (encoder) architectures."),
    preset: list[str] = typer.Option(
        [], "--preset", help="Add an fsdpcheck preset as an extra row, e.g. hazard (repeatable)."
    ),
    problems_only: bool = typer.Option(False, help="Leave the ok rows out of the table."),
    jobs: int | None = typer.Option(None, min=1, help="Children at a time \\[default: CPU count]."),
) -> None:
    """Survey the installed transformers: which architectures' order follows the hash seed.

    One child interpreter per hash seed (PYTHONHASHSEED = 0..K-1, in parallel) builds every
    selected architecture from a small config on meta, mixing sliding and full attention where
    the config has layer types; the rows compare the orders. Verdicts: ok · hang (reordered
    tensors differ in size) · silent-corruption (same sizes) · skipped: why.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from fsdpcheck.children.probe import DEFAULT_SEEDS
    from fsdpcheck.children.scan import scan as run_scan
    from fsdpcheck.console import scan_summary, scan_table
    from fsdpcheck.errors import FsdpcheckError
    from fsdpcheck.output import write_json

    families = ("causal-lm", "masked-lm") if masked_lm else ("causal-lm",)
    columns = (
        TextColumn("[bold]scan"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}"),
    )
    with Progress(*columns, console=_stderr(), transient=True) as bar:
        task = bar.add_task("listing architectures", total=None)

        def progress(done: int, total: int, label: str) -> None:
            bar.update(task, completed=done, total=total, description=escape(label))

        try:
            result = run_scan(
                filters,
                seeds=seeds or DEFAULT_SEEDS,
                families=families,
                presets=preset,
                jobs=jobs,
                timeout=timeout,
                arch_timeout=arch_timeout,
                progress=progress,
            )
        except FsdpcheckError as exc:
            bar.stop()
            _stderr().print(f"[bold red]fsdpcheck scan[/]: {escape(str(exc))}", highlight=False)
            raise typer.Exit(exc.exit_code) from None
    console = _stdout()
    console.print(scan_table(result, all_rows=not problems_only))
    for error in result.errors:
        console.print(f"[bold red]✗ seed {error.seed}[/]: {escape(error.message)}", highlight=False)
    console.print(scan_summary(result), highlight=False)
    if json_path is not None:
        write_json(result, json_path)
    raise typer.Exit(result.exit_code)


def main() -> None:
    app()
