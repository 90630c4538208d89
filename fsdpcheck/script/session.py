"""``fsdpcheck run``: a training script, unmodified, checked from its first ``fully_shard`` to the
end of its first step, then out of its way.

What the session hooks, and when (docs/run.md; docs/architecture.md says why each patch):

- ``fully_shard`` (patched where every call passes, FSDP2's ``FSDPState.init``: torch has no
  hook for it, and a script may hold ``fully_shard`` by name): the first call, on every rank,
  joins the side channel and puts the collective watch on, with the write log as its observer.
- ``Module.to_empty`` (patched: no hook either): from then on, the module's tensors are
  tracked until the first forward (:mod:`fsdpcheck.model.writes`).
- A global forward pre-hook: before the first forward of each outermost FSDP module, every
  rank agrees it is there (so a rank still loading is a ``step`` finding, not a wait), then
  checks the model as ``check_model`` would, the unwritten tensors included.
- A global optimizer step post-hook: the watched steps end when the last ``optimizer.step()``
  returns; every rank's step record is gathered and judged, and one report (model and step)
  decides for every rank.
- Then every hook and patch is removed and the watch leaves the dispatch stack; with
  ``--steps`` only the step counter stays.

A finding ends the script on every rank by raising :class:`RunStopped` inside it (a
``BaseException``: the script's ``except Exception`` does not hold it, its ``finally`` runs).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook

from fsdpcheck.audit import check_live
from fsdpcheck.checks.step import MARKS
from fsdpcheck.decision import AuditResult, decide, never_met
from fsdpcheck.distributed import liveness
from fsdpcheck.distributed.environment import env_record
from fsdpcheck.distributed.setup import DistContext
from fsdpcheck.model.writes import WriteLog, site_of
from fsdpcheck.options import RunOptions
from fsdpcheck.records import Report
from fsdpcheck.step.session import (
    conclude_step,
    forget_raise,
    give_up_on_step,
    leave_raise,
    merged,
    step_record,
    step_report,
)
from fsdpcheck.step.watch import ChannelLost, CollectiveWatch, StepDiverged, fsdp_owners
from fsdpcheck.vocab import ExitCode, Stage

log = logging.getLogger(__name__)

# Where a script may find fully_shard: every module that exports it (torch 2.6-2.15).
_FULLY_SHARD_HOMES = (
    "torch.distributed.fsdp",
    "torch.distributed.fsdp._fully_shard",
    "torch.distributed.fsdp._fully_shard._fully_shard",
    "torch.distributed._composable.fsdp",
    "torch.distributed._composable.fsdp.fully_shard",
)
FIRST_FORWARD, STEP_END = MARKS  # the agreed points: a model's first forward, the step's end


class RunStopped(BaseException):
    """Ends the script on every rank: a finding, a peer gone, or ``--steps`` reached."""

    def __init__(self, exit_code: int):
        super().__init__(f"fsdpcheck run: stopped with exit code {exit_code}")
        self.exit_code = exit_code


def ended_by_the_run(error: BaseException | None) -> bool:
    """``error`` is the run's own end, unwinding the script, not the script's exception: the run
    stopped it (:class:`RunStopped`), the watch found a divergence (``StepDiverged``) or lost a
    peer (``ChannelLost``). Its outcome says so; it is never printed or raised as the script's."""
    return isinstance(error, (RunStopped, StepDiverged, ChannelLost))


@dataclass(frozen=True)
class RunOutcome:
    """How the check of a script ended on this rank."""

    exit_code: int | None  # the run's code for every rank; None: the script's own decides
    report: Report | None  # rank 0, once the ranks concluded
    headline: str
    notes: tuple[str, ...]  # what was not checked, on every rank
    own_error: Any = None  # this rank's RankError, when the run ended without a report


