"""Prove a load: every rank's buffers equal rank 0's, every parameter shard equals its slice of the
source state dict. Digests travel to rank 0 over a gloo group; values never leave their rank.
Tensors are paired with the source by their state-dict names, as the loader moves them
(:mod:`fsdpcheck.loader.names`), so wrappers such as activation checkpointing do not get in the
way; a name the source lacks is also looked up without ``torch.compile``'s ``_orig_mod.``, as
DCP's ``set_model_state_dict`` (torchtitan's loader) and ``get_model_state_dict`` name it.

Digests are :mod:`fsdpcheck.model.checksum` checksums: every rank digests its own shards (on
their device) while rank 0 digests its source slices for the other ranks and compares its own
shards in place, so rank 0's extra work overlaps theirs instead of following it. Those slices are
read from the source alone, so :func:`expect_ahead` can digest them on a thread while the load
runs, leaving rank 0 only its in-place compare and the buffers once the load is done."""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdpcheck.errors import FsdpcheckError
from fsdpcheck.loader.names import Placement, placement, state_dict_names, through_hooks_source
from fsdpcheck.loader.shards import expected_shard
from fsdpcheck.model.checksum import checksums
from fsdpcheck.model.threads import lead_threads, worker_threads
from fsdpcheck.records import VerifyResult
from fsdpcheck.text import name_list

log = logging.getLogger(__name__)

# Status codes rank 0 broadcasts with its verdict.
_RAN, _NOT_RUN, _FAILED = 0, 1, 2


@dataclass(frozen=True)
class _Entry:
    digest: str | None  # None: still on meta
    shape: tuple[int, ...]  # local shape (a parameter's shard)
    placements: tuple[str, ...] | None = None


@dataclass(frozen=True)
class _Digests:
    global_rank: int
    buffers: dict[str, _Entry]
    params: dict[str, _Entry]


@dataclass(frozen=True)
class _Tensors:
    """The model's buffers and parameters by the names they are checked under: their state-dict
    names, or their module paths where no state dict holds them (non-persistent buffers)."""

    buffers: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]
    # where the state dict's entries land (through the model's load_state_dict hooks, if any)
    where: Placement | None = None


def _tensors(model: nn.Module) -> _Tensors:
    where = None
    try:
        where = placement(model)
        names = state_dict_names(model, where.placed)
    except Exception:  # no state dict to go by: module paths, which the report then names
        log.debug(
            "verify_load: the model's state dict failed; checking by module paths", exc_info=True
        )
        names = {}

    def by_state_name(pairs: Any) -> dict[str, torch.Tensor]:
        return {names[id(t)][0] if id(t) in names else name: t for name, t in pairs}

    return _Tensors(
        by_state_name(model.named_buffers()), by_state_name(model.named_parameters()), where
    )


_COMPILED = "_orig_mod"  # torch.compile's wrapper holds the module under this name


def _keyed_like(tensors: _Tensors, source: Mapping[str, Any]) -> Mapping[str, Any]:
    """``source`` under the names the model's tensors are checked by: a name it lacks is looked
    up without the ``_orig_mod`` level, as DCP names a compiled module's tensors. A shallow copy
    only where some name needs it."""
    missing = [name for name in [*tensors.buffers, *tensors.params] if name not in source]
    keyed = None
    for name in missing:
        plain = ".".join(part for part in name.split(".") if part != _COMPILED)
        if plain != name and plain in source:
            keyed = dict(source) if keyed is None else keyed
            keyed[name] = source[plain]
    return source if keyed is None else keyed


