"""The collective watch: every collective a step issues is agreed on by its group's members first.

A :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees each c10d collective (FSDP2's
``c10d._allgather_base_`` and ``c10d._reduce_scatter_base_``, a script's ``all_reduce`` or
``broadcast``, the functional collectives tensor parallelism and DTensor issue) before it
reaches the backend. It describes it in full (:class:`CollectiveCall`: op, reduce op, root as a
global rank, the group's members, each tensor's size and dtype, and for an all_to_all what this
rank sends each member and expects from each), and the members of that collective's own group,
and only they, compare descriptors, bounded by the timeout. Ranks outside the group never wait
for it, so disjoint groups (pipeline stages, TP and EP groups) that issue different numbers of
collectives are clean.

Agreement costs each member the same whatever the group's size: a binary tree over the group's
sorted members, through the rendezvous store. Each member leaves a digest of what must agree
(and, for an all_to_all, its share of a sum that is zero when the splits pair); each member of
the tree leaves the least and greatest digest of its subtree, the root the verdict, and every
member reads the verdict: at most four sets and reads (and polls while a member is
late) and about 150 bytes per member, log2(group) levels. Only a verdict of "differ" (or a
member that has finished, raised in, or stopped in its step) fetches the full descriptors,
every member's from every member, to name the difference.
Equal descriptors (all_to_all splits that pair): the collective is issued. Any difference, or an
ended member: no member issues it; each raises :class:`StepDiverged`, which unwinds its step,
and every rank that later needs one of them stops too. Digests that differ are never issued,
whether or not a compared field names why.

Point-to-point: a ``batch_isend_irecv`` is held whole (:meth:`CollectiveWatch.batches`): its
descriptors are left held until every op of it paired, and a peer whose side pairs with one
waits for that release (or for the holder to wait on it) before issuing its own, and waits in
the watch for the batch to be issued before it waits in gloo, so a fused [send, receive] whose
send never pairs never leaves the peer's send blocked on its receive (``Schedule1F1B``). A
lone send or receive whose peer is itself waiting in the watch goes ahead of its pair, and the
pair is confirmed before anyone waits on it (:meth:`CollectiveWatch.point_to_point`). Ranks
waiting on each other in the watch, directly or in a cycle, the same wait marks for a while,
stop there: a stage running fewer microbatches than the next one is a finding, not a wait in
gloo.

DTensor's redistributions (``clip_grad_norm_`` over FSDP2 gradients, tensor parallelism) issue
functional collectives inside DTensor's own dispatch: for an op on a DTensor the watch answers
``NotImplemented``, so DTensor dispatches it with the watch still on, and those are seen too. A
``torch.compile``d step runs eagerly under the watch (torch 2.13: dynamo compiles no frame and
runs no cached graph while a dispatch mode is active), so its collectives are seen; what is checked
is the eager form of the step. Not seen: collectives from other threads (the mode is
thread-local; FSDP2 on CPU issues its own from the step's thread) and the ops :data:`UNWATCHED`
lists. A divergence there is caught by the timeout.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import logging
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from fsdpcheck.checks.step import (
    FINISHED,
    RAISED,
    STOPPED,
    UNNAMED,
    CollectiveCall,
    PeerView,
    disagreement,
)
from fsdpcheck.distributed import liveness
from fsdpcheck.distributed.wire import span
from fsdpcheck.model.writes import script_frame, site_of
from fsdpcheck.records import from_dict, to_dict

log = logging.getLogger(__name__)

# How a watched op is described: the name users know, its kind and the argument holding what
# this rank sends (None: no size compared).
_ALL, _A2A, _SEND, _RECV = "collective", "all_to_all", "send", "recv"
# torch.distributed._functional_collectives: (op, kind, argument, the in-place or out= variants
# torch registers beside it, watched alike).
_FUNCTIONAL = (
    ("all_reduce", _ALL, "input", ("_",)),
    ("all_reduce_coalesced", _ALL, "inputs", ("_",)),
    ("all_gather_into_tensor", _ALL, "input", ("_out",)),
    ("all_gather_into_tensor_coalesced", _ALL, "inputs", ()),
    ("reduce_scatter_tensor", _ALL, "input", ("_out",)),
    ("reduce_scatter_tensor_coalesced", _ALL, "inputs", ()),
    ("broadcast", _ALL, "input", ("_",)),
    ("all_to_all_single", _A2A, None, ()),
)
WATCHED: dict[str, tuple[str, str, str | None]] = {
    "c10d::_allgather_base_": ("all_gather_into_tensor", _ALL, "input_tensor"),
    "c10d::allgather_": ("all_gather", _ALL, "input_tensors"),
    "c10d::allgather_coalesced_": ("all_gather_coalesced", _ALL, "input_list"),
    "c10d::allgather_into_tensor_coalesced_": ("all_gather_into_tensor_coalesced", _ALL, "inputs"),
    "c10d::_reduce_scatter_base_": ("reduce_scatter_tensor", _ALL, "input_tensor"),
    "c10d::reduce_scatter_": ("reduce_scatter", _ALL, "output_tensors"),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce_scatter_tensor_coalesced", _ALL, "inputs"),
    "c10d::allreduce_": ("all_reduce", _ALL, "tensors"),
    "c10d::allreduce_coalesced_": ("all_reduce_coalesced", _ALL, "tensors"),
    "c10d::broadcast_": ("broadcast", _ALL, "tensors"),
    "c10d::reduce_": ("reduce", _ALL, "tensors"),
    "c10d::alltoall_base_": ("all_to_all_single", _A2A, None),
    "c10d::alltoall_": ("all_to_all", _A2A, None),
    "c10d::gather_": ("gather", _ALL, "input_tensors"),
    "c10d::gather_into_tensor_": ("gather_single", _ALL, "input_tensor"),  # torch 2.15
    "c10d::scatter_": ("scatter", _ALL, "output_tensors"),
    "c10d::barrier": ("barrier", _ALL, None),
    "c10d::monitored_barrier_": ("monitored_barrier", _ALL, None),
    "c10d::send": ("send", _SEND, "tensors"),
    "c10d::recv_": ("recv", _RECV, "tensors"),
    **{
        f"_c10d_functional::{op}{variant}": (op, kind, argument)
        for op, kind, argument, variants in _FUNCTIONAL
        for variant in ("", *variants)
    },
    "_c10d_functional::isend": ("send", _SEND, "tensor"),
    "_c10d_functional::irecv": ("recv", _RECV, "tensor"),
    # The differentiable twins of three of them.
    **{
        f"_c10d_functional_autograd::{op}": (op, kind, argument)
        for op, kind, argument, _ in _FUNCTIONAL
        if op in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")
    },
    # An even reshard: its input may be uneven across ranks, so only op and order are compared.
    "_dtensor::shard_dim_alltoall": ("shard_dim_alltoall", _ALL, None),
}
# Registered ops the watch leaves alone, and why (docs/checks.md lists them too).
UNWATCHED: dict[str, str] = {
    "c10d::recv_any_source_": "no peer to pair it with until it has received",
    "c10d::check_for_nan": "not a collective (a local check)",
    "_c10d_functional::wait_tensor": "not a collective (waits for one already agreed)",
    # torch 2.15: one wait over several results of collectives already agreed (issue 37)
    "_c10d_functional::wait_tensors": "not a collective (waits for several already agreed)",
    "_c10d_functional::batch_p2p_ops": "a compiled batch of sends and receives; eager "
    "batch_isend_irecv is watched op by op",
    "_c10d_functional::_wrap_tensor_autograd": "not a collective (wraps a result for autograd)",
    "_dtensor::mesh_get_process_group": "not a collective (looks a mesh's group up)",
}


def _dtensor_dispatch_file() -> str | None:
    """The file of DTensor's op dispatcher (``tensor/_dispatch.py`` in torch 2.13), where it
    redistributes an op's arguments; None where DTensor has none to find."""
    dispatcher = getattr(DTensor, "_op_dispatcher", None)
    try:
        return inspect.getfile(type(dispatcher)) if dispatcher is not None else None
    except TypeError:  # a class defined outside Python source
        return None


