"""The command line: parse, call the library, render. Nothing here runs collectives itself;
what the process does to its own interpreter is :mod:`fsdpcheck.process`, what it shows is
:mod:`fsdpcheck.console`."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import MISSING, fields
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import typer
from rich.console import Console

from fsdpcheck.options import AuditOptions
from fsdpcheck.vocab import Annotations, Backend, DType, ExitCode, Init, Loader

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from fsdpcheck.records import RankError, Report

app = typer.Typer(
    help="Find cross-rank buffer/parameter mismatches before FSDP2 training does.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
)

AUDIT_EPILOG = """
[bold]Examples[/]

  torchrun --nproc-per-node 2 -m fsdpcheck audit --model tiny-gemma4 --json report.json

  torchrun --nproc-per-node 2 -m fsdpcheck audit --model hazard --vary-hash-seed

  torchrun --nproc-per-node 8 -m fsdpcheck audit --model /ckpt/my-model --dtype bfloat16

  fsdpcheck audit --model google/gemma-3-1b-it --init meta   [dim](one rank, from the HF cache)[/]

[bold]Exit codes[/]: 0 consistent · 1 findings · 2 bad usage or input · 3 runtime failure.
"""


ANNOTATIONS_OPTION = typer.Option(
    Annotations.AUTO,
    help="GitHub workflow commands (::error/::warning) for findings on rank 0's stdout; auto: "
    "when GITHUB_ACTIONS=true.",
)


def _file_option(flag: str, what: str) -> Any:
    """An output file flag (--json, --junit, --sarif): off unless given."""
    return typer.Option(None, flag, help=f"Write {what} here.")


OFFLINE_JSON_OPTION = _file_option("--json", "the machine-readable report (the audit's schema)")
OFFLINE_JUNIT_OPTION = _file_option("--junit", "a JUnit XML file: a test case per check")


# Every default is AuditOptions' own (BuildSpec's for the model options): typed once, there.
_DEFAULTS = {f.name: f.default for f in fields(AuditOptions) if f.default is not MISSING}


def _default(name: str) -> Any:
    """``AuditOptions``' default for field ``name``, as a Typer option takes it."""
    value = _DEFAULTS[name]
    return list(value) if isinstance(value, tuple) else value


# Options shared by the commands that build a model (audit, fingerprint).
DTYPE_OPTION = typer.Option(_default("dtype"), help="Build dtype \\[default: the config's].")
SEED_OPTION = typer.Option(
    _default("seed"), help="Random-init seed when the model has no checkpoint."
)
WRAP_CLASS_OPTION = typer.Option(
    _default("wrap_classes"),
    "--wrap-class",
    help="Layer class to fully_shard (repeatable) \\[default: _no_split_modules].",
)
MIN_PARAMS_OPTION = typer.Option(
    _default("min_params"),
    help="Size-based wrapping threshold, used when no wrap class is present.",
)
TEXT_ONLY_OPTION = typer.Option(
    _default("text_only"), help="Build only the text model of a multimodal config."
)
TRUST_REMOTE_CODE_OPTION = typer.Option(
    _default("trust_remote_code"),
    help="Allow the model's own Python code (off: never runs remote code).",
)
ALLOW_PICKLE_OPTION = typer.Option(
    _default("allow_pickle"),
    help="Allow pickle weights (*.bin, *.pt); safetensors only by default.",
)
INIT_HELP = "rank0: rank 0 real, others meta (as verl); meta: all meta; all: all real."

