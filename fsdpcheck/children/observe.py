"""``--reproduce``: run every known loader for real, each once, in its own bounded 2-rank child
job on gloo, and say what it did (:mod:`fsdpcheck.checks.observed` classifies; the
named-buffers-order row's detail shows which buffers got whose values).

Rank 1 of each job stands for the first group of ranks that differs from rank 0's, with that
group's hash seed; the model is built as the audit built it (the same ``--init``, ``--dtype``,
``--text-only``, trust and pickle settings). The jobs run one after another within ``budget``
seconds in all; whatever is left is shared by the jobs still to run, so a fast loader leaves more
time to the next, and no job outlives the budget (the launcher kills each job's process groups).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from fsdpcheck.checks.observed import Observation, classify
from fsdpcheck.children.jobs import ChildSpec, run_job
from fsdpcheck.children.loaders import MODULE, RUNNERS, accelerate_version
from fsdpcheck.options import child_collective_timeout

MIN_JOB_SECONDS = 8.0  # below this a job cannot even import torch on a busy machine


def observe_loaders(
    spec: ChildSpec,
    *,
    seeds: Sequence[int] = (0, 1),
    budget: float = 300.0,
    loaders: Iterable[str] | None = None,
) -> dict[str, Observation]:
    """One :class:`Observation` per loader (every one of :data:`RUNNERS` unless ``loaders``)."""
    names = list(loaders) if loaders is not None else list(RUNNERS)
    out: dict[str, Observation] = {}
    if spec.init == "meta":
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
            seeds=seeds,
            deadline=deadline,
            collective_timeout=child_collective_timeout(deadline),
        )
        out[name] = classify(name, runs, elapsed)
    return {n: out[n] for n in names}


def job_seeds(hash_seeds: Sequence[str]) -> tuple[int, int]:
    """Hash seeds for the job's two ranks from the audit's groups' (rank 0's group first): the
    first two when both are numbers; one seed twice when every rank agreed; else (0, 1)."""
    numeric = [int(s) for s in hash_seeds if s.isdigit()]
    if len(hash_seeds) == 1:
        return (numeric[0], numeric[0]) if numeric else (0, 0)
    if len(numeric) >= 2 and len(numeric) == len(hash_seeds):
        return numeric[0], numeric[1]
    return 0, 1
