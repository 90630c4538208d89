"""Run the unsafe loader on purpose, to show what it does to a model, only in a child job.

``naive_broadcast_buffers`` is verl's buffer loop before its fix (one broadcast per buffer, in
each rank's own ``named_buffers()`` order). :func:`run_reproduction` launches it as separate
ranks (``python -m fsdpcheck.children.reproduce``) bounded in time, because what it does to a
process cannot be contained: gloo aborts the receiving process on a size mismatch (SIGABRT, not an
exception) and NCCL waits for its watchdog. The calling process never runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdpcheck.children.launch import last_error, signal_name
from fsdpcheck.errors import InputError
from fsdpcheck.options import child_collective_timeout
from fsdpcheck.vocab import ExitCode

EXIT_COLLECTIVE_TIMEOUT = 124  # the child's own collective timed out: the loader hung
_VALUES_SHOWN = 64  # buffers up to this many elements carry their values in the JSON


@dataclass(frozen=True)
class RankExit:
    rank: int
    hash_seed: int
    returncode: int | None  # None: killed at the deadline
    signal: str | None  # e.g. "SIGABRT" when the rank died of a signal
    last_error: str  # the most telling stderr line (gloo's enforce message, a traceback's end)


@dataclass(frozen=True)
class ReproductionResult:
    outcome: str  # a ReproOutcome
    model: str
    nprocs: int
    seeds: tuple[int, ...]
    timeout: float
    elapsed: float
    summary: str
    exits: tuple[RankExit, ...]
    details: Mapping[str, Any] = field(default_factory=dict)  # the child's JSON, when written


def naive_broadcast_buffers(model: Any, src: int = 0, group: Any = None) -> int:
    """verl's loop before its fix: one broadcast per buffer in LOCAL order. Unsafe; for children."""
    import torch.distributed as dist

    count = 0
    for _, buf in model.named_buffers():
        dist.broadcast(buf, src, group=group)
        count += 1
    return count


def run_reproduction(
    model_spec: str,
    nprocs: int = 2,
    seeds: Sequence[int] = (0, 1),
    timeout: float = 60.0,
) -> ReproductionResult:
    """Run the naive loader as ``nprocs`` ranks (PYTHONHASHSEED per rank from ``seeds``)."""
    from fsdpcheck.children.launch import launch
    from fsdpcheck.model.resolve import resolve

    seeds = tuple(int(s) for s in seeds)
    if nprocs < 2:
        raise InputError("a reproduction needs at least 2 ranks (nprocs >= 2).")
    if len(seeds) != nprocs:
        raise InputError(f"seeds has {len(seeds)} entries; give one hash seed per rank ({nprocs}).")
    if timeout <= 0:
        raise InputError(f"timeout must be positive, not {timeout}.")
    resolve(model_spec)  # a bad spec is bad input here, not a "crash" of the children
    # The children's collectives give up first and say so; the launcher's kill is the backstop.
    child_timeout = child_collective_timeout(timeout)
    with tempfile.TemporaryDirectory(prefix="fsdpcheck-reproduce-") as tmp:
        out = Path(tmp) / "reproduction.json"
        result = launch(
            [
                "-m",
                "fsdpcheck.children.reproduce",
                "--model",
                model_spec,
                "--json",
                str(out),
                "--timeout",
                str(child_timeout),
            ],
            nprocs,
            env={"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"},
            rank_env=lambda r: {"PYTHONHASHSEED": str(seeds[r])},
            timeout=timeout,
        )
        details = json.loads(out.read_text()) if out.is_file() else {}
    exits = tuple(
        RankExit(
            rank=r.rank,
            hash_seed=seeds[r.rank],
            returncode=r.returncode,
            signal=signal_name(r.returncode),
            last_error=last_error(r.stderr),
        )
        for r in result.ranks
    )
    outcome, summary = _classify(exits, result.timed_out, details, timeout)
    return ReproductionResult(
        outcome=outcome,
        model=model_spec,
        nprocs=nprocs,
        seeds=seeds,
        timeout=timeout,
        elapsed=round(result.elapsed, 3),
        summary=summary,
        exits=exits,
        details=details,
    )


