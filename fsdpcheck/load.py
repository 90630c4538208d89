"""A safe loader for an FSDP2-sharded model: what a training script calls in place of verl's or
accelerate's full-state-dict loader.

Parameters and persistent buffers go through ``set_model_state_dict`` (keyed by rank 0's names,
so iteration order cannot pair the wrong tensors). Non-persistent buffers, which no state dict
carries, are broadcast by name in sorted order, one flat tensor per dtype, but only after every
rank has shown that it holds the same names, shapes and dtypes; any difference is raised on every
rank before a single byte moves, never a hang and never a partial load.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdpcheck.errors import FsdpcheckError, InputError
from fsdpcheck.fingerprint import dtype_name, non_persistent_buffer_names
from fsdpcheck.records import short_digest

# (name, shape, dtype): what must agree across ranks before a tensor may be paired by name.
Layout = tuple[tuple[str, tuple[int, ...], str], ...]


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
    dtypes: tuple[str, ...]  # one flat broadcast per dtype, in this order
    broadcasts: int
    collectives: int  # issued by fsdpcheck: layout exchange(s) plus the broadcasts
    bytes: int


@dataclass(frozen=True)
class LoadResult:
    """What :func:`load_full_state_dict` did on this rank."""

    params_loaded: int  # state-dict entries (parameters and persistent buffers)
    buffers_broadcast: int
    buffer_broadcasts: int  # flat broadcasts: one per buffer dtype, however many buffers
    collectives: int  # issued by fsdpcheck (2 checks + the broadcasts), not DCP's own
    dtypes: tuple[str, ...]  # of the buffer broadcasts, in order
    materialised: bool  # this rank held meta tensors and got storage via to_empty()


@dataclass(frozen=True)
class _Exchange:
    """One rank's entry in the layout exchange."""

    global_rank: int
    buffers: Layout
    state: Layout
    problems: tuple[str, ...]


def load_full_state_dict(
    model: nn.Module,
    full_state_dict_on_rank0: Mapping[str, torch.Tensor] | None,
    *,
    group: Any = None,
    cpu_offload: bool = False,
) -> LoadResult:
    """Load rank 0's full state dict into a ``fully_shard``-ed model; collective, every rank calls.

    Checks first (layouts over ``group``), then materialises meta ranks, loads parameters and
    persistent buffers, then broadcasts non-persistent buffers from rank 0 by name.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    ranks = _group_ranks(group)
    if 0 not in ranks:
        raise InputError(
            "load_full_state_dict: `group` must contain global rank 0, which holds the full "
            f"state dict; it holds ranks {_compact(ranks)}."
        )
    rank = dist.get_rank()
    source = dict(full_state_dict_on_rank0) if full_state_dict_on_rank0 is not None else None
    mine = _describe(model, rank, src=0, source=source if rank == 0 else None, with_state=True)
    layout, collectives = _agree(mine, src=0, group=group, ranks=ranks)

    # set_model_state_dict writes rank 0's local shards back into the dict it is given, so it
    # gets a copy: the caller's source stays intact (verify_load compares against it).
    payload = source if rank == 0 and source is not None else {}
    options = StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True, cpu_offload=cpu_offload
    )
    failure, materialised = None, False
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
    )


def broadcast_buffers(model: nn.Module, *, src: int = 0, group: Any = None) -> BufferBroadcast:
    """Broadcast non-persistent buffers from global rank ``src`` by sorted name, one flat tensor
    per dtype, after checking that every rank holds the same names, shapes and dtypes."""
    ranks = _group_ranks(group)
    if src not in ranks:
        raise InputError(
            f"broadcast_buffers: src={src} is not in `group` (ranks {_compact(ranks)})."
        )
    mine = _describe(model, dist.get_rank(), src=src, source=None, with_state=False)
    layout, collectives = _agree(mine, src=src, group=group, ranks=ranks)
    moved = _broadcast_flat(model, layout, src=src, group=group)
    return BufferBroadcast(
        names=moved.names,
        dtypes=moved.dtypes,
        broadcasts=moved.broadcasts,
        collectives=collectives + moved.broadcasts,
        bytes=moved.bytes,
    )


# --- describing and agreeing -------------------------------------------------------------------


def _tensor_layout(name: str, tensor: torch.Tensor) -> tuple[str, tuple[int, ...], str]:
    # DTensor.shape is the global shape, which is what must agree across ranks.
    return (name, tuple(int(d) for d in tensor.shape), dtype_name(tensor.dtype))


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
    try:
        non_persistent = non_persistent_buffer_names(model)
        named = dict(model.named_buffers())
        buffers = tuple(sorted(_tensor_layout(n, named[n]) for n in non_persistent if n in named))
        if rank == src:
            on_meta = sorted(n for n in non_persistent if n in named and named[n].is_meta)
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
    return _Exchange(rank, buffers, state, tuple(problems))


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


def _agree(mine: _Exchange, *, src: int, group: Any, ranks: list[int]) -> tuple[Layout, int]:
    """Collective: small digests first; the full layouts only when something differs."""
    summary = (
        short_digest(repr(mine.buffers)),
        short_digest(repr(mine.state)),
        mine.problems,
    )
    summaries: list[Any] = [None] * len(ranks)
    dist.all_gather_object(summaries, summary, group=group)
    reference = summaries[ranks.index(src)]
    same = all(s[0] == reference[0] and s[1] == reference[1] for s in summaries)
    if same and not any(s[2] for s in summaries):
        return mine.buffers, 1
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


def _broadcast_flat(model: nn.Module, layout: Layout, *, src: int, group: Any) -> BufferBroadcast:
    """One broadcast per dtype, buffers packed in name order; every rank holds ``layout``."""
    named = dict(model.named_buffers())  # after to_empty(): the new tensors
    by_dtype: dict[str, list[str]] = defaultdict(list)
    for name, _, dtype in layout:
        by_dtype[dtype].append(name)
    device = _transport_device(group)
    is_src = dist.get_rank() == src
    sent = broadcasts = 0
    with torch.no_grad():
        for dtype in sorted(by_dtype):
            buffers = [named[name] for name in by_dtype[dtype]]
            total = sum(b.numel() for b in buffers)
            if total == 0:
                continue  # every rank agreed on the shapes, so every rank skips it
            if is_src:
                flat = torch.cat([b.detach().reshape(-1).to(device) for b in buffers])
            else:
                flat = torch.empty(total, dtype=buffers[0].dtype, device=device)
            # Raw bytes on the wire: any dtype (bool, bfloat16, float8) travels over gloo.
            dist.broadcast(flat.view(torch.uint8), src=src, group=group)
            broadcasts += 1
            sent += flat.numel() * flat.element_size()
            if not is_src:
                offset = 0
                for buf in buffers:
                    count = buf.numel()
                    buf.copy_(flat[offset : offset + count].view(buf.shape))
                    offset += count
    return BufferBroadcast(
        names=tuple(name for name, _, _ in layout),
        dtypes=tuple(d for d in sorted(by_dtype) if any(named[n].numel() for n in by_dtype[d])),
        broadcasts=broadcasts,
        collectives=broadcasts,
        bytes=sent,
    )


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
