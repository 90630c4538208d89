"""The CLI's features under torchrun, the README's launcher, as well as under the plain env://
variables the rest of the suite launches with (``run_ranks``). torchrun's workers carry its agent
variables (``TORCHELASTIC_*``, its agent store), and every child job, device mesh, side channel
and report write must work with them: once, ``--reproduce`` ran no loader under torchrun and no
test noticed. The CI suite is at its time limit, so each launch combines many features; each
has its env:// counterpart elsewhere (tests/ranks/test_audit.py, test_state_flags.py (whose
``--reproduce`` stands in for each node's own build), test_ci_outputs.py, test_hooks_paths.py)."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import QUIET_ENV, REPO, read_report, run_plain, torchrun, torchrun_fsdpcheck

from fsdpcheck.formats.junit import failures

ROTARY = "model.rotary_emb."


def test_reproduce_probe_hsdp_json_and_junit_under_torchrun(tmp_path: Path) -> None:
    """hazard-equal, each rank its own hash seed: the buffers swap silently. Every loader runs
    for real in its own child job, which must rendezvous on its own rather than wait on
    torchrun's agent store; the probe's child interpreters answer; HSDP on a 1x2 mesh."""
    out, junit = tmp_path / "report.json", tmp_path / "junit.xml"
    features = "--model hazard-equal --vary-hash-seed --reproduce --probe 2 --mesh 1,2".split()
    args = ["audit", *features, "--timeout", "300", "--json", str(out), "--junit", str(junit)]
    result = run_plain(torchrun_fsdpcheck(2, *args), env=QUIET_ENV, timeout=420)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output  # torchrun's code when a rank exits non-zero
    report = read_report(out)
    assert (report["verdict"], report["exit_code"], report["world_size"]) == ("inconsistent", 1, 2)
    assert report["options"]["mesh"] == [1, 2] and report["options"]["reproduce"] is True
    assert [env["hash_seed"] for env in report["environment"]] == ["0", "1"]
    assert {f["kind"] for f in report["findings"]} == {"buffer-order", "hash-seed"}

    # Every known loader was run for real and did what was predicted.
    loaders = {row["name"]: row for row in report["loaders"]}
    assert loaders["named-buffers-order"]["verdict"] == "silent-corruption"
    for row in report["loaders"]:
        assert row["observed"] is not None, row
        assert row["observed"] == (row["on_gloo"] or row["verdict"]), row
        assert row["products"]
    assert not [f for f in report["findings"] if f["kind"] == "prediction"]
    assert "reproduction" not in report  # each loader ran once: the evidence is in its row
    unsafe = loaders["named-buffers-order"]["observed_detail"]
    assert [r["hash_seed"] for r in unsafe["ranks"]] == [0, 1]
    assert [r["stands_for"] for r in unsafe["ranks"]] == [0, 1]
    [swapped, *_] = unsafe["differing"]
    assert swapped["rank"] == 1 and f"holds {ROTARY}" in swapped["state"]
    [rank1_swap, *_] = unsafe["buffers"][1]["swapped"]  # which buffer got whose values
    assert rank1_swap["holds"].startswith(ROTARY)
    assert "not run for real" not in output and "PREDICTION WRONG" not in output

    # The probe answered: both seeds built, the two orders found.
    probe = report["probe"]
    assert (probe["verdict"], probe["seeds"], probe["errors"]) == ("latent", [0, 1], [])
    assert [r["module"] for r in probe["reorders"]] == ["model.rotary_emb"]
    assert report["verify"]["passed"] is True  # the sorted loader, on the HSDP mesh

    # JUnit: one failure per finding and per loader that would break these ranks.
    assert {(c, n) for c, n, _ in failures(junit.read_text())} == {
        ("fsdpcheck.audit.checks", "buffer-order"),
        ("fsdpcheck.audit.checks", "hash-seed"),
        ("fsdpcheck.audit.loaders", "named-buffers-order"),
        ("fsdpcheck.audit.loaders", "ddp-sync"),
    }
    assert result.stdout.count("verdict:") == 1  # rank 0 alone renders
    # torchrun's failure summary names fsdpcheck's headline as the root cause.
    assert "traceback : fsdpcheck: buffer order differs on rank 1" in result.stderr


def test_init_all_cpu_offload_hsdp_clean_twin_under_torchrun(tmp_path: Path) -> None:
    """The clean twin: every rank real (values compared on every rank), parameters offloaded
    to CPU, HSDP on a 2x1 mesh (both ranks replicas): consistent, exit 0 on every rank."""
    out, junit = tmp_path / "report.json", tmp_path / "junit.xml"
    features = "--model tiny-llama --init all --cpu-offload --mesh 2,1".split()
    args = ["audit", *features, "--timeout", "120", "--json", str(out), "--junit", str(junit)]
    result = run_plain(torchrun_fsdpcheck(2, *args), env=QUIET_ENV, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr  # 0 only when every rank is
    report = read_report(out)
    assert (report["verdict"], report["exit_code"], report["world_size"]) == ("consistent", 0, 2)
    options = report["options"]
    assert (options["init"], options["cpu_offload"], options["mesh"]) == ("all", True, [2, 1])
    assert report["findings"] == [] and report["errors"] == []
    assert [g["ranks"] for g in report["groups"]] == [[0, 1]]
    assert report["not_compared"] == []  # every rank real: values compared on both
    assert report["load"]["outcome"] == "loaded" and report["verify"]["passed"] is True
    assert failures(junit.read_text()) == []
    assert "verdict: consistent (exit 0)" in result.stdout


def test_meta_text_only_bf16_wrap_class_and_annotations_under_torchrun(
    tmp_path: Path, multimodal_config: Path
) -> None:
    """The remaining build and output flags in one launch: every rank on meta (nothing to load),
    the text model of a multimodal config, bfloat16, an explicit wrap class, GitHub
    annotations: consistent, exit 0, each flag visible in the report."""
    out = tmp_path / "report.json"
    features = ["--model", str(multimodal_config), "--init", "meta", "--text-only"]
    features += ["--dtype", "bfloat16"]
    features += ["--wrap-class", "Gemma3DecoderLayer", "--annotations", "github"]
    args = ["audit", *features, "--timeout", "120", "--json", str(out)]
    result = run_plain(torchrun_fsdpcheck(2, *args), env=QUIET_ENV, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    report = read_report(out)
    assert (report["verdict"], report["exit_code"], report["world_size"]) == ("consistent", 0, 2)
    assert report["model"]["architecture"] == "Gemma3ForCausalLM"  # the text model alone
    assert (report["model"]["dtype"], report["model"]["init"]) == ("bfloat16", "meta")
    assert report["wrap"]["found"] == ["Gemma3DecoderLayer"]
    assert report["wrap"]["source"] == "--wrap-class"
    assert report["load"]["outcome"] == "skipped"  # every rank on meta
    assert "::error" not in result.stdout  # annotations on, and nothing to annotate


def test_hook_refuses_an_unwritable_json_path_on_every_rank_under_torchrun(tmp_path: Path) -> None:
    """The HF Trainer hook in a torchrun job (the script's own process group, on torchrun's
    store): an unwritable ``json_path`` is refused on every rank, at once, before any collective,
    and no rank goes on alone; its clean twin writes the report. Every rank exits 0 (torchrun's
    0). The slow-peer case stays with env:// (tests/ranks/test_hooks_paths.py): ``--delay 0``."""
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the report's folder should be")
    worker = str(REPO / "tests" / "workers" / "hook_paths_worker.py")
    timeout = 5
    cmd = torchrun(2, worker, str(tmp_path), "--timeout", str(timeout), "--delay", "0")
    result = run_plain(cmd, env=QUIET_ENV, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for mode in ("warn", "raise"):
        failed = [record[f"unwritable-{mode}"] for record in records]
        raised = failed[0]["raised"]
        assert raised is not None and raised["exit_code"] == 2, failed
        assert failed[1]["raised"] == raised  # the same error on every rank
        assert f"json_path {blocked / mode}.json cannot be written" in raised["message"]
        assert "Trainer on_train_begin" in raised["message"]
        for outcome in failed:
            assert outcome["returned"] is None and outcome["warned"] == []
            assert outcome["seconds"] < timeout, outcome  # no collective waited on
    assert blocked.is_file()
    for record in records:
        assert record["new-folder"] == {**record["new-folder"], "raised": None, "returned": 0}
        clean = {"raised": None, "returned": 0, "warned": []}
        assert record["fast-peer"] == {**record["fast-peer"], **clean}
        assert "slow-peer" not in record
    report = read_report(tmp_path / "made-by-the-write" / "report.json")
    assert report["verdict"] == "consistent" and report["world_size"] == 2
