"""Liveness: stage marks, heartbeats and the abort mark in the rendezvous store, so a rank that
gives up can name the rank responsible instead of leaving everyone waiting."""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from fsdpcheck.distributed import setup
from fsdpcheck.distributed.setup import DistContext
from fsdpcheck.records import RankError, from_dict, to_dict
from fsdpcheck.text import STUCK
from fsdpcheck.vocab import STAGE_ORDER, ErrorKind, ExitCode, Stage

log = logging.getLogger(__name__)

_STAGE_KEY = "fsdpcheck/stage/{}"


def mark_stage(ctx: DistContext, stage: str) -> None:
    """Leave this rank's current stage in the store, so a failed gather can name who is missing."""
    if ctx.store is None:
        return
    try:
        ctx.store.set(_STAGE_KEY.format(ctx.rank), stage)
    except Exception:
        log.debug("stage marks off: the store refused %s", stage, exc_info=True)
        ctx.store = None


_ABORT_KEY = "fsdpcheck/abort"
# Errors kept in the abort mark and the published diagnosis: a rank that concludes from either
# reports what the diagnosing rank found (a few KiB in the store at most).
_ERRORS_KEPT = 64


def signal_abort(ctx: DistContext, errors: list[RankError]) -> None:
    """Tell every rank's abort watch that this run is over, and why (a rank gave up)."""
    if ctx.store is None:
        return
    try:
        ctx.store.set(_ABORT_KEY, json.dumps([to_dict(e) for e in errors[:_ERRORS_KEPT]]))
    except Exception:  # the store's host is gone too: the others' own timeouts end them
        log.debug("could not leave the abort mark", exc_info=True)


def _abort_errors(payload: bytes) -> list[RankError]:
    try:
        return [from_dict(RankError, e) for e in json.loads(payload)]
    except (ValueError, TypeError, KeyError):
        log.debug("abort mark is not a list of errors; passing it on as text", exc_info=True)
        return [RankError(-1, Stage.ABORT, payload.decode(errors="replace"), ErrorKind.RUNTIME)]


_ENDED_KEY = "fsdpcheck/ended/{}"
# Ranks the store's host does not wait for (linger): found dead, or never arrived.
_GONE_KEY = "fsdpcheck/gone"


def mark_ended(ctx: DistContext, store: Any = None) -> None:
    """This rank concluded a failed run (or its abort watch took the abort mark, which it will
    conclude with): it says so in the store, once, and needs nothing more from it. Where it
    hosts the store (:func:`hosts_store`), it keeps it up at exit until the others have said so
    too (:func:`linger`, an exit handler: the report is out by then, and a process that goes
    on running keeps its store anyway). ``store``: a client of the store's other than
    ``ctx.store`` (the watch thread's own)."""
    store = ctx.store if store is None else store
    if ctx.ended or store is None:
        return
    ctx.ended = True
    try:
        store.set(_ENDED_KEY.format(ctx.rank), "1")
    except Exception:  # the store's host is gone: nobody waits for the mark
        log.debug("could not mark rank %d's end of the run", ctx.rank, exc_info=True)
    if ctx.world_size > 1 and hosts_store(ctx):
        # The context without its groups and mesh, and the main client, not the watch thread's
        # own: a process that checks many times keeps no more than the store it has anyway.
        atexit.register(
            linger, dataclasses.replace(ctx, side_channel=None, mesh=None, ep_meshes=None)
        )


def _leave_gone(store: Any, ranks: set[int] | list[int]) -> None:
    if not ranks or store is None:
        return
    try:
        store.set(_GONE_KEY, json.dumps(sorted(ranks)))
    except Exception:
        log.debug("could not leave the ranks found gone", exc_info=True)


def _agent_hosts_store() -> bool:
    """torchrun's agent serves the rendezvous store, not rank 0."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


def hosts_store(ctx: DistContext) -> bool:
    """This process serves the rendezvous store: rank 0 over a TCPStore (env:// or tcp://
    ranks), unless a launcher's agent serves it. A FileStore has no host."""
    if ctx.rank != 0 or ctx.store is None or _agent_hosts_store():
        return False
    store = ctx.store
    while hasattr(store, "underlying_store"):  # a PrefixStore: fsdpcheck's own, torch's
        store = store.underlying_store
    return isinstance(store, dist.TCPStore)