# A collective issued from it, not from the script's own DTensor call, is a redistribution of
# an op's arguments. The watch answers DTensor ops NotImplemented and so no longer wraps their
# dispatch to count its depth: it looks for the dispatcher's frames instead (torch 2.13 enters
# them from C++, with no __torch_dispatch__ frame above them).
_DTENSOR_DISPATCH = _dtensor_dispatch_file()
_REDUCE_OPS = {int(v): n.lower() for n, v in dist.ReduceOp.RedOpType.__members__.items()}

# The world-wide fallback (no rendezvous store): eight int64 words, the same on every rank.
_CALL, _FINISHED, _RAISED = 1, 2, 3
_STATE = {_FINISHED: FINISHED, _RAISED: RAISED}
_CONTEXT = 3  # agreed collectives kept for the report's context
_DIVERGED = "diverged"  # a rank's end mark when it stopped at a divergence
_AHEAD = "ahead"  # a point-to-point peer waiting in the watch itself: it compares the pair
_BLOCKED = b"blocked:"  # a peer stuck in a batch of its own that this rank's batch cannot serve
_DEADLOCK_GRACE = 0.5  # seconds a peer's batch wait must stay the same to count as stuck
# A tree wait's pauses between polls (seconds): the first and the longest; it looks at the end
# marks too once it has paused _ENDS_AFTER in all. Each pause is the last one times the growth:
# 1.25 lets a wait end at most a quarter after its peer arrived, once past its first
# milliseconds, where doubling allows as much again. In a world of more than _SMALL_WORLD ranks
# the pauses double: every rank's polls are calls to the one store host, and 1.25 makes 1.4 to
# 2 times as many over waits of 1 to 100 ms.
_PAUSE_FIRST, _PAUSE_MAX, _ENDS_AFTER = 1e-4, 0.02, 0.0125
_PAUSE_GROWTH, _PAUSE_GROWTH_LARGE, _SMALL_WORLD = 1.25, 2.0, 8
_MASK64 = 2**64 - 1
# Seconds a waited-for peer's heartbeat must stand still, at least and at most (_gone_after).
_GONE_FLOOR, _GONE_CAP = 10.0, 30.0
_ENDED = (FINISHED, RAISED)
_OWED = b"owed:"  # a peer confirming a send or receive it issued ahead: "owed:<n>:<call>"
# A descriptor left by a batch that is not yet whole: "held:<batch>:<call>". Its pair waits for
# the batch's release (every op of it paired) before it is issued: a batch is held whole.
_HELD = b"held:"
# A rank waiting for a held batch's release: it goes ahead by itself once the holder waits on
# it, so it is no link of a deadlock: "release:<call>".
_RELEASE = b"release:"


class StepDiverged(BaseException):
    """The members of a group differ at their next collective: raised on each of them (and on
    every rank that then needs one of them) to unwind its step. A ``BaseException``, so that a
    step's own ``except Exception`` does not swallow it."""


class ChannelLost(BaseException):
    """An exchange failed: a peer died, or is stuck past the timeout (``silent``: those ranks)."""

    def __init__(self, cause: BaseException, silent: tuple[int, ...] = ()):
        super().__init__(str(cause))
        self.cause = cause
        self.silent = silent


@dataclass(frozen=True)
class Owner:
    """An FSDP2 parameter group: the module it was applied to and its parameters' names."""

    module: str
    params: tuple[str, ...]


def fsdp_owners(model: Any) -> dict[int, Owner]:
    """``id(FSDPParamGroup)`` → its module's name and parameters, for every FSDP2 module."""
    owners: dict[int, Owner] = {}
    # Names from the model: FSDP2 fills in its own (``_param_fqn``) only at its lazy init.
    names = {id(p): n for n, p in model.named_parameters()}
    for name, module in model.named_modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is None:
            continue
        try:
            group = get_state()._fsdp_param_group
        except Exception:  # private API: a collective without an owner is still watched
            log.debug("no FSDP state on %r", name, exc_info=True)
            continue
        if group is not None:
            params = tuple(
                names.get(id(getattr(p, "sharded_param", None))) or str(p._param_fqn)
                for p in getattr(group, "fsdp_params", ())
            )
            owners[id(group)] = Owner(name, params)
    return owners


