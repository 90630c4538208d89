"""``consistent`` is a proof: a mutation sweep over the per-rank record's schema.

The schema is walked from the type hints of :class:`RankRecord` (never listed by hand): every
field of every record it holds is changed on one rank of a synthetic 3-rank gather, and the
verdict must not be ``consistent``; a field declared per-process or informational
(``records.AGREEMENT``) is the clean twin: changing it must leave the verdict ``consistent``. A
field the declaration does not name fails here.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import replace
from enum import Enum
from pathlib import Path
from typing import Any, Literal

import pytest

from fsdpcheck.checks.gather_view import gathered_from
from fsdpcheck.records import (
    AGREEMENT,
    IN_MESH_LAYOUT,
    IN_VALUE_DIGEST,
    NOT_COMPARED,
    BufferProblem,
    CheckpointRecord,
    ConfigRecord,
    EnvRecord,
    Fingerprint,
    FsdpGroupRecord,
    FsdpPlanRecord,
    LaunchRecord,
    MemoryRecord,
    MeshRecord,
    ModuleKind,
    ModuleStateRecord,
    NonFinite,
    NumericsRecord,
    OptimizerRecord,
    OptimizerState,
    OptimizerTensor,
    ParamGroupRecord,
    RankError,
    RankRecord,
    Renamed,
    ResumeMismatch,
    SchedulerRecord,
    SourceRecord,
    StageMemory,
    TensorRecord,
    TieRecord,
    WrappedModule,
    WrapperRecord,
)
from fsdpcheck.report import AuditOutcome, assemble
from fsdpcheck.vocab import Agreement, BufferReason, MemoryPeak, Snapshot, Stage, Verdict, Wrapper

RANKS = (0, 1, 2)
MUTATED = 1


def _base(rank: int) -> RankRecord:
    """Three HSDP replicas (one shard key) that agree in everything, every optional field set:
    every digest of the record is compared."""

    def tensor(name: str, **kw: Any) -> TensorRecord:
        fields = dict(shape=(4, 2), dtype="float32", device="cpu", digest=f"d-{name}", head=("1",))
        return TensorRecord(name=name, **{**fields, **kw})

    def fp(stage: Snapshot, wrapped: bool) -> Fingerprint:
        # On the mesh below: its shape, dim names and ranks are compared per parameter.
        sharded = dict(placements=("S(0)",), local_shape=(2, 2), mesh="m") if wrapped else {}
        return Fingerprint(
            snapshot=stage,
            buffers=(tensor("rope.inv_freq", persistent=False, requires_grad=False),),
            params=(
                tensor("embed.weight", requires_grad=True, **sharded),
                tensor("norm.weight", requires_grad=True, **sharded),
            ),
            state_dict_keys=("embed.weight", "norm.weight", "head.weight"),
            aliases=(("head.weight", "embed.weight"),),
        )

    group = FsdpGroupRecord(
        modules=("",),
        params=("embed.weight", "norm.weight"),
        param_dtype="bfloat16",
        reduce_dtype="float32",
        output_dtype="float32",
        cast_forward_inputs=True,
        reshard_after_forward=True,
        offload="OffloadPolicy",
        pin_memory=False,
        mesh_shape=(3,),
        mesh_dim_names=("dp",),
        mesh_device_type="cpu",
    )
    ties = tuple(
        TieRecord(
            stage,
            shared=(("embed.weight", "head.weight"),),
            expected=(("head.weight", "embed.weight"),),
            buffers=(("rope.cos", "rope.inv_freq"),),
        )
        for stage in (Snapshot.PRE_WRAP, Snapshot.POST_WRAP)
    )
    return RankRecord(
        env=EnvRecord(
            rank, rank, 3, "node-a", "gloo", "3.12", "2.13", "5.24", "0", "1.15", "2.27", "13.0"
        ),
        pre_wrap=fp(Snapshot.PRE_WRAP, wrapped=False),
        post_wrap=fp(Snapshot.POST_WRAP, wrapped=True),
        fsdp_plan=FsdpPlanRecord(groups=(group,)),
        wrappers=WrapperRecord(
            modules=(WrappedModule("layers.0", Wrapper.CHECKPOINT_WRAPPER),),
            renamed=(Renamed("_checkpoint_wrapped_module", 2, 0),),
        ),
        config=ConfigRecord(digest="c0", canonical={"hidden_size": 8, "rope": {"theta": 1e4}}),
        ties=ties,
        shard_key="k",
        peer_key="p",
        meshes=(MeshRecord("m", (3,), RANKS, (rank,), ("dp",)),),
        source=SourceRecord("acme/tiny", f"/node-{rank}/snapshot", "float32"),
        checkpoint=CheckpointRecord(
            given=f"/node-{rank}/ckpt",
            path="/ckpt/step-100",
            step=100,
            metadata="a1" * 16,
            shard_files=3,
            saved_ranks=3,
        ),
        launch=LaunchRecord(("train.py", "--lr", "1e-4"), {"NCCL_ALGO": "Ring"}),
        modules=ModuleStateRecord(
            kinds=(
                ModuleKind("acme.Model", True, ("forward:acme.scale",), (("scaling", "0.25"),)),
                ModuleKind("torch.nn.LayerNorm", True, (), (("eps", "1e-05"),)),
            ),
            modules=(("", 0), ("norm", 1), ("final_norm", 1)),
            global_hooks=("forward:acme.trace",),
        ),
        numerics=NumericsRecord(
            (("default_dtype", "torch.float32"), ("deterministic_algorithms", "False"))
        ),
        optimizer=OptimizerRecord(
            cls="AdamW",
            groups=(ParamGroupRecord(0, ("embed.weight", "norm.weight"), (("lr", "0.0001"),)),),
            states=(
                OptimizerState(
                    "embed.weight",
                    0,
                    scalars=(("step", "3.0"),),
                    tensors=(
                        OptimizerTensor("exp_avg", (4, 2), "float32", ("S(0)",), (2, 2), "e1"),
                        OptimizerTensor("exp_avg_sq", (4, 2), "float32", None, None, "e2"),
                    ),
                ),
            ),
            scheduler=SchedulerRecord("LambdaLR", 3, 4, ("0.0001",)),
            checkpoint_entries=3,
        ),
        # A small model (below the memory check's floor): the numbers are swept, never compared.
        memory=MemoryRecord(
            rank,
            MemoryPeak.STAGE,
            (StageMemory(Stage.BUILD, 300 << 20, 310 << 20, 305 << 20, 0, 1 << 20),),
            process_peak=400 << 20,
            current=350 << 20,
            cuda_peak=1 << 20,
            cuda_current=0,
            model_bytes=4 << 20,
            shard_bytes=2 << 20,
        ),
    )


def _verdict(records: Mapping[int, RankRecord]) -> tuple[Verdict, list[str]]:
    report = assemble(AuditOutcome(gathered_from(records)), None)
    return report.verdict, [f.summary for f in report.findings]


# ---------------------------------------------------------------- the schema walk


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _optional(hint: Any) -> tuple[Any, bool]:
    """(the hint without None, whether None is allowed)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return (args[0] if len(args) == 1 else args[0]), type(None) in typing.get_args(hint)
    return hint, False


