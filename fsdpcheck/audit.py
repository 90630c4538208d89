"""The audit, one rank's view: resolve → build → fingerprint → wrap → fingerprint → gather →
load → verify, then rank 0 assembles the report once. Library code: returns data, never prints."""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from fsdpcheck.children.jobs import ChildSpec
from fsdpcheck.children.observe import observe_loaders, stand_ins_for
from fsdpcheck.children.probe import probe
from fsdpcheck.decision import AuditResult, decide, ended, give_up, never_met
from fsdpcheck.distributed import liveness
from fsdpcheck.distributed import setup as distributed
from fsdpcheck.distributed.environment import env_record, launch_record
from fsdpcheck.distributed.gather import gather_memory, gather_records
from fsdpcheck.distributed.wire import broadcast_decision
from fsdpcheck.errors import FsdpcheckError, InputError
from fsdpcheck.loader.agree import LoadFailedError
from fsdpcheck.loader.load import load_full_state_dict, receive_ahead
from fsdpcheck.loader.resume import full_state_from, load_checkpoint
from fsdpcheck.loader.source import verify_source
from fsdpcheck.loader.transfer import Prefault
from fsdpcheck.loader.verify import ExpectedAhead, expect_ahead, verify_load
from fsdpcheck.model import build, parallel
from fsdpcheck.model.build import BuiltModel
from fsdpcheck.model.builder import BuildContext, builder_info, call_builder
from fsdpcheck.model.builder import wrapped as is_wrapped
from fsdpcheck.model.memory import process_memory, release
from fsdpcheck.model.optimizer_state import optimizer_record
from fsdpcheck.model.rank_state import model_record
from fsdpcheck.model.resolve import download
from fsdpcheck.model.resume import METADATA, checkpoint_record, resume_problem
from fsdpcheck.model.state import (
    buffer_problems,
    buffer_reference,
    non_finite_tensors,
    tie_record,
)
from fsdpcheck.model.threads import torch_threads
from fsdpcheck.options import AuditOptions
from fsdpcheck.pipeline import Stages, before_wrap, build_from, look_at, record_of
from fsdpcheck.records import (
    CheckpointRecord,
    Gathered,
    LoadOutcome,
    RankError,
    RankRecord,
    SourceRecord,
    VerifyResult,
)
from fsdpcheck.report import AuditOutcome, assemble, error_report
from fsdpcheck.step.session import step_raises
from fsdpcheck.step.synthetic import audit_step
from fsdpcheck.vocab import ErrorKind, ExitCode, Init, LoadMethod, LoadStatus, Snapshot, Stage

if TYPE_CHECKING:
    from fsdpcheck.checks.hash_seed import ProbeResult
    from fsdpcheck.records import (
        BufferProblem,
        EnvRecord,
        MemoryRecord,
        ModelInfo,
        Report,
        WrapPlan,
    )

log = logging.getLogger(__name__)

__all__ = ["AuditOptions", "AuditResult", "check_model", "run_audit"]


@dataclass
class _RankState:
    """What one rank learns on its way to the gather."""

    ctx: distributed.DistContext
    progress: Callable[[str], None] | None = None  # rank 0's console, told each stage
    publish: Callable[[Report], None] | None = None
    model_info: ModelInfo | None = None
    wrap_plan: WrapPlan | None = None
    env: EnvRecord | None = None
    checkpoint: CheckpointRecord | None = None  # --resume: what this rank found there
    # The memory check: rank 0's weights are loaded into every rank (ranks > 0 hold shards).
    rank0_load: bool = False
    script_model: Any = None  # check_model: the script's model (its memory, read at the end)
    # A rank > 0 under rank-0 loading: its shards' memory, given and faulted in while it waits
    # for rank 0 at the gather (loader.load.receive_ahead).
    receiving: Prefault | None = None
    # Each stage is marked for liveness (what a peer's diagnosis reads) and shown on progress.
    stages: Stages = field(init=False)

    def __post_init__(self) -> None:
        hooks = [partial(liveness.mark_stage, self.ctx)]
        if self.progress is not None:
            hooks.append(self.progress)
        self.stages = Stages(self.ctx.rank, hooks=tuple(hooks))