def linger_bound(world_size: int) -> float:
    """The longest the store's host waits for the other ranks to take the end of a failed
    run: two heartbeat intervals (a live rank's watch reads the abort mark once in each) plus
    3 s for a rank that reads the published diagnosis."""
    return 2 * heartbeat_interval(world_size) + 3.0


def linger(ctx: DistContext, store: Any = None) -> None:
    """On the store's host (:func:`hosts_store`), once it concluded a failed run and before its
    process ends: wait, at most :func:`linger_bound`, until every rank not found gone has taken
    the end of the run (:func:`mark_ended`). The store ends with this process; a rank still
    waiting in a collective or its step when it goes would learn of the run's end only the
    store's loss, not the diagnosis. ``store``: as in :func:`mark_ended`."""
    if ctx.world_size == 1 or not hosts_store(ctx):
        return
    store = ctx.store if store is None else store
    deadline = time.monotonic() + linger_bound(ctx.world_size)
    pause = 0.005
    try:
        gone = set(json.loads(store.get(_GONE_KEY))) if store.check([_GONE_KEY]) else set()
        others = [r for r in range(ctx.world_size) if r != ctx.rank and r not in gone]
        keys = [_ENDED_KEY.format(r) for r in others]
        # Polled, not a blocking wait, which logs a C++ warning when it times out.
        while keys and not store.check(keys):
            if time.monotonic() > deadline:
                log.info("rank %d: ending before every rank took the end of the run", ctx.rank)
                return
            time.sleep(pause)
            pause = min(pause * 2, 0.1)
    except Exception:
        log.debug("rank %d: the store failed while it lingered", ctx.rank, exc_info=True)


_ALIVE_KEY = "fsdpcheck/alive/{}"


def heartbeat_interval(world_size: int) -> float:
    """One store write per rank per interval: keep the store's load flat at large scale."""
    return max(1.0, world_size / 512)


def aborted_run(ctx: DistContext) -> list[RankError] | None:
    """The abort mark's errors when the other ranks already gave up on this run, else None."""
    if ctx.store is None:
        return None
    try:
        if ctx.store.check([_ABORT_KEY]):
            return _abort_errors(ctx.store.get(_ABORT_KEY))
    except Exception:  # the store's host is gone: the join that follows says so
        log.debug("could not read the abort mark", exc_info=True)
    return None


class NeverMet(Exception):
    """The ranks never met on the side channel; ``errors`` name who is missing, ``ctx`` is
    this rank's context so far (to shut down)."""

    def __init__(self, ctx: DistContext, errors: list[RankError]):
        super().__init__(errors[0].message)
        self.ctx = ctx
        self.errors = errors


def join(backend: str, timeout: float, **mesh: Any) -> DistContext:
    """Collective: :func:`setup.init` with this rank's arrival marked in the store first, so
    that a side channel that cannot be built (a peer died or is stuck before the check, or the
    store's host is gone) names who never arrived: raises :class:`NeverMet` after at most
    ``timeout``. A rank that arrives after the others gave up on it learns so at once."""
    store = None

    def arrive(ctx: DistContext) -> None:
        nonlocal store
        store = ctx.store
        mark_stage(ctx, Stage.LAUNCH)
        errors = aborted_run(ctx)
        if errors:
            raise NeverMet(ctx, errors)

    try:
        return setup.init(backend, timeout, arrive=arrive, **mesh)
    except setup.JoinError as exc:
        errors = arrival_errors(exc.ctx, store, exc.cause)
        exc.ctx.store = store
        signal_abort(exc.ctx, errors)  # a rank that arrives late is told at once
        raise NeverMet(exc.ctx, errors) from exc.cause


