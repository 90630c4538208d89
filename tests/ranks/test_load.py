"""The safe loader and its verification, on real processes (CPU, gloo), plus their pure parts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, run_worker_cases, run_worker_ranks

from fsdpcheck.children.launch import LaunchResult

ROTARY = "model.rotary_emb"


def run_worker(
    out: Path, model: str, *args: str, seeds: tuple[int, int] = (1, 1), timeout: float = 90.0
) -> tuple[LaunchResult, list[dict]]:
    """Two ranks of ``load_worker.py``; returns the launch and each rank's JSON record."""
    # The ranks' own collective timeout leaves room for a rank that a busy machine slows down
    # in its imports; the launcher's bound stays above it.
    return run_worker_ranks(
        "load_worker.py",
        out,
        ["--model", model, "--timeout", "40", *args],
        seeds=seeds,
        timeout=timeout,
    )


HAZARD = ["--model", "hazard", "--timeout", "40"]
DUMPED = ("model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight")


@pytest.fixture(scope="module")
def loads(tmp_path_factory: pytest.TempPathFactory, llama_checkpoint: Path) -> dict:
    """The cases below, one 2-rank job per pair of hash seeds (the worker's ``--cases``)."""
    alike = {  # hash seeds (1, 1)
        "int-buffer": [*HAZARD, "--int-buffer"],
        "tamper": [*HAZARD, "--tamper", "lm_head.weight"],
        **{
            f"{ahead}tamper-one-{rank}": [
                *HAZARD,
                *("--tamper-one", "model.embed_tokens.weight", "--tamper-rank", str(rank)),
                *(["--ahead"] if ahead else []),
            ]
            for rank in (0, 1)
            for ahead in ("", "ahead-")
        },
        # The torchtitan-style model (tests/workers/fused_qkv.py), filled with 7.0, then loaded.
        **{f"fused-{v}": [*HAZARD, "--fused", v] for v in ("fused", "plain", "extra-entry")},
        "fused-fused-dcp": [*HAZARD, "--fused", "fused", "--method", "dcp"],
        "fused-dcp-own": [*HAZARD, "--fused", "fused", "--loader", "dcp"],
        **{f"ahead-fused-{v}": [*HAZARD, "--fused", v, "--ahead"] for v in ("fused", "plain")},
        # Last: it refuses on every rank.
        "buffer-mismatch": [*HAZARD, "--extra-buffer-on-rank", "1"],
    }
    dumps = [arg for name in DUMPED for arg in ("--dump", name)]
    differ = {  # hash seeds (0, 1): the RoPE buffers in opposite orders
        "odd-params": [*HAZARD, "--odd-params", "--odd-on-meta"],
        "ahead-odd-params": [*HAZARD, "--odd-params", "--ahead"],
        "llama": ["--model", str(llama_checkpoint), "--timeout", "40", *dumps],
        "dcp-int": [*HAZARD, "--loader", "dcp", "--int-buffer"],
        "dcp-big": [*HAZARD, "--loader", "dcp", "--big-buffer", "--int-buffer"],
    }
    root = tmp_path_factory.mktemp("loads")
    return {
        **run_worker_cases("load_worker.py", root / "alike", alike, seeds=(1, 1)),
        **run_worker_cases("load_worker.py", root / "differ", differ, seeds=(0, 1)),
        "root": root,
    }


def _inv_freq(base: float, dim: int) -> list[float]:
    return [1.0 / base ** (i / dim) for i in range(0, dim, 2)]


def _assert_hazard_rope(buffers: dict) -> None:
    """The values the hazard preset computes, independently of any rank."""
    assert buffers[f"{ROTARY}.full_attention_inv_freq"] == pytest.approx(_inv_freq(1e6, 32))
    assert buffers[f"{ROTARY}.sliding_attention_inv_freq"] == pytest.approx(_inv_freq(1e4, 16))


