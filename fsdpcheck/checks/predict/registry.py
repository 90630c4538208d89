"""Every loader fsdpcheck models, keyed by :class:`~fsdpcheck.vocab.Loader`, and the one entry
point that predicts them all over the same pairing walk."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import ModuleType

from fsdpcheck.checks.groups import reference_group, usable_groups
from fsdpcheck.checks.predict import (
    dcp_broadcast,
    ddp_sync,
    named_buffers_order,
    sorted_names,
    state_dict_order,
)
from fsdpcheck.checks.predict.pairing import Context
from fsdpcheck.model.names import canonical_record, state_dict_record
from fsdpcheck.records import EnvRecord, Group, LoaderPrediction, RankRecord
from fsdpcheck.vocab import RESOLVED_BACKENDS, Backend, Loader

BACKENDS = RESOLVED_BACKENDS  # what a prediction is for: the backends a group really runs on


@dataclass(frozen=True)
class LoaderModel:
    """One loader: what it does, who runs it, and its prediction over the pairing walk."""

    description: str
    products: str  # who runs this algorithm: what a user reads to find their own row
    predict: Callable[[Context], LoaderPrediction]
    installed: Callable[[EnvRecord], str] | None = None  # the versions on the reference rank
    # The names it pairs by where wrappers rename tensors (fsdpcheck.checks.wrapper): canonical
    # (by position, or DCP's FQNs, which leave wrapper levels out) or "state-dict" (the keys of
    # model.state_dict(), which keep torch.compile's _orig_mod).
    names: str = "canonical"


def _model(module: ModuleType) -> LoaderModel:
    return LoaderModel(
        module.DESCRIPTION,
        module.PRODUCTS,
        module.predict,
        getattr(module, "installed", None),
        getattr(module, "NAMES", "canonical"),
    )


# In report order (the order of :class:`Loader`).
REGISTRY: dict[Loader, LoaderModel] = {
    Loader.NAMED_BUFFERS_ORDER: _model(named_buffers_order),
    Loader.STATE_DICT_ORDER: _model(state_dict_order),
    Loader.DDP_SYNC: _model(ddp_sync),
    Loader.DCP_BROADCAST: _model(dcp_broadcast),
    Loader.SORTED_NAMES: _model(sorted_names),
}
LOADERS: dict[str, str] = {name: m.description for name, m in REGISTRY.items()}
PRODUCTS: dict[str, str] = {name: m.products for name, m in REGISTRY.items()}


def predict_loaders(
    groups: Sequence[Group],
    records: Mapping[int, RankRecord],
    meta_ranks: Iterable[int] = (),
    backend: str = Backend.NCCL,
) -> list[LoaderPrediction]:
    """One prediction per loader in :data:`LOADERS` order; empty if no group is usable.

    ``records`` needs only each group's representative. Device is not part of the group digest,
    so a rank built on ``meta`` can share a group with a real rank 0: pass such ranks as
    ``meta_ranks`` (or their records) for ``dcp-broadcast`` to see them. ``backend`` is the one
    the ranks run on, and ``verdict`` is for it; where the other backend does otherwise it is
    beside it (``on_nccl`` on gloo, ``on_gloo`` on NCCL). They part ways on a broadcast into a
    larger buffer: NCCL blocks (``hang``), gloo fills its first bytes and leaves the rest
    (``silent-corruption``); a message larger than the buffer aborts gloo (``hang``: the job
    stops there).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: one of {', '.join(BACKENDS)}")
    reference = reference_group(groups, records)
    if reference is None:
        return []
    others = [g for g in usable_groups(groups, records) if g is not reference]
    views = {}
    for names, view in (("canonical", canonical_record), ("state-dict", state_dict_record)):
        named = {rank: view(record) for rank, record in records.items()}
        pairs = [(g, named[g.representative]) for g in others]
        ref = named[reference.representative]
        views[names] = Context(reference, ref, pairs, backend, named, frozenset(meta_ranks))
    ref = records[reference.representative]
    predictions = _predict(views)
    other = Backend.GLOO if backend == Backend.NCCL else Backend.NCCL
    beside = _predict({k: replace(c, backend=other) for k, c in views.items()})
    field = "on_gloo" if other == Backend.GLOO else "on_nccl"
    return [
        replace(
            p,
            backend=str(backend),
            products=products(p.name, ref.env),
            **({field: g.verdict} if g.verdict != p.verdict else {}),
        )
        for p, g in zip(predictions, beside, strict=True)
    ]


def backend_of(records: Mapping[int, RankRecord]) -> str:
    """The backend the lowest rank at hand recorded (``cpu:gloo,cuda:nccl`` counts as NCCL: the
    weights a loader moves live on the GPU); NCCL where none is recorded (offline files)."""
    text = (records[min(records)].env.backend or "").lower() if records else ""
    return Backend.GLOO if "gloo" in text and "nccl" not in text else Backend.NCCL


def _predict(views: Mapping[str, Context]) -> list[LoaderPrediction]:
    return [model.predict(views[model.names]) for model in REGISTRY.values()]


def products(name: str, env: EnvRecord | None = None) -> str:
    """Who runs loader ``name``, with the versions installed on the reference rank."""
    model = REGISTRY.get(name)
    if model is None:
        return ""
    if env is None or model.installed is None:
        return model.products
    return f"{model.products}; {model.installed(env)}"
