"""The state checks (requires-grad, wrap-plan, device, config, env) on synthetic records, and
the collectors on live objects in this process."""

from __future__ import annotations

import dataclasses
import json

import pytest
from synthetic import EMBED, FULL, K_PROJ, Q_PROJ, SCALE, SLIDING, analyse, tensor

from fsdpcheck.checks.config import config_differences
from fsdpcheck.checks.groups import group_ranks
from fsdpcheck.model.config_record import REDACTED, config_record
from fsdpcheck.model.keys import device_exceptions, misplaced
from fsdpcheck.records import (
    EnvRecord,
    Fingerprint,
    FsdpGroupRecord,
    FsdpPlanRecord,
    RankRecord,
    from_dict,
    to_dict,
)
from fsdpcheck.report import verdict

LAYER0 = "model.layers.0"


def env(rank, backend="gloo", **versions):
    return EnvRecord(
        rank=rank,
        local_rank=rank,
        world_size=2,
        host="node0",
        backend=backend,
        python="3.11.9",
        torch="2.13.0",
        transformers="5.24.0",
        hash_seed="0",
        **versions,
    )


def fp(stage, *, device="cpu", frozen=(), buffer_devices=None, param_devices=None):
    buffer_devices = buffer_devices or {}
    param_devices = param_devices or {}
    placements = ("Shard(dim=0)",) if stage == "post-wrap" else None
    bufs = tuple(
        tensor(n, (8,), persistent=False, device=buffer_devices.get(n, device))
        for n in (SCALE, FULL, SLIDING)
    )
    prms = tuple(
        dataclasses.replace(
            tensor(n, (8, 8), placements=placements, device=param_devices.get(n, device)),
            requires_grad=n not in frozen,
        )
        for n in (EMBED, Q_PROJ, K_PROJ)
    )
    return Fingerprint(snapshot=stage, buffers=bufs, params=prms)


def plan(device="cpu", param_dtype=None, offload="OffloadPolicy", layer_params=(Q_PROJ, K_PROJ)):
    def group(modules, names):
        return FsdpGroupRecord(
            modules=modules,
            params=tuple(names),
            param_dtype=param_dtype,
            reshard_after_forward=True,
            offload=offload,
            mesh_shape=(2,),
            mesh_device_type=device,
        )

    rest = [n for n in (EMBED, Q_PROJ, K_PROJ) if n not in layer_params]
    return FsdpPlanRecord(groups=(group(("",), rest), group((LAYER0,), layer_params)))


def dumps(record):
    return json.dumps(to_dict(record))


def record(rank, **fields):
    """A rank's record as the rank sends it: with its own judgement of misplaced tensors."""
    rec = RankRecord(env=fields.pop("env", env(rank)), **fields)
    return dataclasses.replace(rec, misplaced=misplaced(rec))


def run(records):
    """Analyse as rank 0 would after the gather: group by digest, keep representatives."""
    groups = group_ranks({r: rec.group_digest() for r, rec in records.items()})
    reps = {g.representative: records[g.representative] for g in groups}
    return groups, analyse(groups, reps)


def kinds(findings):
    return [f.kind for f in findings]


# ---------------------------------------------------------------- requires-grad


def test_one_frozen_parameter_is_a_requires_grad_finding():
    records = {
        0: record(0, pre_wrap=fp("pre-wrap"), post_wrap=fp("post-wrap")),
        1: record(
            1, pre_wrap=fp("pre-wrap", frozen={Q_PROJ}), post_wrap=fp("post-wrap", frozen={Q_PROJ})
        ),
    }
    groups, findings = run(records)
    assert len(groups) == 2
    assert kinds(findings) == ["requires-grad"]
    f = findings[0]
    assert (f.ranks, f.snapshot, f.cause, f.tensors) == (
        (1,),
        "pre-wrap",
        "construction-time",
        (Q_PROJ,),
    )
    assert f"{Q_PROJ} is trainable on rank 0 but frozen on rank 1" in f.summary
    assert f.details["persists_after_wrap"] is True
    assert verdict(findings, []) == ("inconsistent", 1)


