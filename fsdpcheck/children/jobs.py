"""The loader child jobs' plumbing: the child's side (progress marks, builds, what each
rank holds after its loader) and the parent's side (one bounded 2-rank job, read back as data).

A child never talks to its parent over a socket: each rank writes ``rank<N>.stage`` (where it is
now) and, when it gets that far, ``rank<N>.json`` (what it holds) into a directory the parent
owns. So the parent can tell a rank killed inside a collective (a hang) from one still importing
torch at the deadline (too slow to say anything), and a broken process group after a bad loader
never stands between the parent and the evidence.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdpcheck.checks.observed import RankRun
from fsdpcheck.children.launch import last_error, signal_name
from fsdpcheck.options import BuildSpec

EXIT_REFUSED = 3  # the loader raised a clear exception
EXIT_COLLECTIVE = 124  # a collective failed or timed out (the peer is gone or out of step)
COMMON_DTYPES = ("float32", "bfloat16", "float16")
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory holding fsdpcheck/


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


# ---------------------------------------------------------------- parent side


def run_job(
    module: str,
    loader: str,
    spec: ChildSpec,
    *,
    seeds: Sequence[int],
    deadline: float,
    collective_timeout: float,
) -> tuple[tuple[RankRun, ...], float]:
    """Run ``python -m module --loader loader`` as len(seeds) ranks on gloo, killed at
    ``deadline`` seconds with every process they started; returns each rank and the elapsed time."""
    from fsdpcheck.children.launch import launch

    with tempfile.TemporaryDirectory(prefix=f"fsdpcheck-{loader}-") as tmp:
        argv = ["-m", module, "--loader", loader, "--out", tmp, "--timeout"]
        argv += [f"{collective_timeout:g}", *spec.argv()]
        # This fsdpcheck, wherever it was imported from, whatever the child's working directory.
        path = os.pathsep.join(p for p in (str(_PACKAGE_ROOT), os.environ.get("PYTHONPATH")) if p)
        env = {
            "TRANSFORMERS_VERBOSITY": "error",
            "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": "1",
            "TORCH_CPP_LOG_LEVEL": "ERROR",
            "PYTHONPATH": path,
        }
        result = launch(
            argv,
            len(seeds),
            env=env,
            rank_env=lambda r: {"PYTHONHASHSEED": str(seeds[r])},
            timeout=deadline,
        )
        runs = tuple(
            RankRun(
                rank=r.rank,
                returncode=r.returncode,
                signal=signal_name(r.returncode),
                stage=_read_text(Path(tmp) / f"rank{r.rank}.stage"),
                last_error=last_error(r.stderr, 300),
                record=_read_json(Path(tmp) / f"rank{r.rank}.json"),
            )
            for r in result.ranks
        )
    return runs, result.elapsed


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class Marks:
    """This rank's stage file and result file in the parent's directory."""

    def __init__(self, out: str, rank: int):
        self.out = Path(out)
        self.rank = rank
        self.current = "start"

    def stage(self, name: str) -> None:
        self.current = name
        _atomic_write(self.out / f"rank{self.rank}.stage", name)

    def result(self, record: Mapping[str, Any]) -> None:
        _atomic_write(self.out / f"rank{self.rank}.json", json.dumps(record, sort_keys=True))


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {line}"[:300]


def tensors_held(model: Any) -> dict[str, dict[str, Any]]:
    """Every parameter (deduplicated, as ``named_parameters`` gives them) and buffer: kind,
    persistence, dtype, local shape, placements and a digest of the local values (None on meta)."""
    from fsdpcheck.model.fingerprint import dtype_name, non_persistent_buffers, value_digest

    volatile = non_persistent_buffers(model)
    held: dict[str, dict[str, Any]] = {}
    for name, param in model.named_parameters():
        placements = getattr(param, "placements", None)
        local = param.to_local() if placements is not None else param
        held[name] = {
            "kind": "param",
            "persistent": None,
            "dtype": dtype_name(local.dtype),
            "shape": list(local.shape),
            "placements": [str(p) for p in placements] if placements is not None else None,
            "digest": value_digest(local),
        }
    for name, buf in model.named_buffers():
        held[name] = {
            "kind": "buffer",
            "persistent": name not in volatile,
            "dtype": dtype_name(buf.dtype),
            "shape": list(buf.shape),
            "placements": None,
            "digest": value_digest(buf),
        }
    return held


def expected_holdings(
    model: Any, source: Mapping[str, Any], world_size: int
) -> dict[str, dict[str, dict[str, str | None]]]:
    """Rank 0: for every rank and every entry of its source state dict, the digest of the part
    that rank must hold, cast to each common dtype (a loader may convert to the receiver's)."""
    import torch

    from fsdpcheck.loader.shards import expected_shard
    from fsdpcheck.model.fingerprint import dtype_name, value_digest

    params = dict(model.named_parameters(remove_duplicate=False))
    out: dict[str, dict[str, dict[str, str | None]]] = {}
    for rank in range(world_size):
        mine: dict[str, dict[str, str | None]] = {}
        for name, full in source.items():
            param = params.get(name)
            try:
                part = expected_shard(full, param, rank) if param is not None else full
            except ValueError:
                continue
            dtypes = {dtype_name(part.dtype)}
            if part.is_floating_point():
                dtypes.update(COMMON_DTYPES)
            mine[name] = {d: value_digest(part.to(getattr(torch, d))) for d in sorted(dtypes)}
        out[str(rank)] = mine
    return out


def reference_buffers(build_reference: Callable[[], Any]) -> dict[str, str | None]:
    """Digests of this rank's non-persistent buffers as its own module computes them (a fresh
    CPU build): what "uninitialized" is measured against."""
    from fsdpcheck.model.fingerprint import non_persistent_buffers, value_digest

    model = build_reference()
    return {n: value_digest(b) for n, b in non_persistent_buffers(model).items()}
