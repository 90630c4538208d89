"""``wrapper``: activation checkpointing or ``torch.compile`` wraps different modules on some
ranks, and the names the wrappers add.

``torch.compile(m)`` puts ``m`` under ``_orig_mod``, ``checkpoint_wrapper`` under
``_checkpoint_wrapped_module`` (FSDP1 under ``_fsdp_wrapped_module``, DDP under ``module``): a
rank that wraps where another does not names every tensor below differently. Loaders see
those raw names, so the difference is a hazard for every loader keyed by names; but the
tensors are the same ones. The other checks therefore pair tensors by their *canonical* names
(:func:`canonical_record`: the wrapper levels left out), and this check alone reports the
raw-name difference, naming which ranks wrap what. Pure functions over
:mod:`fsdpcheck.records`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import replace
from typing import Any

from fsdpcheck.records import (
    Finding,
    Fingerprint,
    FsdpPlanRecord,
    Gathered,
    ModuleStateRecord,
    OptimizerRecord,
    RankRecord,
    TensorRecord,
    WrapperRecord,
)
from fsdpcheck.text import name_list, ranks_label
from fsdpcheck.vocab import Cause, FindingKind, Snapshot

# Levels a wrapper inserts anywhere in a name; DDP's ``module`` only at the root, and only on a
# rank whose record says its root is DDP (a user's own submodule may be called ``module``).
WRAPPER_LEVELS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
DDP_LEVEL = "module"
_LISTED = 3


def canonical_name(
    name: str, *, ddp_root: bool = False, levels: Sequence[str] = WRAPPER_LEVELS
) -> str:
    """``name`` without wrapper levels: ``model.layers.0._checkpoint_wrapped_module.mlp.w``
    → ``model.layers.0.mlp.w``; ``_orig_mod.lm_head.weight`` → ``lm_head.weight``. DCP names
    tensors this way too (its FQNs leave these levels out)."""
    parts = name.split(".")
    if ddp_root and parts and parts[0] == DDP_LEVEL:
        parts = parts[1:]
    return ".".join(p for p in parts if p not in levels)


def renames(record: RankRecord) -> bool:
    """The rank recorded wrapper levels in its names: its record is paired by canonical names."""
    return record.wrappers is not None and any(r.names or r.keys for r in record.wrappers.renamed)


def state_dict_record(record: RankRecord) -> RankRecord:
    """``record`` with its tensors named as ``model.state_dict()`` names them: without the
    levels the state dict leaves out (``_checkpoint_wrapped_module``), with those it keeps
    (``_orig_mod``): what a loader keyed by ``state_dict()`` keys pairs."""
    if not renames(record):
        return record
    return canonical_record(record, keep={r.level for r in record.wrappers.renamed if r.keys})


def canonical_record(record: RankRecord, keep: Set[str] = frozenset()) -> RankRecord:
    """``record`` with every tensor and module name canonical (but for the levels in ``keep``),
    where the rank itself recorded wrapper levels in them (:class:`WrapperRecord`); else
    ``record`` unchanged. The wrapper record stays as it is: it is what
    :func:`wrapper_findings` compares."""
    if not renames(record):
        return record
    ddp = DDP_LEVEL not in keep and any(r.level == DDP_LEVEL for r in record.wrappers.renamed)
    dropped = tuple(level for level in WRAPPER_LEVELS if level not in keep)

    def name(n: str) -> str:
        return canonical_name(n, ddp_root=ddp, levels=dropped)

    def names(ns: Sequence[str]) -> tuple[str, ...]:
        return tuple(name(n) for n in ns)

    def tensors(ts: Sequence[TensorRecord]) -> tuple[TensorRecord, ...]:
        return tuple(replace(t, name=name(t.name)) for t in ts)

    def fingerprint(fp: Fingerprint | None) -> Fingerprint | None:
        if fp is None:
            return None
        return replace(
            fp,
            buffers=tensors(fp.buffers),
            params=tensors(fp.params),
            state_dict_keys=names(fp.state_dict_keys),
            aliases=tuple((name(a), name(b)) for a, b in fp.aliases),
        )

    def plan(p: FsdpPlanRecord | None) -> FsdpPlanRecord | None:
        if p is None:
            return None
        groups = tuple(
            replace(g, modules=names(g.modules), params=names(g.params)) for g in p.groups
        )
        return replace(p, groups=groups)

    def modules(m: ModuleStateRecord | None) -> ModuleStateRecord | None:
        # A wrapper module and the module it wraps share a canonical name: the wrapped one,
        # met after its wrapper, is what the name stands for.
        if m is None:
            return None
        last = {name(n): i for n, i in m.modules}
        return replace(m, modules=tuple(last.items()))

    def optimizer(o: OptimizerRecord | None) -> OptimizerRecord | None:
        if o is None:
            return None
        return replace(
            o,
            groups=tuple(replace(g, params=names(g.params)) for g in o.groups),
            states=tuple(replace(st, param=name(st.param)) for st in o.states),
            resumed=tuple(replace(m, param=name(m.param) if m.param else "") for m in o.resumed),
        )

    def misplaced(entry: str) -> str:
        tensor, sep, device = entry.rpartition(":")
        return f"{name(tensor)}{sep}{device}" if sep else name(entry)

    return replace(
        record,
        pre_wrap=fingerprint(record.pre_wrap),
        post_wrap=fingerprint(record.post_wrap),
        fsdp_plan=plan(record.fsdp_plan),
        misplaced=tuple(misplaced(m) for m in record.misplaced),
        ties=tuple(
            replace(
                t,
                shared=tuple(tuple(sorted(names(g))) for g in t.shared),
                expected=tuple((name(a), name(b)) for a, b in t.expected),
                buffers=tuple(tuple(sorted(names(g))) for g in t.buffers),
            )
            for t in record.ties
        ),
        uninitialized=tuple(replace(p, name=name(p.name)) for p in record.uninitialized),
        non_finite=tuple(replace(n, name=name(n.name)) for n in record.non_finite),
        modules=modules(record.modules),
        optimizer=optimizer(record.optimizer),
    )


def canonical_gathered(gathered: Gathered | None) -> Gathered | None:
    """Every record of ``gathered`` by :func:`canonical_record` (itself when none renames)."""
    if gathered is None:
        return None
    everyone = (*gathered.records.values(), *(gathered.extra or {}).values())
    if not any(renames(r) for r in everyone):
        return gathered
    extra = gathered.extra
    return replace(
        gathered,
        records={r: canonical_record(rec) for r, rec in gathered.records.items()},
        extra=None if extra is None else {r: canonical_record(rec) for r, rec in extra.items()},
    )


# ---------------------------------------------------------------- the check


def wrapper_findings(
    ref_rank: int, ref: RankRecord, ranks: Sequence[int], other: RankRecord
) -> list[Finding]:
    """At most one finding: the modules only one side checkpoints or compiles, and the wrapper
    levels in one side's names that the other's lack. Nothing where neither side read its
    wrappers (a record from before they were recorded)."""
    a, b = ref.wrappers, other.wrappers
    if a is None and b is None:
        return []
    a, b = a or WrapperRecord(), b or WrapperRecord()
    ref_label, other_label = f"rank {ref_rank}", ranks_label(ranks)
    theirs = {(m.name, m.how) for m in b.modules}
    mine = {(m.name, m.how) for m in a.modules}
    only_ref = [m for m in a.modules if (m.name, m.how) not in theirs]
    only_other = [m for m in b.modules if (m.name, m.how) not in mine]
    levels = _level_differences(a, b)
    if not only_ref and not only_other and not levels:
        return []
    parts = [
        f"{who} {_wraps(modules)} and {whom} does not"
        for who, whom, modules in (
            (ref_label, other_label, only_ref),
            (other_label, ref_label, only_other),
        )
        if modules
    ]
    if levels:
        shown = "; ".join(
            f"{d['level']}. in {d['reference']['names']} names on {ref_label}, "
            f"{d['other']['names']} on {other_label}"
            for d in levels
        )
        keys = any(d["reference"]["keys"] != d["other"]["keys"] for d in levels)
        parts.append(
            f"tensor names differ by wrapper levels ({shown}), compared here without them; "
            + (
                "model.state_dict() keys differ too: a loader or checkpoint keyed by them "
                "(fsdpcheck's sorted loader, a state_dict() saved on another rank) finds none "
                "of these tensors there (DCP's names leave the level out)"
                if keys
                else "the state dict leaves the level out, named_parameters() does not: code "
                "that pairs by parameter names (optimizer state, parameter filters) differs"
            )
        )
    details: dict[str, Any] = {
        "only_reference": [_module(m) for m in only_ref],
        "only_other": [_module(m) for m in only_other],
        "levels": levels,
    }
    snapshot = Snapshot.POST_WRAP if ref.post_wrap and other.post_wrap else Snapshot.PRE_WRAP
    both_pre = ref.pre_wrap is not None and other.pre_wrap is not None
    return [
        Finding(
            kind=FindingKind.WRAPPER,
            ranks=tuple(ranks),
            reference_rank=ref_rank,
            snapshot=snapshot,
            cause=Cause.CONSTRUCTION_TIME if both_pre else Cause.UNKNOWN,
            summary=f"{FindingKind.WRAPPER.phrase}: " + "; ".join(parts),
            tensors=tuple(dict.fromkeys(m.name for m in (*only_ref, *only_other))),
            details=details,
        )
    ]


def _wraps(modules: Sequence[Any]) -> str:
    by_how: dict[str, list[str]] = {}
    for m in modules:
        by_how.setdefault(str(m.how), []).append(m.name or "the root")
    return "; ".join(f"wraps {name_list(names, _LISTED)} in {how}" for how, names in by_how.items())


def _module(m: Any) -> dict[str, str]:
    return {"name": m.name, "how": str(m.how)}


def _level_differences(a: WrapperRecord, b: WrapperRecord) -> list[dict[str, Any]]:
    mine: Mapping[str, Any] = {r.level: r for r in a.renamed}
    theirs: Mapping[str, Any] = {r.level: r for r in b.renamed}
    out = []
    for level in dict.fromkeys([*mine, *theirs]):
        x, y = mine.get(level), theirs.get(level)
        counts = [(r.names, r.keys) if r is not None else (0, 0) for r in (x, y)]
        if counts[0] != counts[1]:
            out.append(
                {
                    "level": level,
                    "reference": {"names": counts[0][0], "keys": counts[0][1]},
                    "other": {"names": counts[1][0], "keys": counts[1][1]},
                }
            )
    return out
