"""A rank's record from its live model: one look (its fingerprint, ties, buffer problems and
device meshes) and its state beyond its tensors (the live FSDP2 plan, the canonical config,
the tensors it holds on a device its job cannot use). Used by the audit, ``check_model``,
``save_fingerprint`` and ``fingerprint``, on the rank itself, so each writes the same record."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from fsdpcheck.model.config_record import config_record
from fsdpcheck.model.fingerprint import fingerprint
from fsdpcheck.model.fsdp_plan import fsdp_plan
from fsdpcheck.model.keys import misplaced, replica_keys, sibling_key
from fsdpcheck.model.module_state import module_state, numerics_record
from fsdpcheck.model.state import buffer_problems, buffer_reference, mesh_records, tie_record
from fsdpcheck.model.wrappers import wrapper_record
from fsdpcheck.records import (
    BufferProblem,
    EnvRecord,
    Fingerprint,
    MeshRecord,
    RankError,
    RankRecord,
    SourceRecord,
    TieRecord,
)
from fsdpcheck.vocab import Snapshot

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Look:
    """What one look at a live model saw."""

    fingerprint: Fingerprint
    ties: TieRecord
    uninitialized: tuple[BufferProblem, ...] = ()
    meshes: tuple[MeshRecord, ...] = ()  # () until FSDP2 (or TP) has made DTensors


def snapshot_now(model: nn.Module) -> Snapshot:
    """``post-wrap`` once FSDP2 has sharded ``model`` (its parameters are DTensors)."""
    wrapped = any(hasattr(p, "placements") for p in model.parameters())
    return Snapshot.POST_WRAP if wrapped else Snapshot.PRE_WRAP


def look(
    model: nn.Module, snapshot: Snapshot, *, param_values: bool = False, buffers: bool = True
) -> Look:
    """``model`` as it is now. ``param_values``: digests of the parameters' values too (of the
    local shard), to compare them across ranks; ``buffers``: check the buffers against what
    the model's config computes (the audit does that after its load instead)."""
    problems = buffer_problems(model, snapshot, buffer_reference(model)) if buffers else ()
    return Look(
        fingerprint=fingerprint(model, snapshot, param_values=param_values),
        ties=tie_record(model, snapshot),
        uninitialized=problems,
        meshes=mesh_records(model),
    )


def rank_record(
    env: EnvRecord,
    *looks: Look | None,
    error: RankError | None = None,
    model: nn.Module | None = None,
    config: Any = None,
    source: SourceRecord | None = None,
) -> RankRecord:
    """The record of what ``looks`` saw (at most one per snapshot; None: a look that failed),
    with ``model``'s state beyond its tensors (:func:`with_state`) when it is given, and what
    the rank built it from (``source``)."""
    seen = [found for found in looks if found is not None]
    fingerprints = {found.fingerprint.snapshot: found.fingerprint for found in seen}
    # Which ranks must agree: from the latest look that holds DTensors.
    latest = next((found for found in reversed(seen) if found.meshes), None)
    shard_key, peer_key = (
        replica_keys(latest.fingerprint.params, latest.meshes) if latest else (None, None)
    )
    siblings = sibling_key(latest.fingerprint.params, latest.meshes) if latest else None
    record = RankRecord(
        env=env,
        pre_wrap=fingerprints.get(Snapshot.PRE_WRAP),
        post_wrap=fingerprints.get(Snapshot.POST_WRAP),
        error=error,
        ties=tuple(found.ties for found in seen),
        uninitialized=tuple(p for found in seen for p in found.uninitialized),
        shard_key=shard_key,
        peer_key=peer_key,
        sibling_key=siblings,
        meshes=latest.meshes if latest else (),
        source=source,
    )
    return record if model is None else with_state(record, model, config)


def model_record(model: nn.Module, env: EnvRecord, *, param_values: bool = False) -> RankRecord:
    """A training script's ``model`` as it is now (``post-wrap`` when FSDP2 has sharded it),
    with everything a rank record holds: what ``check_model`` and ``save_fingerprint`` record."""
    config = getattr(model, "config", None)
    seen = look(model, snapshot_now(model), param_values=param_values)
    return rank_record(env, seen, model=model, config=config)


def with_state(record: RankRecord, model: Any, config: Any) -> RankRecord:
    """``record`` with ``fsdp_plan``, ``config``, ``wrappers``, ``modules``, ``numerics`` and
    ``misplaced`` filled in.

    None of them may fail a rank: each reads only what is there (a plan that torch does not
    expose says so inside the record) and is left out when it cannot be read. A record that
    already carries an error is returned as it is: its digest is the error's."""
    if record.error is not None:
        return record
    try:
        record = replace(record, fsdp_plan=fsdp_plan(model))
    except Exception:  # fsdp_plan catches its own; this is the last line of defence
        log.debug("the FSDP2 plan could not be read", exc_info=True)
    try:
        record = replace(record, config=config_record(config))
    except Exception:  # a config without a usable dict form: nothing to compare
        log.debug("the config could not be recorded", exc_info=True)
    try:
        record = replace(record, wrappers=wrapper_record(model))
    except Exception:  # a wrapper that cannot be walked: the names still are compared raw
        log.debug("the wrappers could not be read", exc_info=True)
    try:
        record = replace(record, modules=module_state(model))
    except Exception:  # a module that cannot be walked: its tensors are still compared
        log.debug("the modules' state could not be read", exc_info=True)
    try:
        record = replace(record, numerics=numerics_record())
    except Exception:  # each switch reads on its own; this is the last line of defence
        log.debug("the numerics switches could not be read", exc_info=True)
    return replace(record, misplaced=misplaced(record))
