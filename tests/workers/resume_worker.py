"""One rank of the resume and launch test (tests/ranks/test_resume_launch.py), in one 2-rank
gloo job: the checkpoints are saved by this job, then every case runs in turn on its group.

The launch skew is real: the test starts rank 1 with ``FSDPCHECK_TEST_EXTRA_ARGV`` and an
allow-listed ``NCCL_ALGO``; rank 1 re-executes itself with that extra argument appended, so its
``sys.argv`` differs the way a rank started with an extra flag does (vllm #26187). Every other
case is the clean twin of a rank started alike: rank 1 drops the extra argument and variable
for it (``_started_alike``).

Cases (rank 0 writes ``--out``: ``{case: {"exit_codes", "report", "stdout"}}``):

- check_model on a script's own FSDP2 model after ``dcp.load`` from a checkpoint this job saved:
  ``resumed`` (both ranks step-100), ``resumed-latest`` (rank 0 names the root's LATEST file),
  ``stale`` (rank 1 loads and names step-200), ``launch-skew`` (rank 1 as it was started).
- ``audit --resume`` of the tiny-llama preset from a DCP checkpoint this job saved after
  sharding it with FSDP2 (``{"model": state_dict}``, as torchtitan saves): ``audit-resume``,
  ``audit-resume-stale`` (rank 1 resumes the second save) and ``audit-resume-missing``, through
  the library, and ``cli-resume`` / ``cli-resume-missing`` through the CLI command itself.
- ``audit-resume-damaged``: every rank resumes one copy of step-1 whose ``__1_0.distcp`` (the
  shard file only rank 1 reads) is cut in half: bad input naming rank 1 (exit 2).
- ``audit-resume-metadata-on-1``: rank 1 resumes a copy whose ``.metadata`` is cut short,
  which it cannot unpickle before ``dcp.load``'s first collective: bad input naming rank 1 on
  every rank (exit 2), and rank 0 does not wait for it inside the load.
- ``audit-resume-peer-died``, last: rank 1 is killed as it enters the load, so rank 0 fails
  inside ``dcp.load``'s first collective: a runtime failure naming rank 1 and the stage (exit
  3), not bad input. Rank 0 alone writes it to ``--out``: the job ends with rank 1 killed.
"""

import argparse
import contextlib
import io
import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

EXTRA = "FSDPCHECK_TEST_EXTRA_ARGV"
if os.environ.get(EXTRA):  # rank 1, started with one more flag than rank 0
    extra = os.environ.pop(EXTRA)
    os.execv(sys.executable, [sys.executable, *sys.argv, extra])

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

import fsdpcheck  # noqa: E402
from fsdpcheck.audit import AuditOptions, run_audit  # noqa: E402
from fsdpcheck.process import exit_skipping_teardown  # noqa: E402
from fsdpcheck.records import to_dict  # noqa: E402

PRESET = "tiny-llama"
SKEW_VARIABLE = "NCCL_ALGO"


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16, bias=False)
        self.down = nn.Linear(16, 8, bias=False)


def _tiny() -> nn.Module:
    torch.manual_seed(0)
    model = Tiny()
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    return model


def _save_tiny(root: Path) -> None:
    """The script's own checkpoints: step-100, then step-200 after one more "step"."""
    model = _tiny()
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(root / "step-100"))
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().add_(1.0)
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(root / "step-200"))
    if dist.get_rank() == 0:
        (root / "LATEST").write_text("step-100\n")
    dist.barrier()


def _resumed(directory: Path) -> nn.Module:
    """The script's resume, torchtitan's way: build, shard, ``dcp.load`` into it."""
    model = _tiny()
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=str(directory))
    set_model_state_dict(model, state["model"])
    return model


def _save_preset(root: Path) -> None:
    """tiny-llama, built and sharded by fsdpcheck's own pipeline, saved twice (the second after
    its weights moved) by this 2-rank FSDP2 job."""
    from fsdpcheck.model import wrap
    from fsdpcheck.options import BuildSpec
    from fsdpcheck.pipeline import build_from

    built, error = build_from(BuildSpec(PRESET, init="all"), dist.get_rank())
    assert error is None, error
    targets = wrap.plan(built.model, ())
    wrap.apply(targets.modules, init_device_mesh("cpu", (dist.get_world_size(),)))
    state = get_model_state_dict(built.model)
    dcp.save({"model": state}, checkpoint_id=str(root / "step-1"))
    with torch.no_grad():
        next(iter(built.model.parameters())).to_local().mul_(0.5)
    dcp.save({"model": get_model_state_dict(built.model)}, checkpoint_id=str(root / "step-2"))
    dist.barrier()


@contextlib.contextmanager
def _started_alike(skewed: bool) -> Iterator[None]:
    """Rank 1 as started (``skewed``), or as if started like rank 0: the clean twin."""
    argv, value = list(sys.argv), os.environ.get(SKEW_VARIABLE)
    if not skewed:
        sys.argv[:] = [a for a in sys.argv if a != "--enforce-eager"]
        os.environ.pop(SKEW_VARIABLE, None)
    try:
        yield
    finally:
        sys.argv[:] = argv
        if value is not None:
            os.environ[SKEW_VARIABLE] = value


