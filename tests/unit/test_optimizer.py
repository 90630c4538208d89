"""The optimizer record (from real optimizers, in this process) and the ``optimizer`` check (on
synthetic records): per-rank settings, state presence, replicas' state values, a resume that
fell short of its checkpoint; each with its clean twin."""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from fsdpcheck.checks.gather_view import gathered_from
from fsdpcheck.model.optimizer_state import optimizer_record, text
from fsdpcheck.records import (
    EnvRecord,
    OptimizerRecord,
    OptimizerState,
    OptimizerTensor,
    ParamGroupRecord,
    RankRecord,
    SchedulerRecord,
)
from fsdpcheck.report import AuditOutcome, assemble
from fsdpcheck.vocab import Verdict


def _trained(steps: int = 2) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(steps):
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, sched


def test_settings_are_exact_text_and_state_is_named_by_parameter() -> None:
    model, opt, sched = _trained()
    opt.param_groups[0]["lr"] = torch.tensor(2.5e-4)  # a tensor lr: by its value
    found = optimizer_record(model, opt, sched)
    (group,) = found.groups
    hyper = dict(group.hyper)
    assert hyper["lr"] == "0.0002500000118743628"  # float32's value, exactly
    assert hyper["betas"] == "(0.9, 0.95)" and hyper["weight_decay"] == "0.01"
    assert hyper["amsgrad"] == "False" and "params" not in hyper
    assert group.params == ("0.weight", "0.bias", "1.weight", "1.bias")
    state = {s.param: s for s in found.states}
    assert dict(state["0.weight"].scalars) == {"step": "2.0"}
    assert [(t.key, t.shape, t.dtype) for t in state["0.weight"].tensors] == [
        ("exp_avg", (3, 4), "float32"),
        ("exp_avg_sq", (3, 4), "float32"),
    ]
    assert all(t.digest for s in found.states for t in s.tensors)
    # Stepped twice (and once at construction), halving 1e-3 each time.
    assert found.scheduler == SchedulerRecord("StepLR", 2, 3, ("0.00025",))
    assert text(1e-4) == "0.0001" and text(0.1 + 0.2) == "0.30000000000000004"


