"""The bucketed transfer: rank 0 sends every other rank only its own shards of the full state dict,
point to point over gloo, large shards straight from and into the tensors, small ones packed in
buckets of at most ``bucket_bytes``. Every rank derives every message from the specs all ranks
agreed on, so both ends know each message's size before it moves."""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdpcheck.distributed.wire import transport_device
from fsdpcheck.loader.names import Placement, placed_tensors, placement, state_dict_names
from fsdpcheck.loader.shards import local_shape, mesh_coordinate, shard_of, supported
from fsdpcheck.model.fingerprint import dtype_name
from fsdpcheck.model.parallel import sibling_root
from fsdpcheck.model.threads import receiver_threads
from fsdpcheck.records import short_digest
from fsdpcheck.text import int_ranges, ranks_label
from fsdpcheck.vocab import LoadMethod

log = logging.getLogger(__name__)

_ALIGN = 16  # every piece starts at a multiple of this in its bucket, so any dtype can view it
_DIRECT_BYTES = 2**20  # a shard at least this big travels alone, straight from/into the tensor
_STAGING = 2  # staging buffers per rank: one on the wire while the other is packed or unpacked
_WINDOW = 8  # messages a rank keeps posted ahead of the one it is finishing


@dataclass(frozen=True)
class _Spec:
    """One tensor the bucketed path moves, as the structure every rank has agreed on."""

    name: str  # the name its bytes travel under; for tied weights, the name verify checks
    aliases: tuple[str, ...]  # other state-dict names of the same tensor (tied weights)
    shape: tuple[int, ...]  # global shape
    dtype: torch.dtype  # the model's dtype: what travels, whatever rank 0's source holds
    placements: tuple[Any, ...] | None  # None: a plain tensor, every rank holds all of it
    mesh: Any = None  # its DeviceMesh


@dataclass(frozen=True)
class _Bucketed:
    """One rank's entry for the bucketed path in the layout exchange."""

    digest: str  # of everything the transfer layout derives from; every rank must agree
    reason: str | None  # why this rank cannot take the bucketed path
    specs: tuple[_Spec, ...] = ()  # kept on this rank, never sent (see _Bucketed.shared)

    def shared(self) -> tuple[str, str | None]:
        return self.digest, self.reason


@dataclass(frozen=True)
class _Piece:
    """Elements ``start:stop`` of one rank's flattened local shard of ``specs[index]``, at byte
    ``offset`` of a bucket."""

    index: int
    start: int
    stop: int
    offset: int


@dataclass(frozen=True)
class _Message:
    """One point-to-point message from rank 0: a bucket of small shards packed at their offsets,
    or a slice of one large shard alone (``direct``), which needs no packing where the source
    (rank 0) or the target (the receiver) already holds those bytes contiguously."""

    size: int  # bytes on the wire
    pieces: tuple[_Piece, ...]
    direct: bool = False


def aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _specs(model: nn.Module, state: Mapping[str, torch.Tensor]) -> list[_Spec]:
    """The model's tensors to move, by the names the loader moves them under
    (:class:`Placement`'s ``placed``); tied weights move once."""
    specs = []
    for owner, *aliases in state_dict_names(model, state).values():
        tensor = state[owner]
        placements = getattr(tensor, "placements", None)
        specs.append(
            _Spec(
                name=owner,
                aliases=tuple(aliases),
                shape=tuple(int(d) for d in tensor.shape),
                dtype=tensor.dtype,
                placements=tuple(placements) if placements is not None else None,
                mesh=tensor.device_mesh if placements is not None else None,
            )
        )
    return sorted(specs, key=lambda spec: spec.name)