def run_audit(
    options: AuditOptions,
    *,
    progress: Callable[[str], None] | None = None,
    publish: Callable[[Report], None] | None = None,
    preflight: Callable[[], str] | None = None,
    owns_process: bool = False,
) -> AuditResult:
    """Run the audit on this rank; every rank of the job must call it.

    A library call never ends its process: where a peer never arrives, dies or is stuck past
    ``options.timeout``, every rank still alive returns exit 3 naming it (a rank the others gave
    up on, once its own work is done). ``owns_process=True`` only where fsdpcheck owns the
    process (its CLI): such a stuck rank is then ended at once with exit 3 by the abort watch,
    and the model is left to the process's exit instead of collected before returning
    (:func:`~fsdpcheck.model.memory.release`, a walk of the whole heap).

    ``preflight`` (given on every rank or on none) runs on rank 0 right after the ranks meet:
    a non-empty answer (say, an output path rank 0 cannot write) ends the run on every rank
    with exit 2 before any work, and becomes the report's error.

    ``progress`` is called with each stage's name as rank 0 enters it. ``publish`` is called on
    rank 0 with the finished report *before* the other ranks are released: launchers such as
    torchrun stop every rank as soon as one exits non-zero, so the report must be out first.
    """
    try:
        return _run_audit(options, progress, publish, preflight, owns_process)
    finally:
        if not owns_process:  # the CLI's process ends right after: its exit frees the model
            release()


def _run_audit(
    options: AuditOptions,
    progress: Callable[[str], None] | None,
    publish: Callable[[Report], None] | None,
    preflight: Callable[[], str] | None,
    owns_process: bool,
) -> AuditResult:
    try:
        ctx = liveness.join(
            options.backend,
            options.timeout,
            mesh_shape=options.mesh,
            mesh_names=options.mesh_dims,
            tp=options.tp,
            ep=options.ep,
        )
    except liveness.NeverMet as exc:
        return never_met(exc, options, publish)
    try:
        if preflight is not None:
            refused = _preflight(options, ctx, preflight, publish)
            if refused is not None:
                return refused
        on_abort = None
        if ctx.rank == 0 and publish is not None:

            def on_abort(errors: list[RankError]) -> None:
                publish(error_report(errors, ctx.world_size, options))

        with liveness.AbortWatch(ctx, on_abort, end_process=owns_process) as watch:
            state = _RankState(ctx, progress=progress if ctx.rank == 0 else None, publish=publish)
            return _audit(options, state, watch)
    finally:
        distributed.shutdown(ctx)


def _preflight(
    options: AuditOptions,
    ctx: distributed.DistContext,
    preflight: Callable[[], str],
    publish: Callable[[Report], None] | None,
) -> AuditResult | None:
    """Collective: rank 0's preflight answer, on every rank; None to go on."""
    problem = preflight() if ctx.rank == 0 else ""
    try:
        code = ExitCode.BAD_INPUT if problem else ExitCode.CONSISTENT
        code, problem = broadcast_decision(code, problem, ctx.side_channel)
    except Exception:  # a dead peer: the gather names it, with the heartbeats
        log.debug("rank %d: the preflight decision did not arrive", ctx.rank, exc_info=True)
        return None
    if not code:
        return None
    error = RankError(0, Stage.LAUNCH, problem, ErrorKind.INPUT)
    report = error_report([error], ctx.world_size, options) if ctx.rank == 0 else None
    if report is not None and publish is not None:
        publish(report)
    return AuditResult(ctx.rank, code, report, None, problem)


