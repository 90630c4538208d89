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
  tensor per dtype.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from fsdpcheck.distributed import exchange_slots
from fsdpcheck.errors import FsdpcheckError, InputError
from fsdpcheck.fingerprint import dtype_name, non_persistent_buffer_names
from fsdpcheck.records import short_digest

# (name, shape, dtype): what must agree across ranks before a tensor may be paired by name.
Layout = tuple[tuple[str, tuple[int, ...], str], ...]

METHODS = ("bucketed", "dcp")
DEFAULT_BUCKET_BYTES = 256 * 2**20
MIN_BUCKET_BYTES = 1024
_ALIGN = 16  # every piece starts at a multiple of this in its bucket, so any dtype can view it
_DIRECT_BYTES = 2**20  # a shard at least this big travels alone, straight from/into the tensor
_STAGING = 2  # staging buffers per rank: one on the wire while the other is packed or unpacked
_WINDOW = 8  # messages a rank keeps posted ahead of the one it is finishing


class BufferMismatchError(FsdpcheckError):
    """Ranks disagree on their non-persistent buffers; raised on every rank, nothing moved."""

    def __init__(self, message: str, differences: Iterable[str] = ()):
        super().__init__(message)
        self.differences = tuple(differences)


class StateDictMismatchError(FsdpcheckError):
    """Ranks (or rank 0's source) disagree on the state dict; raised on every rank."""

    def __init__(self, message: str, differences: Iterable[str] = ()):
        super().__init__(message)
        self.differences = tuple(differences)


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


@dataclass(frozen=True)
class _Exchange:
    """One rank's entry in the layout exchange."""

    global_rank: int
    buffers: Layout
    state: Layout
    problems: tuple[str, ...]
    # This rank's non-persistent buffers as described; local only, never sent.
    named: Mapping[str, torch.Tensor] | None = field(default=None, compare=False, repr=False)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "named": None}  # the slow path pickles it: layouts only

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


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
class _Fast:
    """One rank's entry for the bucketed path in the layout exchange."""

    digest: str  # of everything the transfer layout derives from; every rank must agree
    reason: str | None  # why this rank cannot take the bucketed path
    specs: tuple[_Spec, ...] = ()  # kept on this rank, never sent (see _Fast.shared)

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
    ranks = _group_ranks(group)
    if 0 not in ranks:
        raise InputError(
            "load_full_state_dict: `group` must contain global rank 0, which holds the full "
            f"state dict; it holds ranks {_compact(ranks)}."
        )
    rank = dist.get_rank()
    source = dict(full_state_dict_on_rank0) if full_state_dict_on_rank0 is not None else None
    mine = _describe(model, rank, src=0, source=source if rank == 0 else None, with_state=True)
    fast = None
    if method == "bucketed":
        fast = _fast_info(model, rank, ranks, group, int(bucket_bytes))
    shared = fast.shared() if fast is not None else None
    layout, collectives, fasts, _ = _agree(mine, src=0, group=group, ranks=ranks, fast=shared)
    chosen, reason = _choose(method, fasts, ranks)

    failure, materialised = None, False
    messages = moved_bytes = biggest = 0
    if chosen == "bucketed":
        try:
            materialised = _materialise(model)
        except Exception as exc:  # this rank still takes part in the transfer, then says so
            failure = f"rank {rank}: materialising failed: {type(exc).__name__}: {exc}"
        transfer = _Transfer(model, fast.specs, ranks, group, int(bucket_bytes))
        messages, moved_bytes, biggest, problem = transfer.run(
            source if rank == 0 else None, write=failure is None
        )
        failure = failure or problem
    else:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        # set_model_state_dict writes rank 0's local shards back into the dict it is given, so
        # it gets a copy: the caller's source stays intact (verify_load compares against it).
        payload = source if rank == 0 and source is not None else {}
        options = StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True, cpu_offload=cpu_offload
        )
        try:
            materialised = _materialise(model)
            set_model_state_dict(model, payload, options=options)
        except Exception as exc:  # reported to every rank below instead of stranding them
            failure = f"rank {rank}: loading failed: {type(exc).__name__}: {exc}"
    _raise_if_any_failed(failure, group, ranks)
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
    )