def arrival_errors(ctx: DistContext, store: Any, exc: BaseException) -> list[RankError]:
    """Who never arrived, from the arrival marks in ``store``; when the store cannot be read
    its host is gone (rank 0, unless a launcher's agent hosts it)."""
    cause = collective_cause(exc)
    if store is None:  # no marks to read: say only what this rank saw
        message = f"rank {ctx.rank} could not meet the other ranks: {cause}"
        return [RankError(ctx.rank, Stage.LAUNCH, message, ErrorKind.RUNTIME)]
    keys = [_STAGE_KEY.format(r) for r in range(ctx.world_size)]
    try:
        marks = _read_many(store, keys, None)
    except Exception:
        log.debug("arrival marks unreadable: the store's host is gone", exc_info=True)
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        host, named = ("the launcher's agent", -1) if _agent_hosts_store() else ("rank 0", 0)
        message = (
            f"the rendezvous store's host ({host}, at {where}) is unreachable: it died or ended "
            f"before the check (rank {ctx.rank} saw: {cause})"
        )
        return [RankError(named, Stage.LAUNCH, message, ErrorKind.RUNTIME)]
    missing = [r for r, mark in enumerate(marks) if mark is None and r != ctx.rank]
    _leave_gone(store, missing)  # the store's host waits for none of them before it goes
    errors = [
        RankError(
            r,
            Stage.LAUNCH,
            f"rank {r} never arrived: it did not reach the check within --timeout "
            f"{ctx.timeout:g}s (it died or is stuck before it; rank {ctx.rank} saw: {cause})",
            ErrorKind.RUNTIME,
        )
        for r in missing
    ]
    if not errors:
        message = f"rank {ctx.rank} could not build the side channel: {cause}"
        errors.append(RankError(ctx.rank, Stage.LAUNCH, message, ErrorKind.RUNTIME))
    return errors


