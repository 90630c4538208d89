"""The layout diff: which tensors each group of ranks has, in which order, with which shapes,
dtypes, persistence and placements, against the reference group.

Pure functions over :mod:`fsdpcheck.records` (no torch, no communication), so the same code runs
on rank 0 after the gather and in unit tests on synthetic fingerprints.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fsdpcheck.checks.flags import requires_grad_difference
from fsdpcheck.checks.groups import Pair
from fsdpcheck.records import (
    Finding,
    Fingerprint,
    MeshRecord,
    RankRecord,
    TensorRecord,
    param_mesh,
)
from fsdpcheck.text import clauses, ranks_label
from fsdpcheck.vocab import Cause, FindingKind, Snapshot

STAGES = (Snapshot.PRE_WRAP, Snapshot.POST_WRAP)

# Every kind this diff finds, in headline order.
LAYOUT_KINDS = (
    FindingKind.BUFFER_ORDER,
    FindingKind.BUFFER_SET,
    FindingKind.BUFFER_SHAPE,
    FindingKind.BUFFER_DTYPE,
    FindingKind.BUFFER_PERSISTENCE,
    FindingKind.PARAM_ORDER,
    FindingKind.PARAM_SET,
    FindingKind.PARAM_SHAPE,
    FindingKind.PARAM_DTYPE,
    FindingKind.PARAM_PLACEMENT,
    FindingKind.STATE_DICT_ORDER,
    FindingKind.STATE_DICT_KEYS,
    FindingKind.REQUIRES_GRAD,
)

_STAGE_NOTE = {
    Cause.CONSTRUCTION_TIME: " (before wrapping)",
    Cause.WRAPPING: " (after wrapping only)",
}
_ORDER_KINDS = (FindingKind.BUFFER_ORDER, FindingKind.PARAM_ORDER)
_LISTED = 3  # names spelled out in one summary before "and N more"


# ---------------------------------------------------------------- shared with predict


def format_shape(shape: Sequence[int] | None) -> str:
    """``(16,)``, ``(4, 8)``, ``()``; lists (after a JSON round trip) print like tuples."""
    if shape is None:
        return "(?)"
    return repr(tuple(shape))


def describe(t: TensorRecord | None) -> str:
    return "nothing" if t is None else f"{t.name} {format_shape(t.shape)} {t.dtype}"


def tensor_dict(t: TensorRecord | None) -> dict[str, Any] | None:
    # Lists, not tuples: details must compare equal after a JSON round trip.
    return None if t is None else {"name": t.name, "shape": list(t.shape), "dtype": t.dtype}


# ---------------------------------------------------------------- public API


def layout_findings(pair: Pair) -> list[Finding]:
    """Every layout difference of one group against the reference, each at the first stage it
    shows (pre-wrap: construction; post-wrap only: wrapping), in headline order."""
    ref, other = pair.ref, pair.other
    sides = _Sides(pair)
    raw: dict[Snapshot, dict[FindingKind, tuple]] = {}
    for stage, a, b in (
        (Snapshot.PRE_WRAP, ref.pre_wrap, other.pre_wrap),
        (Snapshot.POST_WRAP, ref.post_wrap, other.post_wrap),
    ):
        if a is not None and b is not None:
            raw[stage] = _stage_differences(a, b, stage, sides)
            if stage == Snapshot.POST_WRAP:
                _mesh_difference(raw[stage], ref, other, sides)

    findings: list[Finding] = []
    pre, post = raw.get(Snapshot.PRE_WRAP), raw.get(Snapshot.POST_WRAP)
    for kind in LAYOUT_KINDS:
        if pre is not None and kind in pre:
            if _explained(kind, pre):
                continue
            tensors, details, summary = pre[kind]
            details = {**details, "persists_after_wrap": None if post is None else kind in post}
            findings.append(
                _finding(
                    kind,
                    sides,
                    Snapshot.PRE_WRAP,
                    Cause.CONSTRUCTION_TIME,
                    summary,
                    details,
                    tensors,
                )
            )
        elif post is not None and kind in post and not _explained(kind, post):
            tensors, details, summary = post[kind]
            # Without a pre-wrap fingerprint we cannot tell construction from wrapping.
            cause = Cause.WRAPPING if pre is not None else Cause.UNKNOWN
            findings.append(
                _finding(kind, sides, Snapshot.POST_WRAP, cause, summary, details, tensors)
            )
    findings.sort(key=lambda f: (FindingKind(f.kind).order, STAGES.index(f.snapshot)))
    return findings


# ---------------------------------------------------------------- internals


class _Sides:
    """Who is compared, for summaries: the reference rank and the differing group's ranks."""

    def __init__(self, pair: Pair):
        self.ref_rank = pair.ref_rank
        self.ranks = pair.group.ranks
        self.ref = f"rank {self.ref_rank}"
        self.other = ranks_label(pair.group.ranks)

    def verb(self, singular: str, plural: str) -> str:
        """``rank 1 has`` / ``ranks 1,3 have``."""
        return f"{self.other} {singular if len(self.ranks) == 1 else plural}"


