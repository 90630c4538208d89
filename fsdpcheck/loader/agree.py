"""Before a byte moves: every rank shows the state-dict entries and non-persistent buffers it
holds (names, shapes, dtypes) as digests compared in one round of a tree; any difference is
named and raised on every rank, never a hang and never a partial load.
:mod:`fsdpcheck.loader.load` runs it first."""

from __future__ import annotations

import hashlib
import logging
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdpcheck.distributed.wire import (
    Posted,
    landed_bytes,
    landing_for,
    post_span,
    span,
    transport_device,
)
from fsdpcheck.errors import FsdpcheckError
from fsdpcheck.loader.names import Placement, placement
from fsdpcheck.model.fingerprint import dtype_name, non_persistent_buffers
from fsdpcheck.text import name_list, ranks_label

log = logging.getLogger(__name__)

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


class LoadFailedError(StateDictMismatchError):
    """The transfer itself failed on some rank (the layouts agreed): the model is partly loaded."""


@dataclass(frozen=True)
class Exchange:
    """One rank's entry in the layout exchange."""

    global_rank: int
    buffers: Layout
    state: Layout
    problems: tuple[str, ...]
    # This rank's non-persistent buffers as described; local only, never sent.
    named: Mapping[str, torch.Tensor] | None = field(default=None, compare=False, repr=False)
    # Where the state dict's entries land in the model (local only, never sent), and what
    # keeps some of them from landing, in words without the rank (the ranks are added when
    # every rank's are listed together).
    placement: Placement | None = field(default=None, compare=False, repr=False)
    unplaceable: tuple[str, ...] = ()

    def __getstate__(self) -> dict[str, Any]:
        # the slow path pickles it: layouts and problems only
        return {**self.__dict__, "named": None, "placement": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _tensor_layout(name: str, tensor: torch.Tensor) -> tuple[str, tuple[int, ...], str]:
    # DTensor.shape is the global shape, which is what must agree across ranks.
    dtype = tensor.dtype
    named = _DTYPE_NAMES.get(dtype)
    if named is None:
        named = _DTYPE_NAMES[dtype] = dtype_name(dtype)
    return (name, tuple(tensor.shape), named)


def local_layout(
    model: nn.Module,
    rank: int,
    *,
    src: int,
    source: dict[str, torch.Tensor] | None,
    with_state: bool,
) -> Exchange:
    """This rank's layouts and local problems; never raises, so it always joins the exchange."""
    problems: list[str] = []
    buffers: Layout = ()
    state: Layout = ()
    named: dict[str, torch.Tensor] | None = None
    where: Placement | None = None
    unplaceable: list[str] = []
    try:
        named = non_persistent_buffers(model)
        buffers = tuple(sorted(_tensor_layout(n, t) for n, t in named.items()))
        if rank == src:
            on_meta = sorted(n for n, t in named.items() if t.is_meta)
            if on_meta:
                problems.append(
                    f"rank {rank} (the source) holds non-persistent buffers on meta "
                    f"({name_list(on_meta)}): it has no values to broadcast; build it with real "
                    "tensors."
                )
        if with_state:
            local = model.state_dict(keep_vars=True)
            state = tuple(sorted(_tensor_layout(k, v) for k, v in local.items()))
            where = placement(model, local)
            unplaceable = placement_problems(where)
            if rank == src:
                problems.extend(source_problems(rank, state, source))
    except Exception as exc:  # a local failure must reach the others, not strand them
        log.debug("rank %d could not describe its model", rank, exc_info=True)
        problems.append(f"rank {rank} could not describe its model: {type(exc).__name__}: {exc}")
    return Exchange(rank, buffers, state, tuple(problems), named, where, tuple(unplaceable))


def placement_problems(where: Placement) -> list[str]:
    """Why some state-dict entry or model tensor cannot be placed, in words naming them and the
    fix; empty when every entry lands on a tensor (directly or through the model's hooks)."""
    problems = list(where.problems)
    if where.unplaced:
        problems.append(
            f"the model's state dict has entries that no tensor of the model takes, even through "
            f"its load_state_dict pre-hooks: {name_list(list(where.unplaced))} (a state-dict hook "
            "makes them; give the model a load_state_dict pre-hook that turns them back into "
            "its tensors, as torchtitan's FusedQKVLinear does, or load it with its own loader)"
        )
    if where.unreached:
        problems.append(
            f"no state-dict entry reaches the model's tensors {name_list(list(where.unreached))}, "
            "even through its load_state_dict pre-hooks (a state-dict hook leaves them out or "
            "renames them); make its state dict hold them, or load it with its own loader"
        )
    return problems


def source_problems(rank: int, state: Layout, source: dict[str, torch.Tensor] | None) -> list[str]:
    if source is None:
        return [f"rank {rank} was given no full state dict (None); pass rank 0's full state dict."]
    expected = {name: shape for name, shape, _ in state}
    given = {k: tuple(v.shape) for k, v in source.items() if torch.is_tensor(v)}
    problems = []
    if missing := sorted(set(expected) - set(given)):
        problems.append(f"rank {rank}'s full state dict lacks {name_list(missing)}")
    if extra := sorted(set(given) - set(expected)):
        problems.append(
            f"rank {rank}'s full state dict has keys the model lacks: {name_list(extra)}"
        )
    for name in sorted(set(expected) & set(given)):
        if expected[name] != given[name]:
            problems.append(
                f"rank {rank}'s full state dict has {name} with shape {list(given[name])}, "
                f"the model {list(expected[name])}"
            )
    return problems


# The words every rank contributes to the check: flags (each word's greatest value says whether
# any rank set it, its least whether every rank did), then digests as 63-bit words.
_PROBLEMS, _NO_FAST, _FAST_REASON, _INLINE, _DIGESTS = range(5)
_DIGEST = 16
# The buffers' values ride along with the check (one round, not two) when they fit in this
# much; every rank then forwards it at most twice (three times, the root of a star of 4),
# whatever the world size.
_INLINE_MAX, _INLINE_MIN, _INLINE_TOTAL = 64 * 2**10, 4 * 2**10, 2**20


_WORD_COUNT = _DIGESTS + 3 * _DIGEST // 8  # check_words' length


def inline_capacity_for(world_size: int) -> int:
    return max(_INLINE_MIN, min(_INLINE_MAX, _INLINE_TOTAL // max(world_size, 1)))


def post_check(group: Any, ranks: list[int], src: int) -> Posted | None:
    """Post this rank's first receives of :func:`agree`'s round (gloo), so that the ranks
    below it in the tree can send their words while this rank still describes and packs: pass
    it to that agree, which must follow. None on NCCL (one all_reduce, nothing to post)."""
    if transport_device(group).type != "cpu":
        return None
    return post_span(_WORD_COUNT, group, size=len(ranks), root=ranks.index(src))


def check_landing(inline_capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where :func:`agree`'s round lands (pass it as ``landing``), and the place in it (uint8)
    where ``src``'s inline buffers land: ``src`` packs them there, the other ranks may lay out
    their views of it before the round."""
    landing = landing_for(_WORD_COUNT, inline_capacity)
    return landing, landed_bytes(landing, _WORD_COUNT, inline_capacity)


def check_words(
    mine: Exchange, fast: tuple[str, str | None] | None, inline: bool = False
) -> list[int]:
    """This rank's words in the check: flags, then digests of its buffers, state and fast
    layout (each of ``_DIGEST`` bytes as two words of 63 bits, so none is negated out of
    range)."""
    flags = [
        int(bool(mine.problems or mine.unplaceable)),
        int(fast is None),
        int(fast is not None and bool(fast[1])),
        int(inline),
    ]
    fast_digest = fast[0] if fast is not None and fast[0] else "00" * _DIGEST
    digests = layout_digest(mine.buffers) + layout_digest(mine.state) + bytes.fromhex(fast_digest)
    return flags + [
        int.from_bytes(digests[i : i + 8], "big") >> 1 for i in range(0, len(digests), 8)
    ]


def layout_digest(layout: Layout) -> bytes:
    """``_DIGEST`` bytes naming ``layout`` exactly: its names, shapes and dtypes, each column
    hashed in one piece (``repr`` of the whole layout costs 80 µs for 200 buffers; this a third
    of that). A name holds no NUL, so the joined names part the same way on every rank."""
    h = hashlib.blake2b(digest_size=_DIGEST)
    h.update(str(len(layout)).encode())
    h.update("\0".join([name for name, _, _ in layout]).encode())
    h.update(repr([shape for _, shape, _ in layout]).encode())
    h.update("\0".join([dtype for _, _, dtype in layout]).encode())
    return h.digest()


@dataclass(frozen=True)
class Agreement:
    """The ranks agree: the buffer layout, how many collectives that took, every rank's
    bucketed-path entry in group order, and ``src``'s inline buffers when they rode along."""

    layout: Layout
    collectives: int
    bucketed: list[Any]
    inline: torch.Tensor | None  # uint8: where src's packed buffers landed


def agree(
    mine: Exchange,
    *,
    src: int,
    group: Any,
    ranks: list[int],
    fast: tuple[str, str | None] | None = None,
    inline: torch.Tensor | None = None,
    inline_capacity: int = 0,
    landing: torch.Tensor | None = None,
    posted: Posted | None = None,
) -> Agreement:
    """Collective: the ranks' digests compared by their least and greatest values
    (:func:`~fsdpcheck.distributed.wire.span`: a tree, the same few hundred bytes per rank
    whatever the world size); every rank's details only when something differs.

    ``fast`` (this rank's bucketed-path entry: digest and reason, or None): when every rank's
    is the same digest with no reason, each rank's entry is that one; otherwise every rank's is
    gathered, in group order, so every rank takes the same decision from them. With
    ``inline_capacity`` (the same on every rank), ``src`` attaches ``inline`` (its packed
    buffers, or None) to the same round; every rank gets it back when the layouts agree, in
    ``landing`` where given (:func:`check_landing`). ``posted``: :func:`post_check`'s."""
    attach = inline is not None and inline.numel() <= inline_capacity
    spread = span(
        check_words(mine, fast, inline=attach),
        group,
        size=len(ranks),
        device=transport_device(group),
        root=ranks.index(src),
        attached=inline_capacity,
        attachment=inline if attach else None,
        landing=landing,
        posted=posted,
    )
    layouts = slice(_DIGESTS, _DIGESTS + 4)  # the buffers' and the state's digests
    if spread.same(layouts.start, layouts.stop) and not spread.high[_PROBLEMS]:
        attached = spread.landed if spread.high[_INLINE] else None
        if spread.low[_NO_FAST]:  # no rank takes the bucketed path
            return Agreement(mine.buffers, 1, [None] * len(ranks), attached)
        if spread.same(layouts.stop) and not (spread.high[_NO_FAST] or spread.high[_FAST_REASON]):
            return Agreement(mine.buffers, 1, [fast] * len(ranks), attached)
        fasts: list[Any] = [None] * len(ranks)  # which ranks differ, and why: in words
        dist.all_gather_object(fasts, fast, group=group)
        return Agreement(mine.buffers, 2, fasts, None)
    # Every rank saw the same summaries, so every rank takes this branch together.
    everyone: list[Any] = [None] * len(ranks)
    dist.all_gather_object(everyone, mine, group=group)
    by_rank = {e.global_rank: e for e in everyone}
    problems = [p for e in everyone for p in e.problems]
    unplaceable: dict[str, list[int]] = defaultdict(list)
    for e in everyone:
        for p in e.unplaceable:
            unplaceable[p].append(e.global_rank)
    problems += [f"{ranks_label(rs)}: {p}" for p, rs in unplaceable.items()]
    buffer_diffs = layout_differences(by_rank, src, "buffers", "non-persistent buffer")
    state_diffs = layout_differences(by_rank, src, "state", "state-dict entry")
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
    if unplaceable and len(unplaceable) == len(differences):
        raise StateDictMismatchError(
            "the model's state dict does not map onto its tensors, so nothing was loaded or "
            f"broadcast:\n{listed}",
            differences,
        )
    raise StateDictMismatchError(
        "the ranks' state dicts do not line up, so nothing was loaded or broadcast:\n"
        f"{listed}\nBuild the model the same way on every rank and pass rank 0 the model's own "
        "full state dict.",
        differences,
    )


def layout_differences(by_rank: dict[int, Exchange], src: int, field: str, what: str) -> list[str]:
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
    return [f"{ranks_label(ranks)}: {line}" for line, ranks in found.items()]


def raise_if_any_failed(failure: str | None, group: Any, ranks: list[int]) -> None:
    failures: list[Any] = [None] * len(ranks)
    dist.all_gather_object(failures, failure, group=group)
    reported = [f for f in failures if f]
    if reported:
        raise LoadFailedError(
            "loading the state dict failed; the model is partly loaded and must not be used:\n"
            + "\n".join(f"  - {f}" for f in reported),
            reported,
        )


def member_ranks(group: Any) -> list[int]:
    return list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