def _assert_loaded_and_verified(
    result: LaunchResult, records: list[dict], *, rank0_meta: bool = False
) -> None:
    assert result.codes == [0, 0], result.output(0) + result.output(1)
    rank0, rank1 = records
    assert rank0["load"]["materialised"] is rank0_meta
    assert rank1["load"]["materialised"] is True
    assert rank1["buffers"] == rank0["buffers"]
    for record in records:
        verify = record["verify"]
        assert verify["ran"] and verify["passed"], verify
        assert verify["checked"] == record["n_params"] + record["n_buffers"]
    assert rank0["verify"]["mismatches"] == []


def test_meta_rank_gets_rank0_buffers_coalesced_by_dtype(loads: dict) -> None:
    result, records = loads["int-buffer"]
    _assert_loaded_and_verified(result, records)
    rank0, rank1 = records
    assert rank1["buffers"]["step_ids"] == [0, 1, 2, 3, 4]
    _assert_hazard_rope(rank1["buffers"])
    for record in records:
        load = record["load"]
        dtypes = {d.removeprefix("torch.") for d in record["buffer_dtypes"].values()}
        assert load["buffers_broadcast"] == 3
        assert load["dtypes"] == sorted(dtypes) == ["float32", "int64"]
        # Coalesced: one flat broadcast per dtype, not one per buffer.
        assert load["buffer_broadcasts"] == len(dtypes)
        assert load["collectives"] == 2 + len(dtypes)
        assert load["params_loaded"] == record["n_params"]  # hazard has no persistent buffers


def test_different_orders_and_uneven_shards_load_by_name(loads: dict) -> None:
    # Hash seeds 0 and 1 register the RoPE buffers in opposite orders: pairing by sorted name
    # must not care. Params of 3 and 1 rows over 2 ranks shard as 2+1 and 1+0 (empty) rows.
    # Rank 0 builds those two on meta, so it too goes through to_empty(), which must keep its
    # real RoPE buffers: they are what every rank receives.
    result, records = loads["odd-params"]
    _assert_loaded_and_verified(result, records, rank0_meta=True)
    rank0, rank1 = records
    _assert_hazard_rope(rank0["buffers"])
    assert rank0["buffer_order"] == list(reversed(rank1["buffer_order"]))
    assert rank0["load"]["params_loaded"] == rank0["n_params"]


def test_verify_digests_ahead_of_the_load_prove_uneven_and_empty_shards(loads: dict) -> None:
    # Rank 0 digests rank 1's slices (one of them empty) on a thread while it sends them, and
    # still proves every rank after the load, its own shards compared in place then.
    result, records = loads["ahead-odd-params"]
    _assert_loaded_and_verified(result, records)
    assert [r["ahead_started"] for r in records] == [True, False]  # rank 0's work alone


@pytest.mark.parametrize("case", ["fused", "plain"])
def test_verify_digests_ahead_wait_for_the_load_where_hooks_rewrite_the_source(
    loads: dict, case: str
) -> None:
    # A source the model's load_state_dict hooks fuse is read through them, from the model:
    # rank 0 digests it after the load instead. The clean twin, with no hooks, goes ahead.
    result, records = loads[f"ahead-fused-{case}"]
    assert result.codes == [0, 0], result.output(0) + result.output(1)
    assert records[0]["ahead_started"] is (case == "plain")
    for record in records:
        assert record["still_seven"] == []
        assert record["verify"]["passed"] is True, record["verify"]


def test_buffer_set_mismatch_raises_on_every_rank(loads: dict) -> None:
    result, records = loads["buffer-mismatch"]
    assert not result.timed_out and result.elapsed < 60
    assert result.codes == [3, 3], result.output(0) + result.output(1)
    messages = set()
    for record in records:
        error = record["error"]
        assert error["type"] == "BufferMismatchError"
        assert "load" not in record  # refused before anything moved
        messages.add(error["message"])
    [message] = messages  # the same explanation on every rank
    assert "rank 1: has non-persistent buffer 'extra_inv_freq'" in message
    assert "rank 0 does not" in message


