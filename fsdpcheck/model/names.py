"""Canonical tensor names: the levels that ``torch.compile``, activation checkpointing, FSDP1
and DDP add to a name left out, so that ranks that wrap differently still pair the same tensors
(:mod:`fsdpcheck.model.wrappers` records the levels on the rank; the ``wrapper`` check,
:mod:`fsdpcheck.checks.wrapper`, reports the difference). Pure functions over
:mod:`fsdpcheck.records`.
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from dataclasses import replace

from fsdpcheck.records import (
    Fingerprint,
    FsdpPlanRecord,
    Gathered,
    ModuleStateRecord,
    OptimizerRecord,
    RankRecord,
    TensorRecord,
)

# Levels a wrapper inserts anywhere in a name; DDP's ``module`` only at the root, and only on a
# rank whose record says its root is DDP (a user's own submodule may be called ``module``).
WRAPPER_LEVELS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
DDP_LEVEL = "module"


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