def _classify(
    exits: tuple[RankExit, ...], timed_out: bool, details: Mapping[str, Any], timeout: float
) -> tuple[str, str]:
    crashed = [e for e in exits if e.returncode not in (None, 0, EXIT_COLLECTIVE_TIMEOUT)]
    if crashed:
        # The rank a signal killed is the cause; its peers' "connection closed" is the echo.
        first = sorted(crashed, key=lambda e: (e.signal is None, e.rank))[0]
        how = first.signal or f"exit code {first.returncode}"
        return "crash", f"rank {first.rank} died ({how}): {first.last_error or 'no stderr'}"
    stuck = [e.rank for e in exits if e.returncode in (None, EXIT_COLLECTIVE_TIMEOUT)]
    if timed_out or stuck:
        return "hang", f"ranks {stuck} were still waiting in a collective after {timeout:g}s"
    if not details:
        return "crash", "every rank exited 0 but rank 0 wrote no result"
    corrupted = [r for r in details.get("ranks", []) if r["swapped"] or r["corrupted"]]
    if corrupted:
        parts = [
            f"rank {r['rank']}: "
            + ", ".join(f"{s['buffer']} holds {s['holds']}'s values" for s in r["swapped"])
            + (f" corrupted {r['corrupted']}" if r["corrupted"] else "")
            for r in corrupted
        ]
        return "silent-corruption", "the loader finished without error, but " + "; ".join(parts)
    return "ok", "every rank's buffers hold their own expected values"


# --- the child: one rank of the reproduction ---------------------------------------------------


def _buffer_states(after: Mapping[str, Any], expected: Mapping[str, Any]) -> dict[str, Any]:
    """Per buffer: still right ("ok"), holding another buffer's values ("swapped"), or neither."""
    from fsdpcheck.model.fingerprint import value_digest

    want = {name: value_digest(t) for name, t in expected.items()}
    states = {}
    for name, tensor in after.items():
        digest = value_digest(tensor)
        if digest == want.get(name):
            state, holds = "ok", name
        else:
            holds = next(
                (other for other, d in want.items() if other != name and d == digest), None
            )
            state = "swapped" if holds else "corrupted"
        small = tensor.numel() <= _VALUES_SHOWN
        states[name] = {
            "state": state,
            "holds": holds,
            "shape": list(tensor.shape),
            "digest": digest,
            "expected_digest": want.get(name),
            "values": tensor.float().tolist() if small else None,
            "expected_values": expected[name].float().tolist()
            if small and name in expected
            else None,
        }
    return states


def _child(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fsdpcheck.children.reproduce",
        description="One rank of a reproduction (run_reproduction starts these).",
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--json", required=True)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from fsdpcheck.distributed import setup as distributed

    ctx = distributed.init("gloo", args.timeout)
    try:
        return _run_rank(args, ctx)
    except Exception as exc:  # gloo raises on a timeout or a vanished peer: say which, exit
        text = str(exc).strip()
        print(
            f"rank {ctx.rank}: {type(exc).__name__}: {text.splitlines()[-1] if text else ''}",
            file=sys.stderr,
        )
        timed_out = "timed out" in text.lower() or "timeout" in text.lower()
        return EXIT_COLLECTIVE_TIMEOUT if timed_out else ExitCode.RUNTIME
    finally:
        distributed.shutdown(ctx)


def _run_rank(args: argparse.Namespace, ctx: Any) -> int:
    import torch.distributed as dist

    from fsdpcheck.model.build import build
    from fsdpcheck.model.resolve import resolve

    resolved = resolve(args.model, rank=ctx.rank)
    # Every rank real (init="all") and seeded alike, so values are comparable by name.
    model = build(resolved, rank=ctx.rank, init="all", seed=args.seed).model
    order = [name for name, _ in model.named_buffers()]
    naive_broadcast_buffers(model, src=0, group=ctx.side_channel)
    after = {name: buf.detach().clone() for name, buf in model.named_buffers()}
    expected = dict(
        build(resolved, rank=ctx.rank, init="all", seed=args.seed).model.named_buffers()
    )
    states = _buffer_states(after, expected)
    mine = {
        "rank": ctx.rank,
        "hash_seed": os.environ.get("PYTHONHASHSEED", "random"),
        "order": order,
        "buffers": states,
        "swapped": [
            {"buffer": n, "holds": s["holds"]} for n, s in states.items() if s["state"] == "swapped"
        ],
        "corrupted": [n for n, s in states.items() if s["state"] == "corrupted"],
    }
    gathered: list[Any] | None = [None] * ctx.world_size if ctx.rank == 0 else None
    dist.gather_object(mine, gathered, dst=0, group=ctx.side_channel)
    if ctx.rank == 0:
        report = {
            "model": args.model,
            "loader": "naive: one broadcast per buffer in local named_buffers() order",
            "world_size": ctx.world_size,
            "src": 0,
            "ranks": gathered,
        }
        Path(args.json).write_text(json.dumps(report, indent=2, sort_keys=True))
    return ExitCode.CONSISTENT


if __name__ == "__main__":
    sys.exit(_child())