def check_model(
    model: Any,
    *,
    checkpoint: str | os.PathLike[str] | None = None,
    timeout: float = 60.0,
    end_on_abort: bool | None = None,
    rank0_checkpoint: bool = False,
    optimizer: Any = None,
    scheduler: Any = None,
    rank0_load: bool = False,
    source: str | os.PathLike[str] | None = None,
) -> AuditResult:
    """Check a training script's own model: every rank calls it, after building (and optionally
    wrapping) the model, before its loader, after it, or both. Reuses the script's process
    group; metadata goes over a gloo side channel bounded by ``timeout``. Always: layouts, ties,
    loader predictions; where two or more ranks hold real values (after a load, or a model every
    rank initialised): values, and buffers against what the model's own config computes. The
    report (rank 0) has the findings; ``exit_code`` is the same on every rank.

    ``checkpoint``: the path this rank resumed from (a DCP directory, or a root with a LATEST
    file): every rank records what it resolved (path, step, a digest of ``.metadata``, the
    shard files) and ranks that resumed from different states are a ``checkpoint`` finding.
    Read only: nothing is unpickled or written there. Every rank's command line and launch
    variables are compared too (``launch``). ``rank0_checkpoint=True`` (the same on every
    rank): the script loads rank 0's path on every rank, as Lightning's sharding strategies do
    (they broadcast it), so each rank records what it finds at rank 0's path (a node whose copy
    differs is named; a path only the other ranks were given is not, since nothing loaded it);
    a rank that passes a ``checkpoint`` of its own records that one instead (a script that
    loads its own weights), so the broadcast runs on every rank whatever each one passes.

    ``optimizer`` (and ``scheduler``, an lr scheduler): every rank records its param groups'
    settings, which parameters hold state, its step counts, shapes, dtypes and digests (read
    only: nothing is stepped or initialised); ranks that differ, or replicas whose state values
    differ, are an ``optimizer`` finding. With a DCP ``checkpoint`` that holds optimizer state:
    moments absent or all zero where the checkpoint's are not, another step count, a scheduler
    still at step 0: each an ``optimizer`` finding.
    Every rank records its host memory: the process's peak so far and its RSS now (and CUDA's
    where it uses CUDA); nothing is reset. ``rank0_load=True`` (the same on every rank): the
    script reads the full weights on rank 0 only and every other rank gets its shards from it
    (``cpu_ram_efficient_loading``, a rank-0 ``set_model_state_dict`` broadcast), so a rank > 0
    whose peak stood about a model above what it holds at the check (its shards) held the full
    model: a ``memory`` finding. Without it, only a rank far above the others is one. Call it
    after the load: a full copy the rank still holds at the check is not seen.

    It never ends the process (a training script's, a Ray actor's): a peer that never arrives
    (died or stuck before the check, or the store's host gone), dies or is stuck past
    ``timeout`` makes every rank still alive return exit 3 naming it; a rank the others gave up
    on returns the same once its own work is done. ``end_on_abort`` is accepted for old
    callers and ignored (it used to end such a rank).

    ``source`` (the same on every rank): the checkpoint the model was loaded from (a
    safetensors file, a sharded ``model.safetensors.index.json`` or its directory, a DCP
    directory): every rank proves each of its local shards and persistent buffers equals its
    slice of it, reading only that slice; a difference is a ``source`` finding, which sees a
    load that is wrong the same way on every rank."""
    if end_on_abort is not None:
        warnings.warn(
            "check_model(end_on_abort=) is ignored: a library call never ends its process; "
            "it returns exit 3 naming the stuck rank",
            DeprecationWarning,
            stacklevel=2,
        )
    try:
        ctx = liveness.join("auto", timeout)
    except liveness.NeverMet as exc:
        return never_met(exc)
    try:
        with liveness.AbortWatch(ctx) as watch:
            return check_live(
                ctx,
                watch,
                model,
                checkpoint=checkpoint,
                rank0_checkpoint=rank0_checkpoint,
                optimizer=optimizer,
                scheduler=scheduler,
                rank0_load=rank0_load,
                source=source,
            )
    finally:
        distributed.shutdown(ctx)


def check_live(
    ctx: distributed.DistContext,
    watch: liveness.AbortWatch,
    model: Any,
    *,
    checkpoint: str | os.PathLike[str] | None = None,
    rank0_checkpoint: bool = False,
    optimizer: Any = None,
    scheduler: Any = None,
    rank0_load: bool = False,
    source: str | os.PathLike[str] | None = None,
    unwritten: tuple[BufferProblem, ...] = (),
) -> AuditResult:
    """Collective: :func:`check_model` on a side channel the caller holds (``fsdpcheck run``
    checks a script's model inside a session that outlives the check). ``unwritten``: this
    rank's tensors that nothing wrote since ``to_empty()``, added to its record's problems."""
    state = _RankState(ctx, rank0_load=rank0_load, script_model=model)
    if rank0_checkpoint:
        checkpoint = _rank0_checkpoint(ctx, checkpoint)
    env = env_record(ctx.rank, ctx.local_rank, ctx.world_size, ctx.backend)
    record = state.stages.run(
        Stage.FINGERPRINT, lambda: model_record(model, env, param_values=True)
    )
    if record is None:
        record = RankRecord(env=env, error=state.stages.error)
    else:
        resumed = checkpoint_record(checkpoint) if checkpoint is not None else None
        record = replace(
            record,
            checkpoint=resumed,
            launch=launch_record(rank=ctx.rank, local_rank=ctx.local_rank),
            memory=_own_memory(None, state, None),
            uninitialized=(*record.uninitialized, *unwritten),
        )
        if optimizer is not None:
            record = _with_optimizer(state, record, model, optimizer, scheduler, resumed)
    return _conclude(None, state, record, watch, built=None, source=source, model=model)


def _with_optimizer(
    state: _RankState,
    record: RankRecord,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    resumed: CheckpointRecord | None,
) -> RankRecord:
    """``record`` with the rank's optimizer; a failure to read it is the rank's error."""
    path = _optimizer_checkpoint(resumed)
    found = state.stages.run(
        Stage.FINGERPRINT, lambda: optimizer_record(model, optimizer, scheduler, path)
    )
    if found is None:
        return RankRecord(env=record.env, error=state.stages.error)
    return replace(record, optimizer=found)