def verify_load(
    model: nn.Module,
    full_state_dict_on_rank0: Mapping[str, torch.Tensor] | None,
    *,
    group: Any = None,
    ahead: ExpectedAhead | None = None,
) -> VerifyResult:
    """Collective over ``group`` (gloo; None: the default group); rank 0 (the group's first rank)
    returns the mismatches. ``ahead``: what :func:`expect_ahead` started before the load, with
    the same source and group (rank 0 then reads only its own shards and the buffers here; with
    any other source or group, or where that thread failed, it digests every slice itself)."""
    ranks = list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    root = ranks[0]
    rank = dist.get_rank()
    failure: BaseException | None = None
    expected: _Expected | None = None
    tensors = _tensors(model)
    source = full_state_dict_on_rank0
    if rank == root and source is not None:
        try:  # before the gather: the other ranks digest their own shards meanwhile
            if tensors.where is not None and tensors.where.fused:
                source = through_hooks_source(tensors.where, model, source)
            source = _keyed_like(tensors, source)
            others = _digested_ahead(ahead, full_state_dict_on_rank0, ranks)
            expected = _expect(tensors, source, ranks, root, others=others)
        except Exception as exc:  # the gather and the verdict broadcast below must still happen
            log.debug("rank %d: the expected digests failed", rank, exc_info=True)
            failure = exc
    mine = _digests(tensors, rank, in_place=rank == root)
    gathered: list[Any] | None = [None] * len(ranks) if rank == root else None
    dist.gather_object(mine, gathered, dst=root, group=group)

    result = VerifyResult(ran=False, passed=False, checked=0)
    status = torch.tensor([_FAILED, 0, 0], dtype=torch.int64)
    if rank == root and failure is None:
        try:
            if expected is not None:
                result = _judge(tensors, source, gathered, root, expected)
                status = torch.tensor([_RAN, int(result.passed), result.checked])
            else:
                status = torch.tensor([_NOT_RUN, 0, 0])
        except Exception as exc:  # the verdict broadcast below must still happen
            log.debug("rank %d: judging the digests failed", rank, exc_info=True)
            failure = exc
    # Every rank waits here for rank 0's verdict, including when rank 0 failed to reach one.
    dist.broadcast(status, src=root, group=group)
    code, passed, checked = (int(v) for v in status.tolist())
    if code == _FAILED:
        if failure is not None:
            raise failure
        raise FsdpcheckError(f"rank {rank}: verification failed on rank {root}; see its error.")
    if rank == root:
        return result
    return VerifyResult(ran=code == _RAN, passed=bool(passed), checked=checked)


_IN_PLACE = "in-place"  # rank 0's own shards: compared with its source directly, no digest


def _digests(tensors: _Tensors, rank: int, *, in_place: bool = False) -> _Digests:
    """This rank's digests. ``in_place`` (rank 0): parameters are not digested, because rank 0
    compares its own shards with its source slices directly (bitwise, in int64 words: one read
    of each at memory speed, no arithmetic), which halves its checksum work on two ranks."""
    buffers = list(tensors.buffers.items())
    params = []
    for name, param in tensors.params.items():
        placements = getattr(param, "placements", None)
        local = param.to_local() if placements is not None else param
        params.append((name, local, tuple(str(p) for p in placements) if placements else None))
    digested = [b for _, b in buffers]
    if not in_place:
        digested += [local for _, local, _ in params]
    digests = checksums(digested)
    param_digests = (
        [None if local.is_meta else _IN_PLACE for _, local, _ in params]
        if in_place
        else digests[len(buffers) :]
    )
    return _Digests(
        rank,
        {
            name: _Entry(digest, tuple(buf.shape))
            for (name, buf), digest in zip(buffers, digests, strict=False)
        },
        {
            name: _Entry(digest, tuple(local.shape), placements)
            for (name, local, placements), digest in zip(params, param_digests, strict=True)
        },
    )


