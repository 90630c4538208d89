"""Framework hooks for real: HF Trainer, Lightning and accelerate on 2 CPU ranks (DDP over
gloo) with hash seeds 0 and 1. Each launch runs the clean twin (a plain tiny Llama: the same on
both ranks whatever the seed) and the failing twin (the same Llama with buffers registered in
set order, as transformers 5.0-5.15 did: their order follows the seed), in "warn" and "raise".
The Lightning and accelerate launches then run the same twins under FSDP2 (ModelParallelStrategy;
fsdp_version=2), in the same processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import QUIET_ENV, REPO

from fsdpcheck.children.launch import launch

WORKERS = {
    "hf": ("hf_trainer_worker.py", "Trainer on_train_begin"),
    "lightning": ("lightning_worker.py", "Lightning on_fit_start"),
    "accelerate": ("accelerate_worker.py", "after accelerator.prepare"),
}
HEADLINE = "buffer order differs on rank 1 (construction-time)"


_LAUNCHED: dict[str, tuple[list[dict], Path]] = {}


def _run_once(worker: str, tmp_path_factory) -> tuple[list[dict], Path]:
    """One launch of ``worker`` for every test that reads it (the HF worker serves two)."""
    if worker not in _LAUNCHED:
        out = tmp_path_factory.mktemp(worker.removesuffix(".py"))
        _LAUNCHED[worker] = _run(worker, out), out
    return _LAUNCHED[worker]


def _run(worker: str, out: Path) -> list[dict]:
    result = launch(
        [str(REPO / "tests" / "workers" / worker), str(out)],
        2,
        env={**QUIET_ENV, "OMP_NUM_THREADS": "1"},
        rank_env=lambda r: {"PYTHONHASHSEED": str(r)},
        timeout=300,
        cwd=str(REPO),
    )
    # Each rank's record is written before its process ends; torch's teardown abort after it
    # ("terminate called without an active exception", a gloo group that DTensor's caches keep
    # alive past destroy_process_group) is torch's, as for the plain runs in test_run.py.
    for rank, code in enumerate(result.codes):
        assert code == 0 or result.aborted_in_teardown(rank), result.output(rank)[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("framework", list(WORKERS))
def test_hook_fails_only_the_twin_whose_ranks_differ(tmp_path_factory, framework) -> None:
    worker, where = WORKERS[framework]
    records, tmp_path = _run_once(worker, tmp_path_factory)
    for record in records:
        # The clean twin: no warning, no exception, training ran, in both modes.
        for mode in ("warn", "raise"):
            clean = record["clean"][mode]
            assert clean["raised"] is None and clean["warned"] == [], clean
            assert clean["returned"] is not None
        # The planted twin, warn: one warning naming the difference, and training went on.
        warn, fail = record["planted"]["warn"], record["planted"]["raise"]
        assert warn["raised"] is None and warn["returned"] is not None
        assert len(warn["warned"]) == 1 and where in warn["warned"][0]
        assert HEADLINE in warn["warned"][0] and "ddp-sync → silent-corruption" in warn["warned"][0]
        # raise: the exception carries the headline and the exit code, on both ranks.
        assert fail["raised"]["exit_code"] == 1 and HEADLINE in fail["raised"]["message"]
        assert fail["returned"] is None and fail["warned"] == []
    # Rank 0's full reports.
    for mode in ("warn", "raise"):
        assert json.loads((tmp_path / f"clean-{mode}.json").read_text())["verdict"] == "consistent"
        planted = json.loads((tmp_path / f"planted-{mode}.json").read_text())
        assert planted["verdict"] == "inconsistent"
        assert planted["findings"][0]["kind"] == "buffer-order"


FSDP2_WORKERS = {
    # ModelParallelStrategy loads ckpt_path after on_fit_start: the check waits for the load
    "lightning": ("lightning_worker.py", "Lightning on_train_start"),
    "accelerate": ("accelerate_worker.py", "after accelerator.prepare"),
}


@pytest.mark.parametrize("framework", list(FSDP2_WORKERS))
def test_hook_under_fsdp2_fails_only_the_twin_whose_ranks_differ(
    tmp_path_factory, framework
) -> None:
    """The same twins sharded with FSDP2, in the same launch as the DDP ones: Lightning's
    ModelParallelStrategy (the module shards itself in configure_model on Lightning's mesh) and
    accelerate's fsdp_version=2 path. The hook checks the sharded model (DTensor parameters: the
    finding's snapshot is post-wrap), and the first training step is checked after it."""
    worker, where = FSDP2_WORKERS[framework]
    records, out = _run_once(worker, tmp_path_factory)
    for record in records:
        twins = record["fsdp2"]
        for mode in ("warn", "raise"):
            clean = twins["clean"][mode]
            assert clean["raised"] is None and clean["warned"] == [], clean
            assert clean["returned"]["step_exit"] == 0  # the first step under watch: agreed
        warn, fail = twins["planted"]["warn"], twins["planted"]["raise"]
        (warning,) = warn["warned"]
        assert where in warning and "buffer order differs on rank 1" in warning
        assert warn["raised"] is None and warn["returned"]["step_exit"] == 0  # trained on
        assert fail["raised"]["exit_code"] == 1 and fail["returned"] is None
        assert where in fail["raised"]["message"]
        assert "buffer order differs on rank 1" in fail["raised"]["message"]
        if framework == "lightning":  # what configure_model made, seen after fit
            for outcome in (*twins["clean"].values(), warn):
                assert outcome["returned"]["model_class"] == "FSDPLlamaForCausalLM"
                assert outcome["returned"]["dtensor_params"] is True
                assert outcome["returned"]["global_step"] == 1
        else:
            # On CPU accelerate turns Accelerator(fsdp_plugin=FSDP2) into DDP without a word;
            # the worker passes that gate, and prepare's own FSDP2 path sharded both twins.
            assert record["distributed_type"] == "DistributedType.MULTI_CPU"
            assert record["is_fsdp2"] is False
            assert (
                record["fsdp2-prepared"]
                == [{"class": "FSDPLlamaForCausalLM", "dtensor_params": True}] * 2
            )
            assert twins["clean"]["raise"]["returned"]["exit_code"] == 0
            assert warn["returned"]["exit_code"] == 1
    for mode in ("warn", "raise"):
        assert json.loads((out / f"fsdp2-clean-{mode}.json").read_text())["verdict"] == "consistent"
        for variant in ("clean", "planted") if mode == "warn" else ("clean",):
            step = json.loads((out / f"fsdp2-{variant}-{mode}.step.json").read_text())
            assert step["verdict"] == "consistent", step["findings"]
        planted = json.loads((out / f"fsdp2-planted-{mode}.json").read_text())
        assert planted["verdict"] == "inconsistent"
        [finding] = planted["findings"]
        assert finding["kind"] == "buffer-order" and finding["ranks"] == [1]
        assert finding["snapshot"] == "post-wrap"  # the check saw the DTensor model
        assert sorted(finding["tensors"]) == [
            "model.rotary_emb.full_attention_inv_freq",
            "model.rotary_emb.sliding_attention_inv_freq",
        ]
    assert not (out / "fsdp2-planted-raise.step.json").exists()  # raised before the step


def test_lightning_checks_a_resumed_fsdp2_model_after_the_load(tmp_path_factory) -> None:
    """ModelParallelStrategy loads fit(ckpt_path=...) after on_fit_start. A buffer that holds
    the rank until the load: persistent, the checkpoint restores it and the ranks agree (a check
    at on_fit_start cried wolf here); non-persistent, no checkpoint holds it and the check, run
    after the load, names it."""
    records, out = _run_once("lightning_worker.py", tmp_path_factory)
    for rank, record in enumerate(records):
        resumed = record["resumed"]
        saved = resumed["saved"]
        assert saved["raised"] is None and saved["warned"] == [], saved
        # Its sanity check's validation steps ran after the deferred check, never before.
        assert saved["returned"]["validated"] and all(saved["returned"]["validated"])
        persistent, non_persistent = resumed["persistent"], resumed["non-persistent"]
        assert persistent["warned"] == [] and persistent["raised"] is None, persistent
        assert persistent["returned"]["scale"] == 0.0  # the saved value, on every rank
        assert persistent["returned"]["global_step"] == 2  # resumed at step 1, trained one more
        (warning,) = non_persistent["warned"]
        assert "(Lightning on_train_start): values differ on rank 1" in warning
        assert non_persistent["returned"]["scale"] == float(rank)
        assert non_persistent["returned"]["global_step"] == 2
    clean = json.loads((out / "resumed-persistent.json").read_text())
    assert clean["verdict"] == "consistent"
    [finding] = json.loads((out / "resumed-non-persistent.json").read_text())["findings"]
    assert finding["kind"] == "value" and finding["ranks"] == [1]
    assert finding["tensors"] == ["model.scale"]
    # The hook forwarded trainer.ckpt_path: the distributed checkpoint every rank resumed.
    resumed_from = clean["checkpoint"]
    assert resumed_from["path"].endswith("fsdp2-step=1") and resumed_from["step"] == 1
    assert (resumed_from["index"], resumed_from["saved_ranks"]) == (".metadata", 2)


def test_lightning_forwards_a_ddp_resume_file_and_finds_it_consistent(tmp_path_factory) -> None:
    """Under DDP ckpt_path is a .ckpt file (torch.save, a zip): recorded by its zip directory,
    never read as a checkpoint no rank can read."""
    records, out = _run_once("lightning_worker.py", tmp_path_factory)
    for record in records:
        resumed = record["ddp-resumed"]
        assert resumed["raised"] is None and resumed["warned"] == [], resumed
        assert resumed["returned"] == 2  # resumed at step 1, trained one more
    report = json.loads((out / "resumed-ddp.json").read_text())
    assert report["verdict"] == "consistent", report["findings"]
    resumed_from = report["checkpoint"]
    assert resumed_from["path"].endswith("ddp-step=1.ckpt") and resumed_from["step"] == 1
    assert resumed_from["index"] == "zip directory" and resumed_from["problem"] is None


def test_lightning_names_a_rank_whose_node_resolves_the_resume_path_to_another_save(
    tmp_path_factory,
) -> None:
    """Every rank loads rank 0's ckpt_path (the strategy broadcasts it), and rank 1's "node"
    resolves it to the step-2 save: a checkpoint finding naming rank 1, raised before any step.
    Its clean twin is resumed-persistent above (one path, one save, consistent)."""
    records, out = _run_once("lightning_worker.py", tmp_path_factory)
    for record in records:
        node_local = record["resumed"]["node-local"]
        assert node_local["returned"] is None and node_local["warned"] == []
        assert node_local["raised"]["exit_code"] == 1
        assert "Lightning on_train_start" in node_local["raised"]["message"]
    report = json.loads((out / "resumed-node-local.json").read_text())
    [finding] = [f for f in report["findings"] if f["kind"] == "checkpoint"]
    assert (finding["ranks"], finding["reference_rank"]) == ([1], 0)
    assert finding["details"]["reference"]["given"] == "ckpt"  # rank 0's, as every rank loaded it
    [group] = finding["details"]["groups"]
    assert [d["field"] for d in group["differences"]][:3] == ["path", "step", "metadata"]
    assert "(step 2," in finding["summary"] and "(step 1," in finding["summary"]


def test_lightning_checks_the_first_training_step(tmp_path: Path) -> None:
    """check_first_step=True: the first optimizer_step (closure and optimizer) under
    check_step; a NaN loss on rank 1 only is a non-finite finding, on both ranks."""
    for record in _run("lightning_step_worker.py", tmp_path):
        labels, ignored = record["labels"], record["ignored"]
        assert labels["warned"] == [] and labels["returned"]["step_exit"] == 0
        assert labels["returned"]["global_step"] == 2  # training went on after the check
        assert ignored["returned"]["step_exit"] == 1
        (warning,) = ignored["warned"]
        assert "tensors hold NaN or Inf on rank 1" in warning
    assert json.loads((tmp_path / "labels-step.json").read_text())["verdict"] == "consistent"
    report = json.loads((tmp_path / "ignored-step.json").read_text())
    assert [f["kind"] for f in report["findings"]] == ["non-finite"]


def test_hf_trainer_checks_the_first_training_step(tmp_path_factory) -> None:
    """watch_first_step: the Trainer's first training_step under check_step. Rank 1's extra
    all_reduce in its first compute_loss is a step finding, raised on both ranks before any
    rank issued it; the clean twin trains on (its second step runs plain)."""
    records, out = _run_once("hf_trainer_worker.py", tmp_path_factory)
    for record in records:
        clean, extra = record["step-clean"], record["step-extra"]
        assert clean["raised"] is None and clean["warned"] == [], clean
        assert clean["returned"] == {"global_step": 2, "step_exit": 0, "plain_after": True}
        assert extra["returned"] is None and extra["warned"] == []
        assert extra["raised"]["exit_code"] == 1
        assert (
            "Trainer first training_step: collectives differ in the step on rank 1"
            in (extra["raised"]["message"])
        )
    assert json.loads((out / "step-clean.json").read_text())["verdict"] == "consistent"
    report = json.loads((out / "step-extra.json").read_text())
    [finding] = report["findings"]
    assert finding["kind"] == "step" and finding["ranks"] == [1]
    assert finding["details"]["ranks"]["rank 1"]["op"] == "all_reduce"
    assert finding["details"]["ranks"]["rank 0"]["op"] == "broadcast"  # DDP's buffer sync
    assert finding["details"]["caught"].startswith("before the collective was issued")


def test_hf_trainer_forwards_the_checkpoint_each_rank_resumed_from(tmp_path_factory) -> None:
    """args.resume_from_checkpoint, forwarded by the callback: every rank from checkpoint-1 is
    consistent (recorded by its trainer_state.json, the step its name says); rank 1 from
    checkpoint-2 is a checkpoint finding naming it, raised on both ranks before any step."""
    records, out = _run_once("hf_trainer_worker.py", tmp_path_factory)
    for record in records:
        clean, stale = record["resumed"], record["resumed-stale"]
        assert clean["raised"] is None and clean["warned"] == [], clean
        assert clean["returned"] == 2  # resumed at step 1, trained one more
        assert stale["returned"] is None and stale["raised"]["exit_code"] == 1
        assert "Trainer on_train_begin" in stale["raised"]["message"]
    report = json.loads((out / "resumed.json").read_text())
    assert report["verdict"] == "consistent", report["findings"]
    resumed_from = report["checkpoint"]
    assert resumed_from["path"].endswith("checkpoint-1") and resumed_from["step"] == 1
    assert resumed_from["index"] == "trainer_state.json" and resumed_from["metadata"]
    stale = json.loads((out / "resumed-stale.json").read_text())
    [finding] = [f for f in stale["findings"] if f["kind"] == "checkpoint"]
    assert (finding["ranks"], finding["reference_rank"]) == ([1], 0)
    [group] = finding["details"]["groups"]
    assert [d["field"] for d in group["differences"]][:3] == ["path", "step", "metadata"]
    assert "checkpoint-2 (step 2, trainer_state.json " in finding["summary"]
    # The callback forwards the Trainer's optimizer and scheduler, loaded by then: rank 1's
    # took one more step.
    [optim] = [f for f in stale["findings"] if f["kind"] == "optimizer"]
    assert (optim["ranks"], optim["reference_rank"]) == ([1], 0)
    fields = {(d["where"], d["field"]) for d in optim["details"]["differences"]}
    assert ("scheduler", "last_epoch") in fields
    assert ("parameter model.embed_tokens.weight", "step") in fields
