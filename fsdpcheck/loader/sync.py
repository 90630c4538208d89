"""Proof of a trainer-to-rollout weight sync: per-tensor digests that are the same whether taken
from FSDP2 / tensor-parallel shards or from the whole tensors a receiver holds.

The digest is the verify checksum (:mod:`fsdpcheck.model.checksum`). It weighs each 64-bit word
by its place in the whole tensor, so each rank digests only its own shard, at the shard's offset,
and the shares add up to the checksum of the whole tensor: no gather of the weights, one small
``all_gather_object`` of the shares (a few numbers per tensor per rank) on a gloo group with a
timeout. A receiver (a rollout engine that got the weights by broadcast) digests its whole
tensors with no collective at all; :func:`compare_digests` then names what differs.
"""

from __future__ import annotations

import functools
import logging
import math
import pickle
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate

from fsdpcheck.errors import InputError, PeersTimedOut
from fsdpcheck.loader.shards import shard_of, supported
from fsdpcheck.model.checksum import Share, checksums, combine, share
from fsdpcheck.model.threads import worker_threads
from fsdpcheck.records import DigestComparison, DigestDifference, StateDigests, TensorDigest
from fsdpcheck.text import ranks_label
from fsdpcheck.vocab import SyncDifference, Verdict

log = logging.getLogger(__name__)

_UNREAD = "unread"  # a rank's entry for a shard it could not digest (meta, odd placement)
# The gloo side channels over each mesh's ranks, made once per default group, rank set and
# timeout (a sync runs every step, and each is a rendezvous), dropped with their default group.
_side: dict[Any, Any] = {}
# How many gathers this process started per rank set: its arrival mark in the default store
# (one key per rank and rank set, overwritten), read only when a gather fails.
_calls: dict[tuple[int, ...], int] = {}
_MARK = "fsdpcheck/sync/{ranks}/{rank}"


def state_digests(
    source: nn.Module | Iterable[tuple[str, torch.Tensor]],
    group: Any = None,
    *,
    timeout: float = 60.0,
) -> StateDigests:
    """Per-tensor digests (shape, dtype, value checksum) of ``source``.

    ``source``: a module (its parameters and persistent buffers: what a weight sync sends;
    non-persistent buffers such as RoPE's ``inv_freq`` are computed by each side, never sent),
    or ``(name, tensor)`` pairs (a receiver's whole tensors, or a state dict's ``items()``).
    DTensors are digested from this rank's shard and combined by position with one
    ``all_gather_object`` per mesh: by default over a gloo side channel of each DTensor's own
    mesh ranks (created with ``timeout`` on first use; only those ranks take part, so a
    receiver in the same world that holds no DTensor is never waited for), or over ``group``
    (gloo) where given, every rank of which must call. Every rank holding a shard must call,
    and every caller gets the same digests. Without a DTensor there is no collective. Ranks
    that do not come within ``timeout`` raise :class:`~fsdpcheck.errors.PeersTimedOut` on those
    waiting, naming them."""
    named = _named(source)
    whole = {name: t for name, t in named.items() if getattr(t, "placements", None) is None}
    sharded = {name: t for name, t in named.items() if name not in whole}
    digests = checksums([t.detach() for t in whole.values()])
    tensors = {
        name: TensorDigest(tuple(t.shape), str(t.dtype), digest)
        for (name, t), digest in zip(whole.items(), digests, strict=True)
    }
    if sharded:
        tensors.update(_sharded(sharded, group, timeout))
    return StateDigests(tensors={name: tensors[name] for name in named}, sharded=len(sharded))


def compare_digests(a: StateDigests, b: StateDigests) -> DigestComparison:
    """The tensors that differ between ``a`` (say, the trainer's) and ``b`` (the receiver's):
    present on one side only, another shape, another dtype, other values, or not read."""
    differences = []
    for name in sorted(a.tensors.keys() | b.tensors.keys()):
        x, y = a.tensors.get(name), b.tensors.get(name)
        found = _difference(x, y)
        if found is not None:
            differences.append(DigestDifference(name, *found))
    compared = len(a.tensors.keys() & b.tensors.keys())
    verdict = Verdict.INCONSISTENT if differences else Verdict.CONSISTENT
    return DigestComparison(verdict, compared, tuple(differences))