def _sample(hint: Any) -> Any:
    """A value of ``hint`` unlike any in the base record."""
    hint, _ = _optional(hint)
    origin = typing.get_origin(hint)
    if isinstance(hint, type) and issubclass(hint, Enum):
        return list(hint)[-1]
    if origin is Literal:
        return typing.get_args(hint)[-1]
    if dataclasses.is_dataclass(hint):
        return hint(
            **{
                f.name: _sample(_hints(hint)[f.name])
                for f in dataclasses.fields(hint)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            }
        )
    if origin is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return (_sample(args[0]),)
        return tuple(_sample(a) for a in args)
    if origin in (dict, Mapping) or hint in (dict, Mapping):
        return {"mutated": 1}
    return {bool: True, int: 7, float: 0.5, str: "mutated"}.get(hint, "mutated")


def _changed(value: Any, hint: Any) -> Iterator[tuple[str, Any]]:
    """(how, new value) for a field holding ``value``: another value of its type, None."""
    bare, nullable = _optional(hint)
    if value is None:
        yield "set", _sample(bare)
        return
    if nullable:
        yield "none", None
    if isinstance(value, bool):
        yield "flip", not value
    elif isinstance(value, Enum):
        yield "other", next(m for m in type(value) if m is not value)
    elif isinstance(value, (int, float)):
        yield "other", value + 1
    elif isinstance(value, str):
        yield "other", value + "-mutated"
    elif isinstance(value, tuple):
        args = typing.get_args(bare)
        element = args[0] if len(args) == 2 and args[1] is Ellipsis else None
        if element is not None:
            yield "append", (*value, _sample(element))
        if len(value) > 1:
            yield "reverse", tuple(reversed(value))
    elif isinstance(value, Mapping):
        yield "add", {**value, "mutated": 1}