class AbortWatch:
    """A daemon thread that beats this rank's heartbeat and watches for the end of the run.

    The heartbeat lets a rank that gives up tell a dead peer from a slow one. The abort mark
    covers a rank stuck in its own work (a stalled filesystem, a deadlocked import) that never
    reaches the gather: when the others give up they leave the mark. Where fsdpcheck owns the
    process (its CLI, ``end_process=True``) this thread then exits it with code 3 instead of
    leaving it behind, and also when the store's host (rank 0, or the launcher's agent) has
    been gone for a whole timeout. In a library call (a training script, a Ray actor) the
    process is the caller's: the watch only records the errors (:attr:`aborted`), and the call
    returns exit 3 once its own work is done.
    """

    def __init__(
        self,
        ctx: DistContext,
        on_abort: Callable[[list[RankError]], None] | None = None,
        *,
        end_process: bool = False,
    ):
        self._ctx = ctx
        self._on_abort = on_abort
        self._end_process = end_process
        self._interval = heartbeat_interval(ctx.world_size)
        self._done = threading.Event()
        self._armed = True
        self._lock = threading.Lock()  # disarm() against _abort's record
        self.aborted: list[RankError] | None = None  # what the abort mark said, once seen
        self._thread = threading.Thread(target=self._run, name="fsdpcheck-abort-watch", daemon=True)

    def __enter__(self) -> AbortWatch:
        if self._ctx.store is not None and self._ctx.world_size > 1:
            self._thread.start()
        return self

    def disarm(self) -> list[RankError] | None:
        """Keep beating but never abort: this rank is concluding the run itself. Returns the
        abort mark's errors where the watch took them first (the run is over: conclude with
        them, since the store's host may be gone once the watch has told it so; the watch
        beats no more), else None: the watch will not take them now."""
        with self._lock:
            self._armed = False
            return self.aborted

    def stop_if_over(self) -> None:
        """Raise ConnectionError where this watch took the abort mark: before a collective
        the ranks that gave up will never join (a step's conclusion), and before each call of
        :meth:`guarded`'s store."""
        errors = self.aborted
        if errors is not None:  # worded as a peer's failure (is_collective_failure)
            raise ConnectionError(f"a peer gave up on the run: {errors[0].message}")

    def guarded(self, store: Any) -> Any:
        """``store`` for work that must stop once this watch took the abort mark (a library
        call's: a step under the watch): from then on each call raises ConnectionError without
        reaching the store, whose host may be gone, so the work ends at once and the rank
        concludes with the mark's errors (:meth:`disarm`). None stays None."""
        return None if store is None else _UntilAborted(store, self)

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        # Joined, not abandoned: a daemon thread still inside a store call when the
        # interpreter exits makes C++ terminate the process.
        if self._thread.is_alive():
            self._thread.join(timeout=self._interval + 5)

    def _run(self) -> None:
        began, alive = time.monotonic(), _ALIVE_KEY.format(self._ctx.rank)
        store = own_client(self._ctx.store)
        # Not cloned: maybe after waiting out the store's timeout to connect to a host that is
        # gone. Counted unreachable from the start, so that wait is not paid twice (a beat
        # that goes through clears it).
        unreachable_since = began if store is self._ctx.store else None
        while True:
            try:
                store.add(alive, 1)
                aborted = store.check([_ABORT_KEY])
                errors = _abort_errors(store.get(_ABORT_KEY)) if aborted else None
                unreachable_since = None
            except Exception:
                # Rank 0 may simply have finished first; only a store gone for a whole
                # timeout means nobody is left to conclude the run.
                log.debug("heartbeat: store unreachable", exc_info=True)
                unreachable_since = unreachable_since or time.monotonic()
                gone = time.monotonic() - unreachable_since >= self._ctx.timeout
                why = "the rendezvous store is gone: rank 0 or the launcher died"
                errors = (
                    [RankError(self._ctx.rank, Stage.ABORT, why, ErrorKind.RUNTIME)]
                    if gone
                    else None
                )
            if self._done.is_set():
                return
            if errors and self._armed:
                self._abort(errors, store)
            if self.aborted is not None:
                # The run is over and this rank concludes with the mark's errors: nobody reads
                # its beats again, and beats to a store whose host went fail noisily in C++.
                return
            if self._done.wait(self._interval):
                return

    def _abort(self, errors: list[RankError], store: Any) -> None:
        if not self._end_process:  # the caller's process: the call returns exit 3 instead
            with self._lock:
                if not self._armed or self.aborted is not None:
                    return
                log.info("rank %d: the run is over: %s", self._ctx.rank, errors[0].message)
                self.aborted = errors
            # The call concludes with these (disarm). Outside the lock: a store whose host hangs
            # must not hold up the rank's own conclusion in disarm().
            mark_ended(self._ctx, store)
            return
        sys.stderr.write(f"fsdpcheck: rank {self._ctx.rank} aborting: {errors[0].message}\n")
        sys.stderr.flush()
        mark_ended(self._ctx, store)
        if self._on_abort is not None:
            try:  # rank 0 publishes what the rank that gave up found, then goes
                self._on_abort(errors)
            except Exception:  # the exit below matters more than the report
                log.debug("publishing on abort failed", exc_info=True)
        linger(self._ctx, store)  # os._exit runs no exit handler
        os._exit(ExitCode.RUNTIME)


class _UntilAborted:
    """A store whose calls raise once ``watch`` took the abort mark (:meth:`AbortWatch.guarded`)."""

    def __init__(self, store: Any, watch: AbortWatch):
        self._store, self._watch = store, watch

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)
        if not callable(method):
            return method

        def call(*args: Any, **kwargs: Any) -> Any:
            self._watch.stop_if_over()
            return method(*args, **kwargs)

        setattr(self, name, call)  # made once: the watch calls the store on its hot path
        return call


def own_client(store: Any) -> Any:
    """A client of ``store``'s server for one thread alone (``Store.clone``). A TCPStore client
    serves one call at a time: beats sent through the client the main thread uses would wait
    behind any blocking call it makes (a ``store.wait``, a ``new_group`` rendezvous in the
    script), and its peers, watching the heartbeats, would take this live rank for dead. The
    shared client where this torch or store cannot clone."""
    clone = getattr(store, "clone", None)
    if clone is None:
        return store
    try:
        return clone()
    except Exception:  # a store that cannot clone (a script's own), or its host is gone
        log.debug("store not cloned: the heartbeat shares the main thread's client", exc_info=True)
        return store


