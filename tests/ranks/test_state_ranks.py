"""value, uninitialized, tie and failed-load checks on real ranks: each public failure, and its
clean twin (a training script's own steps in tests/workers/state_worker.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import read_report, run_ranks, run_worker_cases

from fsdpcheck.faults import FAULT_ENV

NO_FALSE_ALARMS = [
    "hazard:rank0", "hazard:meta", "hazard:all", "hazard-equal:all::2,1",
    "tiny-gemma3:rank0", "tiny-gemma3:all:bfloat16", "tiny-gemma3:all::2,1",
    "tiny-gemma4:rank0:bfloat16", "tiny-gemma4:all", "tiny-gemma4:meta",
    "tiny-llama:all:bfloat16:1,2", "tiny-qwen3:rank0::2,1",
]  # fmt: skip


def _each(flag: str, values: list[str]) -> list[str]:
    return [a for value in values for a in (flag, value)]


@pytest.fixture(scope="module")
def states(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every case below in turn in one 2-rank job: {case: (each rank's exit code, report)}."""
    cases = {
        "dcp-only": ["--case", "dcp-only"],
        "dcp-and-buffers": ["--case", "dcp-and-buffers"],
        "untied": ["--case", "untied"],
        "tied": ["--case", "tied"],
        "replica-drift": ["--case", "replica-drift", "--model", "hazard"],
        "per-rank-seeds": ["--case", "audits", "--audit", "hazard:all::2,1:rank"],
        **{
            case: ["--case", case, "--model", "tiny-llama"]
            for case in (
                "meta-assign", "meta-assign-rebuilt", "eval", "eval-no-dropout", "hook",
                "buffer-copy", "eps", "numerics", "same-state",
            )
        },
        "no-false-alarms": ["--case", "audits", *_each("--audit", NO_FALSE_ALARMS)],
    }  # fmt: skip
    root = tmp_path_factory.mktemp("states")
    done = run_worker_cases("state_worker.py", root, cases, seeds=(0, 0), timeout=600)
    for run, _ in done.values():
        assert not run.timed_out, run.output(0) + run.output(1)
    return {name: (run.codes, records[0]["report"]) for name, (run, records) in done.items()}


def _kinds(report: dict) -> list[str]:
    return [f["kind"] for f in report["findings"]]


def test_dcp_only_load_leaves_garbage_buffers_that_check_model_names(states: dict) -> None:
    # set_model_state_dict(full_state_dict, broadcast_from_rank0) alone: rank 1 was built on
    # meta and to_empty()-ed, and DCP never touches non-persistent buffers.
    codes, report = states["dcp-only"]
    assert codes == [1, 1] and report["verdict"] == "inconsistent"
    (finding,) = report["findings"]
    assert (finding["kind"], finding["ranks"], finding["cause"]) == (
        "uninitialized",
        [1],
        "loading",
    )
    problems = {p["name"]: p for p in finding["details"]["problems"]}
    scale = problems["model.embed_tokens.embed_scale"]
    assert scale["reason"] == "differs" and scale["expected"] == ["8"] and scale["got"] != ["8"]
    assert any(name.endswith("inv_freq") for name in problems)


def test_dcp_then_buffer_broadcast_is_consistent_after_the_load(states: dict) -> None:
    # The clean twin: every rank holds real values now, so values and ties are compared.
    codes, report = states["dcp-and-buffers"]
    assert codes == [0, 0] and report["verdict"] == "consistent", report["findings"]
    assert report["not_compared"] == []


def test_a_loader_that_reassigns_the_head_breaks_the_configured_tie(states: dict) -> None:
    codes, report = states["untied"]
    assert codes == [1, 1]
    assert _kinds(report) == ["tie"]
    finding = report["findings"][0]
    assert finding["ranks"] == [0, 1]
    assert finding["details"]["missing"] == [["lm_head.weight", "model.embed_tokens.weight"]]


def test_a_tied_model_built_on_every_rank_is_consistent(states: dict) -> None:
    codes, report = states["tied"]
    assert codes == [0, 0] and report["verdict"] == "consistent", report["findings"]


def test_hsdp_replicas_whose_local_shards_drift_apart_are_a_value_finding(states: dict) -> None:
    # (2, 1) mesh: ranks 0 and 1 hold the same shard; rank 1's copy of one tensor differs.
    codes, report = states["replica-drift"]
    assert codes == [1, 1]
    (finding,) = report["findings"]
    assert (finding["kind"], finding["ranks"], finding["snapshot"]) == ("value", [1], "post-wrap")
    assert finding["tensors"] == ["model.norm.weight"]
    assert finding["summary"].startswith("values differ between HSDP replicas on rank 1")
    (diff,) = finding["details"]["differences"]
    assert diff["reference"][:1] == ["1"] and diff["other"][:1] == ["2"]
    assert diff["max_abs_diff_first_values"] == 1.0