def _cli(args: list[str]) -> tuple[int, str]:
    from fsdpcheck.cli import app

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            code = app(args, standalone_mode=False)
        except SystemExit as exc:
            code = exc.code
    return int(code or 0), out.getvalue()


def _cases(root: Path) -> dict[str, Any]:
    rank = dist.get_rank()
    tiny, preset = root / "tiny", root / "preset"
    mine = {
        "resumed": tiny / "step-100",
        "resumed-latest": tiny if rank == 0 else tiny / "step-100",
        "stale": tiny / ("step-200" if rank == 1 else "step-100"),
        "launch-skew": tiny / "step-100",
    }
    done: dict[str, Any] = {}
    for case, path in mine.items():
        with _started_alike(case == "launch-skew"):
            # The script follows a LATEST root itself; check_model is told what it was given.
            model = _resumed(tiny / (tiny / "LATEST").read_text().strip() if path == tiny else path)
            result = fsdpcheck.check_model(model, checkpoint=path, timeout=60)
        done[case] = (int(result.exit_code), result.report, "")
    damaged = preset / "damaged-step-1"
    if rank == 0:  # rank 1's own shard file, cut in half (DCP reads it on rank 1 alone)
        shutil.copytree(preset / "step-1", damaged)
        shard = damaged / "__1_0.distcp"
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    metadata = preset / "metadata-step-1"
    if rank == 0:  # a node whose copy's .metadata is cut short: rank 1 resumes it, rank 0 not
        shutil.copytree(preset / "step-1", metadata)
        index = metadata / ".metadata"
        index.write_bytes(index.read_bytes()[: index.stat().st_size // 2])
    dist.barrier()
    audits = {
        "audit-resume": preset / "step-1",
        "audit-resume-stale": preset / ("step-2" if rank == 1 else "step-1"),
        "audit-resume-missing": preset / ("step-9" if rank == 1 else "step-1"),
        "audit-resume-damaged": damaged,
        "audit-resume-metadata-on-1": preset / ("metadata-step-1" if rank == 1 else "step-1"),
    }
    for case, path in audits.items():
        with _started_alike(False):
            options = AuditOptions(model=PRESET, resume=str(path), timeout=60)  # meta: implied
            result = run_audit(options)
        done[case] = (int(result.exit_code), result.report, "")
    json_out = root / "cli.json"
    for case, path in {
        "cli-resume": preset,  # its LATEST names step-1
        "cli-resume-missing": preset / ("step-9" if rank == 1 else "step-1"),
    }.items():
        with _started_alike(False):
            args = ["audit", "--model", PRESET, "--resume", str(path), "--timeout", "60"]
            code, stdout = _cli([*args, "--json", str(json_out)])
        report = json.loads(json_out.read_text()) if rank == 0 and json_out.exists() else None
        if json_out.exists() and rank == 0:
            json_out.unlink()
        done[case] = (code, report, stdout)
        dist.barrier()
    return done


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--enforce-eager", action="store_true")  # rank 1's extra flag
    args = parser.parse_args()
    dist.init_process_group("gloo")
    root = Path(args.root)
    _save_tiny(root / "tiny")
    _save_preset(root / "preset")
    if dist.get_rank() == 0:
        (root / "preset" / "LATEST").write_text("step-1\n")
    dist.barrier()
    done = _cases(root)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, {case: code for case, (code, _, _) in done.items()})
    if dist.get_rank() == 0:
        out = {
            case: {
                "exit_codes": [codes[case] for codes in every],
                "report": report if isinstance(report, dict) or report is None else to_dict(report),
                "stdout": stdout,
            }
            for case, (_, report, stdout) in done.items()
        }
        Path(args.out).write_text(json.dumps(out))
    dist.barrier()
    # last: rank 1 does not come back from it
    died = _peer_died(root)
    if dist.get_rank() == 0:
        out = json.loads(Path(args.out).read_text())
        out["audit-resume-peer-died"] = died
        Path(args.out).write_text(json.dumps(out))
    dist.destroy_process_group()
    return 0


def _peer_died(root: Path) -> dict[str, Any]:
    """Rank 1 killed as it enters the load (``FSDPCHECK_INJECT_FAULT``, on rank 1 only): rank 0
    is then inside ``dcp.load``'s first collective when its peer goes."""
    from fsdpcheck.faults import FAULT_ENV

    if dist.get_rank() == 1:
        os.environ[FAULT_ENV] = "1:load:kill"
    with _started_alike(False):
        options = AuditOptions(model=PRESET, resume=str(root / "preset" / "step-1"), timeout=60)
        result = run_audit(options)
    return {"exit_code": int(result.exit_code), "report": to_dict(result.report)}


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    exit_skipping_teardown(main())