def _in_place_reason(param: torch.Tensor, shard: torch.Tensor) -> str | None:
    local = param.to_local() if getattr(param, "placements", None) is not None else param
    if local.is_meta:
        return "still on meta (never materialised)"
    if tuple(local.shape) != tuple(shard.shape):
        return f"local shape {list(local.shape)}, expected {list(shard.shape)}"
    if not _same_bytes(local.detach(), shard.to(local.device)):
        return "values differ from the source state dict"
    return None


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, compared in the widest integer words both allow: ``torch.equal`` on
    bfloat16 runs at ~1 GB/s on one core, on int64 words at ~5 GB/s (and NaNs compare equal to
    themselves, as bytes should)."""
    raw_a = a.reshape(-1).contiguous().view(torch.uint8)
    raw_b = b.reshape(-1).contiguous().view(torch.uint8)
    if raw_a.numel() != raw_b.numel():
        return False
    for dtype in (torch.int64, torch.int32, torch.int16):
        size = dtype.itemsize
        aligned = raw_a.data_ptr() % size == 0 and raw_b.data_ptr() % size == 0
        if aligned and raw_a.numel() % size == 0:
            return torch.equal(raw_a.view(dtype), raw_b.view(dtype))
    return torch.equal(raw_a, raw_b)


class _Batches:
    """Rank 0's expected digests, computed in batches (one threaded checksum pass per batch).
    Slices of the source are views; only dtype conversions copy, so a batch closes once those
    copies reach ``_BATCH_COPY_BYTES``. With ``stop`` (the digests ahead of the load), a batch
    also closes at ``_AHEAD_BATCH_BYTES`` in all, and ``stop`` is looked at before each one."""

    def __init__(self, threads: int, stop: threading.Event | None = None) -> None:
        self.threads, self.stop = threads, stop
        self.pending: list[tuple[Any, torch.Tensor]] = []
        self.copied = self.held = 0
        self.done: dict[Any, str | None] = {}

    def add(self, key: Any, tensor: torch.Tensor, copied: bool) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        self.pending.append((key, tensor))
        self.copied += nbytes if copied else 0
        self.held += nbytes
        if self.copied >= _BATCH_COPY_BYTES or (
            self.stop is not None and self.held >= _AHEAD_BATCH_BYTES
        ):
            self.flush()

    def flush(self) -> None:
        if self.stop is not None and self.stop.is_set():
            raise _Stopped
        if self.pending:
            digests = checksums([t for _, t in self.pending], threads=self.threads)
            self.done.update((key, d) for (key, _), d in zip(self.pending, digests, strict=True))
        self.pending, self.copied, self.held = [], 0, 0


_BATCH_COPY_BYTES = 256 * 2**20
# Ahead of the load: a stopped thread ends within one batch's checksum (tens of ms).
_AHEAD_BATCH_BYTES = 64 * 2**20


@dataclass
class _Expected:
    """What rank 0 expects every rank to hold, worked out before the gather."""

    digests: dict[Any, str | None]
    shapes: dict[Any, tuple[int, ...]]
    problems: dict[tuple[str, int], str]  # (parameter, rank): why no digest ("" = rank 0 in place)


def _expect(
    tensors: _Tensors,
    source: Mapping[str, torch.Tensor],
    ranks: Sequence[int],
    root: int,
    *,
    others: _Expected | None = None,
) -> _Expected:
    """Rank 0: the digest of every buffer and of every rank's slice of every parameter (its own
    shards compared in place), in threaded batches. ``others``: the other ranks' slices, already
    digested (:func:`expect_ahead`); then only the buffers and rank 0's own shards are read."""
    # The others digest their own shards meanwhile, 1/world of the model each, so rank 0 (the
    # rest of it) takes every core but one per other rank on the host.
    batches = _Batches(lead_threads())
    shapes: dict[Any, tuple[int, ...]] = {}
    for name, buf in tensors.buffers.items():
        want = source[name] if name in source else buf
        converted = want.to(buf.dtype)
        batches.add(("buffer", name), converted, converted is not want)
        shapes[("buffer", name)] = tuple(want.shape)
    slices = _Slices(tensors, source, [root] if others is not None else ranks, root, batches)
    slices.run()
    problems = slices.problems
    if others is not None:
        batches.done.update(others.digests)
        shapes.update(others.shapes)
        problems.update(others.problems)
    shapes.update(slices.shapes)
    # Both read memory: the comparisons on a thread of their own, beside the checksums.
    with ThreadPoolExecutor(1, thread_name_prefix="fsdpcheck-verify") as side:
        compared = side.submit(
            lambda: {(n, root): _in_place_reason(p, s) or "" for n, p, s in slices.in_place}
        )
        batches.flush()
        problems.update(compared.result())
    return _Expected(batches.done, shapes, problems)


class _Stopped(Exception):
    """No verify follows the load: rank 0's digests ahead of it are no longer wanted."""