def _read_many(store: Any, keys: list[str], default: bytes | None) -> list[bytes | None]:
    """Every key's value: two store calls when every key exists (``check`` + ``multi_get``),
    else one ``check`` + ``get`` per key (``default`` for the missing ones)."""
    if keys and store.check(keys):
        return list(store.multi_get(keys))
    return [store.get(k) if store.check([k]) else default for k in keys]


def _counters(store: Any, keys: list[str]) -> list[int]:
    return [int(v) if v else 0 for v in _read_many(store, keys, b"0")]


def heartbeats(store: Any, ranks: list[int]) -> list[int]:
    """How many times each of ``ranks`` has beaten (0: never, or no abort watch runs there).
    Raises where the store does."""
    return _counters(store, [_ALIVE_KEY.format(r) for r in ranks])


def given_up(store: Any) -> bool:
    """A rank gave up on this run and left the abort mark (:func:`signal_abort`). Raises where
    the store does."""
    return bool(store.check([_ABORT_KEY]))


def dead_ranks(ctx: DistContext) -> set[int]:
    """Ranks whose heartbeat does not move over a few intervals (needs the abort watch)."""
    if ctx.store is None or ctx.world_size == 1:
        return set()
    keys = [_ALIVE_KEY.format(r) for r in range(ctx.world_size)]
    try:
        before = _counters(ctx.store, keys)
        time.sleep(3 * heartbeat_interval(ctx.world_size))
        after = _counters(ctx.store, keys)
    except Exception:
        log.debug("heartbeats unreadable: no rank is called dead", exc_info=True)
        return set()
    still = [r for r in range(ctx.world_size) if r != ctx.rank and before[r] == after[r]]
    # A rank that took the end of the run stops beating, alive (AbortWatch): not dead.
    try:
        return {r for r in still if not ctx.store.check([_ENDED_KEY.format(r)])}
    except Exception:
        log.debug("ended marks unreadable: the stopped heartbeats decide", exc_info=True)
        return set(still)


def last_stages(ctx: DistContext) -> dict[int, str | None]:
    """Each rank's last marked stage; empty when the store is gone (its host died)."""
    if ctx.store is None:
        return {}
    keys = [_STAGE_KEY.format(r) for r in range(ctx.world_size)]
    try:
        values = _read_many(ctx.store, keys, None)
    except Exception:
        log.debug("stage marks unreadable", exc_info=True)
        return {}
    return {r: v.decode() if v is not None else None for r, v in enumerate(values)}


_COLLECTIVE_WORDS = re.compile(
    r"timed out|timeout|connection (closed|reset)|broken pipe|peer|socket|gloo|heartbeat|"
    r"collective mismatch|preamble",
    re.IGNORECASE,
)


def is_collective_failure(exc: BaseException) -> bool:
    """A gloo timeout or a vanished peer, as opposed to a loader refusing with its own error.
    A file the rank could not read is never one, whatever words its path holds."""
    if isinstance(exc, OSError) and not isinstance(exc, ConnectionError | TimeoutError):
        return False
    return bool(_COLLECTIVE_WORDS.search(f"{type(exc).__name__}: {exc}"))


def collective_cause(exc: BaseException) -> str:
    """The useful part of a collective's error: gloo prefixes a source path and adds advice."""
    cause = getattr(exc, "cause", None)  # the step watch's ChannelLost wraps the real error
    exc = cause if isinstance(cause, BaseException) else exc
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    first = re.sub(r"^\[[^\]]*\]\s*", "", first).split(". ")[0]
    return f"{type(exc).__name__}: {first}"


# A peer marked at an earlier stage than ours is behind.
def _stage_index(stage: str | None) -> int:
    return STAGE_ORDER.index(stage) if stage in STAGE_ORDER else 0


_DIAGNOSER_KEY = "fsdpcheck/diagnoser"
_DIAGNOSIS_KEY = "fsdpcheck/diagnosis"