def _optimizer_checkpoint(resumed: CheckpointRecord | None) -> str | None:
    """The DCP directory that holds the resumed optimizer's state: the checkpoint itself, or an
    HF Trainer / accelerate checkpoint's ``optimizer_0`` (FSDP's sharded state dict)."""
    if resumed is None or resumed.path is None:
        return None
    if resumed.index == METADATA:
        return resumed.path
    inner = os.path.join(resumed.path, "optimizer_0")
    return inner if os.path.isfile(os.path.join(inner, METADATA)) else None


def _rank0_checkpoint(
    ctx: distributed.DistContext, checkpoint: str | os.PathLike[str] | None
) -> str | os.PathLike[str] | None:
    """Collective, on every rank whatever it passes: rank 0's checkpoint path (None where rank
    0 has none), or this rank's own where it passes one."""
    mine = os.fspath(checkpoint) if checkpoint is not None and ctx.rank == 0 else ""
    try:
        _, given = broadcast_decision(0, mine, ctx.side_channel)
    except Exception:  # a dead peer: the gather names it, with the heartbeats
        log.debug("rank %d: rank 0's checkpoint path did not arrive", ctx.rank, exc_info=True)
        return checkpoint
    return checkpoint if checkpoint is not None else (given or None)


def _audit(options: AuditOptions, state: _RankState, watch: liveness.AbortWatch) -> AuditResult:
    ctx, stages = state.ctx, state.stages
    env = env_record(ctx.rank, ctx.local_rank, ctx.world_size, ctx.backend)
    state.env = env
    # Parameters' values are compared only where every rank holds its own (--init all).
    values = options.init == Init.ALL
    probing = _ProbeThread(options) if ctx.rank == 0 and options.probe else None
    if options.download and options.model:  # a builder's model is its own to fetch
        _download_on_rank0(options, state)
    resumed = None
    if options.resume is not None:
        resumed = stages.run(Stage.RESOLVE, lambda: _resume_record(options, ctx.rank))
    state.checkpoint = resumed
    if options.builder:
        built = stages.run(Stage.BUILD, lambda: _from_builder(options, ctx))
        # Without a state dict to load, each rank's own values are what training starts from
        # (with --resume, the checkpoint's are: every rank's own values are overwritten).
        has_state = _rank0_has_state(built, ctx)  # collective: on every rank, always
        values = not has_state and options.resume is None
        state.rank0_load = has_state and options.resume is None
    else:
        built, _ = build_from(options, ctx.rank, stages)
        state.rank0_load = options.init == Init.RANK0 and options.resume is None
    # A builder may return its model already sharded: then there is nothing left to wrap.
    prewrapped = built is not None and options.builder is not None and is_wrapped(built.model)
    # Buffers are checked against the config after the load (state-after-load), not here.
    pre = None
    targets = None
    experts = None
    if not prewrapped:
        pre, targets = before_wrap(stages, built, options, values=values)
        # FSDP2 copies each real parameter's shard out of it: on rank 0 alone with --init rank0.
        threads = build.materialising_threads(options.init) if built and built.materialised else 1
        with torch_threads(threads):
            experts = stages.run(
                Stage.WRAP,
                lambda: parallel.shard(
                    built.model,
                    targets.modules,
                    ctx.mesh,
                    cpu_offload=options.cpu_offload,
                    ep_meshes=ctx.ep_meshes,
                ),
            )
    post = look_at(stages, built, Snapshot.POST_WRAP, values=values)
    if built is not None:
        state.model_info = built.info
    if targets is not None:
        state.wrap_plan = targets.plan
        if experts:  # --ep: each experts module was sharded first, over the expert data dims
            wrapped = (*experts, *(n for n in targets.plan.wrapped if n not in experts))
            state.wrap_plan = replace(targets.plan, wrapped=wrapped)
        log.info("wrap plan: %d modules (%s)", len(targets.plan.wrapped), targets.plan.source)
    source = SourceRecord(built.info.spec, built.info.path, built.info.dtype) if built else None
    record = record_of(env, stages, built, pre, post, source=source)
    if record.error is None:
        record = replace(
            record,
            checkpoint=resumed,
            launch=launch_record(rank=ctx.rank, local_rank=ctx.local_rank),
            memory=_own_memory(options, state, built),  # build and wrap, so far
        )
    return _conclude(options, state, record, watch, built, probing)


def _own_memory(
    options: AuditOptions | None, state: _RankState, built: BuiltModel | None
) -> MemoryRecord | None:
    """This rank's memory: the audit's measured stages, or the script's process so far."""
    try:
        if options is None:
            return process_memory(state.ctx.rank, state.script_model)
        model = built.model if built is not None else None
        return state.stages.memory.record(state.ctx.rank, model)
    except Exception:  # a number fsdpcheck could not read must not cost the audit
        log.debug("rank %d: memory not read", state.ctx.rank, exc_info=True)
        return None


