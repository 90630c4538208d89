"""``wrapper``: activation checkpointing or torch.compile on some ranks only is one finding that
names who wraps what; the other checks pair tensors by canonical names. Synthetic records of
real wrapper records (fsdpcheck.model.wrappers on live torch modules), each with a clean twin."""

from __future__ import annotations

from dataclasses import replace

import torch
from synthetic import env
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from fsdpcheck.checks.gather_view import gathered_from
from fsdpcheck.model.fingerprint import fingerprint
from fsdpcheck.model.names import canonical_name
from fsdpcheck.model.wrappers import wrapper_record
from fsdpcheck.records import RankRecord
from fsdpcheck.report import AuditOutcome, assemble
from fsdpcheck.vocab import Snapshot, Verdict


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4), persistent=False)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 2)


def _checkpointed() -> nn.Module:
    net = Net()
    for i, layer in enumerate(net.layers):
        net.layers[i] = checkpoint_wrapper(layer)
    return net


def _compiled() -> nn.Module:
    return torch.compile(Net(), backend="eager")


def _record(rank: int, model: nn.Module) -> RankRecord:
    fp = fingerprint(model, Snapshot.PRE_WRAP, param_values=True)
    return RankRecord(env=env(rank), pre_wrap=fp, wrappers=wrapper_record(model))


def _report(*models: nn.Module):
    records = {rank: _record(rank, model) for rank, model in enumerate(models)}
    return assemble(AuditOutcome(gathered_from(records)), None)


def test_canonical_names_leave_the_wrapper_levels_out() -> None:
    assert (
        canonical_name("layers.0._checkpoint_wrapped_module.proj.weight") == "layers.0.proj.weight"
    )
    assert canonical_name("_orig_mod.layers.0._orig_mod.proj.weight") == "layers.0.proj.weight"
    assert canonical_name("module.head.weight", ddp_root=True) == "head.weight"
    assert canonical_name("module.head.weight") == "module.head.weight"  # not a DDP root


def test_checkpointing_on_every_rank_is_consistent() -> None:
    report = _report(_checkpointed(), _checkpointed())
    assert report.verdict == Verdict.CONSISTENT, [f.summary for f in report.findings]


def test_checkpointing_on_rank_0_only_is_one_wrapper_finding() -> None:
    report = _report(_checkpointed(), Net())
    assert [f.kind for f in report.findings] == ["wrapper"], [f.summary for f in report.findings]
    (finding,) = report.findings
    assert finding.ranks == (1,) and finding.reference_rank == 0
    assert finding.details["only_reference"] == [
        {"name": "layers.0", "how": "checkpoint_wrapper"},
        {"name": "layers.1", "how": "checkpoint_wrapper"},
    ]
    # Four parameter and two buffer names carry the level; the state dict leaves it out.
    assert finding.details["levels"] == [
        {
            "level": "_checkpoint_wrapped_module",
            "reference": {"names": 6, "keys": 0},
            "other": {"names": 0, "keys": 0},
        }
    ]
    assert "rank 0 wraps layers.0, layers.1 in checkpoint_wrapper and rank 1 does not" in (
        finding.summary
    )
    # Every loader pairs the same tensors: by position, by DCP's names or by state-dict keys,
    # none of which holds the level.
    assert {p.name: p.verdict for p in report.loaders} == dict.fromkeys(
        ("named-buffers-order", "state-dict-order", "ddp-sync", "dcp-broadcast", "sorted-names"),
        "ok",
    )


def test_compile_on_every_rank_is_consistent_and_on_one_rank_a_finding() -> None:
    clean = _report(_compiled(), _compiled())
    assert clean.verdict == Verdict.CONSISTENT, [f.summary for f in clean.findings]
    report = _report(Net(), _compiled())
    assert [f.kind for f in report.findings] == ["wrapper"], [f.summary for f in report.findings]
    (finding,) = report.findings
    assert finding.ranks == (1,)
    assert finding.details["only_other"] == [{"name": "", "how": "torch.compile"}]
    assert finding.details["levels"][0]["other"] == {"names": 8, "keys": 6}
    assert "model.state_dict() keys differ too" in finding.summary  # compile renames them too
    # DCP's names leave _orig_mod out; fsdpcheck's loader keys by state_dict(): it refuses.
    verdicts = {p.name: p.verdict for p in report.loaders}
    assert verdicts["dcp-broadcast"] == "ok" and verdicts["sorted-names"] == "refused"


def test_values_are_compared_by_canonical_names() -> None:
    # Rank 1 compiles and holds other weights: a value finding names the canonical tensor.
    other = _compiled()
    with torch.no_grad():
        other._orig_mod.head.weight.add_(1.0)
    report = _report(Net(), other)
    kinds = sorted(f.kind for f in report.findings)
    assert kinds == ["value", "wrapper"], [f.summary for f in report.findings]
    value = next(f for f in report.findings if f.kind == "value")
    assert value.tensors == ("head.weight",)


def test_a_record_without_wrappers_is_compared_as_before() -> None:
    records = {0: _record(0, _checkpointed()), 1: replace(_record(1, Net()))}
    records[0] = replace(records[0], wrappers=None)
    records[1] = replace(records[1], wrappers=None)
    report = assemble(AuditOutcome(gathered_from(records)), None)
    assert "param-set" in [f.kind for f in report.findings]
    assert "wrapper" not in [f.kind for f in report.findings]


def test_composable_checkpoint_on_one_rank_renames_nothing_and_is_still_named() -> None:
    from torch.distributed._composable import checkpoint

    hooked = Net()
    checkpoint(hooked.layers[0])  # hooks only: no new names, so no layout finding could tell
    report = _report(Net(), hooked)
    assert [f.kind for f in report.findings] == ["wrapper"], [f.summary for f in report.findings]
    (finding,) = report.findings
    assert finding.details["only_other"] == [{"name": "layers.0", "how": "checkpoint"}]
    assert finding.details["levels"] == []
    assert _report(hooked, hooked).verdict == Verdict.CONSISTENT