def _difference(
    x: TensorDigest | None, y: TensorDigest | None
) -> tuple[SyncDifference, str] | None:
    if x is None or y is None:
        side = "first" if y is None else "second"
        return SyncDifference.MISSING, f"only in the {side} digests"
    if x.shape != y.shape:
        return SyncDifference.SHAPE, f"shape {list(x.shape)} vs {list(y.shape)}"
    if x.dtype != y.dtype:  # other bytes by definition: the values cannot be compared
        return SyncDifference.DTYPE, f"dtype {x.dtype} vs {y.dtype}"
    if x.digest is None or y.digest is None:
        side = "first" if x.digest is None else "second"
        return SyncDifference.UNREAD, f"not read on the {side} side (meta, or shards missing)"
    if x.digest != y.digest:
        return SyncDifference.VALUE, f"values differ (checksum {x.digest} vs {y.digest})"
    return None


def _named(source: Any) -> dict[str, torch.Tensor]:
    if isinstance(source, nn.Module):
        transient = {
            f"{prefix}.{name}" if prefix else name
            for prefix, module in source.named_modules()
            for name in module._non_persistent_buffers_set
        }
        pairs = [
            *source.named_parameters(),
            *((n, b) for n, b in source.named_buffers() if n not in transient),
        ]
    elif isinstance(source, Mapping):
        pairs = list(source.items())
    else:
        pairs = list(source)
    named: dict[str, torch.Tensor] = {}
    for name, tensor in pairs:
        if name in named:
            raise InputError(f"state_digests: the name {name!r} is given twice")
        named[name] = tensor
    return named


def _sharded(
    sharded: dict[str, torch.Tensor], group: Any, timeout: float
) -> dict[str, TensorDigest]:
    """Each DTensor's digest from every rank's share of it (replicas counted once)."""
    # Many shards of a few MiB each: spread over the threads the checksum uses (torch frees the
    # GIL in its kernels), each shard on one thread, rather than one shard at a time.
    workers = min(worker_threads(), len(sharded))
    if workers > 1:
        with ThreadPoolExecutor(workers, thread_name_prefix="fsdpcheck-sync") as pool:
            shares = list(pool.map(_share_or_unread, sharded.items()))
    else:
        shares = [_share_or_unread(item, threads=None) for item in sharded.items()]
    mine: dict[str, Any] = dict(zip(sharded, shares, strict=True))
    result = {}
    for ranks, side, names in _batches(sharded, group, timeout):
        gathered = _gather({n: mine[n] for n in names}, ranks, side, timeout)
        result.update({name: _combined(name, sharded[name], gathered) for name in names})
    for name, tensor in sharded.items():
        if name not in result:  # on a mesh this rank is not on: its shards are not here
            log.debug("state_digests: %s lives on a mesh without this rank", name)
            result[name] = TensorDigest(tuple(tensor.shape), str(tensor.dtype), None)
    return result


def _combined(name: str, tensor: Any, gathered: list[Any]) -> TensorDigest:
    parts: dict[tuple, Share] = {}
    unread = False
    for shares in gathered:
        entry = shares.get(name, None)
        if entry == _UNREAD:
            unread = True
        elif entry is not None:
            parts.setdefault(entry[0], entry[1])  # replicas: the first rank's
    covered = sum(math.prod(count for _, count in key) for key in parts)
    shape = tuple(tensor.shape)
    digest = None
    if not unread and covered == math.prod(shape):
        digest = combine(list(parts.values()), math.prod(shape) * tensor.element_size())
    elif not unread:
        log.warning(
            "state_digests: the ranks' shards of %s cover %d of its %d elements",
            name,
            covered,
            math.prod(shape),
        )
    return TensorDigest(shape, str(tensor.dtype), digest)


def _batches(
    sharded: dict[str, Any], group: Any, timeout: float
) -> list[tuple[tuple[int, ...], Any, list[str]]]:
    """(the ranks, their gloo group or None to make one, the DTensors combined over them):
    ``group`` for all where given, else one batch per mesh this rank is on, in the order of
    their rank lists, the same order on every rank, so that overlapping meshes never wait on
    each other in a circle."""
    if group is not None:
        return [(tuple(dist.get_process_group_ranks(group)), group, list(sharded))]
    by_mesh: dict[tuple[int, ...], list[str]] = {}
    for name, tensor in sharded.items():
        ranks = tuple(sorted(int(r) for r in tensor.device_mesh.mesh.flatten().tolist()))
        by_mesh.setdefault(ranks, []).append(name)
    me = dist.get_rank()
    return [(ranks, None, names) for ranks, names in sorted(by_mesh.items()) if me in ranks]