def _resume_record(options: AuditOptions, rank: int) -> CheckpointRecord:
    """``--resume``: what this rank finds there; a directory it cannot load from is bad input
    on this rank (its error in the gather, naming it)."""
    assert options.resume is not None
    record = checkpoint_record(options.resume)
    problem = resume_problem(record, rank=rank)
    if problem:
        raise InputError(problem)
    return record


def _conclude(
    options: AuditOptions | None,
    state: _RankState,
    record: RankRecord,
    watch: liveness.AbortWatch,
    built: BuiltModel | None,
    probing: _ProbeThread | None = None,
    *,
    source: str | os.PathLike[str] | None = None,
    model: Any = None,
) -> AuditResult:
    """Gather, load and verify, let rank 0 assemble the report, and agree on one exit code; a
    dead peer ends it with exit 3.

    ``options`` None: :func:`check_model`, which only checks (the script loads its own weights).
    ``source`` (``--source``, ``check_model(source=)``): after the load, every rank's tensors
    against their slices of that checkpoint.
    """
    ctx, stages = state.ctx, state.stages
    try:
        if watch.aborted is not None:  # the others gave up on this rank: nobody will gather
            return ended(ctx, watch.aborted, stages.error, options, state.publish)
        if options is not None and _receives_early(options, state, built):
            state.receiving = _receive_ahead(state, built)
        with stages.timed(Stage.GATHER):
            gathered = gather_records(
                record, ctx.side_channel, rank=ctx.rank, world_size=ctx.world_size
            )
        outcome = None
        if gathered is not None:
            outcome = AuditOutcome(gathered, state.model_info, state.wrap_plan, stages.timings)
        if options is not None:  # every rank knows, so every rank takes the same branch
            load, verified, after = _load_stage(options, state, built, gathered)
            if outcome is not None:
                outcome = replace(outcome, load=load, verify=verified, after_load=after)
        # Collective, on every rank: after the load, so that its peak is in.
        memory = gather_memory(
            _own_memory(options, state, built),
            ctx.side_channel,
            rank=ctx.rank,
            world_size=ctx.world_size,
        )
        if outcome is not None:
            outcome = replace(outcome, memory=memory or (), rank0_load=state.rank0_load)
            if options is not None:
                outcome = _rank0_extras(outcome, options, probing, state.progress)
        if options is not None:
            source = options.source
            model = built.model if built is not None else None
        if source is not None:  # the same on every rank: every rank takes this branch
            checked = _source_stage(state, model, source)
            if outcome is not None:
                outcome = replace(outcome, source=checked)
        report = assemble(outcome, options) if outcome is not None else None
        if options is not None and options.step:  # collective: one step (the builder's), watched
            forget: list = []
            report = audit_step(
                ctx, state.env, built, load, report, seed=options.seed, forget=forget, abort=watch
            )
            decided = decide(ctx, report, state.publish, own_error=stages.error)
            # Every rank is past its step (the decision is collective): nobody reads the
            # watch's keys again.
            for call in forget:
                call()
            return decided
        return decide(ctx, report, state.publish, own_error=stages.error)
    except Exception as exc:  # a peer died or timed out: name it from heartbeats and marks
        log.debug("rank %d: gave up in %s", ctx.rank, stages.current, exc_info=True)
        aborted = watch.disarm()
        _received(state)
        own = stages.error
        if own is None and not liveness.is_collective_failure(exc):  # this rank's own failure
            message = f"{type(exc).__name__}: {exc}"
            own = RankError(ctx.rank, stages.current, message, ErrorKind.RUNTIME)
        # Under --step: each rank's own exception in the step, the first raised first.
        step = options is not None and options.step and not aborted
        known = step_raises(ctx) if step else ()
        return give_up(ctx, exc, own, options, state.publish, known=known, aborted=aborted)


def _rank0_extras(
    outcome: AuditOutcome,
    options: AuditOptions,
    probing: _ProbeThread | None,
    progress: Callable[[str], None] | None = None,
) -> AuditOutcome:
    """Rank 0's optional extras: every loader for real, each once in its own child job, and
    the probe's result. The other ranks wait for rank 0's decision under ``--timeout``, so all
    of it shares one deadline well inside it; what does not fit says so in the report.
    ``progress`` names them on the console (no liveness mark: the others are not behind)."""
    deadline = time.monotonic() + options.budgets.extras
    if options.reproduce:
        if progress is not None:
            progress("reproduce")
        left = min(options.budgets.reproduce, deadline - time.monotonic())
        observed, note = _observe_loaders(options, outcome.gathered, left)
        outcome = replace(outcome, observed=observed, reproduce_failure=note)
    if probing is not None:
        if progress is not None:
            progress("probe")
        result, note = probing.result(deadline)
        outcome = replace(outcome, probe=result, probe_failure=note)
    return outcome