# The audit's own options, by AuditOptions field: what each does (--help).
AUDIT_HELP = {
    "model": "Preset name, local model directory, or cached hub id \\[default: hazard].",
    "builder": "MODULE:FUNCTION or FILE.py:FUNCTION that builds the model instead of --model: "
    "every rank calls FUNCTION(ctx) (ctx.rank, ctx.world_size, ctx.local_rank, ctx.device, "
    "ctx.mesh) and gets the model, wrapped in FSDP2 or not, or (model, rank 0's state dict). "
    "[bold]This runs your code[/]: pass only a builder you would run as a training script.",
    "resume": "A torch.distributed.checkpoint directory (or a root with a LATEST file) to resume "
    "from, as the trainer does: every rank builds on meta, shards, then loads its shards with "
    "dcp.load; the ranks' resolved path, step and .metadata digest are compared and every rank "
    "is verified against rank 0's checkpoint. dcp.load unpickles .metadata: resume only from a "
    "checkpoint you trust.",
    "source": "The checkpoint the model is loaded from, as the reference: a .safetensors file, a "
    "sharded model.safetensors.index.json (or its directory), or a DCP directory. After the "
    "load every rank proves each of its local shards and buffers equals its slice of it, "
    "reading only that slice; a difference is a 'source' finding (a load wrong the same way on "
    "every rank shows only here).",
    "backend": "Process-group backend (auto: nccl with CUDA, else gloo).",
    "timeout": "Seconds any collective may wait before the audit gives up.",
    "probe": "Rank 0 also builds the model under this many fixed hash seeds (8 is a good choice) "
    "and reports a hash-seed dependence as verdict 'latent' even when every rank agrees now.",
    "download": "Let rank 0 download a hub id into the HF cache first (config and safetensors "
    "only); the other ranks wait, then read the cache. Off: never touches the network.",
    "load": "Run the sorted, validated loader and verify every rank afterwards.",
    "reproduce": "Also run every known loader for real, each once in its own isolated 2-rank "
    "gloo child job on the audited model (within 3/4 of --timeout in all: give --timeout 120 or "
    "more), and report what each really did next to its prediction.",
    "loaders": "With --reproduce: run only this loader (repeat for more; default: every one), "
    "e.g. the one your trainer uses. The others keep their predictions.",
    "step": "After the load, run one synthetic training step (seeded tokens, causal-LM loss, "
    "AdamW) with every collective agreed on by every rank before it is issued; names the first "
    "that differs, and NaN or Inf after the step.",
    "mesh": "REPLICATE,SHARD for HSDP (a 2-D mesh whose product is the world size), or named "
    "dims (torchtitan's: dp_replicate, dp_shard, ep, tp), e.g. dp_replicate=2,dp_shard=2,tp=2; "
    "a builder gets it as ctx.mesh.",
    "tp": "Apply the model's own transformers tensor-parallel plan over N ranks (the mesh's tp "
    "dim), then FSDP2 over the data dims; alone, the mesh is dp_shard=WORLD/N,tp=N.",
    "ep": "Apply the model's own transformers expert-parallel plan over N ranks (the mesh's ep "
    "dim): experts Shard(0) over ep, then FSDP2 over dp_shard; everything else FSDP2 over "
    "dp_shard and ep together. Alone, the mesh is dp_shard=WORLD/N,ep=N.",
    "cpu_offload": "Shard with FSDP2's CPUOffloadPolicy (parameters live on CPU between steps), "
    "as offloading jobs do.",
}


def _audit_option(name: str, *decls: str, **kwargs: Any) -> Any:
    """The Typer option for ``AuditOptions`` field ``name``: its default, its help."""
    return typer.Option(_default(name), *decls, help=AUDIT_HELP[name], **kwargs)