def test_llama_checkpoint_loads_equal_to_the_file(loads: dict, llama_checkpoint: Path) -> None:
    from safetensors.torch import load_file

    dumped = DUMPED
    result, records = loads["llama"]
    _assert_loaded_and_verified(result, records)
    assert records[0]["n_params"] == records[0]["load"]["params_loaded"]
    on_disk = load_file(str(next(llama_checkpoint.glob("*.safetensors"))))
    gathered = load_file(str(loads["root"] / "differ" / "llama" / "full.safetensors"))
    assert set(gathered) == set(dumped)
    for name in dumped:
        assert gathered[name].equal(on_disk[name]), name


def test_verify_names_a_tampered_shard_and_its_rank(loads: dict) -> None:
    result, records = loads["tamper"]
    assert result.codes == [0, 0], result.output(0) + result.output(1)
    rank0, rank1 = records
    assert rank0["verify"]["mismatches"] == [
        {
            "name": "lm_head.weight",
            "kind": "param",
            "ranks": [1],
            "reason": "values differ from the source state dict",
        }
    ]
    assert rank0["verify"]["passed"] is False
    assert rank1["verify"]["passed"] is False  # every rank learns the verdict


@pytest.mark.parametrize("rank", [0, 1])  # rank 0 compares in place, rank 1 by checksum
@pytest.mark.parametrize("ahead", ["", "ahead-"])  # rank 1's slices digested during the load
def test_verify_catches_one_bit_of_one_element_in_a_shard(
    loads: dict, rank: int, ahead: str
) -> None:
    result, records = loads[f"{ahead}tamper-one-{rank}"]
    assert result.codes == [0, 0], result.output(0) + result.output(1)
    assert records[0]["ahead_started"] is bool(ahead)
    assert [(m["name"], m["ranks"]) for m in records[0]["verify"]["mismatches"]] == [
        ("model.embed_tokens.weight", [rank])
    ]


def test_verify_failing_on_rank0_before_the_gather_ends_every_rank_without_a_hang(
    tmp_path: Path,
) -> None:
    # Rank 0 works out what every rank must hold before the gather; its failure there must
    # still reach the others through the verdict, within the ranks' own collective timeout.
    result, records = run_worker(tmp_path, "hazard", "--break-verify-source", "lm_head.weight")
    assert result.codes[0] not in (0, None) and result.codes[1] not in (0, None), result.codes
    assert "TypeError: rank 0's source entry 'lm_head.weight' is a str" in result.output(0)
    assert "verification failed on rank 0" in records[1]["error"]["message"]
    assert max(r["elapsed"] for r in records) < 30  # the verdict, not the 40 s timeout


def test_state_dict_load_leaves_buffers_empty_until_broadcast_buffers(loads: dict) -> None:
    # set_model_state_dict alone never touches non-persistent buffers: on the meta rank they
    # hold whatever to_empty() left there. broadcast_buffers alone then fixes exactly those.
    result, records = loads["dcp-int"]
    assert result.codes == [0, 0], result.output(0) + result.output(1)
    rank0, rank1 = records
    before = rank0["verify_dcp_only"]
    assert before["passed"] is False and rank1["verify_dcp_only"]["passed"] is False
    assert {(m["name"], m["kind"], tuple(m["ranks"])) for m in before["mismatches"]} == {
        (f"{ROTARY}.full_attention_inv_freq", "buffer", (1,)),
        (f"{ROTARY}.sliding_attention_inv_freq", "buffer", (1,)),
        ("step_ids", "buffer", (1,)),
    }
    assert all(m["reason"] == "values differ from rank 0's" for m in before["mismatches"])
    for record in records:
        moved = record["broadcast"]
        assert moved["names"] == sorted(record["buffer_order"])  # by name, not local order
        assert moved["dtypes"] == ["float32", "int64"]
        assert moved["bytes"] == (8 + 16) * 4 + 5 * 8
        # 136 bytes ride with the layout check: one collective in all, no broadcast after it.
        assert moved["inline"] is True and moved["broadcasts"] == 0 and moved["collectives"] == 1
        assert record["verify"]["passed"] is True
    assert rank1["buffers"]["step_ids"] == [0, 1, 2, 3, 4]
    assert rank1["buffers"] == rank0["buffers"]


