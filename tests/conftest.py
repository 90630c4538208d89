"""Shared helpers: run fsdpcheck as real ranks, build local checkpoints and HF cache layouts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from fsdpcheck.children.launch import LaunchResult, free_port, kill_group, launch

REPO = Path(__file__).resolve().parents[1]
QUIET_ENV = {"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
TIERS = ("unit", "ranks", "cli")  # tests/<tier>/: pure, real multi-process, whole commands


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test is marked with its tier, the folder it lives in (`pytest -m unit`)."""
    for item in items:
        tier = Path(item.fspath).parent.name
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))


def run_ranks(
    args: list[str],
    nprocs: int = 2,
    *,
    seeds: list[int] | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 120.0,
) -> LaunchResult:
    """``python -m fsdpcheck <args>`` as ``nprocs`` ranks; ``seeds``: PYTHONHASHSEED per rank."""
    base = {**QUIET_ENV, **(env or {})}
    rank_env = (lambda r: {"PYTHONHASHSEED": str(seeds[r])}) if seeds else None
    return launch(
        ["-m", "fsdpcheck", *args],
        nprocs,
        env=base,
        rank_env=rank_env,
        timeout=timeout,
        cwd=str(REPO),
    )


def run_plain(
    argv: list[str], *, env: dict[str, str] | None = None, timeout: float = 180
) -> subprocess.CompletedProcess:
    """``argv`` as one process in the repository, with no launcher variables set; then (also
    past ``timeout``, which raises) its whole process group is killed: what it started, such as
    torchrun's workers, does not outlive it."""
    clean = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    proc = subprocess.Popen(
        argv,
        cwd=REPO,
        env={**clean, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,  # its own process group, for the kill
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        kill_group(proc)
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


def run_cli(
    args: list[str], *, env: dict[str, str] | None = None, timeout: float = 180
) -> subprocess.CompletedProcess:
    """``python -m fsdpcheck <args>`` as one process, with no launcher variables set."""
    return run_plain(
        [sys.executable, "-m", "fsdpcheck", *args],
        env={**QUIET_ENV, **(env or {})},
        timeout=timeout,
    )


def launch_worker(
    worker: str,
    args: list[str],
    nprocs: int,
    *,
    rank_env: Callable[[int], dict[str, str]] | None,
    timeout: float,
) -> LaunchResult:
    """``nprocs`` ranks of ``tests/workers/<worker> ARGS``, one thread each, in the repository:
    what every worker runner below starts."""
    return launch(
        [str(REPO / "tests" / "workers" / worker), *args],
        nprocs,
        env={**QUIET_ENV, "OMP_NUM_THREADS": "1"},
        rank_env=rank_env,
        timeout=timeout,
        cwd=str(REPO),
    )


def _seeded(seeds: tuple[int, ...]) -> Callable[[int], dict[str, str]]:
    return lambda rank: {"PYTHONHASHSEED": str(seeds[rank])}


def run_worker_ranks(
    worker: str,
    out: Path,
    args: list[str],
    *,
    seeds: tuple[int, ...] = (1, 1),
    timeout: float = 90.0,
    nprocs: int = 2,
) -> tuple[LaunchResult, list[dict]]:
    """``nprocs`` ranks of ``tests/workers/<worker>`` (``seeds``: one per rank); returns the
    launch and each rank's JSON record."""
    out.mkdir(parents=True, exist_ok=True)
    result = launch_worker(
        worker, ["--out", str(out), *args], nprocs, rank_env=_seeded(seeds), timeout=timeout
    )
    records = []
    for rank in range(nprocs):
        path = out / f"rank{rank}.json"
        assert path.is_file(), result.output(rank)
        records.append(json.loads(path.read_text()))
    return result, records


class CaseRun:
    """One case of a batched worker job, read as a test reads a launch: its ranks' exit codes,
    the job's output, whether the job ran out of time, the case's own elapsed seconds."""

    def __init__(self, job: LaunchResult, codes: list[int | None], records: list[dict]):
        self.job, self.codes = job, codes
        self.timed_out = job.timed_out
        self.elapsed = max(float(r.get("elapsed") or 0.0) for r in records)

    def output(self, rank: int = 0) -> str:
        return self.job.output(rank)


def run_worker_cases(
    worker: str,
    root: Path,
    cases: dict[str, list[str]],
    *,
    seeds: tuple[int, int] = (1, 1),
    timeout: float = 180.0,
) -> dict[str, tuple[CaseRun, list[dict]]]:
    """Every case of ``tests/workers/<worker>`` in one 2-rank launch (the worker's
    ``--cases``: one process group, the cases in turn); each case's run and rank records. A
    case that leaves the group broken must have a launch of its own (or come last)."""
    root.mkdir(parents=True, exist_ok=True)
    listed = root / "cases.json"
    listed.write_text(json.dumps(cases))
    job = launch_worker(
        worker,
        ["--cases", str(listed), "--out", str(root)],
        2,
        rank_env=_seeded(seeds),
        timeout=timeout,
    )
    done = {}
    for case in cases:
        folder, records, codes = root / case, [], []
        for rank in range(2):
            path = folder / f"rank{rank}.json"
            assert path.is_file(), f"case {case}:\n" + job.output(rank)[-4000:]
            records.append(json.loads(path.read_text()))
            code = folder / f"exit{rank}"
            codes.append(int(code.read_text()) if code.is_file() else job.codes[rank])
        done[case] = (CaseRun(job, codes, records), records)
    return done


def run_audit_cases(
    root: Path, cases: dict, *, rank_env: Callable[[int], dict[str, str]] | None = None
) -> dict:
    """``cases`` audited in turn by one 2-rank job of tests/workers/audit_cases_worker.py (see
    its docstring for the case format); rank 0's per-case results."""
    (root / "cases.json").write_text(json.dumps(cases))
    out = root / "audited.json"
    result = launch_worker(
        "audit_cases_worker.py",
        ["--out", str(out), "--cases", str(root / "cases.json")],
        2,
        rank_env=rank_env,
        timeout=240,
    )
    assert result.codes == [0, 0] and out.is_file(), result.output(0) + result.output(1)
    return json.loads(out.read_text())


def torchrun(nproc: int, *args: str) -> list[str]:
    """``torchrun --nproc-per-node N --master-port <free> ARGS`` (a script or ``-m module``,
    then its arguments), with the torchrun next to this interpreter."""
    launcher = str(Path(sys.executable).with_name("torchrun"))
    return [launcher, "--nproc-per-node", str(nproc), "--master-port", str(free_port()), *args]


def torchrun_fsdpcheck(nproc: int, *args: str) -> list[str]:
    """``torchrun --nproc-per-node N --master-port <free> -m fsdpcheck ARGS``, as the README
    runs it."""
    return torchrun(nproc, "-m", "fsdpcheck", *args)


def read_report(path: Path) -> dict:
    return json.loads(Path(path).read_text())


@pytest.fixture(scope="session")
def llama_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama saved as safetensors (config.json + model.safetensors)."""
    import torch
    from transformers import AutoModelForCausalLM

    from fsdpcheck.model.presets import PRESETS

    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(PRESETS["tiny-llama"].make_config())
    model.save_pretrained(path)
    assert any(p.suffix == ".safetensors" for p in path.iterdir())
    return path


@pytest.fixture()
def hf_home(tmp_path: Path, llama_checkpoint: Path) -> Path:
    """A Hugging Face cache holding ``acme/tiny-llama`` in the hub layout, built offline."""
    return hub_cache(tmp_path / "hf-home", llama_checkpoint)


def hub_cache(home: Path, checkpoint: Path) -> Path:
    """``home`` as a Hugging Face cache holding ``checkpoint`` as ``acme/tiny-llama``."""
    repo = home / "hub" / "models--acme--tiny-llama"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for file in checkpoint.iterdir():
        shutil.copy(file, snapshot / file.name)
    return home


@pytest.fixture(scope="session")
def multimodal_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Gemma3 vision-language config (config.json only, no weights)."""
    from transformers import Gemma3Config

    from fsdpcheck.model.presets import PRESETS

    path = tmp_path_factory.mktemp("tiny-gemma3-vl")
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
    )
    text = PRESETS["tiny-gemma3"].make_config().to_dict()
    Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4).save_pretrained(
        path
    )
    return path