def test_the_same_frozen_parameter_on_every_rank_is_consistent():
    records = {r: record(r, pre_wrap=fp("pre-wrap", frozen={EMBED})) for r in (0, 1)}
    groups, findings = run(records)
    assert len(groups) == 1 and findings == []


def test_requires_grad_is_part_of_the_layout_digest():
    trainable = fp("pre-wrap")
    frozen = fp("pre-wrap", frozen={EMBED})
    unrecorded = Fingerprint(
        "pre-wrap",
        trainable.buffers,
        tuple(dataclasses.replace(t, requires_grad=None) for t in trainable.params),
    )
    digests = {f.layout_digest() for f in (trainable, frozen, unrecorded)}
    assert len(digests) == 3


# ---------------------------------------------------------------- wrap-plan


def test_mixed_precision_on_one_rank_is_a_wrap_plan_finding():
    records = {
        0: record(0, post_wrap=fp("post-wrap"), fsdp_plan=plan()),
        1: record(1, post_wrap=fp("post-wrap"), fsdp_plan=plan(param_dtype="bfloat16")),
    }
    groups, findings = run(records)
    assert len(groups) == 2 and kinds(findings) == ["wrap-plan"]
    f = findings[0]
    assert f.snapshot == "post-wrap" and f.ranks == (1,)
    assert (
        "param_dtype unset on rank 0 but bfloat16 on rank 1 (groups <root>, model.layers.0)"
        in f.summary
    )
    assert {p["group"] for p in f.details["policies"]} == {"<root>", LAYER0}


def test_regrouped_parameters_and_other_targets_are_named():
    other = FsdpPlanRecord(
        groups=(
            FsdpGroupRecord(modules=("",), params=(EMBED, K_PROJ), mesh_shape=(2,)),
            FsdpGroupRecord(modules=("model.layers.0.attn",), params=(Q_PROJ,), mesh_shape=(2,)),
        )
    )
    ref = dataclasses.replace(
        plan(),
        groups=tuple(
            dataclasses.replace(g, offload=None, reshard_after_forward=None, mesh_device_type=None)
            for g in plan().groups
        ),
    )
    records = {0: record(0, fsdp_plan=ref), 1: record(1, fsdp_plan=other)}
    _, findings = run(records)
    f = findings[0]
    assert f.kind == "wrap-plan"
    assert f.details["only_reference"] == [LAYER0]
    assert f.details["only_other"] == ["model.layers.0.attn"]
    moved = {m["name"]: (m["reference"], m["other"]) for m in f.details["regrouped"]}
    assert moved == {Q_PROJ: (LAYER0, "model.layers.0.attn"), K_PROJ: (LAYER0, "<root>")}
    assert set(f.tensors) == {Q_PROJ, K_PROJ}


def test_mesh_shape_and_names_differ():
    hsdp = FsdpPlanRecord(
        groups=tuple(
            dataclasses.replace(g, mesh_shape=(1, 2), mesh_dim_names=("replicate", "shard"))
            for g in plan().groups
        )
    )
    _, findings = run({0: record(0, fsdp_plan=plan()), 1: record(1, fsdp_plan=hsdp)})
    fields = {p["field"] for p in findings[0].details["policies"]}
    assert fields == {"mesh_shape", "mesh_dim_names"}
    assert "mesh_shape (2) on rank 0 but (1, 2) on rank 1" in findings[0].summary


def test_a_rank_that_did_not_wrap_and_unreadable_plans():
    _, findings = run({0: record(0, fsdp_plan=plan()), 1: record(1)})
    assert (
        kinds(findings) == ["wrap-plan"]
        and "rank 1 did not apply fully_shard" in findings[0].summary
    )
    unreadable = FsdpPlanRecord(groups=(), unavailable="AttributeError: private API moved")
    _, findings = run({0: record(0, fsdp_plan=plan()), 1: record(1, fsdp_plan=unreadable)})
    # Unreadable on one side only: the plans were not compared, and the report says so.
    assert kinds(findings) == ["wrap-plan"] and findings[0].details["unavailable"] == "other"
    assert "could not be read on rank 1 (AttributeError: private API moved)" in findings[0].summary
    _, findings = run({r: record(r, fsdp_plan=unreadable) for r in (0, 1)})
    assert findings == []  # unreadable everywhere: nothing to compare, nothing different