def _hash63(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 1


def _group_key(members: tuple[int, ...]) -> str:
    return hashlib.blake2b(",".join(map(str, members)).encode(), digest_size=8).hexdigest()


class CollectiveWatch(TorchDispatchMode):
    """Enter it around the step on every rank; call :meth:`finish` on every rank after it.

    ``store`` (the run's rendezvous store) carries the descriptors among each group's members;
    without one, every rank agrees on every collective over the world-wide ``side_channel``."""

    def __init__(
        self,
        side_channel: Any,
        world_size: int,
        owners: Mapping[int, Owner],
        *,
        store: Any = None,
        rank: int = 0,
        timeout: float = 60.0,
    ):
        super().__init__()
        self._channel = side_channel
        self._world = world_size
        self._owners = owners
        self._store = store
        self._rank = rank
        self._timeout = timeout
        self._groups: dict[int, tuple[str, tuple[int, ...]]] = {}
        self._counts: dict[str, int] = {}  # collectives agreed per group (or p2p channel)
        self._agreed_ahead = 0  # sends and receives of a batch agreed before it was issued
        self._blocked_seen: dict[int, tuple[bytes, float]] = {}  # a peer's batch wait, since
        self._owed: list[_Owed] = []  # sends and receives issued ahead of their pair
        self._batches = 0  # batches this rank left, each released once every op of it paired
        self._gate: dict[int, tuple[int, CollectiveCall, int]] = {}  # the last op's held pair
        self._left: set[str] = set()  # store keys this rank left, for forget()
        self._pipeline_ops: dict[int, tuple[int, str, int]] = {}  # id(tensor) → stage, phase, mb
        self.calls: list[CollectiveCall] = []  # agreed and issued, in order
        self.at: int | None = None  # where the ranks differed (the group's sequence number)
        self.doing: CollectiveCall | None = None  # this rank's collective there
        self.state = ""  # FINISHED or RAISED: this rank issued nothing there; STOPPED
        self.group_ranks: tuple[int, ...] = ()  # the group where it stopped
        self.peers: tuple[PeerView, ...] = ()  # what this rank saw its members doing there
        self.reason = ""
        # Each peer's heartbeat count, and since when this rank has seen it there: a peer whose
        # count stands still while this rank waits for it died (_raise_if_gone).
        self._beats: dict[int, tuple[int, float]] = {}
        self._beat_interval = liveness.heartbeat_interval(world_size)
        self._next_beat_read = 0.0
        self.exchanges = 0
        self.channel_bytes = 0
        self.seconds = 0.0
        # Called with every op before it runs (``fsdpcheck run``'s write log), watched or not.
        self.observer: Callable[[Any, tuple, dict], None] | None = None

    @property
    def diverged(self) -> bool:
        return self.at is not None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.observer is not None:
            self.observer(func, args, kwargs)
        spec = WATCHED.get(func._schema.name)
        if self.diverged:
            return func(*args, **kwargs)
        if spec is None:
            if any(issubclass(t, DTensor) for t in types):
                # DTensor's own dispatch runs it with this mode back on: the functional
                # collectives of its redistributions come here too. (Calling func here would
                # run DTensor with the mode off, unseen.)
                return NotImplemented
            return func(*args, **kwargs)
        if self._agreed_ahead and spec[1] in (_SEND, _RECV):
            self._agreed_ahead -= 1  # one of a batch the members agreed on as a whole
            return func(*args, **kwargs)
        start = time.perf_counter()
        try:
            call = self._describe(func, spec, args, kwargs)
            self._agree(call)
        finally:
            self.seconds += time.perf_counter() - start
        self.calls.append(call)
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def batches(self) -> Iterator[None]:
        """While the step runs: ``batch_isend_irecv`` (a pipeline schedule's sends and
        receives) agreed as a whole before any of it is issued: every descriptor of the batch
        is left first, then each is paired, so two stages that each send before they receive
        neither wait for each other nor commit a send the other will refuse."""
        original = dist.distributed_c10d.batch_isend_irecv

        def agreed_batch(p2p_op_list):
            p2p_op_list = _with_current_ops(p2p_op_list)
            partners: dict[int, tuple[int, CollectiveCall, int]] = {}
            if not self.diverged and self._store is not None:
                partners = self._agree_batch(p2p_op_list)
                self._agreed_ahead += len(p2p_op_list)
            try:
                works = original(p2p_op_list)
            finally:
                self._agreed_ahead = 0
            if not partners or not works:
                return works
            gate = _IssuedGate(self, partners)
            return [_GatedWork(work, gate) for work in works]

        dist.distributed_c10d.batch_isend_irecv = agreed_batch
        dist.batch_isend_irecv = agreed_batch
        try:
            yield
        finally:
            dist.distributed_c10d.batch_isend_irecv = original
            dist.batch_isend_irecv = original

    @contextlib.contextmanager
    def point_to_point(self) -> Iterator[None]:
        """While the step runs: a send or receive issued ahead of its pair (its peer was
        itself waiting in the watch: a ring exchange) has its pair confirmed before it is
        waited on (``isend``/``irecv``'s work, ``send``/``recv``), or when the step ends, so a
        pair that never comes is a finding, not a wait in the backend. A pipeline stage's
        sends and receives carry the stage, the pass and the schedule's microbatch index."""
        c10d = dist.distributed_c10d
        originals = {name: getattr(c10d, name) for name in ("isend", "irecv")}
        patched = {name: _Confirmed(self, fn) for name, fn in originals.items()}
        stage_class, getters = _pipeline_getters()
        # Private API: a torch whose stage lacks one of the getters tags no microbatch there.
        own = {n: stage_class.__dict__[n] for n in getters if n in vars(stage_class)}
        for name, fn in patched.items():
            setattr(c10d, name, fn)
            setattr(dist, name, fn)
        for name, fn in own.items():
            setattr(stage_class, name, self._tagging(fn, getters[name]))
        try:
            yield
        finally:
            for name, fn in originals.items():
                setattr(c10d, name, fn)
                setattr(dist, name, fn)
            for name, fn in own.items():
                setattr(stage_class, name, fn)
            self._pipeline_ops.clear()

    def _tagging(self, getter: Any, phase: str) -> Any:
        def get_ops(stage: Any, chunk_id: int, *args: Any, **kwargs: Any) -> list:
            ops = getter(stage, chunk_id, *args, **kwargs)
            for op in ops:
                self._pipeline_ops[id(op.tensor)] = (int(stage.stage_index), phase, chunk_id)
            return ops

        return get_ops

    def _confirm(self, owed: _Owed) -> None:
        """Before this rank waits on a send or receive it issued ahead of its pair: the peer's
        side, compared; or the peer's end (it finished without it); or the peer confirming one
        of its own that waits on this rank (each waits for the other: a deadlock)."""
        if self.diverged or owed not in self._owed:
            return
        self._owed.remove(owed)
        call, n, theirs, peer = owed.call, owed.n, owed.theirs, owed.call.peer
        start = time.perf_counter()
        deadline = time.monotonic() + self._timeout
        waiting, pause = False, 0.0
        try:
            while True:
                if self._store.check([theirs]):
                    other, batch = _descriptor(self._store.get(theirs))
                    reason = _pair_disagreement(call, self._rank, other, peer)
                    if reason:
                        self._stop(call, n, (PeerView(peer, doing=other),), reason)
                    if batch is not None:
                        self._await_release(call, n, peer, batch)
                        self._await_issued({peer: (batch, call, n)})
                    return
                state = self._ended_without(peer, lambda: self._store.check([theirs]))
                if state is not None:
                    # A peer that stopped at a divergence names it; one that ended its step
                    # without this pair is the finding.
                    reason = _never_comes(call, self._rank, state) if state in _ENDED else ""
                    self._stop(call, n, (PeerView(peer, state=state),), reason)
                if not waiting:
                    waiting = True
                    mark = _OWED + f"{n}:".encode() + json.dumps(to_dict(call)).encode()
                    self._store.set(f"step/wait/{self._rank}", mark)
                other = self._owing_me(peer)
                if other is not None:
                    self._stop(call, n, (PeerView(peer, doing=other),), _deadlock(call, other))
                self._stop_at_cycle(call, n)
                self._raise_if_gone((peer,), deadline, f"for the pair of its {call.op}")
                if time.monotonic() > deadline:
                    raise ChannelLost(
                        TimeoutError(
                            f"rank {peer} neither took nor ended within {self._timeout:g}s "
                            f"where this rank waited for the pair of its {call.op} "
                            f"{_with(call)} (stuck in a collective the watch cannot see, or gone)"
                        ),
                        (peer,),
                    )
                pause = min(max(pause * 2, 1e-4), 0.02)
                time.sleep(pause)
        except (ChannelLost, StepDiverged):
            raise
        except Exception as exc:  # the store's host is gone
            log.debug("confirming a %s: the store failed", call.op, exc_info=True)
            raise ChannelLost(exc) from exc
        finally:
            self.seconds += time.perf_counter() - start
            if waiting:
                with contextlib.suppress(Exception):  # the store is gone: nothing to clear
                    self._store.set(f"step/wait/{self._rank}", "0")

    def _end_of(self, peer: int) -> str | None:
        """The state ``peer`` ended its step in; None while it runs."""
        key = f"step/end/{peer}"
        return self._store.get(key).decode() if self._store.check([key]) else None

    def _past(self, key: str, batch: int) -> bool:
        """A peer's batch counter (``released``, ``issued``) is past its batch ``batch``."""
        return self._store.check([key]) and int(self._store.get(key)) > batch

    def _ended_without(self, peer: int, progressed: Callable[[], bool]) -> str | None:
        """The state ``peer`` ended its step in, when its progress (its side of a pair, its
        batch released or issued), read again after its end mark, is still missing; None while
        it runs or once it has progressed. A peer leaves its progress before its end mark, so
        what is read after the mark is all it left; read only before it, a peer that moved on
        and finished between the two reads (a loaded machine) would look as if it had ended
        without moving."""
        state = self._end_of(peer)
        return None if state is None or progressed() else state

    def _owing_me(self, peer: int) -> CollectiveCall | None:
        """The peer's own call issued ahead, when it waits for this rank's side of it (which
        this rank, confirming, never leaves), the same mark for a while: a deadlock."""
        key = f"step/wait/{peer}"
        mark = self._store.get(key) if self._store.check([key]) else b""
        if not mark.startswith(_OWED):
            self._blocked_seen.pop(peer, None)
            return None
        n, _, payload = mark[len(_OWED) :].partition(b":")
        other = from_dict(CollectiveCall, json.loads(payload))
        if other.peer != self._rank or self._store.check(
            ["step/" + _p2p_keys(peer, other, int(n))[1]]
        ):
            return None
        now = time.monotonic()
        since = self._blocked_seen.get(peer)
        if since is None or since[0] != mark:
            self._blocked_seen[peer] = (mark, now)
            return None
        return other if now - since[1] >= _DEADLOCK_GRACE else None

    def _stuck_on_me(self, peer: int, mark: bytes) -> CollectiveCall | None:
        """The peer's call when its wait ``mark`` (a batch's, a release's or a confirmation's)
        is for this rank and has stayed the same for a while: it cannot move before this rank
        does."""
        other = self._stable_call(peer, mark)
        return other if other is not None and other.peer == self._rank else None

    def _stable_call(self, rank: int, mark: bytes | None = None) -> CollectiveCall | None:
        """The call ``rank`` waits at in the watch for one peer (a batch's, a release's or a
        confirmation's mark), once the mark has stayed the same for a while; None while it
        moves, or where the rank waits nowhere or lets its peers go ahead ("1")."""
        if mark is None:
            key = f"step/wait/{rank}"
            mark = self._store.get(key) if self._store.check([key]) else b""
        if mark in (b"", b"0", b"1") or mark.startswith(_RELEASE):
            self._blocked_seen.pop(rank, None)
            return None
        now = time.monotonic()
        since = self._blocked_seen.get(rank)
        if since is None or since[0] != mark:
            self._blocked_seen[rank] = (mark, now)
            return None
        return _mark_call(mark) if now - since[1] >= _DEADLOCK_GRACE else None

    def _stop_at_cycle(self, call: CollectiveCall, n: int) -> None:
        """Stop where this rank's wait for ``call``'s peer is one link of a cycle of three or
        more ranks, each waiting in the watch for the next (the same marks for a while): none
        can move first. Only the cycle's lowest rank stops on it (one finding); the others
        stop when their peer does. O(cycle) store reads a poll, only once the peer stays put."""
        chain = self._chain_to_me(call.peer)
        if chain is None or len(chain) < 2 or self._rank > min(r for r, _ in chain):
            return
        views = tuple(PeerView(r, doing=c) for r, c in chain)
        self._stop(call, n, views, _cycle(self._rank, call, chain))

    def _chain_to_me(
        self, peer: int | None, mark: bytes | None = None
    ) -> list[tuple[int, CollectiveCall]] | None:
        """The ranks (and their calls), from ``peer`` on, each waiting in the watch for the
        next, the same marks for a while, back to this rank; None where the chain ends at a
        rank that can move. ``mark``: ``peer``'s, already read."""
        chain: list[tuple[int, CollectiveCall]] = []
        at = peer
        while at != self._rank:
            if at is None or any(r == at for r, _ in chain) or len(chain) >= self._world:
                return None
            other = self._stable_call(at, None if chain else mark)
            if other is None:
                return None
            chain.append((at, other))
            at = other.peer
        return chain

    def _await_release(self, call: CollectiveCall, n: int, peer: int, batch: int) -> None:
        """Before this rank issues ``call``, whose pair the peer left in a batch not yet whole:
        the batch released; or the peer's end (it stopped there: so does this rank); or the
        peer waiting, directly or through others, on this rank meanwhile: then this rank goes
        ahead, for what the batch still needs may come from it later (a send, then a receive,
        against a peer's fused receive and send). What it issued then waits, in the watch, for
        the batch to be issued (:meth:`_await_issued`), where a batch that can never be whole
        is a deadlock the holder names."""
        released, wait = f"step/released/{peer}", f"step/wait/{self._rank}"
        deadline = time.monotonic() + self._timeout
        waiting, pause = False, 0.0
        try:
            released_past = functools.partial(self._past, released, batch)
            while True:
                if released_past():
                    return
                state = self._ended_without(peer, released_past)
                if state is not None:
                    self._stop(call, n, (PeerView(peer, state=state),), "")
                if not waiting:
                    waiting = True
                    self._store.set(wait, _RELEASE + json.dumps(to_dict(call)).encode())
                if self._chain_to_me(peer) is not None:
                    log.debug("rank %d waits on this rank: %s goes ahead", peer, call.op)
                    return
                self._raise_if_gone((peer,), deadline, f"to release its batch ({_side(call)})")
                if time.monotonic() > deadline:
                    raise ChannelLost(
                        TimeoutError(
                            f"rank {peer} did not release, within {self._timeout:g}s, the batch "
                            f"holding the other side of this rank's {_side(call)} (stuck in a "
                            "collective the watch cannot see, or gone)"
                        ),
                        (peer,),
                    )
                pause = min(max(pause * 2, 1e-4), 0.02)
                time.sleep(pause)
        except (ChannelLost, StepDiverged):
            raise
        except Exception as exc:  # the store's host is gone
            log.debug("waiting for rank %d's batch: the store failed", peer, exc_info=True)
            raise ChannelLost(exc) from exc
        finally:
            if waiting:
                with contextlib.suppress(Exception):  # the store is gone: nothing to clear
                    self._store.set(wait, "0")

    def _await_issued(self, partners: Mapping[int, tuple[int, CollectiveCall, int]]) -> None:
        """Before this rank waits on what it issued against peers' batches (each peer → its
        batch, and this rank's call and number there): those batches issued too; or a peer's
        end (it stopped before issuing, as a batch whose own partner never came does: so does
        this rank, what it issued left posted); or a cycle of waits through them. A released
        batch is whole, not yet issued: its own partners may still stop it."""
        if self.diverged:
            return
        pending = dict(partners)
        deadline = time.monotonic() + self._timeout
        start, waiting, pause = time.perf_counter(), False, 0.0
        wait = f"step/wait/{self._rank}"
        try:
            while True:
                for peer, (batch, call, n) in list(pending.items()):
                    issued = functools.partial(self._past, f"step/issued/{peer}", batch)
                    if issued():
                        del pending[peer]
                        continue
                    state = self._ended_without(peer, issued)
                    if state is not None:
                        self._stop(call, n, (PeerView(peer, state=state),), "")
                if not pending:
                    return
                peer, (_, call, n) = next(iter(pending.items()))
                if not waiting:
                    waiting = True
                    self._store.set(wait, json.dumps(to_dict(call)))
                self._stop_at_cycle(call, n)
                self._raise_if_gone(tuple(pending), deadline, f"to issue ({_side(call)})")
                if time.monotonic() > deadline:
                    raise ChannelLost(
                        TimeoutError(
                            f"rank {peer} did not issue, within {self._timeout:g}s, the batch "
                            f"holding the other side of this rank's {_side(call)} (stuck in a "
                            "collective the watch cannot see, or gone)"
                        ),
                        (peer,),
                    )
                pause = min(max(pause * 2, 1e-4), 0.02)
                time.sleep(pause)
        except (ChannelLost, StepDiverged):
            raise
        except Exception as exc:  # the store's host is gone
            log.debug("waiting for rank %d's batch to issue: the store failed", peer, exc_info=True)
            raise ChannelLost(exc) from exc
        finally:
            self.seconds += time.perf_counter() - start
            if waiting:
                with contextlib.suppress(Exception):  # the store is gone: nothing to clear
                    self._store.set(wait, "0")

    def _agree_batch(self, ops: list) -> dict[int, tuple[int, CollectiveCall, int]]:
        """Every descriptor of the batch left (held), then each paired; then the batch is
        released, and issued once each batch of a peer that holds one of its pairs is released
        too. A batch held back is held whole: a peer whose send pairs with one of its receives
        waits for the release instead of issuing a send that would block on it. Returns those
        peers' batches (peer → its batch, this rank's call and number that pair with it): a
        wait on what this batch issued first sees them issued (:meth:`_await_issued`)."""
        start = time.perf_counter()
        try:
            batch = self._batches
            self._batches += 1
            pending = []
            for op in ops:
                send = getattr(op.op, "__name__", "") in ("isend", "send")
                group, ranks = self._group(op.group)
                tensor = op.tensor
                call = CollectiveCall(
                    seq=len(self.calls),
                    op="send" if send else "recv",
                    group=group,
                    group_ranks=ranks,
                    numel=tensor.numel(),
                    dtype=str(tensor.dtype).removeprefix("torch."),
                    where=_script_line(),
                    peer=int(op.peer),
                    tag=int(op.tag or 0),
                    **self._pipeline_fields(tensor),
                )
                pending.append((call, *self._publish(call, held=batch)))
            partners: dict[int, tuple[int, CollectiveCall, int]] = {}
            for call, channel, n, wanted in pending:
                seen = self._collect(wanted, blocked=call, at=n)
                self._settle(call, channel, n, seen)
                for peer, theirs in _held(seen).items():
                    partners.setdefault(peer, (theirs, call, n))
            self._leave(f"step/released/{self._rank}", str(batch + 1))
            for peer, (theirs, call, n) in sorted(partners.items()):
                self._await_release(call, n, peer, theirs)
            self._leave(f"step/issued/{self._rank}", str(batch + 1))
            self.calls.extend(call for call, *_ in pending)
            return partners
        finally:
            self.seconds += time.perf_counter() - start

    def finish(self, raised: bool) -> None:
        """Tell the others this rank's step is over (returned or raised): a member still
        issuing a collective on one of its groups sees it and stops there. Without a store,
        collective over the world."""
        if self.diverged:
            return
        start = time.perf_counter()
        try:
            if self._store is not None:
                for owed in list(self._owed):  # issued ahead and never waited on
                    self._confirm(owed)
                self._mark_end(RAISED if raised else FINISHED)
            else:
                self._agree_world(None, _RAISED if raised else _FINISHED)
        except StepDiverged:
            pass
        finally:
            self.seconds += time.perf_counter() - start

    def agree_on(self, op: str, where: str) -> None:
        """A point every rank must reach at the same place in its sequence, agreed on over the
        world like a collective (``fsdpcheck run``: a model's first forward, a step's end), so
        that a rank still loading while another trains differs here instead of waiting.
        Raises :class:`StepDiverged` where the ranks differ."""
        if self.diverged:
            return
        call = CollectiveCall(
            seq=len(self.calls),
            op=op,
            group="default_pg",
            group_ranks=tuple(range(self._world)),
            numel=-1,
            dtype="",
            where=where,
        )
        start = time.perf_counter()
        try:
            self._agree(call)
        finally:
            self.seconds += time.perf_counter() - start
        self.calls.append(call)

    def forget(self) -> int:
        """Delete the store keys this rank left (O(its collectives)), once no member reads
        them again: after every rank has concluded (``check_step`` calls it after its
        decision), so that a job that checks often does not grow the store. The number
        deleted."""
        if self._store is None:
            return 0
        keys = sorted(self._left) + [f"step/{k}/{self._rank}" for k in ("wait", "end")]
        self._left.clear()
        deleted = 0
        for key in keys:
            try:
                deleted += bool(self._store.delete_key(key))
            except Exception:  # the store's host is gone: nothing left to grow
                log.debug("could not delete %s", key, exc_info=True)
                break
        return deleted

    def context(self) -> tuple[CollectiveCall, ...]:
        return tuple(self.calls[-_CONTEXT:])

    # ------------------------------------------------------------ agreement in the group

    def _agree(self, call: CollectiveCall) -> None:
        if self._store is None:
            self._agree_world(call, _CALL)
            return
        if call.peer is None:
            channel = f"c/{_group_key(call.group_ranks)}"
            n = self._counts.get(channel, 0)
            if self._tree_agrees(call, channel, n):
                self._counts[channel] = n + 1
                return
        channel, n, wanted = self._publish(call)
        seen = self._collect(wanted, p2p=call.peer is not None)
        # Here a group's tree verdict said its members differ.
        self._settle(call, channel, n, seen, differed=call.peer is None)
        for peer, batch in _held(seen).items():
            self._await_release(call, n, peer, batch)
            self._gate = {peer: (batch, call, n)}
        if call.peer is not None and seen.get(call.peer) == _AHEAD:
            self._owed.append(_Owed(call, n, wanted[call.peer]))

    def _tree_agrees(self, call: CollectiveCall, channel: str, n: int) -> bool:
        """The members' verdict from the tree: True when every member's digest is the same (and
        all_to_all splits pair); False when they differ or a member ended its step, for the
        full exchange to name why. O(1) store calls and bytes per member."""
        members = sorted(call.group_ranks)
        if len(members) < 2:
            return True
        prefix = f"step/{channel}/{n}"
        at = members.index(self._rank)
        children = [members[c] for c in (2 * at + 1, 2 * at + 2) if c < len(members)]
        internal = {r for i, r in enumerate(members) if 2 * i + 1 < len(members)}
        deadline = time.monotonic() + self._timeout
        self.exchanges += 1
        mine = _Digest.of(call, self._rank)
        self._leave(f"{prefix}/h/{self._rank}", mine.text())
        wanted = {c: f"{prefix}/{'t' if c in internal else 'h'}/{c}" for c in children}
        for got in self._wait(call, prefix, wanted, deadline).values():
            mine = mine.combined(_Digest.parse(got))
        if children and at != 0:  # the root's subtree is the verdict
            self._leave(f"{prefix}/t/{self._rank}", mine.text())
        if at == 0:
            self._leave(f"{prefix}/v", mine.text())
            verdict = mine
        else:
            root = members[0]
            verdict = _Digest.parse(self._wait(call, prefix, {root: f"{prefix}/v"}, deadline)[root])
        return verdict.agreed()

    def _leave(self, key: str, value: str) -> None:
        self._left.add(key)
        try:
            self._store.set(key, value)
        except Exception as exc:  # the store's host is gone
            log.debug("leaving %s: the store failed", key, exc_info=True)
            raise ChannelLost(exc) from exc
        self.channel_bytes += len(value)

    def _wait(
        self, call: CollectiveCall, prefix: str, keys: dict[int, str], deadline: float
    ) -> dict[int, bytes | None]:
        """Each rank's key, or None for a rank that ended its step without leaving it. Polls
        with a growing pause, not a blocking ``wait`` (which logs a C++ warning each time it
        times out, and sees no end mark while it waits); the end marks are looked at
        only once it has waited a while, so members that arrive together cost a call or two."""
        got: dict[int, bytes | None] = {}
        pending = dict(keys)
        pause, paused = _PAUSE_FIRST, 0.0
        growth = _PAUSE_GROWTH if self._world <= _SMALL_WORLD else _PAUSE_GROWTH_LARGE
        try:
            while pending:
                if self._store.check(list(pending.values())):
                    got.update(
                        zip(pending, self._store.multi_get(list(pending.values())), strict=True)
                    )
                    return got
                if paused >= _ENDS_AFTER:
                    for peer in list(pending):
                        # A peer leaves its keys before its end mark: read the key after it.
                        if self._store.check([f"step/end/{peer}"]):
                            key = pending.pop(peer)
                            got[peer] = self._store.get(key) if self._store.check([key]) else None
                    if not pending:
                        return got
                at = f"at {call.op} ({call.where})" if call.where else f"at {call.op}"
                self._raise_if_gone(tuple(pending), deadline, at)
                if time.monotonic() > deadline:
                    raise self._silence(call, prefix, tuple(sorted(pending)))
                time.sleep(pause)
                paused += pause
                pause = min(pause * growth, _PAUSE_MAX)
            return got
        except Exception as exc:  # the store's host is gone (ChannelLost is no Exception)
            log.debug("waiting for %s: the store failed", sorted(keys), exc_info=True)
            raise ChannelLost(exc) from exc

    def _raise_if_gone(self, peers: tuple[int, ...], deadline: float, where: str) -> None:
        """Raise :class:`ChannelLost` naming those of ``peers`` (ranks this rank waits for,
        none of which ended its step) whose heartbeat has stood still for ``_gone_after``: a
        rank that died (killed, out of memory) is named before the timeout. Read once per
        heartbeat interval, and only once this rank has waited that long, so a wait that ends
        quickly costs nothing. A peer that never beat (no abort watch runs there) is never
        called gone; a live one beats from a thread of its own, which neither a collective nor
        the script's own work stops for long (``_gone_after``)."""
        now = time.monotonic()
        waited = now - (deadline - self._timeout)
        if waited < self._beat_interval or now < self._next_beat_read:
            return
        self._next_beat_read = now + self._beat_interval
        peers = tuple(sorted(p for p in peers if p != self._rank))
        counts = liveness.heartbeats(self._store, list(peers))
        still = self._gone_after()
        gone = []
        for peer, count in zip(peers, counts, strict=True):
            seen = self._beats.get(peer)
            if seen is None or seen[0] != count:
                self._beats[peer] = (count, now)
            elif count and now - seen[1] >= still and self._end_of(peer) is None:
                gone.append(peer)
        if gone and liveness.given_up(self._store):
            # A rank that gave up (it lost a peer of its own) leaves the watch without an end
            # mark and stops beating once its call returns: the run is over, and the rank that
            # gave up first has named the one responsible. This rank gives up too, naming
            # nobody of its own.
            raise ChannelLost(
                ConnectionError(
                    f"another rank gave up on the run while this rank waited for "
                    f"{_ranks(tuple(gone))} {where} (its heartbeat stopped after)"
                )
            )
        if gone:
            silent = tuple(gone)
            raise ChannelLost(
                ConnectionError(
                    f"{_ranks(silent)} stopped beating (no heartbeat for {still:g}s) where "
                    f"this rank waited for {_them(silent)} {where}: gone (died or killed), or "
                    "stuck where its heartbeat thread cannot run"
                ),
                silent,
            )

    def _gone_after(self) -> float:
        """Seconds a peer's heartbeat must stand still to call it gone: a quarter of the
        timeout, up to 30 s, and at least 10 s and three intervals. A live process's
        heartbeat thread beats every interval, through a store client of its own
        (``liveness.own_client``); it stalls only where the process is stopped, or where its
        main thread holds what the beat needs: the GIL in a long C call, or, with a store that
        cannot be cloned, the one client (a blocking ``store.wait``, as a ``new_group``
        rendezvous makes) for as long as its peers take to arrive."""
        return max(_GONE_FLOOR, 3 * self._beat_interval, min(self._timeout / 4, _GONE_CAP))

    def _silence(self, call: CollectiveCall, prefix: str, waited: tuple[int, ...]) -> ChannelLost:
        """The members that left nothing at this collective and did not end their step (read
        only now, once, O(group)): the ones to name; else the ones this rank waited for."""
        silent = tuple(
            r
            for r in call.group_ranks
            if r != self._rank
            and not self._store.check([f"{prefix}/h/{r}"])
            and not self._store.check([f"step/end/{r}"])
        )
        return _silent(silent or waited, self._timeout)

    def _publish(
        self, call: CollectiveCall, *, held: int | None = None
    ) -> tuple[str, int, dict[int, str]]:
        """Leave this rank's descriptor (``held``: in that batch of this rank, not yet whole);
        its channel, number there, and the peers' keys."""
        if call.peer is not None:  # point to point: the sender's and receiver's sides pair
            channel = _channel(self._rank, call)
            n = self._counts.get(channel, 0)
            mine, other = _p2p_keys(self._rank, call, n)
            theirs = {call.peer: other}
        else:
            channel = f"c/{_group_key(call.group_ranks)}"
            n = self._counts.get(channel, 0)
            mine = f"{channel}/{n}/{self._rank}"
            theirs = {r: f"{channel}/{n}/{r}" for r in call.group_ranks if r != self._rank}
        self._counts[channel] = n + 1
        payload = json.dumps(to_dict(call), separators=(",", ":"))
        if held is not None:
            payload = f"{_HELD.decode()}{held}:{payload}"
        self._left.add(f"step/{mine}")
        try:
            self._store.set(f"step/{mine}", payload)
        except Exception as exc:  # the store's host is gone
            log.debug("collective on %s: the store failed", channel, exc_info=True)
            raise ChannelLost(exc) from exc
        finally:
            self.exchanges += 1
            self.channel_bytes += len(payload)
        return channel, n, {r: f"step/{k}" for r, k in theirs.items()}

    def _settle(
        self,
        call: CollectiveCall,
        channel: str,
        n: int,
        seen: dict[int, bytes | str],
        *,
        differed: bool = False,
    ) -> None:
        """Compare what the peers left with this rank's call; stop the step where they differ.
        ``differed``: the members' digests differ, so the collective is not issued even where
        no compared field names why (a digest the comparison does not cover)."""
        views, reason = [], ""
        for peer, got in sorted(seen.items()):
            if got == _AHEAD:
                continue
            if isinstance(got, str):
                views.append(PeerView(peer, state=got))
                if call.peer is not None and got in _ENDED:
                    reason = reason or _never_comes(call, self._rank, got)
                continue
            if got.startswith(_BLOCKED):
                other = _mark_call(got[len(_BLOCKED) :])
                views.append(PeerView(peer, doing=other))
                reason = reason or (
                    f"the sends and receives do not pair: rank {self._rank} waits at its "
                    f"{_side(call)} while rank {peer} waits at its {_side(other)}, each for the "
                    "other (stages running different numbers of microbatches?)"
                )
                continue
            other, _ = _descriptor(got)
            views.append(PeerView(peer, doing=other))
            if not reason:
                reason = _pair_disagreement(call, self._rank, other, peer)
        if not reason and all(v.doing is not None for v in views):
            if not differed:
                return
            reason = f"{UNNAMED} (not issued: fsdpcheck never issues a collective whose "
            reason += "members' digests differ)"
            log.warning("collective #%d on %s: digests differ, no field named why", n, call.group)
        self._stop(call, n, tuple(views), reason)

    def _collect(
        self,
        keys: dict[int, str],
        *,
        p2p: bool = False,
        blocked: CollectiveCall | None = None,
        at: int = 0,
    ) -> dict[int, bytes | str]:
        """Each peer's descriptor, or the state it ended its step in without issuing it;
        polls the store until every peer answered or the timeout passed.

        ``p2p``: a send or receive need not block where the peer is itself waiting in the
        watch (two ranks that each send before they receive, as a ring exchange or a
        pipeline's batched sends and receives do): then this side goes ahead and the peer,
        arriving at its half later, finds this rank's descriptor and compares the pair. A pair
        that never comes (a stage running fewer microbatches) leaves the other waiting here
        until the timeout: exit 3, naming the stage that stopped answering.

        ``blocked``: this rank's call in a batch (number ``at`` on its channel), every
        descriptor of which is already left.
        A peer that waits in a batch of its own for a while, for something this rank's batch
        does not hold, while this rank waits for something its batch does not hold, never
        answers: the pair is a deadlock of the schedule, returned as ``_BLOCKED`` + the
        peer's call (two stages running different numbers of microbatches)."""
        got: dict[int, bytes | str] = {}
        pending = dict(keys)
        deadline = time.monotonic() + self._timeout
        pause = 0.0
        waiting = False
        try:
            while pending:
                if self._store.check(list(pending.values())):
                    values = self._store.multi_get(list(pending.values()))
                    got.update(zip(pending, values, strict=True))
                    return got
                if (p2p or blocked is not None) and not waiting:
                    waiting = True
                    mark = "1" if blocked is None else json.dumps(to_dict(blocked))
                    self._store.set(f"step/wait/{self._rank}", mark)
                self._poll(pending, got, p2p=p2p, deadline=deadline, blocked=blocked, at=at)
                pause = min(max(pause * 2, 1e-4), 0.02)
                if pending:
                    time.sleep(pause)
            return got
        except ChannelLost:
            raise
        except Exception as exc:  # the store's host is gone
            log.debug("waiting for %s: the store failed", sorted(keys), exc_info=True)
            raise ChannelLost(exc) from exc
        finally:
            if waiting:
                with contextlib.suppress(Exception):  # the store is gone: nothing to clear
                    self._store.set(f"step/wait/{self._rank}", "0")

    def _poll(
        self,
        pending: dict[int, str],
        got: dict[int, bytes | str],
        *,
        p2p: bool,
        deadline: float,
        blocked: CollectiveCall | None = None,
        at: int = 0,
    ) -> None:
        for peer in list(pending):
            # The end mark first (_end_of): an end mark with no descriptor after it means the
            # peer never issued this one.
            state = self._end_of(peer)
            if state is not None:
                key = pending.pop(peer)
                got[peer] = self._store.get(key) if self._store.check([key]) else state
            elif (p2p or blocked is not None) and self._store.check([f"step/wait/{peer}"]):
                mark = self._store.get(f"step/wait/{peer}")
                if p2p and (mark == b"1" or mark.startswith(_OWED)):
                    pending.pop(peer)
                    got[peer] = _AHEAD
                elif blocked is not None and self._stuck_on_me(peer, mark) is not None:
                    pending.pop(peer)
                    got[peer] = _BLOCKED + mark
                elif blocked is not None:
                    self._stop_at_cycle(blocked, at)
        if pending:
            self._raise_if_gone(tuple(pending), deadline, "at a collective")
        if pending and time.monotonic() > deadline:
            raise _silent(tuple(sorted(pending)), self._timeout)

    def _stop(self, call: CollectiveCall, n: int, views: tuple[PeerView, ...], reason: str) -> None:
        self.at, self.doing, self.peers, self.reason = n, call, views, reason
        self.group_ranks = (
            tuple(sorted({self._rank, call.peer, *(v.rank for v in views)}))
            if call.peer is not None
            else call.group_ranks
        )
        if not reason and any(v.state in (_DIVERGED, STOPPED) for v in views):
            self.state = STOPPED
            self.peers = tuple(
                PeerView(v.rank, v.doing, STOPPED if v.state == _DIVERGED else v.state)
                for v in views
            )
        self._mark_end(STOPPED if self.state == STOPPED else _DIVERGED)
        log.info("collective #%d on %s differs across its members; unwinding", n, call.group)
        raise StepDiverged(f"collective #{n} on {call.group} differs across its members")

    def _mark_end(self, state: str) -> None:
        try:
            self._store.set(f"step/end/{self._rank}", state)
        except Exception:  # the peers' own timeouts end their wait
            log.debug("could not leave the end mark", exc_info=True)

    def _agree_world(self, call: CollectiveCall | None, kind: int) -> None:
        """Without a store: the descriptor's words, their least and greatest over the world
        (:func:`~fsdpcheck.distributed.wire.span`, a tree: O(1) bytes per rank); equal, every
        rank holds the same."""
        seq = len(self.calls)
        words = [kind, seq, 0, 0, 0, 0, 0, 0]
        if call is not None:
            key = repr((*call.key(), call.send, call.recv, call.peer, call.tag))
            words[2:] = [
                _hash63(call.op),
                _hash63(call.group),
                len(call.group_ranks),
                call.numel,
                _hash63(key),
                _hash63(call.module) if call.module is not None else -1,
            ]
        self.exchanges += 1
        try:
            spread = span(words, self._channel, size=self._world)
        except Exception as exc:  # bounded by the side channel's timeout
            log.debug("collective #%d: the side channel failed", seq, exc_info=True)
            raise ChannelLost(exc) from exc
        self.channel_bytes += spread.sent
        if spread.same():
            return
        self.at, self.doing = seq, call
        self.state = _STATE.get(kind, "")
        log.info("collective #%d differs across ranks; unwinding the step", seq)
        raise StepDiverged(f"collective #{seq} differs across ranks")

    # ------------------------------------------------------------ the descriptor

    def _describe(
        self, func: Any, spec: tuple[str, str, str | None], args: tuple, kwargs: dict
    ) -> CollectiveCall:
        op, kind, sent = spec
        bound = _bound(func, args, kwargs)
        pg = self._process_group(bound)
        group, ranks = self._group(pg)
        tensors = _tensors(bound.get(sent)) if sent is not None else []
        sizes = tuple(t.numel() for t in tensors)
        dtypes = tuple(str(t.dtype).removeprefix("torch.") for t in tensors)
        numel, dtype = (sum(sizes), dtypes[0]) if tensors else (-1, "")
        send, recv = _splits(op, bound, len(ranks)) if kind == _A2A else ((), ())
        if kind == _A2A:
            dtype = _a2a_dtype(bound)
        root = None
        for name in ("root_rank", "src"):
            if kind == _ALL and isinstance(bound.get(name), int):
                root = _global(pg, bound[name])
        peer, tag = None, 0
        if kind in (_SEND, _RECV):
            local = bound.get("dst", bound.get("src"))
            peer = _global(pg, int(local)) if local is not None else None
            tag = int(bound.get("tag", 0) or 0)
        pipeline = self._pipeline_fields(tensors[0]) if peer is not None and tensors else {}
        owner = self._owner()
        where = ""
        if owner is None:  # the script's line that issued it, above this method's caller
            _, where, redistributes = script_frame(3, _DTENSOR_DISPATCH)
            if where and redistributes:
                where += " (a DTensor redistribution)"
        return CollectiveCall(
            seq=len(self.calls),
            op=op,
            group=group,
            group_ranks=ranks,
            numel=numel,
            dtype=dtype,
            module=owner.module if owner is not None else None,
            params=owner.params if owner is not None else (),
            where=where,
            reduce_op=_reduce_op(bound.get("reduce_op")),
            root=root,
            sizes=sizes if len(sizes) > 1 else (),
            dtypes=dtypes if len(set(dtypes)) > 1 else (),
            send=send,
            recv=recv,
            peer=peer,
            tag=tag,
            **pipeline,
        )

    def _pipeline_fields(self, tensor: Any) -> dict[str, Any]:
        found = self._pipeline_ops.pop(id(tensor), None)
        if found is None:
            return {}
        return {"stage": found[0], "phase": found[1], "microbatch": found[2]}

    def _process_group(self, bound: dict[str, Any]) -> Any:
        for name in ("process_group", "group_name"):
            arg = bound.get(name)
            if isinstance(arg, torch.ScriptObject):
                return dist.ProcessGroup.unbox(arg)
            if isinstance(arg, dist.ProcessGroup):
                return arg
            if isinstance(arg, str):
                return dist.distributed_c10d._resolve_process_group(arg)
        return None

    def _group(self, pg: Any) -> tuple[str, tuple[int, ...]]:
        if pg is None:
            return "default_pg", tuple(range(self._world))
        known = self._groups.get(id(pg))
        if known is None:
            desc = getattr(pg, "group_desc", "") or "group"
            known = (desc, tuple(dist.get_process_group_ranks(pg)))
            self._groups[id(pg)] = known
        return known

    def _owner(self) -> Owner | None:
        """The FSDPParamGroup on the Python stack (unshard, post_backward...), if any."""
        frame = sys._getframe(2)
        while frame is not None:
            owner = self._owners.get(id(frame.f_locals.get("self")))
            if owner is not None:
                return owner
            frame = frame.f_back
        return None


@dataclass(frozen=True)
class _Digest:
    """What a subtree of a group's members holds at one collective: the least and greatest
    digest of what must agree, the sum of their all_to_all shares (0: the splits pair) and
    whether one of them ended its step instead."""

    low: int
    high: int
    pairs: int = 0
    ended: bool = False

    @classmethod
    def of(cls, call: CollectiveCall, rank: int) -> _Digest:
        digest = _hash63(repr(call.key()))
        pairs = 0
        for member, sent, expected in zip(call.group_ranks, call.send, call.recv, strict=False):
            # What this rank sends `member` counts up, what it expects from it down: every send
            # cancels its receive exactly when the splits pair.
            pairs += _hash63(f"{rank}>{member}:{sent}") - _hash63(f"{member}>{rank}:{expected}")
        return cls(digest, digest, pairs & _MASK64)

    @classmethod
    def parse(cls, raw: bytes | None) -> _Digest:
        if raw is None:  # the member ended its step
            return cls(0, 0, 0, ended=True)
        low, high, pairs, ended = raw.decode().split(":")
        return cls(int(low, 16), int(high, 16), int(pairs, 16), ended == "e")

    def text(self) -> str:
        # Fixed width: what a member leaves does not depend on the digests' values.
        return f"{self.low:016x}:{self.high:016x}:{self.pairs:016x}:{'e' if self.ended else ''}"

    def combined(self, other: _Digest) -> _Digest:
        if other.ended or self.ended:
            return _Digest(self.low, self.high, self.pairs, ended=True)
        return _Digest(
            min(self.low, other.low),
            max(self.high, other.high),
            (self.pairs + other.pairs) & _MASK64,
        )

    def agreed(self) -> bool:
        return not self.ended and self.low == self.high and self.pairs == 0


def _silent(silent: tuple[int, ...], timeout: float) -> ChannelLost:
    return ChannelLost(
        TimeoutError(
            f"{_ranks(silent)} issued nothing within {timeout:g}s where this "
            f"rank waited to agree on a collective with {_them(silent)} (stuck in "
            "a collective the watch cannot see, or gone)"
        ),
        silent,
    )


@dataclass(frozen=True)
class _Owed:
    """A send or receive issued ahead of its pair: its call, number on its channel, and the
    store key the peer's side of it will be left under."""

    call: CollectiveCall
    n: int
    theirs: str


class _Confirmed:
    """``isend``/``irecv`` while the watch runs: the work of one issued ahead of its pair
    confirms the pair before it waits. Equal to (and hashed as) the function it stands for, so
    ``P2POp`` and ``batch_isend_irecv`` accept ops built with either."""

    def __init__(self, watch: CollectiveWatch, fn: Any):
        self._watch, self._fn = watch, fn
        functools.update_wrapper(self, fn)  # its __name__ tells a send from a receive

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        owed = len(self._watch._owed)
        self._watch._gate = {}
        work = self._fn(*args, **kwargs)
        gate, self._watch._gate = self._watch._gate, {}
        if work is None:
            return work
        if len(self._watch._owed) > owed:
            return _OwedWork(work, self._watch, self._watch._owed[-1])
        return _GatedWork(work, _IssuedGate(self._watch, gate)) if gate else work

    def __eq__(self, other: object) -> bool:
        return other is self or other is self._fn or other == self._fn

    def __hash__(self) -> int:
        return hash(self._fn)


class _OwedWork:
    """A backend's work whose ``wait`` first confirms the pair (everything else passes)."""

    def __init__(self, work: Any, watch: CollectiveWatch, owed: _Owed):
        self._work, self._watch, self._owed = work, watch, owed

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self._watch._confirm(self._owed)
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class _IssuedGate:
    """What issued against peers' batches waits, once, for those batches to be issued too."""

    def __init__(
        self, watch: CollectiveWatch, partners: dict[int, tuple[int, CollectiveCall, int]]
    ):
        self._watch, self._partners = watch, partners

    def pass_(self) -> None:
        if self._partners:
            partners, self._partners = self._partners, {}
            self._watch._await_issued(partners)


class _GatedWork:
    """A backend's work whose ``wait`` first passes its gate (everything else passes)."""

    def __init__(self, work: Any, gate: _IssuedGate):
        self._work, self._gate = work, gate

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self._gate.pass_()
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _with_current_ops(ops: list) -> list:
    """``ops`` with ``isend``/``irecv`` as c10d now holds them: ``batch_isend_irecv`` tells a
    send by identity (``op.op is isend``), so an op built before the watch patched them (the
    plain function) would be issued as a receive's keywords and raise."""
    c10d = dist.distributed_c10d
    current = {"isend": c10d.isend, "irecv": c10d.irecv}
    fixed = []
    for op in ops:
        name = getattr(op.op, "__name__", "")
        now = current.get(name)
        if now is None or op.op is now:
            fixed.append(op)
            continue
        fixed.append(dist.P2POp(now, op.tensor, None, op.group, op.tag, group_peer=op.group_peer))
    return fixed


def _pipeline_getters() -> tuple[Any, dict[str, str]]:
    """torch.distributed.pipelining's stage class and the methods that build its sends and
    receives per microbatch, with the pass each belongs to; (None, {}) where the job has not
    imported pipelining, so has no stage. Not imported here: 17 to 25 ms of every rank's
    start for a job without pipeline stages (and torch._dynamo with it, where nothing else
    brought that in)."""
    module = sys.modules.get("torch.distributed.pipelining.stage")
    stage_class = getattr(module, "_PipelineStageBase", None)
    if stage_class is None:
        return None, {}
    return stage_class, {
        "get_fwd_recv_ops": "forward",
        "get_fwd_send_ops": "forward",
        "get_bwd_recv_ops": "backward",
        "get_bwd_send_ops": "backward",
    }


def _channel(me: int, call: CollectiveCall) -> str:
    src, dst = (me, call.peer) if call.op == "send" else (call.peer, me)
    return f"p/{src}-{dst}"


def _p2p_keys(me: int, call: CollectiveCall, n: int) -> tuple[str, str]:
    """The store keys (below ``step/``) of ``me``'s side of a send or receive, and its pair's."""
    channel = f"{_channel(me, call)}/{n}"
    send = call.op == "send"
    return f"{channel}/{'s' if send else 'r'}", f"{channel}/{'r' if send else 's'}"


def _side(call: CollectiveCall) -> str:
    return f"{call.op} {_with(call)} ({call.numel} {call.dtype}{_microbatch(call)})"


def _microbatch(call: CollectiveCall) -> str:
    if call.microbatch is None:
        return ""
    return f", stage {call.stage} {call.phase}, microbatch {call.microbatch}"


def _never_comes(call: CollectiveCall, me: int, state: str) -> str:
    ended = "finished" if state == FINISHED else "raised in"
    return (
        f"the pair never comes: rank {call.peer} {ended} its step without the other side of "
        f"rank {me}'s {_side(call)}"
    )


def _deadlock(call: CollectiveCall, other: CollectiveCall) -> str:
    return (
        f"the sends and receives do not pair: rank {other.peer}'s {_side(call)} is never "
        f"taken while rank {call.peer} waits for its own {_side(other)}, each for the other "
        "(stages running different numbers of microbatches?)"
    )


def _cycle(me: int, call: CollectiveCall, chain: list[tuple[int, CollectiveCall]]) -> str:
    links = "; ".join(f"rank {r} at its {_side(c)}" for r, c in chain)
    return (
        f"the sends and receives do not pair: they form a cycle: rank {me} waits at its "
        f"{_side(call)}; {links}; each for the next, and none can move first"
    )


def _descriptor(raw: bytes) -> tuple[CollectiveCall, int | None]:
    """A descriptor a peer left, and its batch when that batch is not yet known whole."""
    batch = None
    if raw.startswith(_HELD):
        number, _, raw = raw[len(_HELD) :].partition(b":")
        batch = int(number)
    return from_dict(CollectiveCall, json.loads(raw)), batch


def _held(seen: Mapping[int, bytes | str]) -> dict[int, int]:
    """The peers whose side of a pair was left in a batch not yet whole, with that batch."""
    return {
        peer: int(got[len(_HELD) :].partition(b":")[0])
        for peer, got in seen.items()
        if isinstance(got, bytes) and got.startswith(_HELD)
    }


def _mark_call(mark: bytes) -> CollectiveCall:
    """The call a peer's wait mark names (a confirmation's carries its number first)."""
    if mark.startswith(_OWED):
        mark = mark[len(_OWED) :].partition(b":")[2]
    return from_dict(CollectiveCall, json.loads(mark.removeprefix(_RELEASE)))


def _pair_disagreement(mine: CollectiveCall, me: int, other: CollectiveCall, peer: int) -> str:
    if mine.peer is not None:  # a send against its receive
        if mine.op == other.op or other.peer != me:
            return f"rank {me} {mine.op}s where rank {peer} {other.op}s"
        if (mine.numel, mine.dtype, mine.tag) != (other.numel, other.dtype, other.tag):
            sender, receiver = (mine, other) if mine.op == "send" else (other, mine)
            return (
                f"the send does not match its receive (sends {sender.numel} {sender.dtype} "
                f"tag {sender.tag}; the receiver expects {receiver.numel} {receiver.dtype} "
                f"tag {receiver.tag})"
            )
        return ""
    return disagreement(mine, me, other, peer)


def _with(call: CollectiveCall) -> str:
    return f"{'to' if call.op == 'send' else 'from'} rank {call.peer}"


def _bound(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The op's arguments by their schema names."""
    bound = {}
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args):
            bound[arg.name] = args[i]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
    return bound


def _global(pg: Any, local: int) -> int:
    if pg is None:
        return local
    try:
        return dist.get_global_rank(pg, local)
    except Exception:  # not a rank of the group: compared as given, the divergence shows it
        log.debug("rank %d is not in the group", local, exc_info=True)
        return local


def _reduce_op(arg: Any) -> str:
    if isinstance(arg, str):
        return arg.lower()
    if isinstance(arg, torch.ScriptObject):
        try:
            return _REDUCE_OPS.get(int(arg.op()), str(arg.op()))
        except Exception:  # a PREMUL_SUM or other op we cannot read: compared as unknown
            log.debug("unreadable reduce op", exc_info=True)
            return "unknown"
    return ""


def _splits(op: str, bound: dict[str, Any], members: int) -> tuple[tuple[int, ...], ...]:
    """Elements this rank sends each member and expects from each, in group order."""
    if op == "all_to_all":
        return (
            tuple(t.numel() for t in _tensors(bound.get("input_tensors"))),
            tuple(t.numel() for t in _tensors(bound.get("output_tensors"))),
        )
    source = bound.get("input")
    target = bound.get("output", source)

    def each(tensor: Any, splits: Any) -> tuple[int, ...]:
        if not isinstance(tensor, torch.Tensor):
            return ()
        row = tensor[0].numel() if tensor.dim() and tensor.shape[0] else 1
        if splits:
            return tuple(int(s) * row for s in splits)
        return (tensor.numel() // max(members, 1),) * members

    return each(source, bound.get("input_split_sizes")), each(
        target, bound.get("output_split_sizes")
    )


def _a2a_dtype(bound: dict[str, Any]) -> str:
    tensors = _tensors(bound.get("input", bound.get("input_tensors")))
    return str(tensors[0].dtype).removeprefix("torch.") if tensors else ""


def _tensors(arg: Any) -> list[torch.Tensor]:
    if isinstance(arg, torch.Tensor):
        return [arg]
    if isinstance(arg, (list, tuple)):
        return [t for item in arg for t in _tensors(item)]
    return []


def _ranks(ranks: tuple[int, ...]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


def _them(ranks: tuple[int, ...]) -> str:
    return "it" if len(ranks) == 1 else "them"


def _script_line() -> str:
    """The first frame outside torch and fsdpcheck: the script's line that issued it."""
    return site_of(4)[1]
