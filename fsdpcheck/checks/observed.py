"""What a loader really did in its child job, in the predictions' vocabulary; and where the
prediction was wrong. Pure: functions over the ranks' exits, stage marks and JSON records.

- ``hang``: a rank was still inside the loader's collectives at the deadline, or left them with
  a collective failure (a timeout, a vanished peer), or gloo aborted it there (a size mismatch:
  gloo aborts the receiver, NCCL would block until its watchdog);
- ``refused``: the loader raised a clear exception of its own on some rank, and no rank was
  aborted for a mismatched collective;
- ``silent-corruption``: every rank finished, and a tensor differs from what rank 0 holds (or
  sent) under the same name;
- ``uninitialized``: every rank finished, and a non-persistent buffer of a rank built on meta
  differs from its own module's reference and holds no value anyone computed;
- ``None``: the job says nothing about the loader (a rank failed or was too slow before it).

When every rank finished, the detail also shows each rank's buffers value by value
(:func:`buffer_values`): which buffer holds whose values, e.g. the RoPE table of another
attention type after the named-buffers-order loader paired them by each rank's own order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from fsdpcheck.records import Finding, LoaderPrediction, LoaderRecord, RankError
from fsdpcheck.vocab import (
    ChildStage,
    ErrorKind,
    FindingKind,
    LoaderFailure,
    LoaderVerdict,
    Stage,
)

LOADING = ChildStage.LOADING  # the only stage inside the loader's own collectives
_LISTED = 8  # differing tensors kept in the detail
_GARBAGE = "holds uninitialised memory (built on meta, never loaded)"


@dataclass(frozen=True)
class RankRun:
    """One rank of one loader job, as the parent saw it."""

    rank: int
    returncode: int | None  # None: killed at the deadline
    signal: str | None
    stage: ChildStage | None  # the last stage it marked
    last_error: str  # the most telling stderr line
    record: LoaderRecord | None = field(default=None)  # what it emitted, if it got so far

    @property
    def error(self) -> Any:
        """The error its child reported (a :class:`~fsdpcheck.records.LoaderError`), if any."""
        return self.record.error if self.record is not None else None

    hash_seed: int | None = None  # its PYTHONHASHSEED
    stands_for: int | None = None  # the audit rank whose build it repeated


@dataclass(frozen=True)
class Observation:
    loader: str
    verdict: str | None  # None: the job did not get as far as the loader
    detail: Mapping[str, Any] = field(default_factory=dict)


def classify(loader: str, runs: Sequence[RankRun], elapsed: float = 0.0) -> Observation:
    """The outcome of one loader job (see the module docstring for the rules)."""
    detail: dict[str, Any] = {
        "ranks": [_rank_detail(r) for r in runs],
        "elapsed": round(elapsed, 2),
        "differing": [],
    }

    def done(verdict: str | None, summary: str) -> Observation:
        return Observation(loader, verdict, {**detail, "summary": summary})

    # A rank that failed before its loader leaves the others alone in it: that says nothing
    # about the loader (a stand-in rank whose own files do not build, say).
    before = [r for r in runs if r.error is not None and r.error.stage.before_loader]
    if before:
        r = before[0]
        message = r.error.message
        why = f"rank {r.rank} did not get through the loader (stage {r.stage})"
        return done(None, f"{why}: {message}")
    aborted = [r for r in runs if r.signal is not None and r.stage == LOADING]
    if aborted:
        r = aborted[0]
        return done(
            LoaderVerdict.HANG,
            f"rank {r.rank} was killed by {r.signal} inside the loader's collectives "
            f"({r.last_error or 'no message'}): gloo aborts a mismatched collective, NCCL blocks",
        )
    refused = [r for r in runs if _error(r, LoaderFailure.REFUSED)]
    if refused:
        r = refused[0]
        return done(LoaderVerdict.REFUSED, f"rank {r.rank} raised {r.error.message}")
    stuck = [r for r in runs if r.returncode is None and r.stage == LOADING]
    failed = [r for r in runs if _error(r, LoaderFailure.COLLECTIVE)]
    if stuck or failed:
        late = "still inside the loader's collectives at the deadline"
        parts = [f"rank {r.rank} {late}" for r in stuck]
        parts += [f"rank {r.rank}: {r.error.message}" for r in failed]
        return done(LoaderVerdict.HANG, "; ".join(parts))
    unfinished = [r for r in runs if r.returncode != 0 or not r.record or r.error]
    if unfinished:
        r = unfinished[0]
        why = (
            "killed at the deadline"
            if r.returncode is None
            else r.error.message
            if r.error
            else r.last_error or f"exit {r.returncode}"
        )
        return done(None, f"rank {r.rank} did not get through the loader (stage {r.stage}): {why}")

    records = {r.rank: r.record for r in runs}
    detail["buffers"] = buffer_values(records)
    differing, only = compare_holdings(records)
    detail["differing"] = differing[:_LISTED]
    detail["differing_count"] = len(differing)
    if only:
        detail["only_on"] = only[:_LISTED]
    if not differing:
        return done(LoaderVerdict.OK, "every rank holds rank 0's values under every shared name")
    worst = max(differing, key=lambda d: LoaderVerdict(d["verdict"]).severity)
    first = next(d for d in differing if d["verdict"] == worst["verdict"])
    more = f" (and {len(differing) - 1} more)" if len(differing) > 1 else ""
    where = f"rank {first['rank']} {first['name']} {first['state']}"
    return done(worst["verdict"], f"finished, but on {where}{more}")


def compare_holdings(
    records: Mapping[int, LoaderRecord],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every tensor that is not what rank 0 holds or sent, and the names only one side has."""
    ref = records[min(records)]
    ref_tensors = ref.tensors
    first = min(records)
    known = {t.digest for t in ref_tensors.values() if t.digest}
    differing: list[dict[str, Any]] = []
    only: list[dict[str, Any]] = []
    for rank in sorted(records):
        record = records[rank]
        tensors = record.tensors
        own = record.reference
        wants = ref.expected.get(rank, {})
        for name, t in tensors.items():
            volatile = t.kind == "buffer" and t.persistent is False
            if volatile and t.digest != own.get(name):
                if record.meta_built and t.digest not in known | set(own.values()):
                    differing.append(_entry(name, rank, LoaderVerdict.UNINITIALIZED, _GARBAGE))
                    continue
            if name in wants:
                if t.digest == wants[name].get(t.dtype):
                    continue
                state = f"differs from rank {first}'s source"
            elif name in ref_tensors:
                if rank == first or t.digest == ref_tensors[name].digest:
                    continue
                state = f"differs from rank {first}'s"
            elif volatile and t.digest != own.get(name):
                state = "is only on this rank, and the loader overwrote its own value"
            else:
                only.append({"name": name, "rank": rank})
                continue
            held = [n for n, o in ref_tensors.items() if o.digest == t.digest and n != name]
            if held:
                state = f"holds {held[0]}'s values"
            elif volatile and t.digest == own.get(name):
                state = "kept its own value, not rank 0's"
            differing.append(_entry(name, rank, LoaderVerdict.SILENT_CORRUPTION, state))
        if rank != first:
            only += [{"name": n, "rank": first} for n in ref_tensors if n not in tensors]
    return differing, only