def test_identical_plans_are_one_group_and_round_trip():
    records = {
        r: record(r, post_wrap=fp("post-wrap"), fsdp_plan=plan(param_dtype="bfloat16"))
        for r in (0, 1)
    }
    groups, findings = run(records)
    assert len(groups) == 1 and findings == []
    again = from_dict(RankRecord, json.loads(dumps(records[1])))
    assert again == records[1]
    assert again.group_digest() == records[1].group_digest()


# ---------------------------------------------------------------- config


def test_config_difference_names_the_key_path_and_both_values():
    base = {"rope_parameters": {"full_attention": {"rope_theta": 1000000.0}}, "vocab_size": 256}
    stale = {"rope_parameters": {"full_attention": {"rope_theta": 500000.0}}, "vocab_size": 256}
    records = {0: record(0, config=config_record(base)), 1: record(1, config=config_record(stale))}
    groups, findings = run(records)
    assert len(groups) == 2 and kinds(findings) == ["config"]
    assert (
        "rope_parameters.full_attention.rope_theta: 1000000.0 on rank 0, 500000.0 on rank 1"
        in findings[0].summary
    )
    assert findings[0].details["count"] == 1


def test_config_differences_cover_missing_keys_and_lists():
    diffs = config_differences(
        {"layer_types": ["sliding", "full"], "a": 1, "b": {"c": True}},
        {"layer_types": ["sliding", "sliding"], "b": {"c": True, "d": 2}},
    )
    assert diffs == [
        {"path": "a", "reference": 1, "other": None, "missing": "other"},
        {"path": "b.d", "reference": None, "other": 2, "missing": "reference"},
        {"path": "layer_types[1]", "reference": "full", "other": "sliding"},
    ]
    assert config_differences({"x": [1, 2]}, {"x": [1]}) == [
        {"path": "x", "reference": [1, 2], "other": [1]}
    ]


def test_volatile_keys_paths_and_numbers_do_not_split_ranks():
    a = {
        "_name_or_path": "/node0/llama",
        "transformers_version": "5.24.0",
        "dtype": "bfloat16",
        "text_config": {"_attn_implementation_internal": "sdpa", "rope_theta": 10000},
    }
    b = {
        "_name_or_path": "/node1/llama",
        "transformers_version": "5.23.0",
        "dtype": "float32",
        "text_config": {"_attn_implementation_internal": "eager", "rope_theta": 10000.0},
    }
    assert config_record(a).digest == config_record(b).digest
    assert config_record(a).canonical == {"text_config": {"rope_theta": 10000}}


def test_secret_looking_config_values_are_redacted():
    rec = config_record(
        {
            "hub_token": "abc",
            "pad_token_id": 0,
            "note": "hf_" + "x" * 30,
            "nested": {"api_key": "k"},
            "value": float("nan"),
        }
    )
    assert rec.canonical == {
        "hub_token": REDACTED,
        "pad_token_id": 0,
        "note": REDACTED,
        "nested": {"api_key": REDACTED},
        "value": "nan",
    }
    assert "abc" not in dumps(rec) and "xxxx" not in dumps(rec)


def test_config_records_of_real_configs():
    from fsdpcheck.model.hazard import HazardConfig
    from fsdpcheck.model.presets import PRESETS

    gemma = PRESETS["tiny-gemma3"].make_config()
    rec = config_record(gemma)
    assert rec.canonical["rope_parameters"]["full_attention"]["rope_theta"] == 1000000.0
    assert "transformers_version" not in rec.canonical and "_name_or_path" not in rec.canonical
    gemma.rope_parameters["full_attention"]["rope_theta"] = 500000.0
    assert config_record(gemma).digest != rec.digest
    hazard = config_record(HazardConfig())
    assert hazard.canonical["layer_types"] == ["sliding_attention", "full_attention"]
    assert config_record(None) is None and config_record(object()) is None