def bucketed_info(
    model: nn.Module,
    rank: int,
    ranks: list[int],
    group: Any,
    bucket_bytes: int,
    where: Placement | None = None,
) -> _Bucketed:
    """What the bucketed path's layout derives from on this rank, and whether this rank can take
    it at all; never raises, so the rank always joins the exchange."""
    try:
        backend = str(dist.get_backend(group)).lower()
        if "gloo" not in backend:
            # Point-to-point from rank 0 over NCCL would set up a communicator per receiver.
            return _Bucketed(
                "", f"`group` runs {backend}; the bucketed path sends over gloo (pass a gloo group)"
            )
        state = (where or placement(model)).placed
        specs = _specs(model, state)
        members = set(ranks)
        meshes: dict[int, tuple[Any, ...]] = {}
        coordinates: dict[int, list[int] | None] = {}
        outside: dict[int, list[int]] = {}  # mesh ranks that `group` lacks
        described, reasons = [], []
        for spec in specs:
            tensor = state[spec.name]
            mesh_key = None
            if spec.placements is None:
                if not tensor.is_contiguous():
                    reasons.append(f"{spec.name} is not contiguous")
            else:
                mesh_key = meshes.get(id(spec.mesh))
                if mesh_key is None:
                    mesh_key = meshes[id(spec.mesh)] = _mesh_key(spec.mesh)
                    coordinates[id(spec.mesh)] = mesh_coordinate(spec.mesh, rank)
                    outside[id(spec.mesh)] = sorted(set(mesh_key[2]) - members)
                where = (outside[id(spec.mesh)], coordinates[id(spec.mesh)])
                reasons.extend(_shard_problems(spec, tensor, rank, mesh_key, *where))
            placements = tuple(str(p) for p in spec.placements) if spec.placements else None
            described.append(
                (spec.name, spec.aliases, spec.shape, dtype_name(spec.dtype), placements, mesh_key)
            )
        digest = short_digest(repr((bucket_bytes, described)))
        reason = None
        if reasons:
            more = f" (and {len(reasons) - 1} more)" if len(reasons) > 1 else ""
            reason = reasons[0] + more
        return _Bucketed(digest, reason, tuple(specs))
    except Exception as exc:  # the DCP path may still cope; say why this one cannot
        log.debug("bucketed load: the state dict could not be described", exc_info=True)
        return _Bucketed("", f"could not describe its state dict: {type(exc).__name__}: {exc}")


def _mesh_key(mesh: Any) -> tuple[Any, ...]:
    """Equal on every rank whose shards are cut alike: one mesh, or sibling sub-mesh across tp
    (then its root's ranks and the sub-mesh's dims: :func:`mesh_coordinate` finds each rank)."""
    shape = tuple(int(d) for d in mesh.mesh.shape)
    sibling = sibling_root(mesh)
    if sibling is not None:
        ranks = tuple(int(r) for r in sibling.mesh.reshape(-1).tolist())
        return (str(mesh.device_type), shape, ranks, tuple(mesh.mesh_dim_names))
    ranks = tuple(int(r) for r in mesh.mesh.reshape(-1).tolist())
    return (str(mesh.device_type), shape, ranks)


def _shard_problems(
    spec: _Spec,
    tensor: torch.Tensor,
    rank: int,
    mesh_key: tuple[Any, ...],
    outside: list[int],
    coordinate: list[int] | None,
) -> list[str]:
    mesh_shape = mesh_key[1]
    unsupported = [p for p in spec.placements if not supported(p)]
    if unsupported:
        return [f"{spec.name} is placed as {unsupported[0]} (only Shard and Replicate are moved)"]
    if len(spec.placements) != len(mesh_shape):
        return [f"{spec.name} has {len(spec.placements)} placements on a {len(mesh_shape)}-D mesh"]
    if outside:
        return [f"{spec.name}'s mesh holds ranks {int_ranges(outside)} that `group` lacks"]
    if coordinate is None:
        return [f"rank {rank} is not in {spec.name}'s mesh"]
    with torch.no_grad():
        local = tensor.to_local()
    expected = local_shape(spec.shape, spec.placements, mesh_shape, coordinate)
    if tuple(local.shape) != expected:
        return [
            f"{spec.name}'s local shard is {list(local.shape)}, not the torch.chunk slice "
            f"{list(expected)}"
        ]
    if not local.is_contiguous():
        return [f"{spec.name}'s local shard is not contiguous"]
    return []