class _Slices:
    """Every parameter's slice of the source for each of ``ranks``: another rank's slice goes to
    ``batches`` to be digested; rank 0's own is kept to compare in place (or compared at once,
    where a dtype conversion made it a copy). Each slice is cut, then converted to the
    parameter's dtype, so a pass over rank 0's own slices converts only those."""

    def __init__(
        self,
        tensors: _Tensors,
        source: Mapping[str, torch.Tensor],
        ranks: Sequence[int],
        root: int,
        batches: _Batches,
    ) -> None:
        self.tensors, self.source, self.ranks, self.root = tensors, source, ranks, root
        self.batches = batches
        self.shapes: dict[Any, tuple[int, ...]] = {}
        self.problems: dict[tuple[str, int], str] = {}
        self.in_place: list[tuple[str, nn.Parameter, torch.Tensor]] = []

    def run(self) -> None:
        coordinates: dict = {}
        root, stop = self.root, self.batches.stop
        for name, param in self.tensors.params.items():
            if stop is not None and stop.is_set():
                raise _Stopped
            full = self.source.get(name)
            if full is None:
                continue
            if not torch.is_tensor(full):
                raise TypeError(
                    f"rank {root}'s source entry {name!r} is a {type(full).__name__}, not a tensor"
                )
            for global_rank in self.ranks:
                try:
                    view = expected_shard(full, param, global_rank, coordinates)
                except ValueError as exc:
                    self.problems[(name, global_rank)] = str(exc)
                    continue
                shard = view.to(param.dtype)
                if global_rank == root and shard is not view:  # a copy: compare, let it go
                    self.problems[(name, root)] = _in_place_reason(param, shard) or ""
                    continue
                if global_rank == root:  # rank 0's own shard, a view of the source: later
                    self.in_place.append((name, param, shard))
                    continue
                key = ("param", name, global_rank)
                self.batches.add(key, shard, shard is not view)
                self.shapes[key] = tuple(shard.shape)


class ExpectedAhead:
    """Rank 0's digests of the other ranks' slices of its source, worked out on a thread of its
    own while the load runs: they read only the source, which the load reads and never writes,
    and rank 0 mostly waits in its sends meanwhile. :func:`verify_load` takes the result."""

    def __init__(
        self,
        tensors: _Tensors,
        source: Mapping[str, torch.Tensor],
        ranks: Sequence[int],
        root: int,
    ) -> None:
        self._given, self._ranks = source, list(ranks)  # what verify_load must be called with
        self._stop = threading.Event()
        # Its share of the host's cores: the other ranks are receiving, not idle.
        batches = _Batches(worker_threads(), self._stop)
        others = [r for r in ranks if r != root]
        self._slices = _Slices(tensors, _keyed_like(tensors, source), others, root, batches)
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, name="fsdpcheck-verify-ahead", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        try:
            self._slices.run()
            self._slices.batches.flush()
        except _Stopped:
            log.debug("the digests ahead of verify stopped: no verify follows the load")
        except BaseException as exc:  # verify_load digests after the load instead
            log.debug("the digests ahead of verify failed", exc_info=True)
            self._error = exc

    def made_for(self, source: Mapping[str, Any] | None, ranks: Sequence[int]) -> bool:
        """Whether these digests are of ``source`` (the same object) for ``ranks``."""
        return source is self._given and list(ranks) == self._ranks

    def result(self) -> _Expected:
        """The other ranks' expected digests, once the thread is done; FsdpcheckError where it
        failed or was stopped."""
        self._thread.join()
        if self._error is not None:
            raise FsdpcheckError(
                f"verify's digests ahead of the load failed: {type(self._error).__name__}: "
                f"{self._error}"
            ) from self._error
        if self._stop.is_set():
            raise FsdpcheckError("verify's digests ahead of the load were stopped")
        slices = self._slices
        return _Expected(slices.batches.done, slices.shapes, slices.problems)

    def stop(self) -> None:
        """No verify follows (the load failed or was refused): the thread stops between
        parameters or batches (within one batch's checksum) and is gone when this returns."""
        self._stop.set()
        self._thread.join()


def _digested_ahead(
    ahead: ExpectedAhead | None, source: Mapping[str, Any] | None, ranks: Sequence[int]
) -> _Expected | None:
    """``ahead``'s digests where they are of this source and group; None (rank 0 digests every
    slice after the load) otherwise, or where the thread failed: it was a speed-up only."""
    if ahead is None:
        return None
    if not ahead.made_for(source, ranks):
        log.debug("verify_load: `ahead` was started for another source or group; not used")
        ahead.stop()
        return None
    try:
        return ahead.result()
    except FsdpcheckError:
        log.debug("verify_load: digesting every slice after the load instead", exc_info=True)
        return None