def broadcast_buffers(model: nn.Module, *, src: int = 0, group: Any = None) -> BufferBroadcast:
    """Broadcast non-persistent buffers from global rank ``src`` by sorted name, one flat tensor
    per dtype, after checking that every rank holds the same names, shapes and dtypes."""
    ranks = _group_ranks(group)
    if src not in ranks:
        raise InputError(
            f"broadcast_buffers: src={src} is not in `group` (ranks {_compact(ranks)})."
        )
    rank = dist.get_rank()
    mine = _describe(model, rank, src=src, source=None, with_state=False)
    capacity = _inline_capacity(len(ranks))
    payload = None
    if rank == src and not mine.problems:
        try:  # packed before the check: when the layouts agree, the values arrive with it
            payload = _inline_payload(_by_dtype(mine.named, mine.buffers), capacity)
        except Exception:  # too big or unpackable here: the separate broadcast moves them
            payload = None
    layout, collectives, _, inline = _agree(
        mine, src=src, group=group, ranks=ranks, inline=payload, inline_capacity=capacity
    )
    moved = _broadcast_flat(model, layout, src=src, group=group, named=mine.named, inline=inline)
    return BufferBroadcast(
        names=moved.names,
        dtypes=moved.dtypes,
        broadcasts=moved.broadcasts,
        collectives=collectives + moved.broadcasts,
        bytes=moved.bytes,
        inline=moved.inline,
    )


# --- describing and agreeing -------------------------------------------------------------------


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _tensor_layout(name: str, tensor: torch.Tensor) -> tuple[str, tuple[int, ...], str]:
    # DTensor.shape is the global shape, which is what must agree across ranks.
    dtype = tensor.dtype
    named = _DTYPE_NAMES.get(dtype)
    if named is None:
        named = _DTYPE_NAMES[dtype] = dtype_name(dtype)
    return (name, tuple(tensor.shape), named)


def _non_persistent(model: nn.Module) -> dict[str, torch.Tensor]:
    """Non-persistent buffers by name, as ``named_buffers()`` names them, in one pass."""
    found: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        skip = module._non_persistent_buffers_set
        for name, buf in module._buffers.items():
            if buf is None or id(buf) in seen:
                continue
            seen.add(id(buf))  # shared tensors: the first name only, as named_buffers() does
            if name in skip:
                found[f"{prefix}.{name}" if prefix else name] = buf
    return found


def _describe(
    model: nn.Module,
    rank: int,
    *,
    src: int,
    source: dict[str, torch.Tensor] | None,
    with_state: bool,
) -> _Exchange:
    """This rank's layouts and local problems; never raises, so it always joins the exchange."""
    problems: list[str] = []
    buffers: Layout = ()
    state: Layout = ()
    named: dict[str, torch.Tensor] | None = None
    try:
        named = _non_persistent(model)
        buffers = tuple(sorted(_tensor_layout(n, t) for n, t in named.items()))
        if rank == src:
            on_meta = sorted(n for n, t in named.items() if t.is_meta)
            if on_meta:
                problems.append(
                    f"rank {rank} (the source) holds non-persistent buffers on meta "
                    f"({_names(on_meta)}): it has no values to broadcast; build it with real "
                    "tensors."
                )
        if with_state:
            local = model.state_dict(keep_vars=True)
            state = tuple(sorted(_tensor_layout(k, v) for k, v in local.items()))
            if rank == src:
                problems.extend(_source_problems(rank, state, source))
    except Exception as exc:  # a local failure must reach the others, not strand them
        problems.append(f"rank {rank} could not describe its model: {type(exc).__name__}: {exc}")
    return _Exchange(rank, buffers, state, tuple(problems), named)


def _source_problems(rank: int, state: Layout, source: dict[str, torch.Tensor] | None) -> list[str]:
    if source is None:
        return [f"rank {rank} was given no full state dict (None); pass rank 0's full state dict."]
    expected = {name: shape for name, shape, _ in state}
    given = {k: tuple(v.shape) for k, v in source.items() if torch.is_tensor(v)}
    problems = []
    if missing := sorted(set(expected) - set(given)):
        problems.append(f"rank {rank}'s full state dict lacks {_names(missing)}")
    if extra := sorted(set(given) - set(expected)):
        problems.append(f"rank {rank}'s full state dict has keys the model lacks: {_names(extra)}")
    for name in sorted(set(expected) & set(given)):
        if expected[name] != given[name]:
            problems.append(
                f"rank {rank}'s full state dict has {name} with shape {list(given[name])}, "
                f"the model {list(expected[name])}"
            )
    return problems