def buffer_values(records: Mapping[int, LoaderRecord]) -> list[dict[str, Any]]:
    """Per rank, its buffers in its own ``named_buffers()`` order, each ``ok`` (it holds what
    rank 0 holds under that name), ``swapped`` (what rank 0 holds under another name) or
    ``corrupted`` (neither), with the values of small ones next to rank 0's."""
    ref = records[min(records)].tensors
    by_digest: dict[str, str] = {}
    for name, t in ref.items():
        if t.kind == "buffer" and t.digest:
            by_digest.setdefault(t.digest, name)
    out = []
    for rank in sorted(records):
        record = records[rank]
        tensors = record.tensors
        order = record.order or [n for n, t in tensors.items() if t.kind == "buffer"]
        buffers: dict[str, dict[str, Any]] = {}
        for name in order:
            t, want = tensors.get(name), ref.get(name)
            if t is None:
                continue
            if t.digest is not None and want is not None and t.digest == want.digest:
                state, holds = "ok", name
            else:
                holds = by_digest.get(t.digest) if t.digest else None
                state = "swapped" if holds is not None and holds != name else "corrupted"
            buffers[name] = {
                "state": state,
                "holds": holds,
                "shape": list(t.shape),
                "digest": t.digest,
                "expected_digest": want.digest if want else None,
                "values": list(t.values) if t.values is not None else None,
                "expected_values": list(want.values) if want and want.values is not None else None,
            }
        out.append(
            {
                "rank": rank,
                "order": list(order),
                "buffers": buffers,
                "swapped": [
                    {"buffer": n, "holds": b["holds"]}
                    for n, b in buffers.items()
                    if b["state"] == "swapped"
                ],
                "corrupted": [n for n, b in buffers.items() if b["state"] == "corrupted"],
            }
        )
    return out