def test_per_rank_seeds_with_init_all_are_value_findings(states: dict) -> None:
    # FSDP2 has no sync_module_states: every rank trains from its own initial values. On a
    # (2, 1) HSDP mesh the two ranks are replicas, so their local shards must agree too.
    codes, reports = states["per-rank-seeds"]
    report = reports[0]["report"]
    assert codes == [1, 1] and report["verdict"] == "inconsistent"
    (finding,) = report["findings"]
    assert (finding["kind"], finding["ranks"], finding["snapshot"]) == ("value", [1], "pre-wrap")
    assert finding["cause"] == "construction-time"
    assert "model.embed_tokens.weight" in finding["tensors"]
    assert finding["details"]["differences"][0]["max_abs_diff_first_values"] > 0


def test_no_false_alarms_across_presets_init_modes_dtypes_and_meshes(states: dict) -> None:
    specs = NO_FALSE_ALARMS
    codes, reports = states["no-false-alarms"]
    verdicts = {r["spec"]: (r["report"]["verdict"], _kinds(r["report"])) for r in reports}
    assert verdicts == {spec: ("consistent", []) for spec in specs}
    assert codes == [0, 0]
    by_spec = {r["spec"]: r["report"] for r in reports}
    assert by_spec["hazard:rank0"]["not_compared"] == [1]  # on meta until the load
    assert by_spec["hazard:all"]["not_compared"] == []
    assert by_spec["tiny-gemma3:rank0"]["load"]["outcome"] == "loaded"


def test_a_refused_load_is_not_consistent(tmp_path: Path) -> None:
    # Every rank refuses alike (as the loader's own checks raise on every rank).
    out = tmp_path / "report.json"
    result = run_ranks(
        ["audit", "--model", "tiny-llama", "--json", str(out), "--timeout", "60"],
        env={FAULT_ENV: "0:load:input,1:load:input"},
        seeds=[0, 0],
        timeout=240,
    )
    assert result.codes == [1, 1], result.output(0) + result.output(1)
    report = read_report(out)
    assert report["verdict"] == "inconsistent" and report["load"]["outcome"] == "refused"
    assert _kinds(report) == ["verify"] and "refused" in report["findings"][0]["summary"]


# ---------------------------------------------------------------- state that changes training


def test_a_buffer_left_on_meta_by_an_assign_load_is_named(states: dict) -> None:
    # Rank 1 built on meta, load_state_dict(sd, assign=True): the non-persistent inv_freq is in
    # no state dict, so it stays on meta; rank 1's first forward fails.
    codes, report = states["meta-assign"]
    assert codes == [1, 1] and report["verdict"] == "inconsistent"
    (finding,) = report["findings"]
    assert (finding["kind"], finding["ranks"], finding["cause"]) == ("device", [1], "loading")
    assert finding["tensors"] == [
        "model.rotary_emb.inv_freq",
        "model.rotary_emb.original_inv_freq",
    ]
    assert "rank 1 left model.rotary_emb.inv_freq on meta (cpu on rank 0)" in finding["summary"]


def test_the_assign_load_with_its_buffers_rebuilt_is_consistent(states: dict) -> None:
    codes, report = states["meta-assign-rebuilt"]
    assert codes == [0, 0] and report["verdict"] == "consistent", report["findings"]


@pytest.mark.parametrize(
    ("case", "kind", "said"),
    [
        ("eval", "module-state", "self_attn is in training mode on rank 0 but in eval mode on"),
        ("hook", "module-state", "model.layers.0.mlp has hooks none on rank 0 but "),
        ("eps", "module-state", "model.norm setting eps is 1e-05 on rank 0 but 0.1 on rank 1"),
        ("buffer-copy", "tie", "only rank 0 shares storage between model.rotary_emb.inv_freq"),
        ("numerics", "numerics", "is False on rank 0 but True on rank 1"),
    ],
)
def test_state_set_up_on_one_rank_only_is_named(
    states: dict, case: str, kind: str, said: str
) -> None:
    codes, report = states[case]
    assert codes == [1, 1] and report["verdict"] == "inconsistent"
    (finding,) = report["findings"]
    assert (finding["kind"], finding["ranks"]) == (kind, [1])
    assert said in finding["summary"], finding["summary"]


def test_the_hook_is_named_by_its_qualified_name_and_the_numerics_by_switch(states: dict) -> None:
    (hook,) = states["hook"][1]["findings"]
    (diff,) = hook["details"]["differences"]
    assert diff["other"] == ["forward:__main__._scale_output"]  # the script's own
    (numerics,) = states["numerics"][1]["findings"]
    names = {d["name"]: d["other"] for d in numerics["details"]["differences"]}
    assert names == {"default_dtype": "torch.float64", "deterministic_algorithms": "True"}


def test_eval_mode_where_no_module_depends_on_it_is_consistent(states: dict) -> None:
    # A checkpoint loaded with from_pretrained is in eval mode, a from_config build in training
    # mode: with every dropout rate 0 the ranks compute the same (the clean twin of "eval").
    codes, report = states["eval-no-dropout"]
    assert codes == [0, 0] and report["verdict"] == "consistent", report["findings"]


def test_the_same_set_up_on_every_wrapped_rank_is_consistent(states: dict) -> None:
    # A LayerNorm, a buffer view and a forward hook on every rank, all wrapped by FSDP2.
    codes, report = states["same-state"]
    assert codes == [0, 0] and report["verdict"] == "consistent", report["findings"]
