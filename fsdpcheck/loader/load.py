"""A safe loader for an FSDP2-sharded model: what a training script calls in place of verl's or
accelerate's full-state-dict loader.

Before a single byte moves, every rank shows that it holds the same state-dict entries and
non-persistent buffers (names, shapes, dtypes); any difference is raised on every rank, never a
hang and never a partial load. Tensors are then always paired by rank 0's names, never by
position:

- Parameters and persistent buffers (the state dict), by default ``method="bucketed"``: rank 0
  cuts each rank's own shards (``torch.chunk`` slices, as FSDP2 and DTensor shard, uneven shards
  included) out of its full state dict in sorted-name order and sends every rank only its own,
  point-to-point over gloo (1/world of the data per receiver on a 1-D mesh): a shard of 1 MiB or
  more travels alone, straight from the source tensor into the receiver's local shard when both
  are contiguous in the model's dtype (else through a staging buffer that converts the dtype);
  smaller ones travel packed in flat buckets. No message exceeds ``bucket_bytes``, and a rank
  holds at most two staging buffers of that size, which bounds the extra memory. The messages
  are derived from what every rank has shown to agree on (names, shapes, dtypes, placements,
  meshes, tied weights, ``bucket_bytes``); where anything the bucketed path does not cover turns
  up on any rank, every rank falls back to ``method="dcp"`` together and :class:`LoadResult`
  says why.
- ``method="dcp"``: ``set_model_state_dict(..., full_state_dict=True, broadcast_from_rank0=True)``,
  one broadcast per tensor of the full tensor.
- Non-persistent buffers, which no state dict carries, are broadcast by sorted name, one flat
  tensor per dtype (small ones ride with the check itself: one collective in all).

The checks live in :mod:`fsdpcheck.loader.agree`, the bucketed transfer in
:mod:`fsdpcheck.loader.transfer`; this module puts them together.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, replace
from operator import itemgetter
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    set_model_state_dict,
)

from fsdpcheck.distributed.wire import transport_device
from fsdpcheck.errors import InputError
from fsdpcheck.loader.agree import (
    Agreement,
    BufferMismatchError,
    Exchange,
    Layout,
    StateDictMismatchError,
    agree,
    check_landing,
    inline_capacity_for,
    local_layout,
    member_ranks,
    post_check,
    raise_if_any_failed,
)
from fsdpcheck.loader.names import own_tensors, through_hooks_source
from fsdpcheck.loader.transfer import (
    Prefault,
    Transfer,
    aligned,
    bucketed_info,
    choose_method,
)
from fsdpcheck.model.fingerprint import non_persistent_buffers
from fsdpcheck.text import int_ranges, name_list
from fsdpcheck.vocab import LoadMethod

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "METHODS",
    "BufferBroadcast",
    "BufferMismatchError",
    "LoadResult",
    "StateDictMismatchError",
    "broadcast_buffers",
    "load_full_state_dict",
]

METHODS = ("bucketed", "dcp")
DEFAULT_BUCKET_BYTES = 256 * 2**20
MIN_BUCKET_BYTES = 1024


@dataclass(frozen=True)
class BufferBroadcast:
    """What :func:`broadcast_buffers` moved on this rank."""

    names: tuple[str, ...]  # in the (sorted) order they were packed
    dtypes: tuple[str, ...]  # one flat tensor per dtype, in this order
    broadcasts: int  # flat broadcasts after the check; 0 when the values came with it
    collectives: int  # issued by fsdpcheck: layout exchange(s) plus the broadcasts
    bytes: int
    inline: bool = False  # the values travelled with the layout check, in the same collective


@dataclass(frozen=True)
class LoadResult:
    """What :func:`load_full_state_dict` did on this rank."""

    params_loaded: int  # state-dict entries (parameters and persistent buffers)
    buffers_broadcast: int
    buffer_broadcasts: int  # flat broadcasts: one per buffer dtype, however many buffers
    # fsdpcheck's checks and buffer broadcasts (2 checks + the broadcasts); the state dict's own
    # transfer is counted apart: `state_messages` (bucketed) or not at all (DCP's collectives).
    collectives: int
    dtypes: tuple[str, ...]  # of the buffer broadcasts, in order
    materialised: bool  # this rank held meta tensors and got storage via to_empty()
    method: str = "dcp"  # how the state dict moved: "bucketed" or "dcp"
    fallback_reason: str | None = None  # why "bucketed" was asked for and "dcp" was used
    state_messages: int = 0  # bucketed: buckets this rank sent (rank 0) or received
    state_bytes: int = 0  # bucketed: bytes of them on the wire
    bucket_bytes: int = 0  # bucketed: this rank's largest message (at most the bucket_bytes asked)
    # state-dict entries that are no tensor of the model (its state-dict hooks make them, as
    # torchtitan's fused wqkv is saved as wq/wk/wv), placed through its load_state_dict pre-hooks
    through_hooks: int = 0


def load_full_state_dict(
    model: nn.Module,
    full_state_dict_on_rank0: Mapping[str, torch.Tensor] | None,
    *,
    group: Any = None,
    cpu_offload: bool = False,
    method: str = "bucketed",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> LoadResult:
    """Load rank 0's full state dict into a ``fully_shard``-ed model; collective, every rank calls.

    Checks first (layouts over ``group``), then materialises meta ranks, moves parameters and
    persistent buffers (``method``: ``"bucketed"``, falling back to ``"dcp"`` where it must, or
    ``"dcp"``), then broadcasts non-persistent buffers from rank 0 by name. ``bucket_bytes``
    bounds one bucket of the bucketed path; every rank must pass the same ``method`` and
    ``bucket_bytes`` (a rank that differs sends everyone down the DCP path, and says so).
    ``cpu_offload`` is passed to DCP; the bucketed path writes shards wherever they live.
    """
    if method not in METHODS:
        raise InputError(f"load_full_state_dict: method={method!r}; choose one of {METHODS}.")
    if int(bucket_bytes) < MIN_BUCKET_BYTES:
        raise InputError(
            f"load_full_state_dict: bucket_bytes={bucket_bytes} is below {MIN_BUCKET_BYTES}."
        )
    ranks = member_ranks(group)
    if 0 not in ranks:
        raise InputError(
            "load_full_state_dict: `group` must contain global rank 0, which holds the full "
            f"state dict; it holds ranks {int_ranges(ranks)}."
        )
    rank = dist.get_rank()
    source = dict(full_state_dict_on_rank0) if full_state_dict_on_rank0 is not None else None
    mine = local_layout(model, rank, src=0, source=source if rank == 0 else None, with_state=True)
    where = mine.placement
    fast = None
    if method == LoadMethod.BUCKETED:
        fast = bucketed_info(model, rank, ranks, group, int(bucket_bytes), where)
    shared = fast.shared() if fast is not None else None
    agreed = agree(mine, src=0, group=group, ranks=ranks, fast=shared)
    layout, collectives = agreed.layout, agreed.collectives
    chosen, reason = choose_method(method, agreed.bucketed, ranks)

    failure, materialised = None, False
    messages = moved_bytes = biggest = 0
    if rank == 0 and where is not None and where.fused:
        try:  # the entries the model's state-dict hooks derived, as its load hooks place them
            source = through_hooks_source(where, model, source or {})
        except Exception as exc:  # this rank still takes part in the transfer, then says so
            log.debug("rank 0: the model's load_state_dict pre-hooks failed", exc_info=True)
            failure = (
                f"rank 0: the model's load_state_dict pre-hooks failed on the full state dict's "
                f"{name_list(list(where.derived))}: {type(exc).__name__}: {exc}"
            )
    if chosen == LoadMethod.BUCKETED:
        try:
            materialised = materialise(model)
        except Exception as exc:  # this rank still takes part in the transfer, then says so
            log.debug("rank %d: materialising failed", rank, exc_info=True)
            failure = failure or f"rank {rank}: materialising failed: {type(exc).__name__}: {exc}"
        transfer = Transfer(model, fast.specs, ranks, group, int(bucket_bytes), where)
        moved = transfer.run(
            source if rank == 0 else None, write=failure is None, fresh=materialised
        )
        messages, moved_bytes, biggest = moved.messages, moved.bytes, moved.largest
        failure = failure or moved.failure
    else:
        # set_model_state_dict writes rank 0's local shards back into the dict it is given, so
        # it gets a copy: the caller's source stays intact (verify_load compares against it).
        payload = source if rank == 0 and source is not None else {}
        options = StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True, cpu_offload=cpu_offload
        )
        try:
            materialised = materialise(model)
            set_model_state_dict(model, payload, options=options)
        except Exception as exc:  # reported to every rank below instead of stranding them
            log.debug("rank %d: set_model_state_dict failed", rank, exc_info=True)
            failure = failure or f"rank {rank}: loading failed: {type(exc).__name__}: {exc}"
    raise_if_any_failed(failure, group, ranks)
    collectives += 1

    moved = _broadcast_flat(model, layout, src=0, group=group)
    return LoadResult(
        params_loaded=len(mine.state),
        buffers_broadcast=len(moved.names),
        buffer_broadcasts=moved.broadcasts,
        collectives=collectives + moved.broadcasts,
        dtypes=moved.dtypes,
        materialised=materialised,
        method=chosen,
        fallback_reason=reason,
        state_messages=messages,
        state_bytes=moved_bytes,
        bucket_bytes=biggest,
        through_hooks=len(where.derived) if where is not None else 0,
    )


def broadcast_buffers(model: nn.Module, *, src: int = 0, group: Any = None) -> BufferBroadcast:
    """Broadcast non-persistent buffers from global rank ``src`` by sorted name, one flat tensor
    per dtype, after checking that every rank holds the same names, shapes and dtypes."""
    ranks = member_ranks(group)
    if src not in ranks:
        raise InputError(
            f"broadcast_buffers: src={src} is not in `group` (ranks {int_ranges(ranks)})."
        )
    mine, agreed, packing = _check_buffers(model, src=src, group=group, ranks=ranks)
    # The layouts agreed, so every rank's own grouping of its buffers is the one to unpack into.
    moved = _broadcast_flat(
        model,
        agreed.layout,
        src=src,
        group=group,
        named=mine.named,
        inline=agreed.inline,
        packing=packing,
    )
    return replace(moved, collectives=agreed.collectives + moved.broadcasts)


@dataclass(frozen=True)
class _Packing:
    """A rank's buffers grouped for the wire, worked out before the check's round: per dtype
    (sorted), the buffers, their numels, and views of where ``src``'s values land (None on
    ``src``, or where they do not ride along with the check)."""

    groups: list[tuple[str, list[torch.Tensor]]]
    sizes: list[list[int]]
    sources: list[list[torch.Tensor]] | None = None

    @classmethod
    def of(cls, named: Mapping[str, torch.Tensor], layout: Layout) -> _Packing:
        """The buffers of ``layout`` by dtype (:func:`_by_dtype`), with their numels."""
        groups = _by_dtype(named, layout)
        return cls(groups, [[b.numel() for b in bs] for _, bs in groups])

    def nbytes(self, index: int) -> int:
        return sum(self.sizes[index]) * self.groups[index][1][0].element_size()


def _check_buffers(
    model: nn.Module, *, src: int, group: Any, ranks: list[int]
) -> tuple[Exchange, Agreement, _Packing | None]:
    """:func:`broadcast_buffers`' check: this rank's layout, the agreement (``src``'s packed
    values riding with it where they fit), and its packing (None where its layout has
    problems; without ``sources`` where the values did not ride along)."""
    rank = dist.get_rank()
    # The ranks below this one in the check's tree send their words as soon as they have them.
    posted = post_check(group, ranks, src)
    mine = local_layout(model, rank, src=src, source=None, with_state=False)
    capacity = inline_capacity_for(len(ranks))
    landing, place = check_landing(capacity)
    payload = packing = None
    if not mine.problems:
        try:  # packed before the check: when the layouts agree, the values arrive with it
            packing = _Packing.of(mine.named, mine.buffers)
            if rank == src:
                payload = _inline_payload(packing, capacity, into=place)
            else:  # where each buffer's values will land, laid out while rank src packs
                packing = replace(packing, sources=_inline_sources(packing, place))
        except Exception:  # too big or unpackable here: the separate broadcast moves them
            log.debug("buffers not packed inline (capacity %d bytes)", capacity, exc_info=True)
            payload = None  # packing, where made, has no sources: they were set last
    agreed = agree(
        mine,
        src=src,
        group=group,
        ranks=ranks,
        inline=payload,
        inline_capacity=capacity,
        landing=landing,
        posted=posted,
    )
    if packing is not None and agreed.inline is None:
        packing = replace(packing, sources=None)
    return mine, agreed, packing


def materialise(model: nn.Module) -> bool:
    """Give meta tensors real (uninitialised) storage; ranks without meta tensors are untouched."""
    tensors = [*model.parameters(), *model.buffers()]
    if not any(t.is_meta for t in tensors):
        return False
    # to_empty() replaces every tensor, real ones too. Parameters and persistent buffers are
    # reloaded next, but real non-persistent buffers (rank 0's, the broadcast's source) are not:
    # keep their values across it.
    named = dict(model.named_buffers())
    kept = {
        name: named[name].detach().clone()
        for name in non_persistent_buffers(model)
        if name in named and not named[name].is_meta
    }
    model.to_empty(device=_model_device(model))
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name in kept:
                buf.copy_(kept[name])
    return True


def receive_ahead(model: nn.Module) -> Prefault | None:
    """On a rank that will receive its shards (rank-0 loading) but holds them on meta: give
    them memory now and fault it in on a thread while the rank has nothing else to do (the
    audit: waiting for rank 0 to build and wrap the full model), as a trainer's ranks allocate
    theirs while rank 0 reads its weights; :func:`load_full_state_dict` then finds nothing on
    meta and receives into mapped pages. Call :meth:`Prefault.before_receives` before the load
    and :meth:`Prefault.stop` after it. None where nothing was on meta."""
    if not materialise(model):
        return None
    shards, seen = [], set()
    # What the transfer receives into, in its order (by name), tied tensors once. Not through
    # state_dict(): its hooks may run collectives (a fused wqkv redistributed) that rank 0,
    # still building, would never join.
    for _, tensor in sorted(own_tensors(model).values(), key=lambda item: item[0]):
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if not isinstance(local, torch.Tensor) or not local.is_contiguous() or not local.numel():
            continue
        if local.data_ptr() not in seen:
            seen.add(local.data_ptr())
            shards.append(local.detach())
    prefault = Prefault(shards)
    prefault.start(ahead=True)
    return prefault


def _model_device(model: nn.Module) -> torch.device:
    for param in model.parameters():
        mesh = getattr(param, "device_mesh", None)
        if mesh is not None and mesh.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        if mesh is not None:
            return torch.device(mesh.device_type)
    return torch.device("cpu")


def _by_dtype(
    named: Mapping[str, torch.Tensor], layout: Layout
) -> list[tuple[str, list[torch.Tensor]]]:
    """The buffers of ``layout`` in one list per dtype, dtypes sorted; empty ones left out."""
    by_dtype: dict[str, list[torch.Tensor]] = defaultdict(list)
    for name, shape, dtype in layout:
        if 0 not in shape:
            by_dtype[dtype].append(named[name])
    return [(dtype, by_dtype[dtype]) for dtype in sorted(by_dtype)]


def _pack_flat(buffers: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    # One cat of the buffers' flat views; 1-D ones as they are (most buffers, such as RoPE's
    # inv_freq, are): a Python-side view() per buffer costs more than the copy of its values.
    try:
        flat = torch.cat([b if b.dim() == 1 else b.reshape(-1) for b in buffers])
    except RuntimeError:  # buffers on several devices
        log.debug("buffers on several devices: packed one by one", exc_info=True)
        flat = torch.cat([b.reshape(-1).to(device) for b in buffers])
    return flat.to(device)


def _unpack_flat(
    flat: torch.Tensor, buffers: list[torch.Tensor], sizes: list[int] | None = None
) -> None:
    _copy_into(buffers, _views(flat, buffers, sizes or [b.numel() for b in buffers]))


def _views(flat: torch.Tensor, buffers: list[torch.Tensor], sizes: list[int]) -> list[torch.Tensor]:
    """``flat`` cut into views shaped as ``buffers`` (``sizes``: their numels): one split, and a
    view() only for buffers that are not 1-D."""
    parts = flat.split(sizes)
    return [p if b.dim() == 1 else p.view(b.shape) for p, b in zip(parts, buffers, strict=True)]


def _copy_into(buffers: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    try:  # one C++ call; asking every buffer for its device first costs as much again
        torch._foreach_copy_(buffers, sources)
        return
    except RuntimeError:  # should a torch refuse a mix of devices here: one copy_ each (copies
        pass  # are idempotent, so what the foreach call wrote before failing does no harm)
        log.debug("foreach copy refused: unpacked one by one", exc_info=True)
    for buf, source in zip(buffers, sources, strict=True):
        buf.copy_(source)


def _inline_payload(
    packing: _Packing, capacity: int, *, into: torch.Tensor | None = None
) -> torch.Tensor | None:
    """Every dtype's packed buffers as bytes (uint8, on the host; at the start of ``into``
    where given), each starting at an ``_ALIGN`` multiple; None past ``capacity``."""
    sizes = [packing.nbytes(i) for i in range(len(packing.groups))]
    need = sum(aligned(n) for n in sizes)
    if need > capacity:
        return None
    payload = torch.zeros(need, dtype=torch.uint8) if into is None else into[:need]
    offset = 0
    for (_, buffers), nbytes in zip(packing.groups, sizes, strict=True):
        into = payload[offset : offset + nbytes].view(buffers[0].dtype)
        try:  # packed where it is sent from: no flat tensor in between
            torch.cat([b if b.dim() == 1 else b.reshape(-1) for b in buffers], out=into)
        except RuntimeError:  # buffers off the host, or on several devices
            log.debug("buffers not packed in place", exc_info=True)
            into.copy_(_pack_flat(buffers, torch.device("cpu")))
        offset += aligned(nbytes)
    return payload


def _inline_sources(packing: _Packing, place: torch.Tensor) -> list[list[torch.Tensor]] | None:
    """Per dtype, views of ``place`` (uint8) where each buffer's values land when ``src``'s
    inline payload arrives there, laid out as :func:`_inline_payload` packs them; None where
    they would not fit."""
    sources, offset = [], 0
    for index, (_, buffers) in enumerate(packing.groups):
        sizes = packing.sizes[index]
        nbytes = packing.nbytes(index)
        if offset + nbytes > place.numel():
            return None
        flat = place[offset : offset + nbytes].view(buffers[0].dtype)
        sources.append(_views(flat, buffers, sizes))
        offset += aligned(nbytes)
    return sources


def _broadcast_flat(
    model: nn.Module,
    layout: Layout,
    *,
    src: int,
    group: Any,
    named: Mapping[str, torch.Tensor] | None = None,
    inline: torch.Tensor | None = None,
    packing: _Packing | None = None,
) -> BufferBroadcast:
    """One broadcast per dtype, buffers packed in name order; every rank holds ``layout``.
    ``named``: the buffers, when nothing can have replaced them since they were described.
    ``inline``: the packed values (uint8), already received with the check: nothing left to
    send; they are unpacked from where they landed.
    ``packing``: the buffers grouped as ``layout`` groups them, when the caller has them
    already, with views of where ``inline`` landed."""
    if packing is None:
        if named is None:
            named = non_persistent_buffers(model)  # after to_empty(): the new tensors
        packing = _Packing.of(named, layout)
    groups, sources = packing.groups, packing.sources
    is_src = dist.get_rank() == src
    device = None
    sent = broadcasts = offset = 0
    with torch.no_grad():
        for index, (_, buffers) in enumerate(groups):
            nbytes = packing.nbytes(index)
            if inline is not None and sources is not None:
                if not is_src:
                    _copy_into(buffers, sources[index])
                sent += nbytes
                continue
            sizes = packing.sizes[index]
            count = sum(sizes)
            if inline is not None:
                if not is_src:  # a view: the offsets are _ALIGN multiples of an int64 tensor
                    flat = inline[offset : offset + nbytes].view(buffers[0].dtype)
                    _unpack_flat(flat, buffers, sizes)
                offset += aligned(nbytes)
                sent += nbytes
                continue
            if device is None:
                device = transport_device(group)
            if is_src:
                flat = _pack_flat(buffers, device)
            else:
                flat = torch.empty(count, dtype=buffers[0].dtype, device=device)
            # Raw bytes on the wire: any dtype (bool, bfloat16, float8) travels over gloo.
            dist.broadcast(flat.view(torch.uint8), src=src, group=group)
            broadcasts += 1
            sent += nbytes
            if not is_src:
                _unpack_flat(flat, buffers, sizes)
    return BufferBroadcast(
        names=tuple(map(itemgetter(0), layout)),
        dtypes=tuple(dtype for dtype, _ in groups),
        broadcasts=broadcasts,
        collectives=broadcasts,
        bytes=sent,
        inline=inline is not None,
    )