_PROBLEMS, _NO_FAST, _FAST_REASON, _INLINE = 1, 2, 4, 8  # flags: first byte of a slot
_DIGEST = 16
# The buffers' values ride along with the check (one round, not two) when they fit in this
# much; rank 0 then sends at most about 1 MiB in all, whatever the world size.
_INLINE_MAX, _INLINE_MIN, _INLINE_TOTAL = 64 * 2**10, 4 * 2**10, 2**20


def _inline_capacity(world_size: int) -> int:
    return max(_INLINE_MIN, min(_INLINE_MAX, _INLINE_TOTAL // max(world_size, 1)))


def _slot(mine: _Exchange, fast: tuple[str, str | None] | None, inline: bool = False) -> bytes:
    """This rank's fixed-size entry: flags, then digests of its buffers, state and fast layout."""
    flags = _PROBLEMS if mine.problems else 0
    if inline:
        flags |= _INLINE
    if fast is None:
        flags |= _NO_FAST
    elif fast[1]:
        flags |= _FAST_REASON
    fast_digest = fast[0] if fast is not None and fast[0] else "00" * _DIGEST
    return (
        bytes([flags])
        + bytes.fromhex(short_digest(repr(mine.buffers), size=_DIGEST))
        + bytes.fromhex(short_digest(repr(mine.state), size=_DIGEST))
        + bytes.fromhex(fast_digest)
    )


def _agree(
    mine: _Exchange,
    *,
    src: int,
    group: Any,
    ranks: list[int],
    fast: tuple[str, str | None] | None = None,
    inline: bytes | None = None,
    inline_capacity: int = 0,
) -> tuple[Layout, int, list[Any], bytes | None]:
    """Collective: one fixed-size exchange of digests; more only when something differs.

    ``fast`` (this rank's bucketed-path entry: digest and reason, or None) rides along; every
    rank's comes back in group order, so every rank takes the same decision from them. With
    ``inline_capacity`` (the same on every rank), ``src`` attaches ``inline`` (its packed
    buffers, or None) to the same round; every rank gets it back when the layouts agree."""
    attach = inline is not None and len(inline) <= inline_capacity
    entries, attached = exchange_slots(
        _slot(mine, fast, inline=attach),
        group,
        size=len(ranks),
        device=_transport_device(group),
        src=ranks.index(src),
        attached=inline_capacity,
        attachment=inline if attach else b"",
    )
    reference = entries[ranks.index(src)]
    layouts = slice(1, 1 + 2 * _DIGEST)
    same = all(e[layouts] == reference[layouts] for e in entries)
    if same and not any(e[0] & _PROBLEMS for e in entries):
        if any(e[0] & _FAST_REASON for e in entries):  # the reasons, in words
            fasts: list[Any] = [None] * len(ranks)
            dist.all_gather_object(fasts, fast, group=group)
            return mine.buffers, 2, fasts, None
        digests = [None if e[0] & _NO_FAST else (e[1 + 2 * _DIGEST :].hex(), None) for e in entries]
        return mine.buffers, 1, digests, attached if reference[0] & _INLINE else None
    # Every rank saw the same summaries, so every rank takes this branch together.
    everyone: list[Any] = [None] * len(ranks)
    dist.all_gather_object(everyone, mine, group=group)
    by_rank = {e.global_rank: e for e in everyone}
    problems = [p for e in everyone for p in e.problems]
    buffer_diffs = _differences(by_rank, src, "buffers", "non-persistent buffer")
    state_diffs = _differences(by_rank, src, "state", "state-dict entry")
    differences = problems + buffer_diffs + state_diffs
    listed = "\n".join(f"  - {d}" for d in differences)
    if buffer_diffs:
        raise BufferMismatchError(
            "non-persistent buffers differ between ranks, so nothing was loaded or broadcast "
            "(pairing them would hang or swap values):\n"
            f"{listed}\nBuild the model the same way on every rank (same code, config and "
            "options), then load again.",
            differences,
        )
    raise StateDictMismatchError(
        "the ranks' state dicts do not line up, so nothing was loaded or broadcast:\n"
        f"{listed}\nBuild the model the same way on every rank and pass rank 0 the model's own "
        "full state dict.",
        differences,
    )


def _differences(by_rank: dict[int, _Exchange], src: int, field: str, what: str) -> list[str]:
    """Every difference from ``src``, one line per distinct difference, naming its ranks."""
    reference = {n: (s, d) for n, s, d in getattr(by_rank[src], field)}
    found: dict[str, list[int]] = defaultdict(list)
    for rank in sorted(by_rank):
        if rank == src:
            continue
        theirs = {n: (s, d) for n, s, d in getattr(by_rank[rank], field)}
        for name in sorted(set(reference) | set(theirs)):
            if name not in theirs:
                line = f"lacks {what} {name!r} that rank {src} has"
            elif name not in reference:
                shape, dtype = theirs[name]
                line = (
                    f"has {what} {name!r} (shape {list(shape)}, {dtype}) that rank {src} does not"
                )
            elif theirs[name] != reference[name]:
                (shape, dtype), (ref_shape, ref_dtype) = theirs[name], reference[name]
                line = (
                    f"{what} {name!r} is shape {list(shape)}, {dtype}; on rank {src} "
                    f"shape {list(ref_shape)}, {ref_dtype}"
                )
            else:
                continue
            found[line].append(rank)
    return [f"{_rank_word(ranks)} {_compact(ranks)}: {line}" for line, ranks in found.items()]


def _raise_if_any_failed(failure: str | None, group: Any, ranks: list[int]) -> None:
    failures: list[Any] = [None] * len(ranks)
    dist.all_gather_object(failures, failure, group=group)
    reported = [f for f in failures if f]
    if reported:
        raise StateDictMismatchError(
            "loading the state dict failed; the model is partly loaded and must not be used:\n"
            + "\n".join(f"  - {f}" for f in reported),
            reported,
        )


# --- moving tensors ----------------------------------------------------------------------------


def _materialise(model: nn.Module) -> bool:
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
        for name in non_persistent_buffer_names(model)
        if name in named and not named[name].is_meta
    }
    model.to_empty(device=_model_device(model))
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name in kept:
                buf.copy_(kept[name])
    return True


def _model_device(model: nn.Module) -> torch.device:
    for param in model.parameters():
        mesh = getattr(param, "device_mesh", None)
        if mesh is not None and mesh.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        if mesh is not None:
            return torch.device(mesh.device_type)
    return torch.device("cpu")


def _transport_device(group: Any) -> torch.device:
    # gloo (including the cpu half of a "cpu:gloo,cuda:nccl" group) moves CPU tensors only.
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "nccl" not in backend:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _by_dtype(
    named: Mapping[str, torch.Tensor], layout: Layout
) -> list[tuple[str, list[torch.Tensor]]]:
    """The buffers of ``layout`` in one list per dtype, dtypes sorted; empty ones left out."""
    names: dict[str, list[str]] = defaultdict(list)
    for name, shape, dtype in layout:
        if 0 not in shape:
            names[dtype].append(name)
    return [(dtype, [named[n] for n in names[dtype]]) for dtype in sorted(names)]


def _pack_flat(buffers: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    try:
        flat = _flatten_dense_tensors(buffers)  # one C++ call, not one per buffer
    except RuntimeError:  # buffers on several devices
        flat = torch.cat([b.reshape(-1).to(device) for b in buffers])
    return flat.to(device)


def _unpack_flat(flat: torch.Tensor, buffers: list[torch.Tensor]) -> None:
    if all(b.device == flat.device for b in buffers):
        torch._foreach_copy_(buffers, _unflatten_dense_tensors(flat, buffers))
        return
    offset = 0
    for buf in buffers:
        count = buf.numel()
        buf.copy_(flat[offset : offset + count].view(buf.shape))
        offset += count


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _inline_payload(groups: list[tuple[str, list[torch.Tensor]]], capacity: int) -> bytes | None:
    """Every dtype's packed buffers, each starting at an ``_ALIGN`` multiple; None past
    ``capacity``."""
    need = sum(_aligned(sum(b.numel() for b in bs) * bs[0].element_size()) for _, bs in groups)
    if need > capacity:
        return None
    parts = []
    for _, buffers in groups:
        raw = _pack_flat(buffers, torch.device("cpu")).view(torch.uint8).numpy().tobytes()
        parts.append(raw.ljust(_aligned(len(raw)), b"\0"))
    return b"".join(parts)


def _broadcast_flat(
    model: nn.Module,
    layout: Layout,
    *,
    src: int,
    group: Any,
    named: Mapping[str, torch.Tensor] | None = None,
    inline: bytes | None = None,
) -> BufferBroadcast:
    """One broadcast per dtype, buffers packed in name order; every rank holds ``layout``.
    ``named``: the buffers, when nothing can have replaced them since they were described.
    ``inline``: the packed values, already received with the check: nothing left to send."""
    if named is None:
        named = _non_persistent(model)  # after to_empty(): the new tensors
    groups = _by_dtype(named, layout)
    device = _transport_device(group)
    is_src = dist.get_rank() == src
    sent = broadcasts = offset = 0
    with torch.no_grad():
        for _, buffers in groups:
            count = sum(b.numel() for b in buffers)
            nbytes = count * buffers[0].element_size()
            if inline is not None:
                if not is_src:
                    raw = bytearray(inline[offset : offset + nbytes])
                    _unpack_flat(torch.frombuffer(raw, dtype=buffers[0].dtype), buffers)
                offset += _aligned(nbytes)
                sent += nbytes
                continue
            if is_src:
                flat = _pack_flat(buffers, device)
            else:
                flat = torch.empty(count, dtype=buffers[0].dtype, device=device)
            # Raw bytes on the wire: any dtype (bool, bfloat16, float8) travels over gloo.
            dist.broadcast(flat.view(torch.uint8), src=src, group=group)
            broadcasts += 1
            sent += nbytes
            if not is_src:
                _unpack_flat(flat, buffers)
    return BufferBroadcast(
        names=tuple(name for name, _, _ in layout),
        dtypes=tuple(dtype for dtype, _ in groups),
        broadcasts=broadcasts,
        collectives=broadcasts,
        bytes=sent,
        inline=inline is not None,
    )


# --- the bucketed transfer --------------------------------------------------------------------


def _specs(model: nn.Module) -> list[_Spec]:
    """The state dict as the tensors to move, by name; tied weights move once."""
    state = model.state_dict(keep_vars=True)
    owners: dict[int, str] = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        owners.setdefault(id(tensor), name)  # the name named_parameters() and verify_load use
    groups: dict[int, list[str]] = {}
    for name in sorted(state):
        groups.setdefault(id(state[name]), []).append(name)
    specs = []
    for key, names in groups.items():
        tensor = state[names[0]]
        owner = owners.get(key)
        owner = owner if owner in names else names[0]
        placements = getattr(tensor, "placements", None)
        specs.append(
            _Spec(
                name=owner,
                aliases=tuple(n for n in names if n != owner),
                shape=tuple(int(d) for d in tensor.shape),
                dtype=tensor.dtype,
                placements=tuple(placements) if placements is not None else None,
                mesh=tensor.device_mesh if placements is not None else None,
            )
        )
    return sorted(specs, key=lambda spec: spec.name)


def _fast_info(
    model: nn.Module, rank: int, ranks: list[int], group: Any, bucket_bytes: int
) -> _Fast:
    """What the bucketed path's layout derives from on this rank, and whether this rank can take
    it at all; never raises, so the rank always joins the exchange."""
    try:
        backend = str(dist.get_backend(group)).lower()
        if "gloo" not in backend:
            # Point-to-point from rank 0 over NCCL would set up a communicator per receiver.
            return _Fast(
                "", f"`group` runs {backend}; the bucketed path sends over gloo (pass a gloo group)"
            )
        specs = _specs(model)
        state = model.state_dict(keep_vars=True)
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
                    coordinates[id(spec.mesh)] = _coordinate(spec.mesh, rank)
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
        return _Fast(digest, reason, tuple(specs))
    except Exception as exc:  # the DCP path may still cope; say why this one cannot
        return _Fast("", f"could not describe its state dict: {type(exc).__name__}: {exc}")


def _mesh_key(mesh: Any) -> tuple[Any, ...]:
    ranks = tuple(int(r) for r in mesh.mesh.reshape(-1).tolist())
    return (str(mesh.device_type), tuple(int(d) for d in mesh.mesh.shape), ranks)


def _shard_problems(
    spec: _Spec,
    tensor: torch.Tensor,
    rank: int,
    mesh_key: tuple[Any, ...],
    outside: list[int],
    coordinate: list[int] | None,
) -> list[str]:
    from torch.distributed.tensor import Replicate, Shard

    mesh_shape = mesh_key[1]
    unsupported = [p for p in spec.placements if type(p) not in (Shard, Replicate)]
    if unsupported:
        return [f"{spec.name} is placed as {unsupported[0]} (only Shard and Replicate are moved)"]
    if len(spec.placements) != len(mesh_shape):
        return [f"{spec.name} has {len(spec.placements)} placements on a {len(mesh_shape)}-D mesh"]
    if outside:
        return [f"{spec.name}'s mesh holds ranks {_compact(outside)} that `group` lacks"]
    if coordinate is None:
        return [f"rank {rank} is not in {spec.name}'s mesh"]
    with torch.no_grad():
        local = tensor.to_local()
    expected = _local_shape(spec.shape, spec.placements, mesh_shape, coordinate)
    if tuple(local.shape) != expected:
        return [
            f"{spec.name}'s local shard is {list(local.shape)}, not the torch.chunk slice "
            f"{list(expected)}"
        ]
    if not local.is_contiguous():
        return [f"{spec.name}'s local shard is not contiguous"]
    return []


def _coordinate(mesh: Any, rank: int) -> list[int] | None:
    where = (mesh.mesh == rank).nonzero()
    return [int(c) for c in where[0].tolist()] if where.numel() else None


def _local_shape(
    shape: Sequence[int],
    placements: Sequence[Any],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
) -> tuple[int, ...]:
    """The shape :func:`fsdpcheck.verify.shard_of` cuts, from sizes alone: ``Shard(d)`` keeps
    chunk ``c`` of ``torch.chunk(t, n, d)``, ``ceil(L / n)`` long except at the end."""
    from torch.distributed.tensor import Replicate

    dims = [int(d) for d in shape]
    for size, coord, placement in zip(mesh_shape, coordinate, placements, strict=True):
        if isinstance(placement, Replicate):
            continue
        dim = placement.dim % max(len(dims), 1)
        length = dims[dim]
        chunk = -(-length // size)
        dims[dim] = max(0, min(chunk, length - coord * chunk)) if chunk else 0
    return tuple(dims)


def _choose(method: str, fasts: list[Any], ranks: list[int]) -> tuple[str, str | None]:
    """The same decision on every rank, from every rank's (digest, reason), in group order."""
    if method == "dcp":
        return "dcp", None
    if asked := [r for r, f in zip(ranks, fasts, strict=True) if f is None]:
        return "dcp", f"{_rank_word(asked)} {_compact(asked)} asked for method='dcp'"
    reasons = [f"rank {r}: {f[1]}" for r, f in zip(ranks, fasts, strict=True) if f[1]]
    if reasons:
        more = f"; and {len(reasons) - 1} more ranks" if len(reasons) > 1 else ""
        return "dcp", f"not covered by the bucketed path: {reasons[0]}{more}"
    reference = fasts[ranks.index(0)][0]
    if differ := [r for r, f in zip(ranks, fasts, strict=True) if f[0] != reference]:
        return "dcp", (
            f"{_rank_word(differ)} {_compact(differ)} shard, tie or bucket the state dict "
            "differently from rank 0 (placements, meshes, tied weights or bucket_bytes differ)"
        )
    return "bucketed", None


def _plan(numels: Sequence[tuple[int, int]], bucket_bytes: int) -> list[_Message]:
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
        offset = _aligned(used)
        if offset + nbytes > bucket_bytes:
            messages.append(_Message(used, tuple(pieces)))
            pieces, offset = [], 0
        pieces.append(_Piece(index, 0, numel, offset))
        used = offset + nbytes
    if pieces:
        messages.append(_Message(used, tuple(pieces)))
    return messages


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


class _Transfer:
    """Rank 0 sends every other rank its own shards; nobody receives anyone else's.

    Every rank derives the same messages for every rank from the agreed specs (:func:`_plan`),
    so each message's size is known to both ends before it moves. Large shards travel straight
    from rank 0's source tensors into the receivers' local shards; small ones in packed buckets.
    A rank that fails (to materialise, to pack, to unpack) still sends or receives every message,
    so nobody is left waiting; the failure reaches every rank after the transfer."""

    def __init__(
        self, model: nn.Module, specs: Sequence[_Spec], ranks: list[int], group: Any, size: int
    ):
        self.model = model
        self.specs = tuple(specs)
        self.ranks = ranks
        self.group = group
        self.bucket_bytes = size
        self.rank = dist.get_rank()
        self.device = _transport_device(group)
        self.failure: str | None = None
        self._coordinates: dict[tuple[int, int], list[int] | None] = {}
        self._flat_index = -1
        self._flat: dict[int, torch.Tensor] = {}

    def run(
        self, source: Mapping[str, torch.Tensor] | None, *, write: bool
    ) -> tuple[int, int, int, str | None]:
        """(messages, bytes on the wire, largest message, this rank's failure or None)."""
        targets = None
        if write:
            try:
                targets = self._targets()
            except Exception as exc:
                self._fail("finding its local shards", exc)
        with torch.no_grad():
            if self.rank == 0:
                if source is None:
                    self.failure = self.failure or "rank 0: no full state dict to send"
                return (*self._send(source, targets), self.failure)
            return (*self._receive(targets), self.failure)

    # -- layout

    def _numels(self, rank: int) -> list[tuple[int, int]]:
        out = []
        for spec in self.specs:
            shape = spec.shape
            if spec.placements is not None:
                coordinate = self._coordinate(spec.mesh, rank)
                mesh_shape = tuple(spec.mesh.mesh.shape)
                shape = (
                    _local_shape(shape, spec.placements, mesh_shape, coordinate)
                    if coordinate is not None
                    else (0,)
                )
            numel = 1
            for d in shape:
                numel *= d
            out.append((numel, spec.dtype.itemsize))
        return out

    def _coordinate(self, mesh: Any, rank: int) -> list[int] | None:
        key = (id(mesh), rank)
        if key not in self._coordinates:
            self._coordinates[key] = _coordinate(mesh, rank)
        return self._coordinates[key]

    def _targets(self) -> list[torch.Tensor]:
        """This rank's local tensors (after to_empty()), flat, in spec order."""
        state = self.model.state_dict(keep_vars=True)
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
            from fsdpcheck.verify import shard_of

            spec = self.specs[index]
            full = source[spec.name].detach()
            if spec.placements is not None:
                coordinate = self._coordinate(spec.mesh, rank)
                full = shard_of(full, spec.placements, tuple(spec.mesh.mesh.shape), coordinate)
            self._flat[rank] = full.reshape(-1)
        return self._flat[rank]

    def _fail(self, doing: str, exc: Exception) -> None:
        if self.failure is None:
            self.failure = f"rank {self.rank}: {doing} failed: {type(exc).__name__}: {exc}"

    # -- rank 0

    def _send(
        self, source: Mapping[str, torch.Tensor] | None, targets: list[torch.Tensor] | None
    ) -> tuple[int, int, int]:
        plans = {d: _plan(self._numels(d), self.bucket_bytes) for d in self.ranks if d != 0}
        own = _plan(self._numels(0), self.bucket_bytes)
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

    def _receive(self, targets: list[torch.Tensor] | None) -> tuple[int, int, int]:
        plan = _plan(self._numels(self.rank), self.bucket_bytes)
        biggest = max((m.size for m in plan), default=0)
        pipe = _Pipeline(biggest, self.device)
        for k, message in enumerate(plan):
            wire, slot, done = None, None, None
            if message.direct and targets is not None and self.failure is None:
                [piece] = message.pieces
                target = targets[piece.index]
                if target.device == self.device:  # straight into the shard
                    wire = target[piece.start : piece.stop].view(torch.uint8)
            if wire is None:
                slot, wire = pipe.staging(message.size)
                if targets is not None:
                    done = self._unpacker(wire, message, targets)
            pipe.post(dist.irecv(wire, src=0, group=self.group, tag=k), done, slot)
        pipe.drain()
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
                self._fail("unpacking a message", exc)

        return unpack


# --- wording -----------------------------------------------------------------------------------


def _group_ranks(group: Any) -> list[int]:
    return list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def _rank_word(ranks: list[int]) -> str:
    return "rank" if len(ranks) == 1 else "ranks"


def _compact(ranks: Iterable[int]) -> str:
    """``[1, 2, 3, 5]`` → ``"1-3, 5"``: a readable list at thousands of ranks."""
    spans: list[list[int]] = []
    for r in sorted(ranks):
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _names(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