def diagnose_peers(
    ctx: DistContext, exc: BaseException, *, own: RankError | None
) -> list[RankError]:
    """Turn a failed collective into errors that name the rank(s) responsible.

    A rank whose heartbeat stopped died; failing that, a rank marked at an earlier stage than
    this one is stuck there; failing that, the failure is this rank's own.

    Only the first rank to give up reads every rank's marks and heartbeats (O(world) store
    calls, or a few ``multi_get`` calls) and publishes its findings; the others wait for them
    (three store calls each), so a failure costs the store O(world) calls in all, not
    O(world^2). A rank that waits in vain (the diagnosing rank died too) diagnoses alone.
    """
    if ctx.store is None or ctx.world_size == 1:
        return _diagnose(ctx, exc, own=own)
    try:
        first = ctx.store.add(_DIAGNOSER_KEY, 1) == 1
    except Exception:
        log.debug("store gone: diagnosing alone", exc_info=True)
        return _diagnose(ctx, exc, own=own)
    if first:
        errors = _diagnose(ctx, exc, own=own)
        try:
            ctx.store.set(_DIAGNOSIS_KEY, json.dumps([to_dict(e) for e in errors[:_ERRORS_KEPT]]))
        except Exception:  # the others wait in vain, then diagnose alone
            log.debug("could not publish the diagnosis", exc_info=True)
        return errors
    try:
        # A blocking wait: the heartbeat thread beats through a client of its own (own_client).
        ctx.store.wait([_DIAGNOSIS_KEY], timedelta(seconds=diagnosis_wait(ctx.world_size)))
        published = _abort_errors(ctx.store.get(_DIAGNOSIS_KEY))
    except Exception:
        log.debug("no published diagnosis: diagnosing alone", exc_info=True)
        return _diagnose(ctx, exc, own=own)
    if own is None:
        return published
    return [own, *(e for e in published if e != own)]


def diagnosis_wait(world_size: int) -> float:
    """How long a rank waits for the published diagnosis: the diagnosing rank's heartbeat
    watch (three intervals) plus its store reads, with room to spare."""
    return 3 * heartbeat_interval(world_size) + 10.0 + world_size / 200


def _diagnose(ctx: DistContext, exc: BaseException, *, own: RankError | None) -> list[RankError]:
    cause = collective_cause(exc)
    stages = last_stages(ctx)
    mine = stages.get(ctx.rank) or Stage.GATHER
    dead = dead_ranks(ctx)
    _leave_gone(ctx.store, dead)  # the store's host waits for none of them before it goes
    errors = [own] if own is not None else []
    for r in sorted(dead):
        stage = stages.get(r) or Stage.LAUNCH
        message = (
            f"rank {r} died during stage '{stage}' "
            f"(its heartbeat stopped; rank {ctx.rank} saw: {cause})"
        )
        errors.append(RankError(r, stage, message, ErrorKind.RUNTIME))
    behind = [
        (r, stage or Stage.LAUNCH)
        for r, stage in sorted(stages.items())
        if r != ctx.rank and _stage_index(stage) < _stage_index(mine)
    ]
    # Ranks the failed exchange itself names as silent (the step watch knows whom it waited
    # for), when no stage mark tells them apart.
    silent = [r for r in getattr(exc, "silent", ()) if r != ctx.rank and r not in dead]
    if not dead and not behind and silent:
        behind = [(r, stages.get(r) or mine) for r in silent]
    for r, stage in [] if dead else behind:
        message = (
            f"rank {r} {STUCK} '{stage}' (rank {ctx.rank} gave up waiting at "
            f"'{mine}' after --timeout {ctx.timeout:g}s: {cause})"
        )
        errors.append(RankError(r, stage, message, ErrorKind.RUNTIME))
    if len(errors) == (1 if own else 0):
        message = f"rank {ctx.rank} failed at '{mine}': {cause}"
        errors.append(RankError(ctx.rank, mine, message, ErrorKind.RUNTIME))
    return errors