def mutations(record: Any, path: str = "") -> Iterator[tuple[str, str, Any]]:
    """(path, "Class.field", record with that field changed) for every field reachable from
    ``record``, walking its dataclass type hints and the values it holds."""
    cls = type(record)
    hints = _hints(cls)
    for f in dataclasses.fields(record):
        value, hint = getattr(record, f.name), hints[f.name]
        here = f"{path}.{f.name}" if path else f.name
        declared = f"{cls.__name__}.{f.name}"
        for how, new in _changed(value, hint):
            yield f"{here} ({how})", declared, replace(record, **{f.name: new})
        if dataclasses.is_dataclass(value):
            for sub, name, changed in mutations(value, here):
                yield sub, name, replace(record, **{f.name: changed})
        elif isinstance(value, tuple):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    for sub, name, changed in mutations(item, f"{here}[{i}]"):
                        items = (*value[:i], changed, *value[i + 1 :])
                        yield sub, name, replace(record, **{f.name: items})


def schema_fields(cls: type = RankRecord, seen: set | None = None) -> set[str]:
    """Every "Class.field" reachable from ``cls`` through its type hints."""
    seen = set() if seen is None else seen
    out: set[str] = set()
    if cls in seen:
        return out
    seen.add(cls)
    for name, hint in _hints(cls).items():
        out.add(f"{cls.__name__}.{name}")
        for inner in _inner_types(hint):
            if dataclasses.is_dataclass(inner):
                out |= schema_fields(inner, seen)
    return out


def _inner_types(hint: Any) -> Iterator[Any]:
    yield hint
    for arg in typing.get_args(hint):
        if arg is not Ellipsis:
            yield from _inner_types(arg)


# ---------------------------------------------------------------- the sweep

BASE = {rank: _base(rank) for rank in RANKS}
SWEEP = list(mutations(BASE[MUTATED]))


def test_the_base_is_consistent_and_every_field_is_declared_once() -> None:
    assert _verdict(BASE) == (Verdict.CONSISTENT, [])
    # A field added to the record (or one it holds) without a declaration fails here: say in
    # records.AGREEMENT whether it must agree, and docs/checks.md why.
    assert set(AGREEMENT) == schema_fields(), (
        f"undeclared: {sorted(schema_fields() - set(AGREEMENT))}, "
        f"no such field: {sorted(set(AGREEMENT) - schema_fields())}"
    )
    replicas = {k for k, a in AGREEMENT.items() if a is Agreement.REPLICAS}
    assert replicas == IN_VALUE_DIGEST | IN_MESH_LAYOUT and not replicas & NOT_COMPARED