def test_a_fresh_optimizer_holds_no_state() -> None:
    model = nn.Linear(2, 2)
    found = optimizer_record(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert found.states == () and dict(found.groups[0].hyper)["momentum"] == "0.9"


@pytest.mark.parametrize("saver", ["get_optimizer_state_dict", "state_dict"])
def test_a_resume_is_held_to_the_checkpoint(tmp_path: Path, saver: str) -> None:
    """Against a DCP save (parameters by name, or by number as optimizer.state_dict() has
    them): a fresh optimizer falls short on every parameter, a restored one nowhere."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model, opt, sched = _trained()
    optim = get_optimizer_state_dict(model, opt) if saver != "state_dict" else opt.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP without a process group: one process
        dcp.save({"model": model.state_dict(), "optimizer": optim}, checkpoint_id=str(tmp_path))
        fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.StepLR(fresh, step_size=1)
        short = optimizer_record(model, fresh, scheduler, str(tmp_path))
        assert short.checkpoint_entries == 12  # 4 parameters: exp_avg, exp_avg_sq, step
        fields = {(m.param, m.field): (m.loaded, m.saved) for m in short.resumed}
        assert fields["0.weight", "exp_avg"] == ("absent", "non-zero")
        assert fields["1.bias", "step"] == ("absent", "2.0")
        assert fields["", "last_epoch"] == ("0", "2.0")
        # Zeroed moments and another step count are no better than absent ones.
        for state in opt.state.values():
            state["exp_avg"].zero_()
        opt.state[model[0].weight]["step"].fill_(5)
        zeroed = optimizer_record(model, opt, sched, str(tmp_path))
        fields = {(m.param, m.field): (m.loaded, m.saved) for m in zeroed.resumed}
        assert fields["0.weight", "exp_avg"] == ("all zero", "non-zero")
        assert fields["0.weight", "step"] == ("5.0", "2.0")
        assert ("0.weight", "exp_avg_sq") not in fields and ("", "last_epoch") not in fields
    model, opt, sched = _trained()  # the clean twin: the state that was saved
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert optimizer_record(model, opt, sched, str(tmp_path)).resumed == ()


# ---------------------------------------------------------------- the check, on records


def _record(rank: int, *, lr: str = "0.0001", digest: str = "d", state: bool = True) -> RankRecord:
    tensors = (
        OptimizerTensor("exp_avg", (4, 2), "float32", ("S(0)",), (2, 2), f"{digest}-shard"),
        OptimizerTensor("exp_avg_sq", (4, 2), "float32", None, None, digest),
    )
    states = (OptimizerState("w", 0, (("step", "3.0"),), tensors),) if state else ()
    return RankRecord(
        env=EnvRecord(rank, rank, 3, "node", "gloo", "3.12", "2.13", "", "", "", "", ""),
        shard_key="k",
        optimizer=OptimizerRecord(
            "AdamW", (ParamGroupRecord(0, ("w",), (("lr", lr),)),), states=states
        ),
    )


def _report(records: dict[int, RankRecord]):
    return assemble(AuditOutcome(gathered_from(records)), None)


def test_ranks_that_agree_are_consistent() -> None:
    assert _report({r: _record(r) for r in range(3)}).verdict == Verdict.CONSISTENT


def test_a_per_rank_lr_names_the_group_the_field_and_the_ranks() -> None:
    report = _report({0: _record(0), 1: _record(1), 2: _record(2, lr="0.0002")})
    (finding,) = report.findings
    assert (finding.kind, finding.ranks, finding.reference_rank) == ("optimizer", (2,), 0)
    assert "param group 0 lr 0.0002 (rank 0: 0.0001)" in finding.summary
    assert finding.cause == "set-up"


def test_a_rank_without_state_is_named_with_the_parameter() -> None:
    report = _report({0: _record(0), 1: _record(1, state=False), 2: _record(2)})
    (finding,) = report.findings
    assert finding.ranks == (1,) and finding.tensors == ("w",) and finding.cause == "loading"
    assert finding.details["differences"][0]["field"] == "state"


@pytest.mark.parametrize("which", ["shard", "unsharded"])
def test_state_values_differ_between_replicas_and_peers(which: str) -> None:
    other = _record(1)
    state = other.optimizer.states[0]
    i = 0 if which == "shard" else 1  # exp_avg is sharded (S(0)), exp_avg_sq is not
    tensors = list(state.tensors)
    tensors[i] = replace(tensors[i], digest="x")
    states = (replace(state, tensors=tuple(tensors)),)
    other = replace(other, optimizer=replace(other.optimizer, states=states))
    report = _report({0: _record(0), 1: other, 2: _record(2)})
    (finding,) = report.findings
    assert (finding.kind, finding.ranks) == ("optimizer", (1,))
    key = "exp_avg" if which == "shard" else "exp_avg_sq"
    assert finding.details["differences"] == [{"param": "w", "key": key}]
    assert ("between replicas" in finding.summary) == (which == "shard")


def test_shards_that_are_no_replicas_are_not_compared() -> None:
    records = {r: replace(_record(r, digest=f"d{r}"), shard_key=f"k{r}") for r in range(2)}
    # The unsharded moment still differs between peers; the shards are each rank's own.
    (finding,) = _report(records).findings
    assert finding.details["differences"] == [{"param": "w", "key": "exp_avg_sq"}]


def test_state_values_of_a_rank_already_named_are_not_told_twice() -> None:
    # Another lr steps to other values: the settings finding says why.
    report = _report({0: _record(0), 1: _record(1, lr="0.0002", digest="x"), 2: _record(2)})
    (finding,) = report.findings
    assert finding.ranks == (1,) and "lr 0.0002" in finding.summary


def test_a_checkpoint_that_saved_the_parameters_under_a_prefix_is_matched(tmp_path: Path) -> None:
    """A framework that saved the whole module (Lightning: ``model.0.weight``) while the check
    looks at the inner model (``0.weight``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model, opt, _ = _trained()
    outer = nn.Module()
    outer.model = model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"optim": get_optimizer_state_dict(outer, opt)}, checkpoint_id=str(tmp_path))
        fresh = torch.optim.AdamW(model.parameters())
        short = optimizer_record(model, fresh, None, str(tmp_path))
    assert short.checkpoint_entries == 12
    assert ("0.weight", "exp_avg") in {(m.param, m.field) for m in short.resumed}


def test_a_compiled_rank_names_its_optimizer_state_canonically() -> None:
    """torch.compile on rank 1 alone puts ``_orig_mod.`` in its parameter names: the ``wrapper``
    check says so; the optimizer, paired by canonical names, holds the same state."""
    from fsdpcheck.records import Renamed, WrappedModule, WrapperRecord
    from fsdpcheck.vocab import Wrapper

    compiled = _record(1)
    optimizer = compiled.optimizer
    compiled = replace(
        compiled,
        wrappers=WrapperRecord(
            modules=(WrappedModule("", Wrapper.COMPILE),), renamed=(Renamed("_orig_mod", 1, 0),)
        ),
        optimizer=replace(
            optimizer,
            groups=(replace(optimizer.groups[0], params=("_orig_mod.w",)),),
            states=(replace(optimizer.states[0], param="_orig_mod.w"),),
        ),
    )
    report = _report({0: _record(0), 1: compiled, 2: _record(2)})
    assert [f.kind for f in report.findings] == ["wrapper"], report.findings


def test_the_checkpoint_is_read_in_bounded_batches(tmp_path: Path, monkeypatch) -> None:
    """One entry per dcp.load (a budget of one byte): the same comparison as all at once."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from fsdpcheck.model import optimizer_state

    model, opt, _ = _trained()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=str(tmp_path))
        whole = optimizer_record(model, torch.optim.AdamW(model.parameters()), None, str(tmp_path))
        monkeypatch.setattr(optimizer_state, "_BATCH_BYTES", 1)
        batched = optimizer_record(
            model, torch.optim.AdamW(model.parameters()), None, str(tmp_path)
        )
    assert batched == whole and len(whole.resumed) == 12