@app.command(epilog=AUDIT_EPILOG)
def audit(
    model: str | None = _audit_option("model", "--model", "-m", show_default=False),
    builder: str | None = _audit_option("builder"),
    resume: str | None = _audit_option("resume"),
    source: str | None = _audit_option("source"),
    backend: Backend = _audit_option("backend"),
    timeout: float = _audit_option("timeout"),
    init: Init = typer.Option(_default("init"), help=INIT_HELP),
    dtype: DType | None = DTYPE_OPTION,
    seed: int = SEED_OPTION,
    wrap_classes: list[str] = WRAP_CLASS_OPTION,
    min_params: int = MIN_PARAMS_OPTION,
    text_only: bool = TEXT_ONLY_OPTION,
    trust_remote_code: bool = TRUST_REMOTE_CODE_OPTION,
    allow_pickle: bool = ALLOW_PICKLE_OPTION,
    vary_hash_seed: bool = typer.Option(
        False,
        help="Give each rank its own PYTHONHASHSEED (= its rank), so a hash-order dependence "
        "shows up as a real cross-rank divergence every run.",
    ),
    probe: int = _audit_option("probe"),
    download: bool = _audit_option("download"),
    load: bool = _audit_option("load"),
    reproduce: bool = _audit_option("reproduce"),
    loaders: list[Loader] = _audit_option(
        "loaders", "--loader", metavar="NAME", show_default=False
    ),
    step: bool = _audit_option("step"),
    mesh: str | None = _audit_option("mesh"),
    tp: int | None = _audit_option("tp"),
    ep: int | None = _audit_option("ep"),
    cpu_offload: bool = _audit_option("cpu_offload"),
    json_path: Path | None = _file_option("--json", "the machine-readable report (rank 0)"),
    junit_path: Path | None = _file_option(
        "--junit", "a JUnit XML file (rank 0): a test case per check"
    ),
    annotations: Annotations = ANNOTATIONS_OPTION,
) -> None:
    """Build MODEL on every rank, fully_shard it, and compare every rank's buffers and params."""
    options = _audit_options(locals())  # first: locals() is the parameters, nothing else yet
    from fsdpcheck import process

    if vary_hash_seed:
        process.vary_hash_seed()

    from fsdpcheck.audit import run_audit
    from fsdpcheck.console import StageStatus, rank_failed
    from fsdpcheck.distributed.launcher import rank_hint
    from fsdpcheck.errors import FsdpcheckError
    from fsdpcheck.records import RankError
    from fsdpcheck.vocab import Stage

    rank = rank_hint(os.environ)
    outputs = _Outputs(annotations, json=json_path, junit=junit_path)

    def publish(report: Report) -> None:
        from fsdpcheck.console import render

        render(report, _stdout())
        outputs.publish_report(report)

    process.raise_on_sigterm()
    process.tune_gc()
    try:
        with StageStatus(rank) as status:
            result = run_audit(
                options,
                progress=status.update,
                publish=publish,
                preflight=lambda: outputs.check(distributed=True),
                owns_process=True,  # a rank the others gave up on is ended, not left behind
            )
    except FsdpcheckError as exc:  # raised before any gather: bad input, unreachable rendezvous
        log.debug("rank %d: the audit refused to start", rank, exc_info=True)
        _fail(RankError(rank, Stage.LAUNCH, str(exc), exc.kind), exc.exit_code, outputs, options)

    if result.report is None and result.own_error is not None:
        _stderr().print(rank_failed(result.own_error), highlight=False)
    if result.exit_code != 0:
        process.tell_torchrun(result.headline or "fsdpcheck audit failed; see rank 0's report")
    raise typer.Exit(result.exit_code)


RUN_EPILOG = """
[bold]Examples[/]

  torchrun --nproc-per-node 2 -m fsdpcheck run train.py --lr 3e-4

  torchrun --nproc-per-node 8 -m fsdpcheck run --steps 1 --json run.json train.py
  [dim](a CI smoke job: stop after step 1, the verdict as exit code)[/]

  torchrun --nproc-per-node 2 -m fsdpcheck run -m torchtitan.train --job.config_file c.toml

  accelerate launch -m fsdpcheck run train.py

fsdpcheck's options go before the script, the script's own after it. The script runs as
[bold]python SCRIPT.py ARGS[/] would (its __main__, sys.argv, sys.path[0] and folder), with
no line of it changed. Checked: every collective from its first fully_shard to the end of its
first optimizer step, and before the model's first forward everything check_model checks,
tensors nothing wrote since to_empty() included. Then every hook is removed. See docs/run.md.

[bold]Exit codes[/]: the script's own when nothing is found · 1 findings (the job is stopped on
every rank) · 2 bad usage or input (and, with --strict, a script fsdpcheck could not check) ·
3 a rank died or stopped answering. With --steps N: the verdict's code after step N.
"""

RUN_HELP = {
    "watch_steps": "Optimizer steps watched from the first forward (every collective agreed "
    "on by every rank before it is issued).",
    "steps": "Stop the job after this many optimizer steps, with the verdict as the exit code "
    "(a CI smoke job) \\[default: run the job to its end].",
    "source": "The checkpoint the model is checked against after the script's load (a "
    ".safetensors file, an index, a DCP folder); 'none' to skip.",
    "strict": "Exit 2 when something was not checked (no fully_shard, no forward, no step "
    "seen), instead of a note.",
}