def test_the_docs_table_is_the_declaration() -> None:
    """docs/checks.md's table of what may differ between ranks is records.AGREEMENT: every
    declared field once, with its agreement, and nothing else."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "checks.md").read_text()
    table: dict[str, str] = {}
    for cls, fields, agreement in re.findall(r"^\| `(\w+)` \| ([^|]+) \| ([a-z-]+) \|", text, re.M):
        for name in re.findall(r"`(\w+)`", fields):
            assert f"{cls}.{name}" not in table, f"{cls}.{name} twice"
            table[f"{cls}.{name}"] = agreement
    assert table == {k: a.value for k, a in AGREEMENT.items()}


def test_the_sweep_reaches_every_field_of_the_schema() -> None:
    reached = {name for _, name, _ in SWEEP}
    # A field that always holds a record is swept through that record's own fields.
    reached |= {
        f"{cls.__name__}.{name}"
        for cls in (RankRecord,)
        for name, hint in _hints(cls).items()
        if dataclasses.is_dataclass(hint)
    }
    # A rank's error is compared as the report's error (never consistent, see below); a buffer
    # problem is a finding by itself, so its fields are swept on records that already have one.
    elsewhere = {f"RankError.{f.name}" for f in dataclasses.fields(RankError)}
    elsewhere |= {f"BufferProblem.{f.name}" for f in dataclasses.fields(BufferProblem)}
    # Likewise a tensor counted non-finite after the load (its fingerprint's count is swept).
    elsewhere |= {f"NonFinite.{f.name}" for f in dataclasses.fields(NonFinite)}
    # ... and a resume that fell short of its checkpoint (an optimizer finding on every rank).
    elsewhere |= {f"ResumeMismatch.{f.name}" for f in dataclasses.fields(ResumeMismatch)}
    assert schema_fields() - elsewhere <= reached, schema_fields() - elsewhere - reached


@pytest.mark.parametrize(("path", "declared", "mutated"), SWEEP, ids=[p for p, _, _ in SWEEP])
def test_a_field_changed_on_one_rank_is_never_consistent(
    path: str, declared: str, mutated: RankRecord
) -> None:
    verdict, findings = _verdict({**BASE, MUTATED: mutated})
    if declared in NOT_COMPARED or _not_compared(path):
        assert verdict == Verdict.CONSISTENT, findings  # the clean twin
    else:
        assert verdict != Verdict.CONSISTENT, f"{path}: consistent"


def _not_compared(path: str) -> bool:
    # A tensor without values (digest None: on meta, or not materialised) is not compared: that
    # is what lets ranks > 0 of --init rank0 hold nothing yet.
    return path.endswith(".digest (none)")


def test_a_buffer_problem_on_one_rank_and_its_fields() -> None:
    problem = BufferProblem("rope.inv_freq", Snapshot.POST_WRAP, BufferReason.NAN, ("nan",), ("1",))
    verdict, _ = _verdict({**BASE, MUTATED: replace(BASE[MUTATED], uninitialized=(problem,))})
    assert verdict != Verdict.CONSISTENT
    both = {r: replace(BASE[r], uninitialized=(problem,)) for r in RANKS}
    for path, declared, mutated in mutations(problem, "problem"):
        record = replace(both[MUTATED], uninitialized=(mutated,))
        same = record.group_digest() == both[0].group_digest()
        assert same == (declared in NOT_COMPARED), path


def test_a_resume_mismatch_on_every_rank_and_its_fields() -> None:
    """A resume that reset the optimizer on every rank alike is a finding though all agree."""
    mismatch = ResumeMismatch("embed.weight", "exp_avg", "absent", "non-zero")

    def short(record: RankRecord, found: ResumeMismatch) -> RankRecord:
        return replace(record, optimizer=replace(record.optimizer, resumed=(found,)))

    both = {r: short(BASE[r], mismatch) for r in RANKS}
    verdict, summaries = _verdict(both)
    assert verdict == Verdict.INCONSISTENT and "not restored" in summaries[0], summaries
    for path, declared, mutated in mutations(mismatch, "mismatch"):
        same = short(BASE[MUTATED], mutated).group_digest() == both[0].group_digest()
        assert same == (declared in NOT_COMPARED), path


def test_an_error_on_one_rank_is_never_consistent() -> None:
    error = RankError(MUTATED, "build", "boom")
    verdict, _ = _verdict({**BASE, MUTATED: replace(BASE[MUTATED], error=error)})
    assert verdict == Verdict.ERROR


def test_an_unexplained_difference_names_the_field_and_the_ranks() -> None:
    """aliases alone have no check of their own: the last resort names them."""
    mutated = replace(
        BASE[MUTATED], pre_wrap=replace(BASE[MUTATED].pre_wrap, aliases=(("x.weight", "w"),))
    )
    report = assemble(AuditOutcome(gathered_from({**BASE, MUTATED: mutated})), None)
    [finding] = report.findings
    assert (finding.kind, finding.ranks, finding.reference_rank) == ("unexplained", (1,), 0)
    assert finding.details["fields"] == ["pre_wrap.aliases"]
    assert "rank 1 and rank 0 differ in pre_wrap.aliases" in finding.summary
    assert report.verdict == Verdict.INCONSISTENT


def test_values_not_read_and_no_nan_seen_are_the_same_record() -> None:
    """A rank on meta (non_finite None: not read) and one with values (0 NaN) agree; a rank
    that holds NaN does not (its own group, a ``non-finite`` finding)."""

    def counted(record: RankRecord, count: int | None) -> RankRecord:
        fp = record.pre_wrap
        buffers = tuple(replace(t, non_finite=count) for t in fp.buffers)
        return replace(record, pre_wrap=replace(fp, buffers=buffers))

    read = {rank: counted(BASE[rank], 0 if rank == 0 else None) for rank in RANKS}
    assert _verdict(read) == (Verdict.CONSISTENT, [])
    poisoned = {**read, MUTATED: counted(BASE[MUTATED], 2)}
    verdict, summaries = _verdict(poisoned)
    assert verdict != Verdict.CONSISTENT and any("NaN" in s or "Inf" in s for s in summaries)
