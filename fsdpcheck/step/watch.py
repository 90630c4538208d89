"""The collective watch: every collective a step issues is agreed on by every rank first.

A :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees each c10d collective (FSDP2's
``c10d._allgather_base_`` and ``c10d._reduce_scatter_base_``, a script's ``all_reduce`` or
``broadcast``) before it reaches the backend. Each rank then exchanges a fixed-size descriptor
of it (op, group, sizes, dtype, owning FSDP module) with every other rank over the gloo side
channel, bounded by its timeout. Equal descriptors: the collective is issued. Any difference,
or a rank that has finished (or raised in) its step while another issues one more: no rank
issues it; each raises :class:`StepDiverged`, which unwinds the step on every rank alike.

Not seen: collectives a tensor subclass issues inside its own dispatch (DTensor's
redistributions, e.g. ``clip_grad_norm_`` over DTensor gradients: the mode is off while a
handler runs), point-to-point sends (no peer-symmetric descriptor), and collectives from other
threads (the mode is thread-local; FSDP2 on CPU issues its own from the step's thread). A
divergence there is caught only by the timeout of the next exchange.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from fsdpcheck.checks.step import FINISHED, RAISED, CollectiveCall
from fsdpcheck.distributed.wire import exchange_slots

log = logging.getLogger(__name__)

# c10d op → (the name users know, the argument holding what this rank sends; None: no size).
_C10D = {
    "_allgather_base_": ("all_gather_into_tensor", 1),
    "allgather_": ("all_gather", 1),
    "allgather_into_tensor_coalesced_": ("all_gather_into_tensor_coalesced", 1),
    "_reduce_scatter_base_": ("reduce_scatter_tensor", 1),
    "reduce_scatter_": ("reduce_scatter", 0),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter_tensor_coalesced", 1),
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce_coalesced", 0),
    "broadcast_": ("broadcast", 0),
    "reduce_": ("reduce", 0),
    "alltoall_base_": ("all_to_all_single", None),
    "alltoall_": ("all_to_all", None),
    "gather_": ("gather", None),
    "scatter_": ("scatter", None),
    "barrier": ("barrier", None),
}
_FUNCTIONAL = {  # torch.distributed._functional_collectives on plain tensors: group by name
    "all_reduce": ("all_reduce", 0),
    "all_reduce_coalesced": ("all_reduce_coalesced", 0),
    "all_gather_into_tensor": ("all_gather_into_tensor", 0),
    "all_gather_into_tensor_coalesced": ("all_gather_into_tensor_coalesced", 0),
    "reduce_scatter_tensor": ("reduce_scatter_tensor", 0),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter_tensor_coalesced", 0),
    "broadcast": ("broadcast", 0),
    "all_to_all_single": ("all_to_all_single", None),
}
_NAMESPACES = {"c10d": _C10D, "_c10d_functional": _FUNCTIONAL}

# The descriptor: eight int64 words, the same size on every rank whatever it holds.
_CALL, _FINISHED, _RAISED = 1, 2, 3
SLOT_BYTES = 8 * 8
_STATE = {_FINISHED: FINISHED, _RAISED: RAISED}
_CONTEXT = 3  # agreed collectives kept for the report's context
_SKIP_FRAMES = (os.sep + "torch" + os.sep, os.sep + "fsdpcheck" + os.sep)


class StepDiverged(BaseException):
    """The ranks' next collectives differ: raised on every rank to unwind its step. A
    ``BaseException``, so that a step's own ``except Exception`` does not swallow it."""


class ChannelLost(BaseException):
    """An exchange on the side channel failed (a peer died, or is stuck past the timeout)."""

    def __init__(self, cause: BaseException):
        super().__init__(str(cause))
        self.cause = cause


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