def _gather(mine: dict[str, Any], ranks: tuple[int, ...], group: Any, timeout: float) -> list:
    """Every member's shares of ``ranks``' DTensors; a member that does not come within
    ``timeout`` (or a failed gather) is :class:`PeersTimedOut` naming who did not arrive."""
    label = ",".join(map(str, ranks))
    count = _calls[ranks] = _calls.get(ranks, 0) + 1
    store = _store()
    if store is not None:
        store.set(_MARK.format(ranks=label, rank=dist.get_rank()), str(count))
    try:
        if group is None:
            gathered = _all_gather_object(_side_channel(ranks, timeout), mine, len(ranks))
        else:
            gathered = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, mine, group=group)
    except Exception as exc:  # a timeout, a vanished peer: named, never a raw store error
        log.warning("state_digests: the gather over ranks %s failed", label, exc_info=True)
        silent = _silent(store, ranks, label, count)
        who = f"{ranks_label(silent)} did not call" if silent else "the gather failed"
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise PeersTimedOut(
            f"state_digests: {who} within {timeout:g} s, of ranks {label}, which hold these "
            "DTensors' shards: every one of them must call state_digests (pass group= to "
            f"combine over another group) ({type(exc).__name__}: {first})",
            silent,
        ) from exc
    return gathered


def _store() -> Any | None:
    """The default group's store, where the arrival marks go (None: this torch hides it)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # a private API: without it the marks are skipped, never the gather
        log.debug("no default store for state_digests' arrival marks", exc_info=True)
        return None


def _silent(store: Any, ranks: tuple[int, ...], label: str, count: int) -> tuple[int, ...]:
    """The members whose arrival mark is behind this rank's ``count`` (or absent)."""
    if store is None:
        return ()
    silent = []
    try:
        for rank in ranks:
            key = _MARK.format(ranks=label, rank=rank)
            if not store.check([key]) or int(store.get(key)) < count:
                silent.append(rank)
    except Exception:  # the store itself is gone: nobody can be named
        log.debug("state_digests: arrival marks not read", exc_info=True)
        return ()
    return tuple(silent)


def _share_or_unread(item: tuple[str, Any], threads: int | None = 1) -> Any:
    name, tensor = item
    try:
        return _share_of(tensor, threads)
    except Exception:  # a shard this code cannot place: unread, never a guess
        log.warning("state_digests: could not digest %s's shard", name, exc_info=True)
        return _UNREAD


def _share_of(tensor: Any, threads: int | None) -> tuple[tuple, Share] | str | None:
    """(where this rank's shard sits, its share), or None where this rank holds none of it."""
    local = tensor.to_local()
    if local.is_meta:
        return _UNREAD
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    placements = tuple(tensor.placements)
    if not all(supported(p) for p in placements):
        return _UNREAD
    layout = _layout(tuple(tensor.shape), placements, tuple(mesh.shape), tuple(coordinate))
    local_shape, key, starts, lengths = layout
    if local_shape != tuple(local.shape):
        log.warning(
            "state_digests: local shard %s, placements %s give %s",
            list(local.shape),
            placements,
            list(local_shape),
        )
        return _UNREAD
    if not local.numel():
        return None
    return key, share(local.detach(), starts, lengths, threads=threads)


@functools.lru_cache(maxsize=4096)
def _layout(
    shape: tuple[int, ...], placements: tuple, mesh_shape: tuple, coordinate: tuple
) -> tuple[tuple[int, ...], tuple, tuple[int, ...], tuple[int, ...]]:
    """(the shard's shape, the key naming its region, its runs' starts and lengths): the same
    for every step of a training run, so a sync that runs each step works it out once per
    layout."""
    index = [_dim_index(shape, d, placements, mesh_shape, coordinate) for d in range(len(shape))]
    local_shape = tuple(len(i) for i in index)
    if not math.prod(local_shape):
        return local_shape, (), (), ()
    starts, lengths = _runs(shape, index)
    # The key names the region: regions of one DTensor are equal (replicas) or disjoint in
    # some dim, where their first indices then differ.
    key = tuple((int(i[0]), len(i)) for i in index)
    return local_shape, key, tuple(starts), tuple(lengths)


