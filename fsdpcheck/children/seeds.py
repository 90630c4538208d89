"""The one fan-out over hash seeds, shared by probe and scan: the same child command once per
``PYTHONHASHSEED`` = 0 .. seeds-1 (at most ``jobs`` at a time, each bounded by ``timeout`` and
killed when it expires), read back as the :class:`~fsdpcheck.records.SeedBuild` records each
child emitted. String hashes depend only on the seed, so one interpreter per seed gives every
order a model can take under it."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from fsdpcheck.checks.hash_seed import ModuleReorder, SeedError, compare_orders
from fsdpcheck.children.launch import JOB_ENV, RankOutcome, run_each
from fsdpcheck.errors import InputError
from fsdpcheck.records import SeedBuild
from fsdpcheck.vocab import SeedFailure


@dataclass(frozen=True)
class SeedRuns:
    """What each seed's child built, and the seeds whose child failed as a whole."""

    seeds: tuple[int, ...]
    builds: Mapping[int, tuple[SeedBuild, ...]]  # per seed, in the order its child emitted them
    lost: Mapping[int, SeedError]  # a child that exited with an error, was killed or said nothing
    slowest: float  # seconds, the slowest child

    def built(self, target: str) -> dict[int, SeedBuild]:
        """``target``'s last record under each seed that emitted one."""
        out: dict[int, SeedBuild] = {}
        for seed in self.seeds:
            for build in self.builds[seed]:
                if build.target == target:
                    out[seed] = build
        return out


def check_seeds(seeds: int) -> None:
    if seeds < 2:
        raise InputError(f"--seeds {seeds}: comparing orders needs at least 2 hash seeds.")


def over_seeds(
    argv: Sequence[str],
    seeds: int,
    *,
    jobs: int | None,
    timeout: float,
    total: int,
    progress: Callable[[int, int, str], None] | None = None,
    label: Callable[[int, SeedBuild], str] = lambda seed, _: f"PYTHONHASHSEED={seed}",
) -> SeedRuns:
    """``python <argv>`` once per hash seed 0 .. seeds-1. ``progress(done, total, label)`` is
    called as each record arrives (from worker threads, one call at a time)."""
    seed_list = tuple(range(seeds))
    done = 0

    def on_record(index: int, build: SeedBuild) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total, label(seed_list[index], build))

    envs = [{**JOB_ENV, "PYTHONHASHSEED": str(seed)} for seed in seed_list]
    outcomes = run_each(
        argv, envs, jobs=jobs, timeout=timeout, on_record=on_record, record=SeedBuild
    )
    by_seed = dict(zip(seed_list, outcomes, strict=True))
    return SeedRuns(
        seeds=seed_list,
        builds={seed: tuple(o.records) for seed, o in by_seed.items()},
        lost={
            seed: _lost(seed, o, timeout)
            for seed, o in by_seed.items()
            if o.returncode != 0 or not o.records
        },
        slowest=max((o.elapsed for o in outcomes), default=0.0),
    )


def _lost(seed: int, outcome: RankOutcome, timeout: float) -> SeedError:
    kind = SeedFailure.TIMEOUT if outcome.returncode is None else SeedFailure.RUNTIME
    return SeedError(seed, kind, outcome.failure(timeout))


def compare_builds(builds: Mapping[int, SeedBuild]) -> tuple[ModuleReorder, ...]:
    """The reorders among the seeds whose build has a fingerprint (see ``compare_orders``)."""
    return compare_orders({s: b.fingerprint for s, b in builds.items() if b.fingerprint})