@app.command(
    epilog=RUN_EPILOG,
    context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
)
def run(
    timeout: float = _audit_option("timeout"),
    watch_steps: int = typer.Option(1, min=1, help=RUN_HELP["watch_steps"]),
    steps: int | None = typer.Option(None, min=1, help=RUN_HELP["steps"], show_default=False),
    source: str | None = typer.Option(None, help=RUN_HELP["source"], show_default=False),
    strict: bool = typer.Option(False, help=RUN_HELP["strict"]),
    json_path: Path | None = _file_option("--json", "the machine-readable report (rank 0)"),
    junit_path: Path | None = _file_option(
        "--junit", "a JUnit XML file (rank 0): a test case per check"
    ),
    annotations: Annotations = ANNOTATIONS_OPTION,
    script: list[str] = typer.Argument(
        None, metavar="SCRIPT.py [ARGS]... | -m MODULE [ARGS]...", show_default=False
    ),
) -> None:
    """Run a training script unmodified, checked from its first fully_shard to its first step."""
    from fsdpcheck import process
    from fsdpcheck.console import rank_failed
    from fsdpcheck.distributed.launcher import rank_hint
    from fsdpcheck.errors import FsdpcheckError, InputError
    from fsdpcheck.options import RunOptions
    from fsdpcheck.records import RankError
    from fsdpcheck.script import runner
    from fsdpcheck.script.api import watched_run
    from fsdpcheck.vocab import Stage

    rank = rank_hint(os.environ)
    outputs = _Outputs(annotations, json=json_path, junit=junit_path)
    try:
        target = runner.Target.parse(list(script or []))
        problem = target.problem()
        if problem:
            raise InputError(f"rank {rank}: {problem}")
        options = RunOptions(
            timeout=timeout, watch_steps=watch_steps, steps=steps, source=source, strict=strict
        )
    except FsdpcheckError as exc:
        log.debug("rank %d: fsdpcheck run refused to start", rank, exc_info=True)
        _fail(RankError(rank, Stage.LAUNCH, str(exc), exc.kind), exc.exit_code, outputs, None)
    if rank == 0:
        problem = outputs.check(distributed=True)
        if problem:
            _stderr().print(problem, highlight=False)

    def publish(report: Report) -> None:
        from fsdpcheck.console import render

        render(report, _stdout(), title="fsdpcheck run")
        outputs.publish_report(report, suite="fsdpcheck.run")

    try:
        outcome, error = watched_run(lambda: runner.run(target), options, publish)
    except KeyboardInterrupt as interrupted:  # as Python ends on one: traceback, then SIGINT
        runner.print_script_error(interrupted)
        process.end_by_sigint()
    for note in outcome.notes:
        _stderr().print(f"fsdpcheck run (rank {rank}): not checked: {note}", highlight=False)
    if outcome.report is None and outcome.own_error is not None:
        _stderr().print(rank_failed(outcome.own_error), highlight=False)
    code = _run_exit_code(error, outcome.exit_code)
    if code == 0 and strict and outcome.notes:
        code = ExitCode.BAD_INPUT
    if outcome.exit_code:  # fsdpcheck's verdict ended the job, not the script's own failure
        process.tell_torchrun(outcome.headline or "fsdpcheck run failed; see rank 0's report")
    raise typer.Exit(code)


def _run_exit_code(error: BaseException | None, verdict: int | None) -> int:
    """The run's exit code: the verdict's when it found something (every rank the same), else
    the script's own, as Python gives it (an uncaught exception, printed here: 1)."""
    from fsdpcheck.script.runner import print_script_error
    from fsdpcheck.script.session import RunStopped, ended_by_the_run

    if isinstance(error, RunStopped):
        return error.exit_code
    found = int(verdict) if verdict else 0
    if isinstance(error, SystemExit):
        if found:
            return found
        code = error.code
        if code is None or isinstance(code, int):
            return code or 0
        sys.stderr.write(f"{code}\n")
        return 1
    if error is not None and not ended_by_the_run(error):
        print_script_error(error)
        return found or 1
    return found