def _dim_index(
    shape: tuple[int, ...], dim: int, placements: tuple, mesh_shape: tuple, coordinate: list
) -> torch.Tensor:
    """The whole tensor's indices along ``dim`` that this rank's shard holds, in order: the
    cuts of ``dim`` alone (cuts of different dims commute) applied to ``arange``."""
    ndim = len(shape)
    only = tuple(
        p if not isinstance(p, Replicate) and p.dim % ndim == dim else Replicate()
        for p in placements
    )
    view = [1] * ndim
    view[dim] = shape[dim]
    base = torch.arange(shape[dim]).view(view)
    return shard_of(base, only, mesh_shape, coordinate).reshape(-1)


def _runs(shape: tuple[int, ...], index: list[torch.Tensor]) -> tuple[list[int], list[int]]:
    """The shard's elements as runs contiguous in the whole tensor: (start, length) each, in
    the shard's own row-major order. A shard of dim 0 is one run."""
    if not shape:
        return [0], [1]
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    partial = [d for d in range(len(shape)) if not torch.equal(index[d], torch.arange(shape[d]))]
    if not partial:
        return [0], [math.prod(shape)]
    last = partial[-1]
    along = index[last]
    cuts = ((along[1:] - along[:-1]) != 1).nonzero().reshape(-1) + 1
    bounds = torch.cat([torch.tensor([0]), cuts, torch.tensor([len(along)])])
    first, length = along[bounds[:-1]], bounds[1:] - bounds[:-1]
    base = torch.zeros(1, dtype=torch.int64)
    for d in range(last):
        base = (base[:, None] + index[d][None, :] * strides[d]).reshape(-1)
    starts = (base[:, None] + first[None, :] * strides[last]).reshape(-1)
    lengths = (length * strides[last]).repeat(len(base))
    return starts.tolist(), lengths.tolist()


def _side_channel(ranks: tuple[int, ...], timeout: float) -> Any:
    """A gloo group of ``ranks`` alone, rendezvoused in the default store under a name of its
    own: a rank outside every mesh, such as a rollout receiver in the same world, never has to
    call. Not ``new_group(use_local_synchronization=True)``: its name hashes how many groups
    each member already has, and a trainer that also shares a group with the receiver has one
    more than its peers (measured, torch 2.13: the members wait for each other under two
    names until the timeout). Each attempt rendezvouses under its own name, so the keys of one
    that timed out are never read by the next; a rank that raised :class:`PeersTimedOut` is
    one attempt ahead of a peer that never came, and they do not meet again in this default
    group: like any stuck peer, the error is the end of the job, not a step to retry."""
    world = dist.group.WORLD
    if _side.get("world") is not world:  # a new default group: the old groups went with it
        _side.clear()
        _side["world"] = world
    key = (ranks, timeout)
    if key not in _side:
        attempt = _side[("attempts", key)] = _side.get(("attempts", key), 0) + 1
        label = ",".join(map(str, ranks))
        prefix = f"fsdpcheck/sync-group/{label}/{timeout:g}/{attempt}/"
        store = dist.PrefixStore(prefix, dist.distributed_c10d._get_default_store())
        _side[key] = dist.ProcessGroupGloo(
            store, ranks.index(dist.get_rank()), len(ranks), timedelta(seconds=timeout)
        )
    return _side[key]


def _all_gather_object(group: Any, obj: Any, size: int) -> list[Any]:
    """``dist.all_gather_object`` on a group no registry knows (:func:`_side_channel`):
    the pickled lengths, then the bytes padded to the longest."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    group.allgather([lengths], [torch.tensor([data.numel()], dtype=torch.int64)]).wait()
    longest = max(int(n) for n in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    out = [torch.empty(longest, dtype=torch.uint8) for _ in range(size)]
    group.allgather([out], [padded]).wait()
    return [pickle.loads(o[: int(n)].numpy().tobytes()) for o, n in zip(out, lengths, strict=True)]