# ---------------------------------------------------------------- device


def nccl_record(rank, fingerprint, fsdp_plan=None, stage="post-wrap"):
    key = "post_wrap" if stage == "post-wrap" else "pre_wrap"
    return record(rank, env=env(rank, backend="nccl"), fsdp_plan=fsdp_plan, **{key: fingerprint})


def test_a_cpu_buffer_in_an_nccl_job_is_a_device_finding_on_every_rank_that_has_it():
    # transformers >= 5 left inv_freq on CPU (unsloth #6662): every rank, including rank 0.
    wrapped = fp("post-wrap", device="cuda", buffer_devices={FULL: "cpu"})
    records = {r: nccl_record(r, wrapped, plan("cuda")) for r in (0, 1)}
    groups, findings = run(records)
    assert len(groups) == 1 and kinds(findings) == ["device"]
    f = findings[0]
    assert f.ranks == (0, 1) and f.tensors == (FULL,)
    assert f"ranks 0,1 have {FULL} on cpu, not cuda (the FSDP2 mesh)" in f.summary
    assert f.details["misplaced"] == [
        {
            "kind": "buffer",
            "name": FULL,
            "device": "cpu",
            "expected": "cuda",
            "because": "the FSDP2 mesh",
        }
    ]


def test_a_cpu_buffer_on_one_rank_only_splits_the_group():
    good = fp("post-wrap", device="cuda")
    bad = fp("post-wrap", device="cuda", buffer_devices={SLIDING: "cpu"})
    records = {0: nccl_record(0, good, plan("cuda")), 1: nccl_record(1, bad, plan("cuda"))}
    groups, findings = run(records)
    assert [g.ranks for g in groups] == [(0,), (1,)]
    assert [(f.kind, f.ranks) for f in findings] == [("device", (1,)), ("device", (1,))]
    cross = findings[1]
    assert f"{SLIDING} is on cuda on rank 0 but on cpu on rank 1" in cross.summary


def test_no_device_finding_where_placement_is_legitimate():
    # Meta on ranks > 0 before the load; a CPU-built model before fully_shard moves it;
    # CPU-offloaded parameters; a gloo job on CPU; no readable plan (parameters unknown).
    cases = [
        (nccl_record(1, fp("post-wrap", device="meta"), plan("cuda")), ()),
        (nccl_record(0, fp("pre-wrap", device="cpu"), stage="pre-wrap"), ()),
        (
            nccl_record(
                0,
                fp(
                    "post-wrap",
                    device="cuda",
                    param_devices={EMBED: "cpu", Q_PROJ: "cpu", K_PROJ: "cpu"},
                ),
                plan("cuda", offload="CPUOffloadPolicy"),
            ),
            (),
        ),
        (record(0, post_wrap=fp("post-wrap"), fsdp_plan=plan("cpu")), ()),
        (nccl_record(0, fp("post-wrap", device="cuda", param_devices={EMBED: "cpu"})), ()),
    ]
    for rec, expected in cases:
        assert tuple(device_exceptions(rec)) == expected, rec


def test_device_exceptions_that_are_real():
    # Offloaded parameters whose buffers stayed on CPU; a buffer outside every fully_shard in
    # an NCCL job; any tensor on CPU when the FSDP2 mesh is on the accelerator.
    offloaded = nccl_record(
        0, fp("post-wrap", device="cpu"), plan("cuda", offload="CPUOffloadPolicy")
    )
    assert [e["name"] for e in device_exceptions(offloaded)] == [SCALE, FULL, SLIDING]
    layer_only = FsdpPlanRecord(groups=(plan("cuda").groups[1],))
    outside = nccl_record(
        0, fp("post-wrap", device="cuda", buffer_devices={FULL: "cpu"}), layer_only
    )
    assert device_exceptions(outside) == [
        {
            "kind": "buffer",
            "name": FULL,
            "device": "cpu",
            "expected": "cuda",
            "because": "the nccl backend",
        }
    ]
    param = nccl_record(
        0, fp("post-wrap", device="cuda", param_devices={K_PROJ: "cpu"}), plan("cuda")
    )
    assert [(e["kind"], e["name"]) for e in device_exceptions(param)] == [("param", K_PROJ)]