def _explained(kind: FindingKind, diffs: Mapping[FindingKind, tuple]) -> bool:
    # A state-dict walk follows module order, so a buffer/param order change already explains it.
    return kind == FindingKind.STATE_DICT_ORDER and any(k in diffs for k in _ORDER_KINDS)


def _finding(
    kind: FindingKind,
    sides: _Sides,
    stage: Snapshot,
    cause: Cause,
    summary: str,
    details: Mapping[str, Any],
    tensors: Sequence[str] = (),
) -> Finding:
    return Finding(
        kind=kind,
        ranks=tuple(sides.ranks),
        reference_rank=sides.ref_rank,
        snapshot=stage,
        cause=cause,
        summary=summary + _STAGE_NOTE.get(cause, ""),
        tensors=tuple(tensors),
        details=details,
    )


@dataclass(frozen=True)
class _Kinds:
    """The kinds one tensor list (buffers or parameters) can differ in."""

    order: FindingKind
    names: FindingKind
    shape: FindingKind
    dtype: FindingKind


_BUFFER = _Kinds(
    FindingKind.BUFFER_ORDER,
    FindingKind.BUFFER_SET,
    FindingKind.BUFFER_SHAPE,
    FindingKind.BUFFER_DTYPE,
)
_PARAM = _Kinds(
    FindingKind.PARAM_ORDER, FindingKind.PARAM_SET, FindingKind.PARAM_SHAPE, FindingKind.PARAM_DTYPE
)


def _stage_differences(a: Fingerprint, b: Fingerprint, stage: Snapshot, sides: _Sides) -> dict:
    """kind -> (tensors, details, summary) for one stage, before cause attribution."""
    out: dict[FindingKind, tuple] = {}
    _tensor_differences(out, _BUFFER, a.buffers, b.buffers, sides)
    _field_difference(out, FindingKind.BUFFER_PERSISTENCE, a.buffers, b.buffers, sides)
    _tensor_differences(out, _PARAM, a.params, b.params, sides)
    if stage == Snapshot.POST_WRAP:
        _field_difference(out, FindingKind.PARAM_PLACEMENT, a.params, b.params, sides)
    sd = _state_dict_order(a.state_dict_keys, b.state_dict_keys, sides)
    if sd is not None:
        out[FindingKind.STATE_DICT_ORDER] = sd
    keys = _state_dict_keys(a, b, sides)
    if keys is not None:
        out[FindingKind.STATE_DICT_KEYS] = keys
    grads = requires_grad_difference(a, b, sides.ref, sides.other)
    if grads is not None:
        out[FindingKind.REQUIRES_GRAD] = grads
    return out


def _tensor_differences(
    out: dict,
    kinds: _Kinds,
    ref_list: Sequence[TensorRecord],
    other_list: Sequence[TensorRecord],
    sides: _Sides,
) -> None:
    ref_names = {t.name for t in ref_list}
    other_names = {t.name for t in other_list}
    only_ref = [t for t in ref_list if t.name not in other_names]
    only_other = [t for t in other_list if t.name not in ref_names]
    if only_ref or only_other:
        out[kinds.names] = _set_difference(
            kinds.names, ref_list, other_list, only_ref, only_other, sides
        )
    _field_difference(out, kinds.shape, ref_list, other_list, sides)
    _field_difference(out, kinds.dtype, ref_list, other_list, sides)
    order = _order_difference(kinds.order, ref_list, other_list, sides)
    if order is not None:
        out[kinds.order] = order


def _first_divergence(
    ref_list: Sequence[TensorRecord], other_list: Sequence[TensorRecord]
) -> dict[str, Any] | None:
    for i in range(max(len(ref_list), len(other_list))):
        a = ref_list[i] if i < len(ref_list) else None
        b = other_list[i] if i < len(other_list) else None
        if a is None or b is None or a.name != b.name:
            return {"index": i, "reference": tensor_dict(a), "other": tensor_dict(b)}
    return None


def _listed(tensors: Sequence[TensorRecord]) -> str:
    text = ", ".join(describe(t) for t in tensors[:_LISTED])
    if len(tensors) > _LISTED:
        text += f" and {len(tensors) - _LISTED} more"
    return text