def test_buffers_too_big_to_ride_with_the_check_are_broadcast_after_it(loads: dict) -> None:
    result, records = loads["dcp-big"]
    assert result.codes == [0, 0], result.output(0) + result.output(1)
    rank0, rank1 = records
    for record in records:
        moved = record["broadcast"]
        assert moved["inline"] is False
        assert moved["dtypes"] == ["float32", "int64"] and moved["broadcasts"] == 2
        assert moved["collectives"] == 3  # the check, then one flat broadcast per dtype
        assert moved["bytes"] == (8 + 16 + 20_000) * 4 + 5 * 8
        assert record["verify"]["passed"] is True
    assert rank1["buffers"]["big_table"] == [float(i) for i in range(20_000)]
    assert rank1["buffers"] == rank0["buffers"]


QKV = "layers.0.attention.qkv"


@pytest.mark.parametrize("case", ["fused-fused", "fused-fused-dcp", "fused-plain"])
def test_a_state_dict_made_by_hooks_loads_through_them(loads: dict, case: str) -> None:
    # torchtitan's FusedQKVLinear saves its fused wqkv as wq/wk/wv (a state-dict post-hook) and
    # fuses them back on load (a load_state_dict pre-hook): every entry lands, on both paths.
    # "fused-plain" is the clean twin: three separate projections, no hooks.
    result, records = loads[case]
    assert result.codes == [0, 0], result.output(0) + result.output(1)
    hooked = case != "fused-plain"
    for record in records:
        assert record["still_seven"] == []  # no tensor left as it was before the load
        assert record["load"]["params_loaded"] == 21
        assert record["load"]["through_hooks"] == (12 if hooked else 0)
        assert record["verify"]["passed"] is True, record["verify"]
    rank0 = records[0]
    assert f"{QKV}.wq.weight" in rank0["source_keys"]
    assert rank0["differ_from_source"] == []  # its own state dict reads back the source


def test_an_entry_no_tensor_takes_is_refused_on_every_rank(loads: dict) -> None:
    result, records = loads["fused-extra-entry"]
    assert result.codes == [3, 3], result.output(0) + result.output(1)
    [message] = {record["error"]["message"] for record in records}  # the same on every rank
    assert all(record["error"]["type"] == "StateDictMismatchError" for record in records)
    assert "load" not in records[0] and "nothing was loaded" in message
    assert (
        "ranks 0,1: the model's state dict has entries that no tensor of the model takes, even "
        f"through its load_state_dict pre-hooks: {QKV}.r_dim, layers.1.attention.qkv.r_dim"
    ) in message
    assert "wq" not in message  # the fused entries are placed; only the stray one is named


def test_verify_names_the_loader_when_hooked_entries_were_not_placed(loads: dict) -> None:
    # DCP's set_model_state_dict on this model fails on its fused tensors (torch 2.13: its
    # load hook hands FSDP a plain tensor), leaving them as they were: verify says the loader
    # did not place them, not that the source lacks them.
    result, records = loads["fused-dcp-own"]
    assert result.codes == [0, 0], result.output(0) + result.output(1)
    rank0 = records[0]
    assert "mixed torch.Tensor and DTensor" in rank0["dcp_error"]
    mismatches = rank0["verify"]["mismatches"]
    fused = {m["name"] for m in mismatches}
    assert fused == {
        f"layers.{i}.attention.qkv.wqkv.{p}" for i in (0, 1) for p in ("weight", "bias")
    }
    for m in mismatches:
        assert m["reason"].startswith("not placed by the loader"), m
        assert "not in the source" not in m["reason"]
    [weight] = [m for m in mismatches if m["name"] == f"{QKV}.wqkv.weight"]
    assert weight["ranks"] == [0, 1]
    assert f"{QKV}.wq.weight" in weight["reason"] and "layers.1." not in weight["reason"]


# --- pure parts, in process ---------------------------------------------------------------------


def test_import_stays_torch_free_and_exports_the_loader() -> None:
    code = (
        "import sys, fsdpcheck; assert 'torch' not in sys.modules; "
        "assert 'load_full_state_dict' in dir(fsdpcheck); "
        "fsdpcheck.load_full_state_dict, fsdpcheck.broadcast_buffers, fsdpcheck.verify_load; "
        "assert 'torch' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