def _entry(name: str, rank: int, verdict: str, state: str) -> dict[str, Any]:
    return {"name": name, "rank": rank, "verdict": verdict, "state": state}


def _error(run: RankRun, kind: LoaderFailure) -> bool:
    """The rank's child reported an error of ``kind`` raised inside the loader."""
    return run.error is not None and run.error.kind == kind and run.error.stage == LOADING


def _rank_detail(run: RankRun) -> dict[str, Any]:
    message = run.error.message if run.error is not None else None
    if run.returncode is None:
        exit_text = "killed at the deadline"
    elif run.signal:
        exit_text = run.signal
    else:
        exit_text = f"exit {run.returncode}"
    return {
        "rank": run.rank,
        "hash_seed": run.hash_seed,
        "stands_for": run.stands_for,
        "exit": exit_text,
        "stage": run.stage,
        "error": message or (run.last_error if run.returncode != 0 else None),
    }


def reproduce_error(
    observed: Mapping[str, Observation] | None, why: str | None = None
) -> RankError | None:
    """``--reproduce`` was asked for but no loader ran for real: rank 0's error (the verdict
    ``error``, exit 3), never a silent ``consistent``. ``why``: why no job ran at all. One
    loader observed is an answer: the rows of the others say why they were not."""
    if observed and any(o.verdict is not None for o in observed.values()):
        return None
    if observed:
        first = next(iter(observed.values()))
        why = f"{first.loader}: {first.detail.get('summary') or 'not run'}"
    message = f"--reproduce ran no loader for real ({why or 'no result'})"
    return RankError(0, Stage.REPRODUCE, message, ErrorKind.RUNTIME)


# ---------------------------------------------------------------- folding into the report


def with_observations(
    loaders: Sequence[LoaderPrediction], observations: Mapping[str, Observation]
) -> tuple[tuple[LoaderPrediction, ...], tuple[Finding, ...]]:
    """Predictions with ``observed`` filled in, and a ``prediction`` finding per disagreement."""
    out, findings = [], []
    for p in loaders:
        seen = observations.get(p.name)
        if seen is None:
            out.append(p)
            continue
        out.append(replace(p, observed=seen.verdict, observed_detail=dict(seen.detail)))
        expected = p.gloo_verdict  # the jobs run on gloo
        if seen.verdict is not None and seen.verdict != expected:
            summary = (
                f"fsdpcheck predicted {p.name} → {expected} on gloo, but the real loader was "
                f"{seen.verdict}: {seen.detail.get('summary', '')} (a bug in fsdpcheck's model "
                "of this loader; please report it)"
            )
            details = {"loader": p.name, "predicted": expected, "observed": seen.verdict}
            findings.append(Finding.about(FindingKind.PREDICTION, (), 0, summary, details=details))
    return tuple(out), tuple(findings)