def _set_difference(
    kind: FindingKind, ref_list, other_list, only_ref, only_other, sides: _Sides
) -> tuple:
    parts = []
    if only_ref:
        parts.append(f"only {sides.ref} has {_listed(only_ref)}")
    if only_other:
        parts.append(f"only {sides.verb('has', 'have')} {_listed(only_other)}")
    details = {
        "only_reference": [t.name for t in only_ref],
        "only_other": [t.name for t in only_other],
        "first_divergence": _first_divergence(ref_list, other_list),
    }
    tensors = [t.name for t in only_ref] + [t.name for t in only_other]
    return tensors, details, f"{kind.phrase}: {'; '.join(parts)}"


# (the attribute, as compared; as JSON; as a person reads it)
_SHAPE = (lambda t: t.shape, lambda t: list(t.shape), format_shape)
_DTYPE = (lambda t: t.dtype, lambda t: t.dtype, str)
_FIELDS = {
    FindingKind.BUFFER_SHAPE: _SHAPE,
    FindingKind.PARAM_SHAPE: _SHAPE,
    FindingKind.BUFFER_DTYPE: _DTYPE,
    FindingKind.PARAM_DTYPE: _DTYPE,
    FindingKind.BUFFER_PERSISTENCE: (
        lambda t: t.persistent,
        lambda t: t.persistent,
        lambda v: {True: "persistent", False: "non-persistent"}.get(v, "of unknown persistence"),
    ),
    FindingKind.PARAM_PLACEMENT: (
        lambda t: t.placements,
        lambda t: None if t.placements is None else list(t.placements),
        lambda v: "not sharded" if v is None else "[" + ", ".join(v) + "]",
    ),
}


def _field_difference(out: dict, kind: FindingKind, ref_list, other_list, sides: _Sides) -> None:
    """Per common name, one attribute (shape, dtype, persistence, placement) that differs."""
    get, jsonable, show = _FIELDS[kind]
    others = {t.name: t for t in other_list}
    diffs = []
    for a in ref_list:
        b = others.get(a.name)
        if b is not None and get(a) != get(b):
            diffs.append((a, b))
    if not diffs:
        return
    text = clauses(
        diffs,
        lambda d: (
            f"{d[0].name} is {show(get(d[0]))} on {sides.ref} but {show(get(d[1]))} on "
            f"{sides.other}"
        ),
        _LISTED,
    )
    details = {
        "differences": [
            {"name": a.name, "reference": jsonable(a), "other": jsonable(b)} for a, b in diffs
        ]
    }
    out[kind] = ([a.name for a, _ in diffs], details, f"{kind.phrase}: {text}")


_RANKS_SHOWN = 8


def _mesh_text(t: TensorRecord, mesh: MeshRecord, ranks: bool) -> str:
    names = ", ".join(mesh.dim_names or ()) or "unnamed dims"
    text = f"[{', '.join(t.placements or ())}] on mesh {format_shape(mesh.shape)} ({names})"
    if ranks:
        shown = ", ".join(map(str, mesh.ranks[:_RANKS_SHOWN]))
        text += f" of ranks [{shown}{', ...' if len(mesh.ranks) > _RANKS_SHOWN else ''}]"
    return text


def _mesh_dict(mesh: MeshRecord, ranks: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"shape": list(mesh.shape), "dim_names": list(mesh.dim_names or ())}
    return {**out, "ranks": list(mesh.ranks)} if ranks else out