class CollectiveWatch(TorchDispatchMode):
    """Enter it around the step on every rank; call :meth:`finish` on every rank after it."""

    def __init__(self, side_channel: Any, world_size: int, owners: Mapping[int, Owner]):
        super().__init__()
        self._channel = side_channel
        self._world = world_size
        self._owners = owners
        self._groups: dict[int, tuple[str, tuple[int, ...]]] = {}
        self.calls: list[CollectiveCall] = []  # agreed and issued, in order
        self.at: int | None = None  # where the ranks differed
        self.doing: CollectiveCall | None = None  # this rank's collective there
        self.state = ""  # FINISHED or RAISED: this rank issued nothing there
        self.exchanges = 0
        self.seconds = 0.0

    @property
    def diverged(self) -> bool:
        return self.at is not None

    @property
    def channel_bytes(self) -> int:
        """Bytes this rank sent on the side channel (its slot to every other rank)."""
        return self.exchanges * SLOT_BYTES * (self._world - 1)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        table = _NAMESPACES.get(func.namespace)
        spec = table.get(func._opname) if table is not None else None
        if spec is None or self.diverged:
            return func(*args, **kwargs)
        start = time.perf_counter()
        try:
            call = self._describe(func.namespace, spec, args)
            self._agree(call, _CALL)
        finally:
            self.seconds += time.perf_counter() - start
        self.calls.append(call)
        return func(*args, **kwargs)

    def finish(self, raised: bool) -> None:
        """Collective: tell the others this rank's step is over (returned or raised). A rank
        still issuing collectives there makes every rank see the divergence."""
        if self.diverged:
            return
        start = time.perf_counter()
        try:
            self._agree(None, _RAISED if raised else _FINISHED)
        except StepDiverged:
            pass
        finally:
            self.seconds += time.perf_counter() - start

    def context(self) -> tuple[CollectiveCall, ...]:
        return tuple(self.calls[-_CONTEXT:])

    # ------------------------------------------------------------ internals

    def _agree(self, call: CollectiveCall | None, kind: int) -> None:
        seq = len(self.calls)
        words = [kind, seq, 0, 0, 0, 0, 0, 0]
        if call is not None:
            words[2:] = [
                _hash63(call.op),
                _hash63(call.group),
                len(call.group_ranks),
                call.numel,
                _hash63(call.dtype),
                _hash63(call.module) if call.module is not None else -1,
            ]
        mine = b"".join(w.to_bytes(8, "little", signed=True) for w in words)
        try:
            slots, _ = exchange_slots(mine, self._channel, size=self._world)
        except Exception as exc:  # bounded by the side channel's timeout
            log.debug("collective #%d: the side channel failed", seq, exc_info=True)
            raise ChannelLost(exc) from exc
        finally:
            self.exchanges += 1
        if all(slot == mine for slot in slots):
            return
        self.at, self.doing = seq, call
        self.state = _STATE.get(kind, "")
        log.info("collective #%d differs across ranks; unwinding the step", seq)
        raise StepDiverged(f"collective #{seq} differs across ranks")

    def _describe(
        self, namespace: str, spec: tuple[str, int | None], args: tuple
    ) -> CollectiveCall:
        op, sent = spec
        group, ranks = self._group(namespace, args)
        numel, dtype = -1, ""
        if sent is not None and sent < len(args):
            tensors = _tensors(args[sent])
            numel = sum(t.numel() for t in tensors)
            dtype = str(tensors[0].dtype).removeprefix("torch.") if tensors else ""
        owner = self._owner()
        return CollectiveCall(
            seq=len(self.calls),
            op=op,
            group=group,
            group_ranks=ranks,
            numel=numel,
            dtype=dtype,
            module=owner.module if owner is not None else None,
            params=owner.params if owner is not None else (),
            where="" if owner is not None else _script_line(),
        )

    def _group(self, namespace: str, args: tuple) -> tuple[str, tuple[int, ...]]:
        # A functional collective names its group last: earlier strings are its reduce op
        # ("sum", as tensor parallelism's all_reduce passes it).
        names = [a for a in args if isinstance(a, str)] if namespace == "_c10d_functional" else []
        for arg in (*args, *names[-1:]):
            pg = None
            if isinstance(arg, torch.ScriptObject):
                pg = dist.ProcessGroup.unbox(arg)
            elif isinstance(arg, str) and names and arg is names[-1]:
                pg = dist.distributed_c10d._resolve_process_group(arg)
            if pg is None:
                continue
            known = self._groups.get(id(pg))
            if known is None:
                desc = getattr(pg, "group_desc", "") or "group"
                known = (desc, tuple(dist.get_process_group_ranks(pg)))
                self._groups[id(pg)] = known
            return known
        return "default_pg", tuple(range(self._world))

    def _owner(self) -> Owner | None:
        """The FSDPParamGroup on the Python stack (unshard, post_backward...), if any."""
        frame = sys._getframe(2)
        while frame is not None:
            owner = self._owners.get(id(frame.f_locals.get("self")))
            if owner is not None:
                return owner
            frame = frame.f_back
        return None


def _tensors(arg: Any) -> list[torch.Tensor]:
    if isinstance(arg, torch.Tensor):
        return [arg]
    if isinstance(arg, (list, tuple)):
        return [t for item in arg for t in _tensors(item)]
    return []


def _script_line() -> str:
    """The first frame outside torch and fsdpcheck: the script's line that issued it."""
    frame = sys._getframe(3)
    while frame is not None:
        path = frame.f_code.co_filename
        if not any(part in path for part in _SKIP_FRAMES):
            return f"{os.path.basename(path)}:{frame.f_lineno}"
        frame = frame.f_back
    return ""