def test_before_wrapping_any_placement_is_fine():
    # fully_shard will move a CPU straggler of a model already on the accelerator.
    straggler = fp("pre-wrap", device="cuda", buffer_devices={SCALE: "cpu"})
    assert device_exceptions(nccl_record(0, straggler, stage="pre-wrap")) == []


# ---------------------------------------------------------------- env


def test_nccl_and_cuda_versions_are_compared():
    records = {
        0: record(0, env=env(0, nccl="2.21.5", cuda="12.4", accelerate="1.15.0")),
        1: record(1, env=env(1, nccl="2.26.2", cuda="12.4", accelerate="1.15.0")),
    }
    _, findings = run(records)
    assert kinds(findings) == ["env"]
    assert findings[0].details["differences"] == [
        {"field": "nccl", "reference": "2.21.5", "other": "2.26.2"}
    ]


def test_env_records_without_the_optional_versions_load_with_none():
    bare = {k: v for k, v in to_dict(env(0)).items() if k not in ("accelerate", "nccl", "cuda")}
    loaded = from_dict(EnvRecord, bare)
    assert loaded == env(0) and loaded.nccl is None
    assert loaded._digest_part() != env(0, nccl="2.21.5")._digest_part()


# ---------------------------------------------------------------- collectors, live


@pytest.fixture()
def one_rank_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_fsdp_plan_reads_the_live_policies(one_rank_group):
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from fsdpcheck.model.fingerprint import fingerprint
    from fsdpcheck.model.fsdp_plan import fsdp_plan

    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 2)))
    model.register_buffer("table", torch.ones(3), persistent=False)
    model[0].weight.requires_grad_(False)
    assert fsdp_plan(model) is None
    mesh = init_device_mesh("cpu", (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model[1], mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    got = fsdp_plan(model)
    assert got.unavailable is None
    root, inner = got.groups
    assert root.modules == ("",) and root.params == ("0.weight", "0.bias")
    assert (root.offload, root.pin_memory, root.param_dtype) == ("CPUOffloadPolicy", False, None)
    assert root.reshard_after_forward is True and root.mesh_shape == (1,)
    assert root.mesh_device_type == "cpu"
    assert inner.modules == ("1",) and inner.params == ("1.0.weight", "1.0.bias")
    assert (inner.param_dtype, inner.reduce_dtype, inner.reshard_after_forward) == (
        "bfloat16",
        "float32",
        False,
    )
    assert from_dict(FsdpPlanRecord, json.loads(dumps(got))) == got
    params = {t.name: t.requires_grad for t in fingerprint(model, "post-wrap").params}
    assert params == {"0.weight": False, "0.bias": True, "1.0.weight": True, "1.0.bias": True}
    rank = RankRecord(env=env(0), post_wrap=fingerprint(model, "post-wrap"), fsdp_plan=got)
    assert device_exceptions(rank) == []


def _sharded_with_bf16():
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = nn.Sequential(nn.Linear(4, 4))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)), mp_policy=mp)
    state = model._get_fsdp_state()
    return model, state, state._fsdp_param_groups[0]


def _drop(obj, name: str) -> None:
    """``del obj.name`` where this torch keeps it there: 2.15's parameter group has no
    ``mp_policy`` at all (issue 37), 2.13's does."""
    if hasattr(obj, name):
        delattr(obj, name)


def test_fsdp_plan_reads_the_policy_where_torch_2_15_keeps_it(one_rank_group):
    # torch 2.15 keeps the policy on each FSDPParam and the module's state, not on the
    # parameter group: this real group, without its mp_policy, is laid out as 2.15 lays it.
    from fsdpcheck.model.fsdp_plan import fsdp_plan

    model, _, group = _sharded_with_bf16()
    _drop(group, "mp_policy")
    [record] = fsdp_plan(model).groups
    assert (record.param_dtype, record.unread) == ("bfloat16", ())
    for fsdp_param in group.fsdp_params:  # nor on the parameters: the state's is read
        _drop(fsdp_param, "mp_policy")
    [record] = fsdp_plan(model).groups
    assert (record.param_dtype, record.unread) == ("bfloat16", ())