def _mesh_difference(out: dict, ref: RankRecord, other: RankRecord, sides: _Sides) -> None:
    """Per common parameter with equal placements (other placements are the field's): a mesh
    of another shape or other dim names, or, between two ranks that share the mesh (one is on
    the other's), another rank list. Folded into ``param-placement``: the same tensor is cut
    along other dims or over other ranks. Sub-meshes' rank lists differ by design elsewhere."""
    if ref.post_wrap is None or other.post_wrap is None:
        return
    theirs = {t.name: t for t in other.post_wrap.params}
    me, them = sides.ref_rank, sides.ranks[0]
    diffs = []
    for a in ref.post_wrap.params:
        b = theirs.get(a.name)
        if b is None or a.placements != b.placements:
            continue
        ma, mb = param_mesh(ref, a), param_mesh(other, b)
        if ma is None or mb is None:
            continue  # nothing recorded to compare
        # Two ranks on one mesh see one rank list; a sub-mesh of ranks apart is another mesh.
        ranks = (them in ma.ranks or me in mb.ranks) and ma.ranks != mb.ranks
        if ranks or (ma.shape, ma.dim_names) != (mb.shape, mb.dim_names):
            diffs.append((a, b, ma, mb, ranks))
    if not diffs:
        return
    text = clauses(
        diffs,
        lambda d: (
            f"{d[0].name} is {_mesh_text(d[0], d[2], d[4])} on {sides.ref} but "
            f"{_mesh_text(d[1], d[3], d[4])} on {sides.other}"
        ),
        _LISTED,
    )
    found = [
        {
            "name": a.name,
            "reference": list(a.placements or ()),
            "other": list(b.placements or ()),
            "reference_mesh": _mesh_dict(ma, r),
            "other_mesh": _mesh_dict(mb, r),
        }
        for a, b, ma, mb, r in diffs
    ]
    kind = FindingKind.PARAM_PLACEMENT
    tensors, details, summary = out.get(kind, ([], {"differences": []}, kind.phrase))
    out[kind] = (
        [*tensors, *(a.name for a, *_ in diffs)],
        {**details, "differences": [*details["differences"], *found]},
        f"{summary}; {text}" if kind in out else f"{kind.phrase}: {text}",
    )


def _moved(ref_names: Sequence[str], other_names: Sequence[str]) -> list[str] | None:
    """Common names whose position among the common names differs; None if the order agrees."""
    common = set(ref_names) & set(other_names)
    ref_common = [n for n in ref_names if n in common]
    other_common = [n for n in other_names if n in common]
    if ref_common == other_common:
        return None
    position = {n: i for i, n in enumerate(other_common)}
    return [n for i, n in enumerate(ref_common) if position[n] != i]


def _order_difference(kind: FindingKind, ref_list, other_list, sides: _Sides) -> tuple | None:
    moved = _moved([t.name for t in ref_list], [t.name for t in other_list])
    if moved is None:
        return None
    first = _first_divergence(ref_list, other_list)
    i = first["index"] if first else 0
    a = ref_list[i] if i < len(ref_list) else None
    b = other_list[i] if i < len(other_list) else None
    summary = (
        f"{kind.phrase} at index {i}: {sides.ref} has {describe(a)}, "
        f"{sides.verb('has', 'have')} {describe(b)}"
    )
    return moved, {"first_divergence": first, "moved": moved}, summary


def _state_dict_order(ref_keys: Sequence[str], other_keys: Sequence[str], sides: _Sides):
    if set(ref_keys) != set(other_keys) or list(ref_keys) == list(other_keys):
        return None
    i = next(i for i, (a, b) in enumerate(zip(ref_keys, other_keys, strict=False)) if a != b)
    moved = _moved(ref_keys, other_keys) or []
    details = {
        "first_divergence": {"index": i, "reference": ref_keys[i], "other": other_keys[i]},
        "moved": moved,
    }
    summary = (
        f"{FindingKind.STATE_DICT_ORDER.phrase} at index {i}: {sides.ref} walks {ref_keys[i]}, "
        f"{sides.verb('walks', 'walk')} {other_keys[i]}"
    )
    return moved, details, summary


def _state_dict_keys(a: Fingerprint, b: Fingerprint, sides: _Sides) -> tuple | None:
    """State-dict keys on one side only that no buffer or parameter explains: a module's
    ``get_extra_state`` (``..._extra_state``), a state-dict hook, a renamed key. A key that is a
    tensor's name on either side is the set, persistence or tie finding's to tell."""
    tensors = {
        name
        for fp in (a, b)
        for name in (*(t.name for t in (*fp.buffers, *fp.params)), *(n for n, _ in fp.aliases))
    }
    ref_keys, other_keys = set(a.state_dict_keys), set(b.state_dict_keys)
    only_ref = [k for k in a.state_dict_keys if k not in other_keys and k not in tensors]
    only_other = [k for k in b.state_dict_keys if k not in ref_keys and k not in tensors]
    if not only_ref and not only_other:
        return None
    parts = [
        f"only {who} {_names(keys)}"
        for keys, who in ((only_ref, f"{sides.ref} has"), (only_other, sides.verb("has", "have")))
        if keys
    ]
    details = {"only_reference": only_ref, "only_other": only_other}
    summary = (
        f"{FindingKind.STATE_DICT_KEYS.phrase}: {'; '.join(parts)} (not a buffer or parameter: "
        "get_extra_state, a state-dict hook or a renamed key)"
    )
    return [*only_ref, *only_other], details, summary


def _names(names: Sequence[str]) -> str:
    text = ", ".join(names[:_LISTED])
    if len(names) > _LISTED:
        text += f" and {len(names) - _LISTED} more"
    return text
