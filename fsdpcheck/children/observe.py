"""``--reproduce``: run every known loader for real, each once, in its own bounded 2-rank child
job on gloo, and say what it did (:mod:`fsdpcheck.checks.observed` classifies; the
named-buffers-order row's detail shows which buffers got whose values).

Rank 1 of each job stands for the first group of ranks that differs from rank 0's: it builds
what that group's representative built (its hash seed, its own model directory where this host
has it, its dtype, its config where it differs from rank 0's), the rest as the audit built it
(the same ``--init``, ``--text-only``, trust and pickle settings). The jobs run one after
another within ``budget`` seconds in all; whatever is left is shared by the jobs still to run,
so a fast loader leaves more time to the next, and no job outlives the budget (the launcher
kills each job's process groups).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fsdpcheck.checks.observed import Observation, classify
from fsdpcheck.children.jobs import ChildSpec, StandIn, run_job
from fsdpcheck.children.loaders import MODULE, RUNNERS, accelerate_version
from fsdpcheck.model.config_record import REDACTED
from fsdpcheck.options import child_collective_timeout
from fsdpcheck.vocab import Init

MIN_JOB_SECONDS = 8.0  # below this a job cannot even import torch on a busy machine


def observe_loaders(
    spec: ChildSpec,
    *,
    seeds: Sequence[int] = (0, 1),
    stand_ins: Sequence[StandIn] | None = None,
    budget: float = 300.0,
    loaders: Iterable[str] | None = None,
) -> dict[str, Observation]:
    """One :class:`Observation` per loader (every one of :data:`RUNNERS` unless ``loaders``).
    The job's ranks are ``stand_ins`` (see :func:`stand_ins_for`), or, without them, ranks
    built alike under ``seeds``."""
    if stand_ins is None:
        stand_ins = [StandIn(rank, seed) for rank, seed in enumerate(seeds)]
    names = list(loaders) if loaders is not None else list(RUNNERS)
    out: dict[str, Observation] = {}
    if spec.init == Init.META:
        why = "--init meta: rank 0 holds no weights, so no loader has anything to load"
        return {n: Observation(n, None, {"summary": why}) for n in names}
    start = time.monotonic()
    runnable = [n for n in names if n != "state-dict-order" or accelerate_version() is not None]
    for name in names:
        if name not in runnable:
            why = "accelerate is not installed (pip install 'fsdpcheck[accelerate]')"
            out[name] = Observation(name, None, {"summary": why})
    for i, name in enumerate(runnable):
        left = budget - (time.monotonic() - start)
        deadline = left / (len(runnable) - i)
        if deadline < MIN_JOB_SECONDS:
            why = f"not run: {max(left, 0):.0f}s of the --reproduce budget left"
            out[name] = Observation(name, None, {"summary": why})
            continue
        runs, elapsed = run_job(
            MODULE,
            name,
            spec,
            stand_ins=stand_ins,
            deadline=deadline,
            collective_timeout=child_collective_timeout(deadline),
        )
        out[name] = classify(name, runs, elapsed)
    return {n: out[n] for n in names}


def stand_ins_for(records: Mapping[int, Any]) -> tuple[StandIn, StandIn]:
    """The job's two ranks from the audit's gathered records (rank 0's group first): rank 0,
    and the first rank that differs from it (rank 0 twice when every rank agreed).

    Hash seeds are the ranks' own when both are numbers (else 0 and 1: the order then differs
    as it may have). The other rank keeps its own directory when this host has one there, and
    sets each top-level config key it read otherwise than rank 0."""
    ranks = sorted(records)
    ref = records[ranks[0]]
    other = records[ranks[1]] if len(ranks) > 1 else ref
    seeds = [ref.env.hash_seed, other.env.hash_seed]
    numeric = all(s.isdigit() for s in seeds)
    hash_seeds = [int(s) for s in seeds] if numeric else [0, 0 if other is ref else 1]
    return (
        StandIn(ref.env.rank, hash_seeds[0], dtype=_dtype(ref)),
        StandIn(
            other.env.rank,
            hash_seeds[1],
            model=_own_directory(other),
            dtype=_dtype(other),
            config=_config_changes(ref, other),
        ),
    )


def _dtype(record: Any) -> str | None:
    return record.source.dtype if record.source is not None else None


def _own_directory(record: Any) -> str | None:
    path = record.source.path if record.source is not None else None
    return path if path is not None and Path(path, "config.json").is_file() else None


def _config_changes(ref: Any, other: Any) -> dict[str, Any]:
    """Top-level keys of ``other``'s canonical config whose value is not ``ref``'s."""
    if ref.config is None or other.config is None or ref.config.digest == other.config.digest:
        return {}
    mine, theirs = ref.config.canonical, other.config.canonical
    return {
        key: value
        for key, value in theirs.items()
        if mine.get(key) != value and REDACTED not in repr(value)
    }