def expect_ahead(
    model: nn.Module,
    full_state_dict_on_rank0: Mapping[str, torch.Tensor] | None,
    *,
    group: Any = None,
) -> ExpectedAhead | None:
    """Call on every rank of ``group`` just before the load, with what :func:`verify_load` will
    be given: rank 0 starts digesting the other ranks' slices of its source on a thread
    (returned, for ``verify_load(..., ahead=...)``). Elsewhere None, and on rank 0 too where it
    has no source, no other rank, or the model's load_state_dict hooks rewrite its source.
    Every rank lists its tensors here alike, so state-dict hooks that communicate run on all of
    them."""
    ranks = list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    root = ranks[0]
    tensors = _tensors(model)
    source = full_state_dict_on_rank0
    if dist.get_rank() != root or source is None or len(ranks) == 1:
        return None
    if tensors.where is not None and tensors.where.fused:
        return None  # the hooks' rewrite reads the model: left to verify_load, after the load
    return ExpectedAhead(tensors, source, ranks, root)


def _judge(
    tensors: _Tensors,
    source: Mapping[str, torch.Tensor],
    gathered: Sequence[_Digests],
    root: int,
    expected: _Expected,
) -> VerifyResult:
    """Rank 0: compare every rank's digests with what that rank must hold."""
    found: dict[tuple[str, str, str], list[int]] = defaultdict(list)
    own_buffers = tensors.buffers
    own_params = tensors.params

    for name in own_buffers:
        if name in source:  # persistent: the source is the truth, rank 0 included
            differs = "values differ from the source state dict"
        else:
            differs = f"values differ from rank {root}'s"
        key = ("buffer", name)
        want = _Entry(expected.digests[key], expected.shapes[key])
        for digests in gathered:
            reason = _compare(digests.buffers.get(name), want, differs)
            if reason:
                found[(name, "buffer", reason)].append(digests.global_rank)

    where = tensors.where or Placement(placed={})
    fused, unreached = set(where.fused), set(where.unreached)
    for name, param in own_params.items():
        for digests in gathered:
            got = digests.params.get(name)
            key = ("param", name, digests.global_rank)
            if name in unreached:
                reason = (
                    "no entry of the source state dict reaches it, even through the model's "
                    "load_state_dict hooks"
                )
            elif name not in source:
                reason = "not in the source state dict"
            elif got is not None and got.placements != _placements(param):
                reason = f"sharded as {got.placements}, on rank {root} as {_placements(param)}"
            elif (name, digests.global_rank) in expected.problems:
                reason = expected.problems[(name, digests.global_rank)] or None
            else:
                want = _Entry(expected.digests[key], expected.shapes[key])
                reason = _compare(got, want, _DIFFERS)
            if reason == _DIFFERS and name in fused:
                reason = _not_placed(name, where)
            if reason:
                found[(name, "param", reason)].append(digests.global_rank)

    for digests in gathered:  # tensors rank 0 does not have at all
        for kind, entries, own in (
            ("buffer", digests.buffers, own_buffers),
            ("param", digests.params, own_params),
        ):
            for name in entries.keys() - own.keys():
                found[(name, kind, f"not on rank {root}")].append(digests.global_rank)

    mismatches = tuple(
        {"name": name, "kind": kind, "ranks": sorted(ranks), "reason": reason}
        for (name, kind, reason), ranks in sorted(found.items())
    )
    checked = len(own_buffers) + len(own_params)
    return VerifyResult(ran=True, passed=not mismatches, checked=checked, mismatches=mismatches)


_DIFFERS = "values differ from the source state dict"


def _not_placed(name: str, where: Placement) -> str:
    """Why a tensor that only the model's load_state_dict hooks reach differs: the loader did
    not put it through them (a loader that pairs state-dict names with tensors leaves it as it
    was). Names the source's entries under the same module, where the hooks find them."""
    module = name.rsplit(".", 2)[0] + "."
    entries = [e for e in where.derived if e.startswith(module)] or list(where.derived)
    return (
        "not placed by the loader: it differs from what the model's load_state_dict hooks make "
        f"of the source's {name_list(entries)} (the model's state dict is rewritten by hooks; "
        "load it through them, as fsdpcheck.load_full_state_dict does)"
    )


def _compare(got: _Entry | None, want: _Entry, differs: str) -> str | None:
    if got is None:
        return "missing on this rank"
    if got.digest is None:
        return "still on meta (never materialised)"
    if got.shape != want.shape:
        return f"local shape {list(got.shape)}, expected {list(want.shape)}"
    if got.digest != want.digest:
        return differs
    return None


def _placements(param: torch.Tensor) -> tuple[str, ...] | None:
    placements = getattr(param, "placements", None)
    return tuple(str(p) for p in placements) if placements is not None else None