class _Outputs:
    """What rank 0 writes and prints besides the console: files (checked before any work, so an
    unwritable path is bad input, not a traceback at the end) and workflow annotations."""

    def __init__(self, annotations: Annotations, **paths: Path | None):
        from fsdpcheck.formats.annotations import enabled

        self.paths = {f"--{name}": path for name, path in paths.items()}
        self.annotate = enabled(annotations, os.environ)
        self.skipped: set[str] = set()
        self.failed = False

    def check(self, *, distributed: bool = False) -> str:
        """One paragraph naming every output that cannot be written ("" when all can)."""
        from fsdpcheck.output import output_problems, problems_paragraph

        problems = output_problems(self.paths.items())
        self.skipped = {p.split(" ", 1)[0] for p in problems}
        return problems_paragraph(problems, distributed=distributed) if problems else ""

    def write(self, option: str, writer) -> None:
        path = self.paths.get(option)
        if path is None or option in self.skipped:
            return
        try:
            writer(path)
        except OSError as exc:  # checked up front; a full disk can still say no
            log.debug("writing %s %s failed", option, path, exc_info=True)
            from fsdpcheck.console import output_failed

            self.failed = True
            _stderr().print(output_failed(option, path, exc), highlight=False)

    def exit_code(self, result: int) -> int:
        """The command's result, or 3 when it found nothing but an output could not be written."""
        return result or (ExitCode.RUNTIME if self.failed else ExitCode.CONSISTENT)

    def annotations(self, lines: list[str]) -> None:
        if self.annotate:
            for line in lines:
                print(line, flush=True)

    def finish(
        self,
        result: int,
        lines: list[Any],
        annotations: list[str],
        writers: dict[str, Callable[[Path], None]],
    ) -> NoReturn:
        """A single-process command's end: its lines on stdout, its annotations and files, and
        its exit code (3 where it found nothing but a file could not be written)."""
        console = _stdout()
        for line in lines:
            console.print(line, highlight=False)
        self.annotations(annotations)
        for option, writer in writers.items():
            self.write(option, writer)
        raise typer.Exit(self.exit_code(result))

    def publish_report(self, report: Report, suite: str = "fsdpcheck.audit") -> None:
        from fsdpcheck.formats.annotations import report_annotations
        from fsdpcheck.formats.junit import report_to_junit, write_junit
        from fsdpcheck.output import write_json

        self.annotations(report_annotations(report, tool=suite.replace(".", " ")))
        self.write("--json", lambda path: write_json(report, path))
        self.write("--junit", lambda path: write_junit(report_to_junit(report, suite=suite), path))


def _refuse_outputs(command: str, outputs: _Outputs) -> None:
    """Single-process commands: an unwritable output is bad input before any work (exit 2)."""
    problem = outputs.check()
    if problem:
        _exit_with(command, problem, ExitCode.BAD_INPUT, outputs)


@contextmanager
def _errors_exit(command: str, outputs: _Outputs | None = None) -> Iterator[None]:
    """A single-process command's explained failure (``FsdpcheckError``) ends it with its exit
    code, its one paragraph on stderr and, where annotations are on, a workflow error."""
    from fsdpcheck.errors import FsdpcheckError

    try:
        yield
    except FsdpcheckError as exc:
        log.debug("%s failed", command, exc_info=True)
        _exit_with(command, str(exc), exc.exit_code, outputs)


def _exit_with(command: str, message: str, code: int, outputs: _Outputs | None) -> NoReturn:
    from fsdpcheck.console import command_error
    from fsdpcheck.formats.annotations import command as workflow_command

    _stderr().print(command_error(f"fsdpcheck {command}", message), highlight=False)
    if outputs is not None:
        outputs.annotations([workflow_command("error", message, title=f"fsdpcheck {command}")])
    raise typer.Exit(code)


def _build_fields(
    model: str,
    init: Init,
    dtype: DType | None,
    seed: int,
    text_only: bool,
    trust_remote_code: bool,
    allow_pickle: bool,
) -> dict[str, Any]:
    """The model options, as ``fsdpcheck.options.BuildSpec`` fields (audit and fingerprint)."""
    return {
        "model": model,
        "init": init,
        "dtype": dtype,
        "seed": seed,
        "text_only": text_only,
        "trust_remote_code": trust_remote_code,
        "allow_pickle": allow_pickle,
    }


def _audit_options(given: dict[str, Any]) -> AuditOptions:
    """``audit``'s parameters as ``AuditOptions`` (the same names; ``--mesh`` parsed, repeated
    options once each); a combination it refuses is the CLI's usage error (exit 2)."""
    from fsdpcheck.errors import OptionError

    named = {
        name: tuple(dict.fromkeys(value)) if isinstance(value, list) else value
        for name, value in given.items()
        if name in _DEFAULTS
    }
    try:
        return AuditOptions(**{**named, **_parse_mesh(given["mesh"])})
    except OptionError as exc:
        hint = f"'{exc.option}'" if exc.option else None
        raise typer.BadParameter(str(exc), param_hint=hint) from None