class ScriptSession:
    """One script's check on one rank: :meth:`install` before the script runs, :meth:`finish`
    after it ends (returned, raised, stopped); ``publish`` renders rank 0's report."""

    def __init__(self, options: RunOptions, publish: Callable[[Report], None] | None = None):
        self.options = options
        self._publish = publish
        self._undo: list[Callable[[], None]] = []
        self._ctx: DistContext | None = None
        self._abort: liveness.AbortWatch | None = None
        self._watch: CollectiveWatch | None = None
        self._contexts = contextlib.ExitStack()
        self._writes = WriteLog()
        self._sharded: list[weakref.ref] = []  # every module fully_shard was applied to
        self._roots_known: set[int] | None = None
        self._owners: dict[int, Any] = {}  # the watch's FSDP param groups, filled in later
        self._checked: set[int] = set()
        self._model_report: Report | None = None
        self._model: nn.Module | None = None  # the first model checked (its step's state)
        self._steps = 0
        self._step_start: float | None = None
        self._concluded: RunOutcome | None = None
        self._loaded: list[tuple[str, str]] = []  # ("dcp" | "safetensors", path) the script read
        self._checking = False  # inside the session's own check: its reads are not the script's
        self.notes: list[str] = []

    # ------------------------------------------------------------------ hooks in and out

    def install(self) -> None:
        state = _fsdp_state_class()
        if state is not None:  # every fully_shard, however the script imported it
            init = state.init
            session = self

            @functools.wraps(init)
            def watched_init(fsdp_state: Any, modules: Any, *args: Any, **kwargs: Any) -> Any:
                result = init(fsdp_state, modules, *args, **kwargs)
                session._sharding(modules)
                return result

            state.init = watched_init
            self._undo.append(functools.partial(setattr, state, "init", init))
        else:  # a torch without FSDP2's state class where we look: the exported function
            self._patch_fully_shard()
        to_empty = nn.Module.to_empty
        session = self

        @functools.wraps(to_empty)
        def watched_to_empty(module: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
            result = to_empty(module, *args, **kwargs)
            session._emptied(module)
            return result

        nn.Module.to_empty = watched_to_empty
        self._undo.append(functools.partial(setattr, nn.Module, "to_empty", to_empty))
        self._patch_loads()
        hooks = [
            register_module_forward_pre_hook(self._pre_forward),
            register_optimizer_step_post_hook(self._step_post),
        ]
        self._undo.extend(h.remove for h in hooks)

    def remove(self, *, keep_counter: bool = False) -> None:
        """Every hook and patch out; the watch off the dispatch stack, the heartbeat stopped."""
        self._close()
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        if keep_counter:  # --steps: the one hook left on the path counts optimizer steps
            handle = register_optimizer_step_post_hook(self._count)
            self._undo.append(handle.remove)

    def _patch_loads(self) -> None:
        """DCP's ``load`` and safetensors' ``load_file`` (no hook for either): the checkpoint
        the script loads is the model's reference (``--source``) and its resume record."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import state_dict_loader

        session = self

        def seen(kind: str, original: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(original)
            def load(*args: Any, **kwargs: Any) -> Any:
                if not session._checking:
                    path = _loaded_path(kind, args, kwargs)
                    if path:
                        session._loaded.append((kind, path))
                return original(*args, **kwargs)

            return load

        homes: list[tuple[Any, str, str]] = [
            (dcp, "load", "dcp"),
            (state_dict_loader, "load", "dcp"),
        ]
        try:
            import safetensors.torch

            homes.append((safetensors.torch, "load_file", "safetensors"))
        except ImportError:  # safetensors is a dependency; a broken install loads nothing
            log.debug("safetensors not importable: its loads are not seen", exc_info=True)
        patched: dict[int, Callable[..., Any]] = {}
        for module, name, kind in homes:
            original = getattr(module, name, None)
            if original is None:
                continue
            wrapper = patched.setdefault(id(original), seen(kind, original))
            setattr(module, name, wrapper)
            self._undo.append(functools.partial(setattr, module, name, original))

    def _patch_fully_shard(self) -> None:
        original = _fully_shard()
        if original is None:
            return
        session = self

        @functools.wraps(original)  # keeps contract's ``fully_shard.state``
        def fully_shard(module: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(module, *args, **kwargs)
            session._sharding(module if isinstance(module, (list, tuple)) else (module,))
            return result

        for home in _FULLY_SHARD_HOMES:
            module = sys.modules.get(home)
            if module is not None and getattr(module, "fully_shard", None) is original:
                module.fully_shard = fully_shard
                self._undo.append(functools.partial(setattr, module, "fully_shard", original))

    def _sharding(self, modules: Any) -> None:
        """A ``fully_shard`` call: its modules are FSDP modules; the first one starts the watch."""
        for sharded in modules:
            self._sharded.append(weakref.ref(sharded))
        self._roots_known = None
        if self._ctx is None and self._concluded is None:
            self._start(site_of()[1])

    # ------------------------------------------------------------------ the watch

    def _start(self, site: str) -> None:
        """The first ``fully_shard``, on every rank: join, and put the watch on."""
        log.info("first fully_shard at %s: the watch starts", site)
        try:
            ctx = liveness.join("auto", self.options.timeout)
        except liveness.NeverMet as exc:
            self._conclude_with(never_met(exc))
        self._ctx = ctx
        self._abort = liveness.AbortWatch(ctx).__enter__()
        liveness.mark_stage(ctx, Stage.STEP)
        watch = CollectiveWatch(
            ctx.side_channel,
            ctx.world_size,
            self._owners,
            store=self._abort.guarded(ctx.store),
            rank=ctx.rank,
            timeout=ctx.timeout,
        )
        watch.observer = self._writes.saw
        self._watch = watch
        self._step_start = time.perf_counter()
        self._contexts.enter_context(watch)
        self._contexts.enter_context(watch.batches())
        self._contexts.enter_context(watch.point_to_point())

    def _leave_watch(self) -> None:
        if self._watch is not None:
            self._watch.observer = None
        self._contexts.close()

    def _emptied(self, module: nn.Module) -> None:
        if self._watch is None:
            if self._concluded is None:
                self.notes.append(
                    f"to_empty() at {site_of(3)[1]} ran before the first fully_shard: its "
                    "tensors were not tracked for writes (uninitialised memory not checked)"
                )
            return
        self._writes.emptied(module, site_of(3)[1])

    def _roots(self) -> set[int]:
        """The outermost FSDP modules (sharded, and inside no other sharded module), by id;
        read again only after another ``fully_shard``."""
        if self._roots_known is None:
            sharded = [m for m in (ref() for ref in self._sharded) if m is not None]
            inner = {id(sub) for m in sharded for sub in m.modules() if sub is not m}
            self._roots_known = {id(m) for m in sharded if id(m) not in inner}
        return self._roots_known

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        if self._watch is None or id(module) in self._checked or id(module) not in self._roots():
            return
        self._checked.add(id(module))
        self._check_model(module, site_of(2)[1])

    def _check_model(self, model: nn.Module, site: str) -> None:
        """Before a root's first forward, on every rank: agreed on, then checked."""
        watch, ctx = self._watch, self._ctx
        assert watch is not None and ctx is not None
        self._owners.update(fsdp_owners(model))  # the watch's table: FSDP2 made them by now
        watch.agree_on(FIRST_FORWARD, site)  # StepDiverged unwinds the script
        unwritten = self._writes.unwritten(model)
        if self._model is None:
            self._model = model
            watch.observer = None  # writes are tracked up to the first forward only
        checks = self._references(model)
        self._checking = True
        try:
            with _modes_off():
                result = self._guarded(
                    lambda: check_live(ctx, self._abort, model, unwritten=unwritten, **checks)
                )
        finally:
            self._checking = False
        if result.exit_code != ExitCode.CONSISTENT:
            self._conclude_with(result)
        report = result.report
        if report is not None and self._model_report is not None:
            report = _combined(self._model_report, report)
        self._model_report = report or self._model_report
        self._step_start = time.perf_counter()

    def _references(self, model: nn.Module) -> dict[str, Any]:
        """What the model is checked against: the checkpoint the script loaded (or
        ``--source``), the DCP folder it resumed from, and its optimizer, if one exists."""
        found: dict[str, Any] = {}
        source = self.options.source
        if source is None and self._loaded:
            source = self._loaded[-1][1]
        if source is not None and source != "none":
            found["source"] = source
        resumed = [path for kind, path in self._loaded if kind == "dcp"]
        if resumed:
            found["checkpoint"] = resumed[-1]
        optimizer = _optimizer_of(model)
        if optimizer is not None:
            found["optimizer"] = optimizer
        return found

    def _step_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._steps += 1
        if self._watch is None or self._model is None:
            return
        if self._steps < self.options.watch_steps:
            return
        self._watch.agree_on(STEP_END, site_of(2)[1])
        outcome = self._conclude(message="")
        if outcome.exit_code != ExitCode.CONSISTENT:
            raise RunStopped(outcome.exit_code)
        keep = self.options.steps is not None and self.options.steps > self._steps
        self.remove(keep_counter=keep)
        self._stop_if_done()

    def _count(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._steps += 1
        self._stop_if_done()

    def _stop_if_done(self) -> None:
        if self.options.steps is not None and self._steps >= self.options.steps:
            code = self._concluded.exit_code if self._concluded else ExitCode.CONSISTENT
            raise RunStopped(int(code or 0))

    # ------------------------------------------------------------------ the end

    def _guarded(self, work: Callable[[], AuditResult]) -> AuditResult:
        """A collective of the session's own; a peer that stopped answering is named."""
        ctx = self._ctx
        assert ctx is not None
        try:
            return work()
        except (Exception, ChannelLost) as exc:
            log.debug("rank %d: fsdpcheck run gave up", ctx.rank, exc_info=True)
            return give_up_on_step(ctx, exc, self._abort)

    def _conclude(self, message: str) -> RunOutcome:
        """Collective: the watch ends, every rank's step record is judged with the model's
        report, and rank 0's verdict is every rank's."""
        if self._concluded is not None:
            return self._concluded
        watch, ctx = self._watch, self._ctx
        assert watch is not None and ctx is not None
        self._leave_watch()
        model = self._model if self._model is not None else _Nothing()
        if message:
            leave_raise(ctx, message)
        with _modes_off():

            def judged() -> AuditResult:
                watch.finish(raised=bool(message))
                record = step_record(watch, model, None, message)
                seconds = time.perf_counter() - (self._step_start or time.perf_counter())
                env = env_record(ctx.rank, ctx.local_rank, ctx.world_size, ctx.backend)
                outcome = conclude_step(ctx, model, env, record, seconds, abort=self._abort)
                report = None
                if outcome is not None:
                    base = self._model_report
                    report = merged(base, outcome) if base is not None else None
                    report = report or step_report(outcome, ctx.world_size)
                    report = replace(report, warnings=(*report.warnings, *self._unseen()))
                decided = decide(ctx, report)
                # Every rank is past the decision: nobody reads the watch's keys again.
                watch.forget()
                forget_raise(ctx)
                return decided

            result = self._guarded(judged)
        return self._conclude_with(result, raise_stop=False)

    def _conclude_with(self, result: AuditResult, *, raise_stop: bool = True) -> RunOutcome:
        """The run's result on this rank: rank 0 publishes; a failing one stops the script."""
        outcome = RunOutcome(
            exit_code=result.exit_code,
            report=result.report,
            headline=result.headline,
            notes=tuple(self.notes),
            own_error=result.own_error,
        )
        self._concluded = outcome
        if result.report is not None and self._publish is not None:
            self._publish(result.report)
        self._close()
        if raise_stop and result.exit_code != ExitCode.CONSISTENT:
            raise RunStopped(result.exit_code)
        return outcome

    def _close(self) -> None:
        self._leave_watch()
        if self._abort is not None:
            self._abort.__exit__(None, None, None)
            self._abort = None

    def _unseen(self) -> tuple[str, ...]:
        notes = list(self.notes)
        if self._model is None:
            notes.append("no FSDP module ran a forward under the watch: the model was not checked")
        elif self._watch is not None and not any(c.module is not None for c in self._watch.calls):
            notes.append(
                "the watched step issued no FSDP collective the watch could see (a step "
                "compiled before the check, or run on another thread): the step was not checked"
            )
        return tuple(notes)

    def finish(self, error: BaseException | None) -> RunOutcome:
        """After the script ended on this rank: returned (``error`` None), raised, or stopped.
        Every rank still watching concludes with the others; the notes say what was not seen."""
        try:
            if self._concluded is not None:
                return self._concluded
            if self._watch is None:  # the script never called fully_shard
                self.notes.append(
                    "the script never called fully_shard: nothing was checked (fsdpcheck run "
                    "checks FSDP2 jobs; a DDP, FSDP1 or single-process script runs unchecked)"
                )
                return RunOutcome(None, None, "", tuple(self.notes))
            if isinstance(error, ChannelLost):  # the watch lost a peer: the peer's failure
                self._leave_watch()
                return self._conclude_with(self._guarded(_raising(error)), raise_stop=False)
            message = ""
            if error is not None and not (ended_by_the_run(error) or isinstance(error, SystemExit)):
                message = f"{type(error).__name__}: {error}"
            if self._model is None and error is None:
                self.notes.append("the script ended before any FSDP module's forward")
            elif self._steps < self.options.watch_steps and error is None:
                self.notes.append(
                    f"the script ended after {self._steps} optimizer step(s), before the "
                    f"{self.options.watch_steps} watched: the step was checked as far as it ran"
                )
            return self._conclude(message)
        finally:
            self.remove()


def _raising(error: BaseException) -> Callable[[], AuditResult]:
    """Work that raises ``error``: a failure already met, given to :meth:`_guarded` to name."""

    def work() -> AuditResult:
        raise error

    return work


class _Nothing(nn.Module):
    """No model ran a forward: a step's state check has nothing to read."""


def _combined(first: Report, second: Report) -> Report:
    """Two roots' reports (an actor and a reference model): every finding, the worse verdict."""
    worse = max(first, second, key=lambda r: int(r.exit_code))
    return replace(worse, findings=(*first.findings, *second.findings))


@contextlib.contextmanager
def _modes_off():
    """The session's own collectives on the side channel, out of the watch's sight."""
    disable = getattr(torch.utils._python_dispatch, "_disable_current_modes", None)
    with disable() if disable is not None else contextlib.nullcontext():
        yield


def _fsdp_state_class() -> Any:
    """FSDP2's per-module state class, whose ``init`` every ``fully_shard`` call runs (private:
    where torch 2.6-2.15 keep it, feature-detected)."""
    for home in (
        "torch.distributed.fsdp._fully_shard._fsdp_state",
        "torch.distributed._composable.fsdp._fsdp_state",
    ):
        try:
            module = __import__(home, fromlist=["FSDPState"])
        except ImportError:
            continue
        state = getattr(module, "FSDPState", None)
        if state is not None and callable(getattr(state, "init", None)):
            return state
    return None


def _fully_shard() -> Callable[..., Any] | None:
    """torch's ``fully_shard`` (its public home since 2.6; the composable one before)."""
    for home in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        try:
            module = __import__(home, fromlist=["fully_shard"])
        except ImportError:
            continue
        found = getattr(module, "fully_shard", None)
        if found is not None:
            return found
    return None


def _loaded_path(kind: str, args: tuple, kwargs: dict) -> str:
    """The path a load reads: DCP's ``checkpoint_id`` or its reader's path, safetensors' file."""
    if kind == "safetensors":
        path = args[0] if args else kwargs.get("filename")
    else:
        path = kwargs.get("checkpoint_id") or (args[1] if len(args) > 1 else None)
        reader = kwargs.get("storage_reader")
        path = path or getattr(reader, "path", None)
    return str(path) if isinstance(path, (str, os.PathLike)) else ""


def _optimizer_of(model: nn.Module) -> Any:
    """The optimizer that holds ``model``'s parameters, if one exists yet: found among live
    objects once, at the first forward (torch has no hook for an optimizer's creation)."""
    params = {id(p) for p in model.parameters()}
    for candidate in gc.get_objects():
        # type(), not isinstance: isinstance reads __class__, which some live objects (torch's
        # deprecated aliases) answer with a warning.
        if issubclass(type(candidate), torch.optim.Optimizer):
            groups = getattr(candidate, "param_groups", ())
            if any(id(p) in params for group in groups for p in group.get("params", ())):
                return candidate
    return None