def _observe_loaders(
    options: AuditOptions, gathered: Gathered, budget: float
) -> tuple[dict, str | None]:
    """Every known loader (or the ``--loader`` ones), run for real in its own 2-rank gloo child
    job, within ``budget`` seconds in all: ``({loader: Observation}, a note if it could not
    run)``."""
    try:  # an extra: its failure, even to import, must not end the audit
        if budget < 2.0:
            return {}, f"--reproduce: no time left to run the loaders ({budget:.1f} s)"
        spec = ChildSpec(**vars(options.build_spec))
        stand_ins = stand_ins_for(gathered.records)
        chosen = [loader.value for loader in options.loaders] or None
        return observe_loaders(spec, stand_ins=stand_ins, budget=budget, loaders=chosen), None
    except Exception as exc:
        log.debug("--reproduce: the loader jobs could not run", exc_info=True)
        return {}, f"--reproduce could not run the loaders: {type(exc).__name__}: {exc}"


def _from_builder(options: AuditOptions, ctx: distributed.DistContext) -> BuiltModel:
    """``--builder``: the user's function builds this rank's model (the trust boundary)."""
    assert options.builder is not None
    mesh = ctx.mesh if options.mesh or options.tp or options.ep else None
    context = BuildContext(ctx.rank, ctx.world_size, ctx.local_rank, ctx.device, mesh)
    answer = call_builder(options.builder, context)
    model = answer.model
    return BuiltModel(
        model=model,
        info=builder_info(options.builder, answer),
        materialised=not any(p.is_meta for p in model.parameters()),
        full_state_dict=dict(answer.state_dict) if answer.state_dict and ctx.rank == 0 else None,
        config=getattr(model, "config", None),
        step=answer.step,
        batch=answer.batch,
    )


def _rank0_has_state(built: BuiltModel | None, ctx: distributed.DistContext) -> bool:
    """Collective: whether rank 0's builder returned a state dict to load (False when rank 0
    failed, or a peer is gone: the gather then says why)."""
    mine = int(ctx.rank == 0 and built is not None and built.full_state_dict is not None)
    try:
        answer, _ = broadcast_decision(mine, "", ctx.side_channel)
    except Exception:  # a dead peer: the gather names it
        log.debug(
            "rank %d: the builder's state-dict decision did not arrive", ctx.rank, exc_info=True
        )
        return False
    return bool(answer)


def _download_on_rank0(options: AuditOptions, state: _RankState) -> None:
    """Rank 0 downloads into the shared cache while the others wait, then all read the cache."""
    ctx, stages = state.ctx, state.stages
    if ctx.rank == 0:
        stages.run(
            Stage.DOWNLOAD,
            lambda: download(options.model, rank=0, allow_pickle=options.allow_pickle),
        )
    try:
        dist.barrier(group=ctx.side_channel)
    except Exception as exc:  # a dead peer: the gather will name it
        log.debug("rank %d: the download barrier failed", ctx.rank, exc_info=True)
        if stages.error is None:
            cause = liveness.collective_cause(exc)
            stages.error = RankError(ctx.rank, Stage.DOWNLOAD, cause, ErrorKind.RUNTIME)


class _ProbeThread:
    """``--probe K`` on rank 0: child builds under K hash seeds, alongside the audit's own work.

    Bounded by a share of ``--timeout``, because the other ranks wait for rank 0's decision."""

    def __init__(self, options: AuditOptions):
        self._options = options
        self._started = time.monotonic()
        self._budget = options.budgets.probe
        self._result: ProbeResult | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="fsdpcheck-probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        o = self._options
        try:
            self._result = probe(
                o.model or "",  # with a builder, the builder is built instead
                seeds=o.probe,
                text_only=o.text_only,
                trust_remote_code=o.trust_remote_code,
                timeout=self._budget,
                builder=o.builder,
            )
        except BaseException as exc:  # reported in the audit's warnings, never fatal
            log.debug("the probe failed", exc_info=True)
            self._error = exc

    def result(self, deadline: float) -> tuple[ProbeResult | None, str | None]:
        """The probe's result by ``deadline`` (monotonic), or why there is none (a warning)."""
        own_end = self._started + self._budget + 5
        self._thread.join(max(0.0, min(own_end, deadline) - time.monotonic()))
        if self._result is not None:
            return self._result, None
        why = f"{type(self._error).__name__}: {self._error}" if self._error else "timed out"
        return None, f"--probe did not finish: {why}"