def choose_method(method: str, fasts: list[Any], ranks: list[int]) -> tuple[str, str | None]:
    """The same decision on every rank, from every rank's (digest, reason), in group order."""
    if method == LoadMethod.DCP:
        return "dcp", None
    if asked := [r for r, f in zip(ranks, fasts, strict=True) if f is None]:
        return "dcp", f"{ranks_label(asked)} asked for method='dcp'"
    reasons = [f"rank {r}: {f[1]}" for r, f in zip(ranks, fasts, strict=True) if f[1]]
    if reasons:
        more = f"; and {len(reasons) - 1} more ranks" if len(reasons) > 1 else ""
        return "dcp", f"not covered by the bucketed path: {reasons[0]}{more}"
    reference = fasts[ranks.index(0)][0]
    if differ := [r for r, f in zip(ranks, fasts, strict=True) if f[0] != reference]:
        return "dcp", (
            f"{ranks_label(differ)} shard, tie or bucket the state dict "
            "differently from rank 0 (placements, meshes, tied weights or bucket_bytes differ)"
        )
    return "bucketed", None


def plan_messages(numels: Sequence[tuple[int, int]], bucket_bytes: int) -> list[_Message]:
    """One rank's messages: ``numels[i]`` = (elements of its shard of tensor i, bytes each).

    A shard of at least ``min(bucket_bytes, 1 MiB)`` travels alone, in slices of at most
    ``bucket_bytes``; smaller ones are packed, in order, into buckets of at most ``bucket_bytes``.
    Pure: both ends of every message derive it from the same agreed sizes."""
    direct = min(bucket_bytes, _DIRECT_BYTES)
    messages: list[_Message] = []
    pieces: list[_Piece] = []
    used = 0
    for index, (numel, itemsize) in enumerate(numels):
        nbytes = numel * itemsize
        if nbytes == 0:
            continue
        if nbytes >= direct:
            step = max(1, bucket_bytes // itemsize)
            for start in range(0, numel, step):
                stop = min(numel, start + step)
                piece = _Piece(index, start, stop, 0)
                messages.append(_Message((stop - start) * itemsize, (piece,), direct=True))
            continue
        offset = aligned(used)
        if offset + nbytes > bucket_bytes:
            messages.append(_Message(used, tuple(pieces)))
            pieces, offset = [], 0
        pieces.append(_Piece(index, 0, numel, offset))
        used = offset + nbytes
    if pieces:
        messages.append(_Message(used, tuple(pieces)))
    return messages


class Prefault:
    """Faults in the pages of a receiving rank's fresh shards (just allocated by
    ``to_empty()``) before gloo's receive thread writes into them, in message order.

    gloo's receive thread faulting fresh pages in itself, one by one inside the socket's
    receive, made the transfer 5 to 10 times slower in runs where page faults were dear on a
    2-core VM (issue 38, the audit's 1B-parameter model, 2 ranks: rank 1's 0.93 GiB of shards
    took 5.1 to 11.3 s; 0.89 to 0.99 s with every page touched first). Where the kernel has
    ``MADV_POPULATE_WRITE`` (Linux 5.14), a thread of its own populates the pages ahead of the
    receives while they run: no byte changes, so it may overlap them. Measured on the full load
    bench's 502M float32 model in runs where faults were cheap: 0.62 to 0.66 s, as fast as the
    bare point-to-point of the same bytes (0.61 to 0.64 s), against 0.76 to 0.80 s without it
    and 0.82 to 0.86 s touching every page first. Where the kernel lacks it, every page is
    written once, all before the first receive is posted (a write racing a receive could
    overwrite what arrived)."""

    def __init__(self, buffers: Sequence[torch.Tensor]):
        self._buffers = [b for b in buffers if b.device.type == "cpu" and b.numel()]
        self._thread: threading.Thread | None = None
        self._writes = False  # the thread writes the pages: no receive may run beside it
        self._stopped = threading.Event()

    def start(self, *, ahead: bool = False) -> None:
        """Fault the pages in. ``ahead``: no receive is posted into them until
        :meth:`before_receives`, so every page goes to the thread at once, even where the
        kernel cannot populate without writing (the thread then writes, and
        :meth:`before_receives` waits for it). Otherwise the first buffer is populated here, so
        the thread runs ahead of the first receive, or every page is written before it."""
        if not self._buffers:
            return
        if ahead:
            # One page: can the kernel populate without writing?
            self._writes = not _populate(self._buffers[0].reshape(-1)[:1])
            target = _touch_all if self._writes else self._populate_all
            self._run(target, self._buffers)
            return
        if _populate(self._buffers[0]):
            self._run(self._populate_all, self._buffers[1:])
            return
        first_touch(self._buffers, receiver_threads())

    def _run(self, target: Callable[[Sequence[torch.Tensor]], None], buffers: list) -> None:
        self._thread = threading.Thread(
            target=target, args=(buffers,), name="fsdpcheck-prefault", daemon=True
        )
        self._thread.start()

    def before_receives(self) -> None:
        """Wait for the thread where it writes the pages (a write racing a receive could
        overwrite what arrived); populating changes no byte, so it may go on beside them."""
        if self._writes:
            self.join()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def stop(self) -> None:
        """Fault in no more pages and wait for the thread, within one piece of
        ``_POPULATE_PIECE`` bytes: once the receives are over (they faulted in what they
        wrote), or where none will come (a skipped load, a failure on the way to it), so that
        no rank spends its timeout's worth of seconds populating memory nothing reads."""
        self._stopped.set()
        self.join()

    def _populate_all(self, buffers: Sequence[torch.Tensor]) -> None:
        try:
            for buffer in buffers:
                raw = buffer.detach().reshape(-1).view(torch.uint8)
                for start in range(0, raw.numel(), _POPULATE_PIECE):
                    if self._stopped.is_set():
                        return
                    if not _populate(raw[start : start + _POPULATE_PIECE]):
                        # a speed-up only: gloo faults the rest in itself
                        log.debug("MADV_POPULATE_WRITE failed part-way: gloo faults in the rest")
                        return
        except Exception:  # the same: nothing is lost but the speed
            log.debug("prefaulting the receive buffers failed", exc_info=True)


_POPULATE_PIECE = 64 * 2**20  # bytes populated between looks at Prefault.stop


_MADV_POPULATE_WRITE = 23  # <linux/mman.h>, Linux >= 5.14


@functools.cache
def _madvise() -> Any | None:
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        log.debug("no madvise in this process's C library", exc_info=True)
        return None
    madvise.argtypes, madvise.restype = (
        [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int],
        ctypes.c_int,
    )
    return madvise


def _populate(buffer: torch.Tensor) -> bool:
    """Fault in ``buffer``'s pages, writable, changing no byte; False where the kernel or the C
    library cannot. Whole pages: each holds at least one byte of ``buffer``, so it is mapped."""
    madvise = _madvise()
    if madvise is None or buffer.device.type != "cpu":
        return False
    page = mmap.PAGESIZE
    start = buffer.data_ptr()
    end = start + buffer.numel() * buffer.element_size()
    first, last = start - start % page, -(-end // page) * page
    return madvise(first, last - first, _MADV_POPULATE_WRITE) == 0


def _touch_all(buffers: Sequence[torch.Tensor]) -> None:
    try:
        first_touch(buffers, receiver_threads())
    except Exception:  # a speed-up only: gloo faults the pages in itself
        log.debug("touching the receive buffers failed", exc_info=True)


def first_touch(buffers: Sequence[torch.Tensor], threads: int) -> None:
    """Write one byte of every page of ``buffers`` (to zero), ``threads`` side by side: where
    :class:`Prefault` cannot populate pages without writing, and before any receive is posted."""
    cpu = [b.view(-1).view(torch.uint8) for b in buffers if b.device.type == "cpu"]
    cpu = [b for b in cpu if b.numel() >= mmap.PAGESIZE]
    if threads > 1 and len(cpu) > 1:  # the writes release the GIL: buffers side by side
        with ThreadPoolExecutor(threads, thread_name_prefix="fsdpcheck-touch") as pool:
            list(pool.map(_touch, cpu))
        return
    for buffer in cpu:
        _touch(buffer)


def _touch(buffer: torch.Tensor) -> None:
    buffer[:: mmap.PAGESIZE].zero_()


class _Pipeline:
    """Point-to-point messages in flight, finished in the order they were posted, with a few
    staging buffers (allocated on first use) for the messages that need packing."""

    def __init__(self, staging_bytes: int, device: torch.device):
        self.staging_bytes = staging_bytes
        self.device = device
        self.buffers: list[torch.Tensor | None] = [None] * _STAGING
        self.busy = [False] * _STAGING
        self.turn = 0
        self.pending: deque[tuple[Any, Callable[[], None] | None, int | None]] = deque()

    def staging(self, size: int) -> tuple[int, torch.Tensor]:
        slot, self.turn = self.turn, (self.turn + 1) % _STAGING
        while self.busy[slot]:
            self.finish_oldest()
        if self.buffers[slot] is None:
            self.buffers[slot] = torch.empty(
                self.staging_bytes, dtype=torch.uint8, device=self.device
            )
        self.busy[slot] = True
        return slot, self.buffers[slot][:size]

    def post(self, work: Any, done: Callable[[], None] | None, slot: int | None) -> None:
        self.pending.append((work, done, slot))
        while len(self.pending) > _WINDOW:
            self.finish_oldest()

    def finish_oldest(self) -> None:
        work, done, slot = self.pending.popleft()
        work.wait()
        if done is not None:
            done()
        if slot is not None:
            self.busy[slot] = False

    def drain(self) -> None:
        while self.pending:
            self.finish_oldest()


@dataclass(frozen=True)
class TransferStats:
    messages: int
    bytes: int  # on the wire
    largest: int  # one message's bytes
    failure: str | None  # this rank's, or None


class Transfer:
    """Rank 0 sends every other rank its own shards; nobody receives anyone else's.

    Every rank derives the same messages for every rank from the agreed specs
    (:func:`plan_messages`), so each message's size is known to both ends before it moves. Large
    shards travel straight from rank 0's source tensors into the receivers' local shards; small
    ones in packed buckets. A rank that fails (to materialise, to pack, to unpack) still sends or
    receives every message, so nobody is left waiting; the failure reaches every rank after the
    transfer."""

    def __init__(
        self,
        model: nn.Module,
        specs: Sequence[_Spec],
        ranks: list[int],
        group: Any,
        size: int,
        where: Placement | None = None,
    ):
        self.model = model
        self.where = where
        self.specs = tuple(specs)
        self.ranks = ranks
        self.group = group
        self.bucket_bytes = size
        self.rank = dist.get_rank()
        self.device = transport_device(group)
        self.failure: str | None = None
        self._coordinates: dict[tuple[int, int], tuple[list[int] | None, tuple[int, ...]]] = {}
        self._flat_index = -1
        self._flat: dict[int, torch.Tensor] = {}

    def run(
        self, source: Mapping[str, torch.Tensor] | None, *, write: bool, fresh: bool = False
    ) -> TransferStats:
        """Move every rank's shards; ``failure`` says what went wrong on this rank. ``fresh``:
        this rank's shards were just allocated (``to_empty()``), so their pages are faulted in
        before anything is received (:func:`first_touch`)."""
        targets = None
        if write:
            try:
                targets = self._targets()
            except Exception as exc:
                log.debug("rank %d: finding its local shards failed", self.rank, exc_info=True)
                self._fail("finding its local shards", exc)
        with torch.no_grad():
            if self.rank == 0:
                if source is None:
                    self.failure = self.failure or "rank 0: no full state dict to send"
                return TransferStats(*self._send(source, targets), self.failure)
            return TransferStats(*self._receive(targets, fresh), self.failure)

    # -- layout

    def _numels(self, rank: int) -> list[tuple[int, int]]:
        out = []
        for spec in self.specs:
            shape = spec.shape
            if spec.placements is not None:
                coordinate, mesh_shape = self._coordinate(spec.mesh, rank)
                shape = (
                    local_shape(shape, spec.placements, mesh_shape, coordinate)
                    if coordinate is not None
                    else (0,)
                )
            numel = 1
            for d in shape:
                numel *= d
            out.append((numel, spec.dtype.itemsize))
        return out

    def _coordinate(self, mesh: Any, rank: int) -> tuple[list[int] | None, tuple[int, ...]]:
        """``rank``'s coordinate in ``mesh`` and the mesh's shape, worked out once per mesh and
        rank: ``DeviceMesh.mesh`` builds a new tensor on every access (0.3 s of rank 0's load
        of a 1B-parameter model, 341 tensors, when asked for each tensor)."""
        key = (id(mesh), rank)
        if key not in self._coordinates:
            self._coordinates[key] = (mesh_coordinate(mesh, rank), tuple(mesh.mesh.shape))
        return self._coordinates[key]

    def _targets(self) -> list[torch.Tensor]:
        """This rank's local tensors (after to_empty()), flat, in spec order."""
        where = self.where or placement(self.model)
        state = placed_tensors(self.model, where)
        flat = []
        for spec in self.specs:
            tensor = state[spec.name]
            local = tensor.to_local() if spec.placements is not None else tensor
            flat.append(local.detach().view(-1))
        return flat

    def _source(self, index: int, rank: int, source: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Rank ``rank``'s part of rank 0's full tensor ``index``, flat (a view where it can)."""
        if index != self._flat_index:
            self._flat_index, self._flat = index, {}
        if rank not in self._flat:
            spec = self.specs[index]
            full = source[spec.name].detach()
            if spec.placements is not None:
                coordinate, mesh_shape = self._coordinate(spec.mesh, rank)
                full = shard_of(full, spec.placements, mesh_shape, coordinate)
            self._flat[rank] = full.reshape(-1)
        return self._flat[rank]

    def _fail(self, doing: str, exc: Exception) -> None:
        if self.failure is None:
            self.failure = f"rank {self.rank}: {doing} failed: {type(exc).__name__}: {exc}"

    # -- rank 0

    def _send(
        self, source: Mapping[str, torch.Tensor] | None, targets: list[torch.Tensor] | None
    ) -> tuple[int, int, int]:
        plans = {d: plan_messages(self._numels(d), self.bucket_bytes) for d in self.ranks if d != 0}
        own = plan_messages(self._numels(0), self.bucket_bytes)
        biggest = max((m.size for plan in plans.values() for m in plan), default=0)
        pipe = _Pipeline(biggest, self.device)
        rounds = max([len(own), *(len(plan) for plan in plans.values())])
        messages = sent = 0
        for k in range(rounds):
            # Round-robin over the receivers, so each one unpacks while the others receive.
            for dst, plan in plans.items():
                if k >= len(plan):
                    continue
                message, wire, slot = plan[k], None, None
                if message.direct and self.failure is None:
                    wire = self._direct_source(message, dst, source)
                if wire is None:
                    slot, wire = pipe.staging(message.size)
                    if self.failure is None:
                        try:
                            self._pack(wire, message, dst, source)
                        except Exception as exc:
                            log.debug(
                                "rank 0: packing message %d for rank %d failed",
                                k,
                                dst,
                                exc_info=True,
                            )
                            self._fail("packing a message", exc)
                pipe.post(dist.isend(wire, dst=dst, group=self.group, tag=k), None, slot)
                messages += 1
                sent += message.size
            if k < len(own) and targets is not None and self.failure is None:
                try:  # rank 0's own shards, straight from the source, while its sends run
                    for piece in own[k].pieces:
                        part = self._source(piece.index, 0, source)[piece.start : piece.stop]
                        targets[piece.index][piece.start : piece.stop].copy_(part)
                except Exception as exc:
                    log.debug("rank 0: copying its own shards failed", exc_info=True)
                    self._fail("copying its own shards", exc)
        pipe.drain()
        return messages, sent, biggest

    def _direct_source(
        self, message: _Message, dst: int, source: Mapping[str, torch.Tensor]
    ) -> torch.Tensor | None:
        """The source's own bytes for a direct message, or None when they must be packed (a
        different dtype, device or memory layout than the wire's)."""
        try:
            [piece] = message.pieces
            part = self._source(piece.index, dst, source)[piece.start : piece.stop]
        except Exception as exc:
            log.debug("rank 0: slicing the source for rank %d failed", dst, exc_info=True)
            self._fail("slicing the source", exc)
            return None
        usable = part.dtype == self.specs[piece.index].dtype and part.device == self.device
        return part.view(torch.uint8) if usable and part.is_contiguous() else None

    def _pack(
        self, wire: torch.Tensor, message: _Message, dst: int, source: Mapping[str, torch.Tensor]
    ) -> None:
        for piece in message.pieces:
            dtype = self.specs[piece.index].dtype
            end = piece.offset + (piece.stop - piece.start) * dtype.itemsize
            part = self._source(piece.index, dst, source)[piece.start : piece.stop]
            wire[piece.offset : end].view(dtype).copy_(part)  # converts to the model's dtype

    # -- every other rank

    def _receive(self, targets: list[torch.Tensor] | None, fresh: bool) -> tuple[int, int, int]:
        plan = plan_messages(self._numels(self.rank), self.bucket_bytes)
        biggest = max((m.size for m in plan), default=0)
        pipe = _Pipeline(biggest, self.device)
        direct: dict[int, torch.Tensor] = {}  # message → the shard's bytes it lands in
        if targets is not None and self.failure is None:
            for k, message in enumerate(plan):
                if message.direct:
                    [piece] = message.pieces
                    target = targets[piece.index]
                    if target.device == self.device:  # straight into the shard
                        direct[k] = target[piece.start : piece.stop].view(torch.uint8)
        prefault = Prefault(list(direct.values()) if fresh else [])
        try:
            prefault.start()
        except Exception:  # a speed-up only: gloo faults the pages in itself
            log.debug("rank %d: prefaulting the receive buffers failed", self.rank, exc_info=True)
        for k, message in enumerate(plan):
            wire, slot, done = direct.get(k), None, None
            if wire is None:
                slot, wire = pipe.staging(message.size)
                if targets is not None:
                    done = self._unpacker(wire, message, targets)
            pipe.post(dist.irecv(wire, src=0, group=self.group, tag=k), done, slot)
        pipe.drain()
        prefault.join()
        return len(plan), sum(m.size for m in plan), biggest

    def _unpacker(
        self, wire: torch.Tensor, message: _Message, targets: list[torch.Tensor]
    ) -> Callable[[], None]:
        def unpack() -> None:
            if self.failure is not None:
                return
            try:
                for piece in message.pieces:
                    dtype = self.specs[piece.index].dtype
                    end = piece.offset + (piece.stop - piece.start) * dtype.itemsize
                    part = wire[piece.offset : end].view(dtype)
                    targets[piece.index][piece.start : piece.stop].copy_(part)
            except Exception as exc:
                log.debug("rank %d: unpacking a message failed", self.rank, exc_info=True)
                self._fail("unpacking a message", exc)

        return unpack