def _parse_mesh(text: str | None) -> dict[str, Any]:
    """``--mesh`` as ``AuditOptions``' ``mesh`` and ``mesh_dims`` fields."""
    from fsdpcheck.options import parse_mesh

    try:
        spec = parse_mesh(text) if text else None
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="'--mesh'") from None
    return {"mesh": spec.sizes if spec else None, "mesh_dims": spec.names if spec else None}


def _stdout() -> Console:
    from fsdpcheck.console import stdout_console

    return stdout_console()


def _stderr() -> Console:
    from fsdpcheck.console import stderr_console

    return stderr_console()


def _fail(error: RankError, exit_code: int, outputs: _Outputs, options: object) -> NoReturn:
    from fsdpcheck import process
    from fsdpcheck.console import command_error, rank_error
    from fsdpcheck.distributed.launcher import world_hint
    from fsdpcheck.report import error_report

    _stderr().print(rank_error(error), highlight=False)
    if error.rank == 0:
        problem = outputs.check()  # a path that cannot be written is named and skipped
        if problem:
            _stderr().print(command_error("fsdpcheck", problem), highlight=False)
        outputs.publish_report(error_report([error], world_hint(os.environ), options))
    process.tell_torchrun(error.message)
    raise typer.Exit(exit_code)


@app.command()
def presets() -> None:
    """List the built-in models."""
    from fsdpcheck.console import presets_table
    from fsdpcheck.model.presets import PRESETS

    Console().print(presets_table(PRESETS.values()))


def _over_seeds(command: str, outputs: _Outputs, run: Callable[..., Any], **fan_out: Any) -> Any:
    """probe and scan: refuse outputs that cannot be written, then ``run`` (the one fan-out over
    hash seeds, :mod:`fsdpcheck.children.seeds`) behind a progress bar, its errors exiting as
    the command's own."""
    from fsdpcheck.children.probe import DEFAULT_SEEDS
    from fsdpcheck.console import CountProgress

    _refuse_outputs(command, outputs)
    fan_out["seeds"] = fan_out["seeds"] or DEFAULT_SEEDS
    with _errors_exit(command, outputs), CountProgress(command) as bar:
        return run(progress=bar.update, **fan_out)


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
    json_path: Path | None = _file_option("--json", "the result as JSON"),
    junit_path: Path | None = _file_option(
        "--junit", "a JUnit XML file: a test case per seed and per order"
    ),
    annotations: Annotations = ANNOTATIONS_OPTION,
    text_only: bool = TEXT_ONLY_OPTION,
    trust_remote_code: bool = TRUST_REMOTE_CODE_OPTION,
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
    from fsdpcheck.children.probe import probe as run_probe
    from fsdpcheck.console import probe_errors, probe_header, probe_summary, probe_table
    from fsdpcheck.formats.annotations import probe_annotations
    from fsdpcheck.formats.junit import probe_to_junit, write_junit
    from fsdpcheck.output import write_json

    outputs = _Outputs(annotations, json=json_path, junit=junit_path)
    run = partial(run_probe, model, text_only=text_only, trust_remote_code=trust_remote_code)
    result = _over_seeds("probe", outputs, run, seeds=seeds, jobs=jobs, timeout=timeout)
    outputs.finish(
        result.exit_code,
        [
            probe_header(model, result),
            *([probe_table(result)] if result.reorders else []),
            *probe_errors(result),
            probe_summary(result),
        ],
        probe_annotations(result),
        {
            "--json": lambda path: write_json(result, path),
            "--junit": lambda path: write_junit(probe_to_junit(result), path),
        },
    )


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
    json_path: Path | None = _file_option("--json", "the table as JSON"),
    junit_path: Path | None = _file_option(
        "--junit", "a JUnit XML file: a test case per architecture"
    ),
    sarif_path: Path | None = typer.Option(
        None,
        "--sarif",
        help="Write SARIF 2.1.0 here: the modeling-file lines that register tensors while "
        "iterating a set (seen reordering, or latent).",
    ),
    annotations: Annotations = ANNOTATIONS_OPTION,
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
    from fsdpcheck.children.scan import scan as run_scan
    from fsdpcheck.console import scan_errors, scan_summary, scan_table
    from fsdpcheck.formats.annotations import scan_annotations
    from fsdpcheck.formats.junit import scan_to_junit, write_junit
    from fsdpcheck.formats.sarif import scan_to_sarif, write_sarif
    from fsdpcheck.output import write_json

    outputs = _Outputs(annotations, json=json_path, junit=junit_path, sarif=sarif_path)
    families = ("causal-lm", "masked-lm") if masked_lm else ("causal-lm",)
    run = partial(run_scan, filters, families=families, presets=preset, arch_timeout=arch_timeout)
    result = _over_seeds("scan", outputs, run, seeds=seeds, jobs=jobs, timeout=timeout)
    table = scan_table(result, all_rows=not problems_only)
    outputs.finish(
        result.exit_code,
        [table, *scan_errors(result), scan_summary(result)],
        scan_annotations(result),
        {
            "--json": lambda path: write_json(result, path),
            "--junit": lambda path: write_junit(scan_to_junit(result), path),
            "--sarif": lambda path: write_sarif(scan_to_sarif(result), path),
        },
    )