def _load_stage(
    options: AuditOptions,
    state: _RankState,
    built: BuiltModel | None,
    gathered: Gathered | None,
) -> tuple[LoadOutcome | None, VerifyResult | None, Gathered | None]:
    """Collective: rank 0 decides whether the loader runs; then load, verify and look at every
    rank's ties and buffers, or say why not. The outcome is known on rank 0 (``None`` elsewhere
    when skipped)."""
    ctx = state.ctx
    skip = _load_skip_reason(options, gathered, built) if ctx.rank == 0 else ""
    try:
        go, _ = broadcast_decision(0 if skip else 1, "", ctx.side_channel)
        if go:
            resume = _resume_and_verify if options.resume else _load_and_verify
            load, verified = resume(state, built)
            # The outcome is the same on every rank (a refusal or failure is raised on all).
            after = _state_after_load(state, built) if load.outcome == LoadStatus.LOADED else None
            return load, verified, after
    finally:
        _received(state)
    if ctx.rank == 0:
        log.info("load skipped: %s", skip)
        return LoadOutcome(False, LoadStatus.SKIPPED, skip), None, None
    return None, None, None


def _receives_early(options: AuditOptions, state: _RankState, built: BuiltModel | None) -> bool:
    """Whether this rank gives its shards memory before the gather: a rank > 0 that will
    receive them from rank 0, where nothing reads its values before the load but the load
    (no ``--source``, no ``--step``, which would read them had the load been skipped)."""
    return (
        state.ctx.rank != 0
        and built is not None
        and state.stages.error is None  # a rank that failed is never loaded into
        and state.rank0_load
        and options.load
        and options.source is None
        and not options.step
        and is_wrapped(built.model)  # its shards, never a whole unwrapped model
    )


def _receive_ahead(state: _RankState, built: BuiltModel) -> Prefault | None:
    try:
        return receive_ahead(built.model)
    except Exception:  # a speed-up only: the load materialises and faults in the rest itself
        log.debug(
            "rank %d: shards not given memory ahead of the load", state.ctx.rank, exc_info=True
        )
        return None


def _received(state: _RankState) -> None:
    """No thread of the audit's outlives its load (or the gather that failed before it). Stopped,
    not waited for: after the receives nothing is left for it to do, and where none came
    (a skipped load, a failure) finishing it would only delay this rank's next collective."""
    if state.receiving is not None:
        state.receiving.stop()
        state.receiving = None


def _load_skip_reason(
    options: AuditOptions, gathered: Gathered | None, built: BuiltModel | None
) -> str:
    """Why rank 0 will not run the loader ("" to run it). Decided on rank 0, then shared."""
    if gathered is None or gathered.errors:
        return "a rank failed before the load"
    if not options.load:
        return "--no-load"
    if options.resume:
        return "" if built is not None else "rank 0 built no model"
    if options.init == Init.META and not options.builder:
        return "--init meta: nothing to load from"
    if options.builder and (built is None or built.full_state_dict is None):
        return "the builder returned no state dict to load"
    if built is None or built.full_state_dict is None:
        return "rank 0 holds no weights"
    return ""


def _load_and_verify(
    state: _RankState, built: BuiltModel | None
) -> tuple[LoadOutcome, VerifyResult | None]:
    """Collective: the sorted, validated loader, then the proof that every rank is equal."""
    ctx, stages = state.ctx, state.stages
    full = built.full_state_dict if ctx.rank == 0 else None
    # The gloo channel on every backend: the bucketed path stages CUDA shards through host
    # memory, and the audit's collectives stay bounded by --timeout, whatever NCCL's state.
    ahead: ExpectedAhead | None = None
    try:
        with stages.timed(Stage.LOAD):
            if state.receiving is not None:
                state.receiving.before_receives()
            ahead = _expect_ahead(state, built, full)
            result = load_full_state_dict(built.model, full or {}, group=ctx.side_channel)
    except BaseException as exc:
        if ahead is not None:  # no verify follows
            ahead.stop()
        if not isinstance(exc, FsdpcheckError):
            raise
        # raised on every rank alike
        log.debug("rank %d: the load failed", ctx.rank, exc_info=True)
        seconds = stages.timings[Stage.LOAD]
        # Failed mid-transfer (partly loaded), or refused before anything moved.
        status = LoadStatus.FAILED if isinstance(exc, LoadFailedError) else LoadStatus.REFUSED
        log.info("load %s after %.2f s", status, seconds)
        return LoadOutcome(True, status, str(exc), seconds=seconds), None
    load = LoadOutcome(
        ran=True,
        outcome=LoadStatus.LOADED,
        params_loaded=result.params_loaded,
        buffers_broadcast=result.buffers_broadcast,
        collectives=result.collectives,
        seconds=stages.timings[Stage.LOAD],
        method=result.method,
        fallback_reason=result.fallback_reason,
        state_messages=result.state_messages,
        state_bytes=result.state_bytes,
    )
    log.info("loaded by %s in %.2f s", result.method, load.seconds)
    with stages.timed(Stage.VERIFY):
        verified = verify_load(built.model, full, group=ctx.side_channel, ahead=ahead)
    log.info(
        "verify: ran %s, passed %s, %d checked", verified.ran, verified.passed, verified.checked
    )
    return load, verified


