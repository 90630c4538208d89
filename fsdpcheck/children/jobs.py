"""The loader child jobs' plumbing: the parent's side (one bounded 2-rank job, read back as
data) and the child's side (the builds, what each rank holds after its loader).

Each rank marks its stages and emits its record through :mod:`fsdpcheck.children.launch`, so the
parent can tell a rank killed inside the loader's collectives from one too slow to get there.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fsdpcheck.checks.observed import RankRun
from fsdpcheck.children.launch import JOB_ENV, last_error, launch
from fsdpcheck.loader.shards import expected_shard
from fsdpcheck.model.fingerprint import dtype_name, non_persistent_buffers, value_digest
from fsdpcheck.options import BuildSpec
from fsdpcheck.records import HeldTensor, LoaderRecord

log = logging.getLogger(__name__)

COMMON_DTYPES = ("float32", "bfloat16", "float16")
VALUES_SHOWN = 64  # buffers up to this many elements carry their values in the record
STANDS_FOR = "FSDPCHECK_STANDS_FOR"  # a child rank's environment: its StandIn, as JSON


@dataclass(frozen=True)
class ChildSpec(BuildSpec):
    """The audited model and how the audit built it: every loader job builds it the same way."""

    def argv(self) -> list[str]:
        args = ["--model", self.model, "--init", self.init, "--seed", str(self.seed)]
        if self.dtype:
            args += ["--dtype", self.dtype]
        for flag, on in (
            ("--text-only", self.text_only),
            ("--trust-remote-code", self.trust_remote_code),
            ("--allow-pickle", self.allow_pickle),
        ):
            if on:
                args.append(flag)
        return args


@dataclass(frozen=True)
class StandIn:
    """The audit rank one child rank stands for, and what that rank built: its hash seed, its
    own model directory (where this host has it), its dtype, and the config keys it read
    otherwise than rank 0 (a stale node's ``config.json``). Empty fields: as the audit's spec."""

    rank: int  # the audit rank
    hash_seed: int
    model: str | None = None
    dtype: str | None = None
    config: Mapping[str, Any] = field(default_factory=dict)  # top-level keys to set

    def env(self) -> dict[str, str]:
        built = {"rank": self.rank, "model": self.model, "dtype": self.dtype, "config": self.config}
        return {"PYTHONHASHSEED": str(self.hash_seed), STANDS_FOR: json.dumps(built)}


def stand_in_here() -> dict[str, Any]:
    """In a child rank: what its parent rank built (``{}`` when started without one)."""
    text = os.environ.get(STANDS_FOR)
    return json.loads(text) if text else {}


# ---------------------------------------------------------------- parent side


def run_job(
    module: str,
    loader: str,
    spec: ChildSpec,
    *,
    stand_ins: Sequence[StandIn],
    deadline: float,
    collective_timeout: float,
) -> tuple[tuple[RankRun, ...], float]:
    """Run ``python -m module --loader loader`` (``python module ...`` for a ``.py`` path) as one
    rank per stand-in on gloo, killed at ``deadline`` seconds with every process they started;
    returns each rank and the elapsed time."""
    entry = [module] if module.endswith(".py") else ["-m", module]
    argv = [*entry, "--loader", loader, "--timeout", f"{collective_timeout:g}", *spec.argv()]
    result = launch(
        argv,
        len(stand_ins),
        env=JOB_ENV,
        rank_env=lambda r: stand_ins[r].env(),
        timeout=deadline,
        record=LoaderRecord,
    )
    runs = tuple(
        RankRun(
            rank=r.rank,
            returncode=r.returncode,
            signal=r.signal,
            stage=r.stage,
            last_error=last_error(r.stderr, 300),
            record=r.result,
            hash_seed=stand_ins[r.rank].hash_seed,
            stands_for=stand_ins[r.rank].rank,
        )
        for r in result.ranks
    )
    return runs, result.elapsed


# ---------------------------------------------------------------- child side


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {line}"[:300]


def tensors_held(model: Any) -> dict[str, HeldTensor]:
    """Every parameter (deduplicated, as ``named_parameters`` gives them) and buffer, in that
    order: kind, persistence, dtype, local shape, placements, a digest of the local values (None
    on meta) and, for a small buffer, its values."""
    volatile = non_persistent_buffers(model)
    held: dict[str, HeldTensor] = {}
    for name, param in model.named_parameters():
        placements = getattr(param, "placements", None)
        local = param.to_local() if placements is not None else param
        held[name] = HeldTensor(
            kind="param",
            dtype=dtype_name(local.dtype),
            shape=tuple(local.shape),
            digest=value_digest(local),
            placements=tuple(str(p) for p in placements) if placements is not None else None,
        )
    for name, buf in model.named_buffers():
        held[name] = HeldTensor(
            kind="buffer",
            dtype=dtype_name(buf.dtype),
            shape=tuple(buf.shape),
            digest=value_digest(buf),
            persistent=name not in volatile,
            values=small_values(buf),
        )
    return held


def small_values(tensor: Any) -> tuple[float | str, ...] | None:
    """The values of a small tensor that holds any (None on meta or past :data:`VALUES_SHOWN`)."""
    if tensor.is_meta or tensor.numel() > VALUES_SHOWN:
        return None
    # Strict JSON has no NaN: uninitialised memory often holds some.
    return tuple(
        v if math.isfinite(v) else str(v) for v in tensor.detach().float().flatten().tolist()
    )


def expected_holdings(
    model: Any, source: Mapping[str, Any], world_size: int
) -> dict[int, dict[str, dict[str, str | None]]]:
    """Rank 0: for every rank and every entry of its source state dict, the digest of the part
    that rank must hold, cast to each common dtype (a loader may convert to the receiver's)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    out: dict[int, dict[str, dict[str, str | None]]] = {}
    for rank in range(world_size):
        mine: dict[str, dict[str, str | None]] = {}
        for name, full in source.items():
            param = params.get(name)
            try:
                part = expected_shard(full, param, rank) if param is not None else full
            except ValueError:
                log.debug("rank %d: no expected shard of %s", rank, name, exc_info=True)
                continue
            dtypes = {dtype_name(part.dtype)}
            if part.is_floating_point():
                dtypes.update(COMMON_DTYPES)
            mine[name] = {d: value_digest(part.to(getattr(torch, d))) for d in sorted(dtypes)}
        out[rank] = mine
    return out


def reference_buffers(build_reference: Callable[[], Any]) -> dict[str, str | None]:
    """Digests of this rank's non-persistent buffers as its own module computes them (a fresh
    CPU build): what "uninitialized" is measured against."""
    model = build_reference()
    return {n: value_digest(b) for n, b in non_persistent_buffers(model).items()}