FINGERPRINT_EPILOG = """
[bold]Examples[/]

  fsdpcheck fingerprint --model hazard --out fp/rank0.json

  torchrun --nproc-per-node 8 -m fsdpcheck fingerprint --model /ckpt/m --out 'fp/rank{rank}.json'

  fsdpcheck diff fp/          [dim](compare them: no process group needed)[/]

[bold]Exit codes[/]: 0 written · 2 bad usage or input · 3 runtime failure (the record, with the
error, is still written when --out is writable).
"""


@app.command(epilog=FINGERPRINT_EPILOG)
def fingerprint(
    model: str = typer.Option(
        ..., "--model", "-m", help="Preset name, local model directory, or cached hub id."
    ),
    out: Path = typer.Option(
        ...,
        "--out",
        "-o",
        help="Where to write the fingerprint; may contain {rank}, {local_rank}, {host}.",
    ),
    init: Init = typer.Option(_default("init"), help=INIT_HELP),
    dtype: DType | None = DTYPE_OPTION,
    seed: int = SEED_OPTION,
    wrap: bool = typer.Option(
        True, help="Also fully_shard on a one-rank group of this process's own, and record after."
    ),
    wrap_class: list[str] = WRAP_CLASS_OPTION,
    min_params: int = MIN_PARAMS_OPTION,
    text_only: bool = TEXT_ONLY_OPTION,
    trust_remote_code: bool = TRUST_REMOTE_CODE_OPTION,
    allow_pickle: bool = ALLOW_PICKLE_OPTION,
    rank: int | None = typer.Option(
        None,
        "--rank",
        "--rank-hint",
        min=0,
        help="Record this rank \\[default: the launcher's RANK, else 0]; it also decides what "
        "--init rank0 builds.",
    ),
) -> None:
    """Write this process's fingerprint of MODEL (the record the audit gathers) with no
    process group: run it once per rank, on each machine or library version, then `diff`."""
    from fsdpcheck import process
    from fsdpcheck.console import fingerprint_failed, fingerprint_written, note
    from fsdpcheck.offline.files import (
        check_writable,
        env_record,
        format_path,
        process_identity,
        write_fingerprint,
    )
    from fsdpcheck.offline.standalone import StandaloneOptions, fingerprint_standalone
    from fsdpcheck.vocab import errors_exit_code

    options = StandaloneOptions(
        **_build_fields(model, init, dtype, seed, text_only, trust_remote_code, allow_pickle),
        wrap=wrap,
        wrap_classes=tuple(wrap_class),
        min_params=min_params,
        rank=rank,
    )
    process.tune_gc()  # as in audit: a short-lived process with a big heap
    with _errors_exit("fingerprint"):
        identity = process_identity(rank)
        path = format_path(out, env_record(identity))
        check_writable(path, identity.rank)  # before the build, not after it
        content = fingerprint_standalone(options)
        path = write_fingerprint(content, format_path(out, content.record.env))
    record = content.record
    if record.error is not None:
        _stderr().print(fingerprint_failed(record, path), highlight=False)
        raise typer.Exit(errors_exit_code([record.error.kind]))
    console = _stdout()
    console.print(fingerprint_written(record, path), highlight=False)
    for line in content.notes:
        console.print(note(line), highlight=False)