def _expect_ahead(
    state: _RankState, built: BuiltModel, full: Mapping[str, Any] | None
) -> ExpectedAhead | None:
    try:
        return expect_ahead(built.model, full, group=state.ctx.side_channel)
    except Exception:  # a speed-up only: verify digests every slice itself after the load
        log.debug("rank %d: no digests ahead of verify", state.ctx.rank, exc_info=True)
        return None


def _resume_and_verify(
    state: _RankState, built: BuiltModel | None
) -> tuple[LoadOutcome, VerifyResult | None]:
    """Collective: ``--resume``: every rank loads its shards from the checkpoint it resolved
    with ``dcp.load``, then the proof that every rank holds what rank 0's checkpoint holds."""
    ctx, stages = state.ctx, state.stages
    record = state.checkpoint
    # A peer that dies or times out inside dcp.load goes on up to _conclude (exit 3, naming it).
    loaded = stages.run(
        Stage.LOAD,
        lambda: load_checkpoint(built.model, record, rank=ctx.rank, group=ctx.side_channel),
        collective=True,
    )
    seconds = stages.timings.get(Stage.LOAD, 0.0)
    kind = None
    if loaded is None:  # this rank's own failure; the others learn it from the verify
        error = stages.error
        message = error.message if error is not None else "the resume did not run"
        kind = error.kind if error is not None else None
        log.info("rank %d: resume failed: %s", ctx.rank, message)
    unverified = ""  # why rank 0 has no source to verify against (never a silent pass)
    with stages.timed(Stage.VERIFY):
        full = None
        if ctx.rank == 0 and loaded is not None:
            try:
                full = full_state_from(built.model, record)
            except Exception as exc:  # verify_load still runs on every rank, without a source
                log.debug("rank 0 could not read the checkpoint's full copy", exc_info=True)
                unverified = f"rank 0 could not read {record.path} to verify: {exc}"
        verified = verify_load(built.model, full, group=ctx.side_channel)
    if unverified:
        loaded, message, kind = None, unverified, None
    if loaded is None:
        status = LoadStatus.FAILED
        return LoadOutcome(
            True, status, message, seconds=seconds, method=LoadMethod.RESUME, error_kind=kind
        ), verified
    log.info("resumed %d entries by dcp.load in %.2f s", loaded, seconds)
    load = LoadOutcome(
        ran=True,
        outcome=LoadStatus.LOADED,
        params_loaded=loaded,
        seconds=seconds,
        method=LoadMethod.RESUME,
        message=f"resumed from {record.path} by dcp.load",
    )
    return load, verified


def _source_stage(state: _RankState, model: Any, source: str | os.PathLike[str]) -> VerifyResult:
    """Collective: every rank's tensors against their slices of ``source``; rank 0 has all
    ranks' mismatches."""
    with state.stages.timed(Stage.SOURCE):
        checked = verify_source(model, source, group=state.ctx.side_channel)
    log.info("source: passed %s, %d checked", checked.passed, checked.checked)
    return checked


def _state_after_load(state: _RankState, built: BuiltModel) -> Gathered | None:
    """Collective: every rank's ties, buffer problems and NaN/Inf after the load, gathered on
    rank 0 (``None`` elsewhere). Values are the verification's business."""
    ctx = state.ctx
    with state.stages.timed(Stage.STATE_AFTER_LOAD):
        try:
            model = built.model
            record = RankRecord(
                env=state.env,
                ties=(tie_record(model, Snapshot.LOAD),),
                uninitialized=buffer_problems(model, Snapshot.LOAD, buffer_reference(model)),
                non_finite=non_finite_tensors(model, Snapshot.LOAD),
            )
        except Exception as exc:  # this rank still joins the gather, with its failure
            log.debug("rank %d: state after the load", ctx.rank, exc_info=True)
            message = f"{type(exc).__name__}: {exc}"
            error = RankError(ctx.rank, Stage.STATE_AFTER_LOAD, message, ErrorKind.RUNTIME)
            record = RankRecord(env=state.env, error=error)
        return gather_records(record, ctx.side_channel, rank=ctx.rank, world_size=ctx.world_size)
