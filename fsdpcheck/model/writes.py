"""Which of a model's tensors nothing wrote since ``to_empty()``: uninitialised memory, whatever
it happens to hold.

``Module.to_empty()`` allocates storage and writes nothing (DESIGN fact 15). A tensor counts as
written when, since then, any of these happened:
- its version counter moved (an in-place op on it or on a view of it: ``nn.init``, ``copy_``,
  a load's ``_load_from_state_dict``), on the DTensor or on its local shard;
- an op seen by the dispatch mode wrote its storage (:meth:`WriteLog.saw`): this also sees
  writes through ``.data``, which have a version counter of their own, and collectives that
  receive into it;
- the module holds another tensor under its name (a load with ``assign=True``, a re-registered
  buffer).
Anything else is unwritten. Garbage need not be NaN: this finds it whatever it holds.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from fsdpcheck.records import BufferProblem
from fsdpcheck.vocab import BufferReason, Snapshot

log = logging.getLogger(__name__)

# Frames that are not the script's: code of the torch and fsdpcheck packages, by where they are
# installed, so a script under a folder that happens to be called torch or fsdpcheck (a CI
# checkout of this repository, ~/torch/train.py) is still the script.
_SKIP_DIRS = (
    os.path.dirname(torch.__file__) + os.sep,
    os.path.dirname(os.path.dirname(__file__)) + os.sep,  # fsdpcheck/, from fsdpcheck/model/
)
_FIRST_VALUES = 3
_WRITERS_LISTED = 3
# Every tensor argument of a collective is taken as written: c10d's schemas do not annotate
# what they receive into, and a false "written" only ever hides a finding.
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")


@dataclass
class _Tracked:
    name: str
    # id(), not a weakref: torch's swap_tensors (``Module._apply`` on DTensor parameters)
    # refuses to swap a tensor that has one.
    tensor: int
    version: int
    local_version: int
    storage: int


def _local(tensor: torch.Tensor) -> torch.Tensor:
    inner = getattr(tensor, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else tensor


def _storage(tensor: torch.Tensor) -> int:
    local = _local(tensor)
    if isinstance(local, FakeTensor) or local.is_meta:  # DTensor's sharding propagation
        return 0
    try:
        return local.untyped_storage().data_ptr()
    except Exception:  # a tensor without storage (a fake or functional wrapper): not tracked
        log.debug("no storage to track on a %s", type(tensor).__name__, exc_info=True)
        return 0


def site_of(skip: int = 2) -> tuple[str, str]:
    """The first frame outside torch and fsdpcheck: its function and its ``file:line``."""
    function, line, _ = script_frame(skip + 1)
    return function, line


def script_frame(skip: int = 2, through: str | None = None) -> tuple[str, str, bool]:
    """The first frame outside torch and fsdpcheck, from the caller's ``skip``-th on: its
    function, its ``file:line``, and whether code of the file ``through`` runs between (one
    walk of the stack for both: the watch asks both of a collective no FSDP module issued)."""
    frame = sys._getframe(skip)
    passed = False
    while frame is not None:
        code = frame.f_code
        path = code.co_filename
        passed = passed or path == through
        if not path.startswith(_SKIP_DIRS):
            function = getattr(code, "co_qualname", code.co_name)
            return function, f"{os.path.basename(path)}:{frame.f_lineno}", passed
        frame = frame.f_back
    return "", "", passed


class WriteLog:
    """Tracks the tensors of every module ``to_empty()`` ran on until :meth:`unwritten` reads
    them. :meth:`saw` is the dispatch mode's observer: cheap for ops that write nothing."""

    def __init__(self) -> None:
        self._tracked: dict[int, _Tracked] = {}  # storage pointer → the tensor there
        self._written: set[int] = set()
        # (function, file) → the first line of it that wrote a tracked tensor
        self._writers: dict[tuple[str, str], str] = {}
        self._writes: dict[Any, tuple[int, ...]] = {}  # op → the positions of what it writes
        self.sites: list[str] = []  # where to_empty() ran

    @property
    def tracking(self) -> bool:
        return bool(self._tracked)

    def emptied(self, module: nn.Module, site: str) -> None:
        """After ``module.to_empty()``: every parameter and buffer it now holds, as it is."""
        self.sites.append(site)
        named = [*module.named_parameters(), *module.named_buffers()]
        for name, tensor in named:
            if tensor is None or tensor.is_meta:
                continue
            storage = _storage(tensor)
            if storage:
                self._tracked[storage] = _Tracked(
                    name,
                    id(tensor),
                    tensor._version,
                    _local(tensor)._version,
                    storage,
                )
                self._written.discard(storage)

    def saw(self, func: Any, args: tuple, kwargs: dict) -> None:
        """An op about to run: the tracked storages it writes are written."""
        if not self._tracked:
            return
        positions = self._writes.get(func)
        if positions is None:
            positions = self._writes[func] = _written_positions(func)
        if not positions:
            return
        for tensor in _written_tensors(func, positions, args, kwargs):
            storage = _storage(tensor)
            if storage in self._tracked and storage not in self._written:
                self._written.add(storage)
                function, line = site_of(3)
                self._writers.setdefault((function, line.rpartition(":")[0]), line)

    def unwritten(self, model: nn.Module) -> tuple[BufferProblem, ...]:
        """``model``'s tensors that nothing wrote since ``to_empty()``, one problem each."""
        held = {}
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor is not None and not tensor.is_meta:
                held[_storage(tensor)] = (name, tensor)
        detail = self._detail()
        problems = []
        for storage, tracked in self._tracked.items():
            if storage in self._written or storage not in held:
                continue
            name, tensor = held[storage]
            if tracked.tensor != id(tensor):  # another tensor under its name
                continue
            if (tensor._version, _local(tensor)._version) != (
                tracked.version,
                tracked.local_version,
            ):
                continue
            problems.append(
                BufferProblem(
                    name=name,
                    snapshot=Snapshot.LOAD,
                    reason=BufferReason.UNWRITTEN,
                    got=_first_values(tensor),
                    detail=detail,
                )
            )
        return tuple(sorted(problems, key=lambda p: p.name))

    def _detail(self) -> str:
        where = f"to_empty() at {', '.join(dict.fromkeys(self.sites))}"
        writers = [
            f"{function or '<module>'} ({line})"
            for (function, _), line in list(self._writers.items())[:_WRITERS_LISTED]
        ]
        if not writers:
            return f"{where}; nothing wrote any of its tensors before the first forward"
        more = len(self._writers) - len(writers)
        return f"{where}; written only by {', '.join(writers)}" + (
            f" and {more} more" if more > 0 else ""
        )


def _written_positions(func: Any) -> tuple[int, ...]:
    schema = getattr(func, "_schema", None)
    if schema is None:
        return ()
    if getattr(func, "namespace", "") in _COLLECTIVE_NAMESPACES:
        return tuple(range(len(schema.arguments)))
    return tuple(
        i
        for i, arg in enumerate(schema.arguments)
        if arg.alias_info is not None and arg.alias_info.is_write
    )


def _written_tensors(func: Any, positions: tuple[int, ...], args: tuple, kwargs: dict) -> list:
    arguments = func._schema.arguments
    found: list[torch.Tensor] = []
    for i in positions:
        value = args[i] if i < len(args) else kwargs.get(arguments[i].name)
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


def _first_values(tensor: torch.Tensor) -> tuple[str, ...]:
    try:
        flat = _local(tensor).detach().reshape(-1)[:_FIRST_VALUES]
        return tuple(f"{v:.6g}" for v in flat.float().cpu().tolist())
    except Exception:  # values are only shown; a tensor we cannot read still is unwritten
        log.debug("could not read the first values", exc_info=True)
        return ()
