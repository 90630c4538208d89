"""Probe one model for a latent, hash-seed-dependent tensor order, on one host, without ranks.

A model whose ``named_buffers()`` / ``named_parameters()`` order follows the interpreter's string
hash seed (``PYTHONHASHSEED``) is consistent on every run where the ranks happen to agree and
breaks on the runs where they do not. :func:`probe` makes the dependence show up deterministically:
it builds the model on ``meta`` in ``seeds`` child interpreters with the fixed hash seeds
``0 .. seeds-1`` and compares the orders they produce.

Why 8 seeds by default: a two-element ``set`` of strings (``{"sliding_attention",
"full_attention"}``) iterates in one of its 2 orders, each with probability about 1/2 per seed, so
all 8 seeds agree by chance with probability ``2 * 2**-8 = 1/128`` (< 1 %). Seeds 0 and 1 alone
already give different orders for that pair, so the known cases are found every time.

:func:`probe_builder` (``fsdpcheck.probe``) does the same for a trainer's own builder, the way
``audit --builder`` names it (``MODULE:FUNCTION`` or ``FILE.py:FUNCTION``) or as the function
itself: a Ray driver or a script whose workers run with hash randomisation on can check its
model before any worker starts. The builder runs in each child on a one-process gloo group (so
a builder that calls ``fully_shard`` works), and its model is compared by name as it came back.

Each child runs ``python -m fsdpcheck.children.probe --child`` and prints its fingerprint as
one JSON line (never pickle). Children run in parallel (at most ``jobs`` at a time), each bounded
by ``timeout``
and killed when it expires. Library code: returns frozen records, never prints.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fsdpcheck.checks.hash_seed import ProbeResult, SeedError, tensor_names
from fsdpcheck.children.launch import emit
from fsdpcheck.children.seeds import check_seeds, compare_builds, over_seeds
from fsdpcheck.distributed.environment import package_version
from fsdpcheck.errors import FsdpcheckError, InputError
from fsdpcheck.model.builder import BuildContext, builder_spec, call_builder
from fsdpcheck.model.fingerprint import fingerprint
from fsdpcheck.model.resolve import resolve
from fsdpcheck.model.wrap import model_class
from fsdpcheck.options import BuildSpec
from fsdpcheck.pipeline import build_or_raise
from fsdpcheck.records import SeedBuild
from fsdpcheck.vocab import ExitCode, Init, SeedFailure, Snapshot, Verdict

log = logging.getLogger(__name__)

DEFAULT_SEEDS = 8
DEFAULT_TIMEOUT = 180.0


def probe_builder(
    build: str | Callable[..., Any],
    *,
    seeds: int = DEFAULT_SEEDS,
    jobs: int | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> ProbeResult:
    """``fsdpcheck.probe(build, seeds=K)``: call ``build`` in K child interpreters under
    PYTHONHASHSEED = 0 .. K-1 and compare the orders of the models it returns, by name.

    ``build``: ``"MODULE:FUNCTION"``, ``"FILE.py:FUNCTION"``, or a module-level function (one a
    child can import by its module and name; in a script run as ``__main__``, by the script's
    file). It is called as ``build(ctx)`` (an ``audit --builder`` builder: ``ctx.rank`` 0,
    ``ctx.world_size`` 1) or ``build()``, and returns the model, or ``(model, state_dict)``.
    Verdict ``latent`` (the differing tensors in ``reorders``), ``consistent`` or ``error``, as
    :func:`probe`."""
    return probe("", seeds=seeds, jobs=jobs, timeout=timeout, builder=builder_spec(build))


def probe(
    model: str,
    *,
    seeds: int = DEFAULT_SEEDS,
    text_only: bool = False,
    trust_remote_code: bool = False,
    jobs: int | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    progress: Callable[[int, int, str], None] | None = None,
    builder: str | None = None,
) -> ProbeResult:
    """Build ``model`` on meta under PYTHONHASHSEED = 0 .. seeds-1 and compare tensor orders.

    Verdict ``latent`` (exit 1) when any buffer or parameter order differs between seeds, even if
    some seeds failed (the difference is real); ``consistent`` (exit 0) when every seed built and
    all orders agree; ``error`` otherwise (exit 2 when every failure is bad input such as an
    unknown preset, else 3). With the default 8 seeds a two-way set order goes unnoticed with
    probability 2*2^-8 = 1/128 (< 1 %). ``progress(done, total, label)`` is called as each
    seed's child reports (from worker threads, one call at a time). ``builder``
    (``MODULE:FUNCTION`` or ``FILE.py:FUNCTION``): build with it instead of ``model``.
    """
    check_seeds(seeds)
    start = time.monotonic()
    refused = None if builder else _refused(model)
    if refused is not None:  # every child would find it: none is started
        return ProbeResult(
            model=model,
            architecture=None,
            seeds=tuple(range(seeds)),
            verdict=Verdict.ERROR,
            exit_code=ExitCode.BAD_INPUT,
            reorders=(),
            errors=tuple(SeedError(seed, SeedFailure.INPUT, refused) for seed in range(seeds)),
            orders=0,
            transformers=package_version("transformers"),
            text_only=text_only,
            timings={"total": round(time.monotonic() - start, 3), "slowest_child": 0.0},
        )
    target = ["--builder", builder] if builder else ["--model", model]
    argv = ["-m", "fsdpcheck.children.probe", "--child", *target]
    argv += ["--text-only"] * text_only + ["--trust-remote-code"] * trust_remote_code
    runs = over_seeds(argv, seeds, jobs=jobs, timeout=timeout, total=seeds, progress=progress)

    built: dict[int, SeedBuild] = {}
    errors: list[SeedError] = []
    for seed in runs.seeds:
        build = runs.builds[seed][-1] if runs.builds[seed] else None
        if build is not None and build.built:
            built[seed] = build
        elif build is not None and build.failure is not None:
            errors.append(SeedError(seed, build.failure, build.message))
        else:
            errors.append(runs.lost[seed])
    architecture = next((b.architecture for b in built.values() if b.architecture), None)
    reorders = compare_builds(built)
    orders = len(
        {
            (tensor_names(b.fingerprint.buffers), tensor_names(b.fingerprint.params))
            for b in built.values()
        }
    )
    verdict = Verdict.LATENT if reorders else Verdict.ERROR if errors else Verdict.CONSISTENT
    # A seed that ran out of time is a runtime failure (SeedError.kind "timeout").
    code = verdict.exit_code(
        SeedFailure.RUNTIME if e.kind == SeedFailure.TIMEOUT else e.kind for e in errors
    )
    return ProbeResult(
        model=builder or model,
        architecture=architecture,
        seeds=runs.seeds,
        verdict=verdict,
        exit_code=code,
        reorders=reorders,
        errors=tuple(errors),
        orders=orders,
        transformers=package_version("transformers"),
        text_only=text_only,
        timings={
            "total": round(time.monotonic() - start, 3),
            "slowest_child": round(runs.slowest, 3),
        },
    )


def _refused(model: str) -> str | None:
    """Why ``--model`` is bad input (an unknown preset, a directory without a readable
    config.json, a hub id not in the cache), found here once, where each of the K children
    would find it after its own interpreter's start-up; None where it resolves, or where
    resolving fails otherwise (each child then reports its own failure, as before). The
    config's values are the children's to check: that imports transformers."""
    try:
        resolve(model, allow_pickle=BuildSpec(model).allow_pickle, config_values=False)
    except InputError as exc:
        log.debug("probe of %s refused before any child", model, exc_info=True)
        return _for_seeds(exc)
    except Exception:  # not bad input as resolve() knows it: the children say what it is
        log.debug("probe of %s: resolving in the caller failed", model, exc_info=True)
    return None


def _for_seeds(exc: FsdpcheckError) -> str:
    """``exc``'s message without resolve()'s rank: a probe has one process per hash seed."""
    return str(exc).removeprefix("rank 0: ")


# ---------------------------------------------------------------- child entry point


def _child(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsdpcheck.children.probe")
    parser.add_argument("--child", action="store_true", required=True)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--model")
    target.add_argument("--builder")
    parser.add_argument("--text-only", action="store_true")
    parser.add_argument("--trust-remote-code", action="store_true")
    args = parser.parse_args(argv)

    what = args.builder or args.model
    try:
        if args.builder:
            model, architecture = _from_builder(args.builder)
        else:
            spec = BuildSpec(
                args.model,
                init=Init.META,
                text_only=args.text_only,
                trust_remote_code=args.trust_remote_code,
            )
            built = build_or_raise(spec, 0)  # resolves before importing torch: fails fast
            model, architecture = built.model, built.info.architecture

        fp = fingerprint(model, Snapshot.PRE_WRAP, with_values=False)
    except FsdpcheckError as exc:
        log.debug("probe of %s refused", what, exc_info=True)
        emit(SeedBuild(what, failure=SeedFailure(exc.kind), message=_for_seeds(exc)))
        return exc.exit_code
    except Exception as exc:
        log.debug("probe of %s failed", what, exc_info=True)
        first = str(exc).splitlines()[0] if str(exc) else ""
        message = f"{type(exc).__name__}: {first}"
        emit(SeedBuild(what, failure=SeedFailure.RUNTIME, message=message))
        return ExitCode.RUNTIME
    emit(SeedBuild(what, fingerprint=fp, architecture=architecture))
    return 0


def _from_builder(spec: str) -> tuple[Any, str]:
    """The builder's model in this child, on a one-process gloo group of its own (in memory,
    no port), so a builder that shards its model with ``fully_shard`` runs as on a rank."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    built = call_builder(spec, BuildContext(0, 1, 0, torch.device("cpu")))
    return built.model, model_class(built.model).__name__


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
