"""``fsdpcheck run``'s pure parts: the command line's target, the write log on a real module (one
process, no ranks), and how unwritten tensors are named (synthetic records)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fsdpcheck.checks.groups import group_ranks
from fsdpcheck.checks.uninitialized import owning_modules, uninitialized_findings
from fsdpcheck.errors import InputError
from fsdpcheck.model.writes import WriteLog, script_frame
from fsdpcheck.options import RunOptions
from fsdpcheck.records import BufferProblem, RankRecord
from fsdpcheck.script.runner import Target
from fsdpcheck.vocab import BufferReason, Snapshot
from tests.synthetic import env


@pytest.mark.parametrize(
    ("words", "target"),
    [
        (["train.py", "--lr", "3", "-m", "x"], Target("train.py", ("--lr", "3", "-m", "x"))),
        (
            ["-m", "torchtitan.train", "--steps", "1"],
            Target("torchtitan.train", ("--steps", "1"), True),
        ),
        (["-mtorchtitan.train"], Target("torchtitan.train", (), True)),
    ],
)
def test_the_target_is_read_as_python_reads_it(words: list[str], target: Target) -> None:
    assert Target.parse(words) == target


@pytest.mark.parametrize("words", [[], ["-m"], ["--lr", "3"]])
def test_a_missing_or_misplaced_target_is_bad_input(words: list[str]) -> None:
    with pytest.raises(InputError):
        Target.parse(words)


def test_a_target_that_is_not_there_says_so() -> None:
    assert "does not exist" in Target("no_such_script.py").problem()
    assert "no module named" in Target("no_such_module_here", module=True).problem()
    assert Target("json", module=True).problem() == ""


def test_run_options_refuse_steps_before_the_watch_ends() -> None:
    with pytest.raises(InputError, match="--steps"):
        RunOptions(watch_steps=3, steps=2)
    with pytest.raises(InputError, match="--watch-steps"):
        RunOptions(watch_steps=0)


class _Observed(TorchDispatchMode):
    """Stands in for the collective watch: every op goes to the write log first."""

    def __init__(self, log: WriteLog):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.log.saw(func, args, kwargs or {})
        return func(*args, **(kwargs or {}))


def _model() -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.LayerNorm(4))


def test_the_write_log_sees_every_way_a_tensor_is_written() -> None:
    model, log = _model(), WriteLog()
    with _Observed(log):
        model.to_empty(device="cpu")
        log.emptied(model, "script.py:10")
        nn.init.normal_(model[0].weight)  # version counter
        model[0].bias.data.zero_()  # through .data: its own counter, seen by the mode
        model[2].load_state_dict(  # a load that assigns new tensors
            {"weight": torch.ones(4), "bias": torch.zeros(4)}, assign=True
        )
    unwritten = log.unwritten(model)
    assert [p.name for p in unwritten] == ["1.bias", "1.weight"]
    assert all(p.reason == BufferReason.UNWRITTEN for p in unwritten)
    assert "to_empty() at script.py:10" in unwritten[0].detail
    assert "test_the_write_log_sees_every_way_a_tensor_is_written" in unwritten[0].detail


def test_script_frame_looks_only_between_the_call_and_the_script() -> None:
    # How the watch tells DTensor's redistributions from the script's own collectives: torch's
    # code (here pytree calling back, the lambda standing for the watch) counts, the script's
    # callers (pytest) do not; the frame it stops at is the script's (``looks``).
    import _pytest.python
    import torch.utils._pytree as pytree

    def looks(path: str) -> list[tuple[str, str, bool]]:
        return pytree.tree_map(lambda _: script_frame(2, path), [0])

    [(function, line, passed)] = looks(pytree.__file__)
    assert passed and function.endswith("looks") and line.startswith("test_run_parts.py:")
    assert looks(nn.modules.module.__file__)[0][2] is False  # torch, but not on the way
    assert looks(_pytest.python.__file__)[0][2] is False  # above the script: never reached


def test_a_script_under_a_folder_called_torch_is_still_the_script(tmp_path: Path) -> None:
    # Frames are skipped by the package they belong to, not by a folder name in their path: a
    # script at ~/torch/train.py (or a checkout of this repository under .../fsdpcheck/) is
    # the script.
    import torch.utils._pytree as pytree

    source = "def looks(path):\n    return pytree.tree_map(lambda _: script_frame(2, path), [0])\n"
    for folder in ("torch", "fsdpcheck"):
        script = tmp_path / folder / "train.py"
        code = compile(source, str(script), "exec")
        space = {"pytree": pytree, "script_frame": script_frame}
        exec(code, space)
        [(function, line, passed)] = space["looks"](pytree.__file__)
        assert (function, line, passed) == ("looks", "train.py:2", True), folder


def test_the_write_log_without_the_mode_still_reads_version_counters() -> None:
    """Writes on another thread: no mode sees them, the version counter does."""
    model, log = _model(), WriteLog()
    model.to_empty(device="cpu")
    log.emptied(model, "script.py:3")
    for p in model.parameters():
        with torch.no_grad():
            p.copy_(torch.zeros_like(p))
    assert log.unwritten(model) == ()


def _record(rank: int, problems: tuple[BufferProblem, ...], garbage: str) -> RankRecord:
    # garbage differs per rank (informational): the ranks still are one finding
    shown = tuple(
        BufferProblem(p.name, p.snapshot, p.reason, got=(garbage,), detail=p.detail)
        for p in problems
    )
    return RankRecord(env=env(rank), uninitialized=shown)


def test_unwritten_tensors_are_one_finding_named_by_their_modules() -> None:
    names = [f"layers.{i}.{t}" for i in range(10) for t in ("attn.wq.weight", "ffn.w1.bias")]
    problems = tuple(
        BufferProblem(n, Snapshot.LOAD, BufferReason.UNWRITTEN, detail="to_empty() at t.py:9")
        for n in names
    )
    records = {0: _record(0, problems, "nan"), 1: _record(1, problems, "1e-39")}
    groups = group_ranks({0: "a", 1: "b"}, {0: "h", 1: "h"})
    (finding,) = uninitialized_findings(groups, records)
    assert finding.ranks == (0, 1)
    assert "20 tensors of layers.0-9 (10 modules) were never written" in finding.summary
    assert "to_empty() at t.py:9" in finding.summary


def test_owning_modules_stop_at_the_first_numbered_child() -> None:
    assert owning_modules(["layers.3.attn.wq.weight", "norm.weight", "bias"]) == [
        "layers.3",
        "norm",
        "(root)",
    ]