def test_an_unreadable_policy_is_unread_never_equal_and_said(one_rank_group):
    from fsdpcheck.checks.wrap_plan import unread_note, wrap_plan_findings
    from fsdpcheck.model.fsdp_plan import fsdp_plan

    model, state, group = _sharded_with_bf16()
    readable = fsdp_plan(model)
    _drop(group, "mp_policy")
    for fsdp_param in group.fsdp_params:
        _drop(fsdp_param, "mp_policy")
    _drop(state, "_mp_policy")  # a torch that keeps it somewhere fsdpcheck does not know
    hidden = fsdp_plan(model)
    [record] = hidden.groups
    assert record.param_dtype is None  # not "unset": unread
    assert record.unread == ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
    assert record.reshard_after_forward is True  # the rest of the plan is still read
    assert from_dict(FsdpPlanRecord, json.loads(dumps(hidden))) == hidden
    # Unread on both ranks: nothing compared equal, and the report says so.
    assert wrap_plan_findings(0, hidden, [1], hidden) == []
    [note] = unread_note({0: hidden, 1: hidden})
    assert "param_dtype, reduce_dtype, output_dtype, cast_forward_inputs on ranks 0,1" in note
    assert "not compared" in note
    # Its clean twin: read on every rank, no note.
    assert readable.groups[0].unread == () and unread_note({0: readable, 1: readable}) == ()
    # Read on one rank only: that rank's bfloat16 is not paired with an unread "unset".
    assert wrap_plan_findings(0, readable, [1], hidden) == []
    assert "on rank 1" in unread_note({0: readable, 1: hidden})[0]


def test_every_finding_kind_has_a_readme_entry():
    from pathlib import Path

    from fsdpcheck.vocab import FindingKind

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert [k.value for k in FindingKind if f"`{k.value}`" not in readme] == []


def test_device_cause_after_wrapping_depends_on_a_pre_wrap_record():
    bad = fp("post-wrap", device="cuda", buffer_devices={FULL: "cpu"})
    audit = nccl_record(0, bad, plan("cuda"))
    audit = dataclasses.replace(audit, pre_wrap=fp("pre-wrap"))
    script = nccl_record(0, bad, plan("cuda"))
    assert [f.cause for f in run({0: audit})[1]] == ["wrapping"]
    assert [f.cause for f in run({0: script})[1]] == ["unknown"]


def test_fsdp_plan_survives_private_state_it_does_not_know():
    # Another torch release: the state lacks the attributes this one has, or reading it fails.
    from types import SimpleNamespace

    from torch import nn

    from fsdpcheck.model.fsdp_plan import fsdp_plan

    class Bare(nn.Linear):
        def _get_fsdp_state(self):
            return SimpleNamespace()

    class Broken(nn.Linear):
        def _get_fsdp_state(self):
            raise AttributeError("_fsdp_param_groups moved")

    bare = fsdp_plan(Bare(2, 2))
    unread = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
    assert bare == FsdpPlanRecord(groups=(FsdpGroupRecord(modules=(), params=(), unread=unread),))
    broken = fsdp_plan(Broken(2, 2))
    assert broken.groups == () and "moved" in broken.unavailable
    # An unreadable plan is never a finding, and never splits ranks by itself.
    _, findings = run({0: record(0, fsdp_plan=broken), 1: record(1, fsdp_plan=broken)})
    assert findings == []


def test_a_set_in_a_config_is_canonical_whatever_the_hash_seed() -> None:
    from fsdpcheck.model.config_record import canonicalize

    assert canonicalize({"layer_types": {"sliding_attention", "full_attention"}}) == {
        "layer_types": ["full_attention", "sliding_attention"]
    }