DIFF_EPILOG = """
[bold]Examples[/]

  fsdpcheck diff fp/                          [dim](every *.json fingerprint in fp/)[/]

  fsdpcheck diff today/rank0.json lastweek/rank0.json --json diff.json

[bold]Exit codes[/]: 0 consistent · 1 findings · 2 bad input (unreadable or foreign JSON, mixed
schema versions, fewer than two fingerprints) · 3 a fingerprinted rank failed at runtime.
"""


@app.command(epilog=DIFF_EPILOG)
def diff(
    paths: list[Path] = typer.Argument(
        ..., help="Fingerprint files, or directories of them (their *.json).", show_default=False
    ),
    json_path: Path | None = OFFLINE_JSON_OPTION,
    junit_path: Path | None = OFFLINE_JUNIT_OPTION,
    annotations: Annotations = ANNOTATIONS_OPTION,
) -> None:
    """Compare saved fingerprints as ranks, with the audit's analysis and report: ranks of one
    job (hung or not), or the same model across machines and library versions."""
    from fsdpcheck.console import diff_inputs
    from fsdpcheck.offline.diff import diff_records
    from fsdpcheck.offline.files import damaged_as_input, read_inputs

    outputs = _Outputs(annotations, json=json_path, junit=junit_path)
    _refuse_outputs("diff", outputs)
    among = f"a fingerprint among {', '.join(map(str, paths))} is"
    with _errors_exit("diff", outputs), damaged_as_input(among):
        report = diff_records(read_inputs(paths))
    _show_offline("diff", outputs, report, diff_inputs(report))


EXPLAIN_EPILOG = """
[bold]Examples[/]

  fsdpcheck explain fr/          [dim](one dump per rank)[/]

  fsdpcheck explain fr/ --fingerprint fp/ --json out.json

  fsdpcheck explain /tmp/nccl_trace_rank_0 /tmp/nccl_trace_rank_1 --allow-pickle

Dumps: set TORCH_FR_BUFFER_SIZE before the process group starts; on every
rank write torch._C._distributed_c10d._dump_fr_trace_json() to a file whose
name ends in the rank (torch's dump on timeout writes pickle).

[bold]Exit codes[/]: 0 same collectives · 1 diverged · 2 bad input (no dumps,
one rank only, unreadable or foreign files, pickle without --allow-pickle).
"""


@app.command(epilog=EXPLAIN_EPILOG)
def explain(
    paths: list[Path] = typer.Argument(
        ...,
        help="Flight Recorder dumps, one per rank, or the directory that holds them.",
        show_default=False,
    ),
    fingerprint: list[Path] = typer.Option(
        [],
        "--fingerprint",
        help="The job's fingerprints (files or a directory; one per rank), to name the "
        "tensors each collective carried (repeatable).",
    ),
    json_path: Path | None = OFFLINE_JSON_OPTION,
    junit_path: Path | None = OFFLINE_JUNIT_OPTION,
    allow_pickle: bool = typer.Option(
        False,
        help="Read pickle dumps (torch's dump-on-timeout format) too; only a pickle of plain "
        "values is loaded. Off: JSON only.",
    ),
    annotations: Annotations = ANNOTATIONS_OPTION,
) -> None:
    """Name the first collective where the ranks of a hung or aborted job diverged, from their
    Flight Recorder dumps, and (with fingerprints) the tensors behind it."""
    from fsdpcheck.console import trace_inputs
    from fsdpcheck.offline.explain import explain as explain_dumps

    outputs = _Outputs(annotations, json=json_path, junit=junit_path)
    _refuse_outputs("explain", outputs)
    with _errors_exit("explain", outputs):
        report = explain_dumps(paths, fingerprints=fingerprint, allow_pickle=allow_pickle)
    _show_offline("explain", outputs, report, trace_inputs(report))


def _show_offline(command: str, outputs: _Outputs, report: Report, inputs: list[str]) -> NoReturn:
    """diff and explain: what was read, then the report and its files; exit with its code."""
    from fsdpcheck.console import render

    console = _stdout()
    for line in inputs:
        console.print(line, highlight=False)
    render(report, console, title=f"fsdpcheck {command}")
    outputs.publish_report(report, suite=f"fsdpcheck.{command}")
    raise typer.Exit(outputs.exit_code(report.exit_code))


def main() -> NoReturn:
    from fsdpcheck import process

    try:
        app()
    except SystemExit as done:
        process.exit_skipping_teardown(done.code)
    process.exit_skipping_teardown(0)
