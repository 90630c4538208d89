"""The fault matrix: every failure ends every rank quickly, with a message naming rank and cause.

Each test runs real ranks, asserts the exit codes, that every process exited within the bound
(``--timeout`` plus a margin), and what the report says.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, hub_cache, read_report, run_audit_cases, run_ranks, torchrun_fsdpcheck

from fsdpcheck.children.launch import free_port, launch
from fsdpcheck.faults import FAULT_ENV

TIMEOUT = 15  # --timeout for these runs
HANG_TIMEOUT = 8  # the hung-rank case waits this long by design: the rest need not
BOUND = TIMEOUT + 30  # import + build + the timeout, with room for a loaded CI machine
SECRET = "hf_SECRETtoken1234567890"
SECRET_VARS = ("HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "WANDB_API_KEY")


def audit(tmp_path: Path, *extra: str, model: str = "hazard") -> list[str]:
    return [
        "audit",
        "--model",
        model,
        "--timeout",
        str(TIMEOUT),
        "--json",
        str(tmp_path / "report.json"),
        *extra,
    ]


def assert_all_exited(result, codes) -> None:
    assert not result.timed_out, f"a rank was still running after {BOUND}s: {result.codes}"
    assert result.codes == codes, "\n".join(result.output(r) for r in range(len(codes)))


# ------------------------------------------------------------------ runtime failures (exit 3)


@pytest.mark.parametrize("stage", ["build", "wrap", "fingerprint-post"])
def test_exception_on_one_rank_ends_every_rank(refused, stage: str) -> None:
    # In the cases job below: rank 1 raises in ``stage``; every rank reaches the gather.
    done = refused[f"raise-{stage}"]
    assert done["exit_codes"] == [3, 3], done
    report = done["report"]
    assert report["verdict"] == "error" and report["exit_code"] == 3
    [error] = report["errors"]
    assert (error["rank"], error["stage"]) == (1, stage)
    assert "injected fault" in error["message"]


def test_killed_rank_is_named_and_the_others_exit(tmp_path: Path) -> None:
    result = run_ranks(audit(tmp_path), nprocs=3, env={FAULT_ENV: "2:build:kill"}, timeout=BOUND)
    assert not result.timed_out
    assert result.codes == [3, 3, -9]
    report = read_report(tmp_path / "report.json")
    named = {(e["rank"], e["stage"]) for e in report["errors"]}
    assert (2, "build") in named, report["errors"]
    assert "rank 2 died during stage 'build'" in json.dumps(report["errors"])
    # Ranks 0 and 1 both gave up: the one that diagnosed watched the heartbeats while the other
    # waited in the store for its findings, beating all along (through its own store client).
    died = {e["rank"] for e in report["errors"] if "died" in e["message"]}
    assert died == {2}, report["errors"]
    for rank in (0, 1):  # each live rank's own message names it too
        assert "rank 2 died during stage 'build'" in result.output(rank), result.output(rank)


def test_rank_killed_during_the_gather(tmp_path: Path) -> None:
    result = run_ranks(audit(tmp_path), env={FAULT_ENV: "1:gather:kill"}, timeout=BOUND)
    assert not result.timed_out
    assert result.codes == [3, -9]
    report = read_report(tmp_path / "report.json")
    assert report["verdict"] == "error"
    assert "gather" in report["errors"][0]["message"]


def test_hung_rank_is_named_and_aborted(tmp_path: Path) -> None:
    # Its own, shorter --timeout (the last one wins): rank 0 waits it out in the gather.
    args = [*audit(tmp_path), "--timeout", str(HANG_TIMEOUT)]
    result = run_ranks(args, env={FAULT_ENV: "1:build:hang"}, timeout=BOUND)
    # Rank 0 times out in the gather, names rank 1, and its abort mark ends the hung rank too.
    assert_all_exited(result, [3, 3])
    report = read_report(tmp_path / "report.json")
    assert {(e["rank"], e["stage"]) for e in report["errors"]} >= {(1, "build")}
    assert "aborting" in result.ranks[1].stderr


# ------------------------------------------------------------------------ bad input (exit 2)


# Every bad input below is refused on every rank with exit 2; they run in turn in one 2-rank job
# (tests/workers/audit_cases_worker.py: run_audit on the job's gloo group), whose rank 1 has an
# empty Hugging Face cache. The CLI's own exit for bad input: tests/cli/test_bad_input.py.


@pytest.fixture(scope="module")
def refused(tmp_path_factory: pytest.TempPathFactory, llama_checkpoint: Path) -> dict:
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("bad-input")
    home = hub_cache(tmp_path_factory.mktemp("node0") / "hf-home", llama_checkpoint)
    config = (llama_checkpoint / "config.json").read_bytes()

    def folder(name: str, files: dict[str, bytes | str]) -> str:
        path = root / name
        path.mkdir()
        for file, data in files.items():
            target = path / file
            target.write_bytes(data) if isinstance(data, bytes) else target.write_text(data)
        return str(path)

    weights = (llama_checkpoint / "model.safetensors").read_bytes()
    tensors = load_file(str(llama_checkpoint / "model.safetensors"))
    tensors.pop("model.norm.weight")
    tensors["model.extra.weight"] = tensors["model.layers.0.input_layernorm.weight"].clone()
    mismatched = folder("mismatched", {"config.json": config})
    save_file(tensors, f"{mismatched}/model.safetensors", metadata={"format": "pt"})
    remote = {
        "model_type": "custom-thing",
        "auto_map": {
            "AutoConfig": "configuration_custom.CustomConfig",
            "AutoModelForCausalLM": "modeling_custom.CustomModel",
        },
    }
    marker = root / "remote-code-ran"
    remote_code = (
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import PretrainedConfig\n"
        "class CustomConfig(PretrainedConfig):\n    model_type = 'custom-thing'\n"
    )
    cases = {
        "unknown-preset": {"model": "tiny-nonesuch"},
        "missing-path": {"model": str(root / "no-such-model")},
        "rank-0-only": {"model": "acme/tiny-llama"},  # rank 1's cache is empty
        "corrupt-config": {
            "model": folder("broken", {"config.json": '{"model_type": "llama", "hidden_si'})
        },
        "truncated": {
            "model": folder(
                "truncated",
                {"config.json": config, "model.safetensors": weights[: len(weights) // 2]},
            )
        },
        "mismatched-keys": {"model": mismatched},
        "mesh": {"model": "hazard", "options": {"mesh": [2, 2]}},
        "remote-code": {
            "model": folder(
                "custom",
                {"config.json": json.dumps(remote), "configuration_custom.py": remote_code},
            )
        },
        "pickle": {
            "model": folder(
                "pickled", {"config.json": config, "pytorch_model.bin": b"not even a real pickle"}
            )
        },
    }
    for stage in ("build", "wrap", "fingerprint-post"):  # not bad input: rank 1 raises there
        cases[f"raise-{stage}"] = {"model": "hazard", "env": {FAULT_ENV: f"1:{stage}:raise"}}
    # --download: rank 0 fetches while the other waits; offline, it fails and nobody hangs.
    cases["download"] = {"model": "acme/not-cached", "options": {"download": True}}
    cases["secrets"] = {"model": "tiny-llama", "env": {key: SECRET for key in SECRET_VARS}}
    for case in cases.values():
        case["options"] = {"timeout": TIMEOUT, **case.get("options", {})}
    empty = root / "empty-home"
    done = run_audit_cases(root, cases, rank_env=lambda r: {"HF_HOME": str(empty if r else home)})
    done["remote-code"]["marker"] = marker.exists()
    return {**done, "paths": {name: case["model"] for name, case in cases.items()}}


def _errors(refused: dict, case: str) -> list[dict]:
    done = refused[case]
    assert done["exit_codes"] == [2, 2], done
    return done["report"]["errors"]


def test_unknown_preset_reported_by_every_rank(refused) -> None:
    errors = _errors(refused, "unknown-preset")
    assert [e["rank"] for e in errors] == [0, 1]
    assert all("tiny-nonesuch" in e["message"] and e["kind"] == "input" for e in errors)


def test_missing_path(refused) -> None:
    assert refused["paths"]["missing-path"] in _errors(refused, "missing-path")[0]["message"]


def test_model_present_on_rank_0_only(refused) -> None:
    [error] = _errors(refused, "rank-0-only")
    assert error["rank"] == 1 and error["stage"] == "resolve"
    assert "rank 1" in error["message"] and "empty-home" in error["message"]


def test_corrupt_config_json(refused) -> None:
    message = _errors(refused, "corrupt-config")[0]["message"]
    assert "config.json" in message and "corrupt or truncated" in message


def test_truncated_safetensors(refused) -> None:
    [error] = _errors(refused, "truncated")
    assert error["rank"] == 0 and error["stage"] == "build"  # only rank 0 reads the weights
    assert "truncated" in error["message"]


def test_checkpoint_with_missing_and_unexpected_keys(refused) -> None:
    message = _errors(refused, "mismatched-keys")[0]["message"]
    assert "model.norm.weight" in message and "model.extra.weight" in message


def test_mesh_not_matching_world_size(refused) -> None:
    done = refused["mesh"]  # refused before any stage, as every rank joins the mesh
    assert done["exit_codes"] == [2, 2] and done["report"] is None
    for message in done["raised"]:
        assert "--mesh 2,2" in message and "WORLD_SIZE is 2" in message


def test_nccl_without_cuda(tmp_path: Path) -> None:
    result = run_ranks(audit(tmp_path, "--backend", "nccl"), timeout=BOUND)
    assert_all_exited(result, [2, 2])
    assert (
        "--backend nccl needs CUDA" in read_report(tmp_path / "report.json")["errors"][0]["message"]
    )


def test_unreachable_rendezvous(tmp_path: Path) -> None:
    port = free_port()  # nobody listens: rank 0 is never started
    env = {
        **os.environ,
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "fsdpcheck", "audit", "--model", "hazard", "--timeout", "5"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=BOUND,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"127.0.0.1:{port}" in proc.stderr and "rank 1" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_version_skew_is_a_finding_not_a_crash(tmp_path: Path) -> None:
    fake = tmp_path / "skew"
    (fake / "transformers-0.0.1.dist-info").mkdir(parents=True)
    (fake / "transformers-0.0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: transformers\nVersion: 0.0.1\n"
    )
    result = launch(
        ["-m", "fsdpcheck", *audit(tmp_path)],
        2,
        cwd=str(REPO),
        timeout=BOUND,
        rank_env=lambda r: {"PYTHONHASHSEED": "1", **({"PYTHONPATH": str(fake)} if r == 1 else {})},
    )
    assert_all_exited(result, [1, 1])
    [finding] = read_report(tmp_path / "report.json")["findings"]
    assert finding["kind"] == "env" and finding["ranks"] == [1]
    assert "0.0.1" in json.dumps(finding["details"])


# ------------------------------------------------------------------------ security defaults


def test_remote_code_is_refused_by_default(refused) -> None:
    assert "--trust-remote-code" in _errors(refused, "remote-code")[0]["message"]
    assert refused["remote-code"]["marker"] is False  # its code never ran


def test_pickle_weights_are_refused_by_default(refused) -> None:
    message = _errors(refused, "pickle")[0]["message"]
    assert "pytorch_model.bin" in message and "--allow-pickle" in message


def test_secrets_in_the_environment_stay_out_of_the_report(refused) -> None:
    done = refused["secrets"]
    assert done["exit_codes"] == [0, 0], done
    assert SECRET not in json.dumps(done)


# ------------------------------------------------------------------------------- multi-node


def test_two_torchrun_agents_group_ranks_by_host(tmp_path: Path) -> None:
    """Two agents (2 ranks each) on one machine; the second in its own UTS namespace, so it
    has its own host name, as a second node would."""
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    port = free_port()
    out = tmp_path / "report.json"

    def agent(node_rank: int) -> list[str]:
        cmd = [
            torchrun,
            "--nnodes",
            "2",
            "--nproc-per-node",
            "2",
            "--node-rank",
            str(node_rank),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            "fsdpcheck-test",
            "-m",
            "fsdpcheck",
            "audit",
            "--model",
            "hazard",
            "--timeout",
            str(TIMEOUT),
            "--json",
            str(out),
        ]
        if node_rank == 1:
            return ["unshare", "--uts", "sh", "-c", 'hostname node-b && exec "$@"', "sh", *cmd]
        return cmd

    env = {**os.environ, "PYTHONHASHSEED": "1"}
    procs = [
        subprocess.Popen(
            agent(n), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for n in (0, 1)
    ]
    try:
        outputs = [p.communicate(timeout=BOUND + 30)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outputs)
    report = read_report(out)
    assert report["world_size"] == 4 and report["verdict"] == "consistent"
    hosts = report["hosts"]
    assert len(hosts) == 2 and hosts["node-b"] in ([0, 1], [2, 3])
    assert sorted(report["groups"][0]["hosts"]) == sorted(hosts)
    assert "node-b" in "".join(outputs)


def test_download_failure_on_rank_0_ends_every_rank_cleanly(refused) -> None:
    errors = _errors(refused, "download")
    assert (errors[0]["rank"], errors[0]["stage"]) == (0, "download")
    assert "--download 'acme/not-cached' failed" in errors[0]["message"]
    assert errors[1]["rank"] == 1 and "not in the local Hugging Face cache" in errors[1]["message"]


def test_torchrun_summary_shows_the_cause(tmp_path: Path) -> None:
    proc = subprocess.run(
        torchrun_fsdpcheck(2, *audit(tmp_path, model="tiny-nonesuch")),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=BOUND,
    )
    assert proc.returncode == 1  # torchrun's own code for any failed worker
    # torch elastic's error file: the root cause in torchrun's summary is fsdpcheck's message.
    assert "tiny-nonesuch" in proc.stderr and "error_file: <N/A>" not in proc.stderr
    # The one-line cause, not a Python traceback through fsdpcheck (torchrun prints its own).
    assert "traceback : fsdpcheck: " in proc.stderr
    assert "fsdpcheck/cli.py" not in proc.stderr


@pytest.mark.parametrize("stage", ["load", "verify"])
def test_failure_after_the_gather_still_reaches_rank_0s_report(tmp_path: Path, stage: str) -> None:
    # Its own launch: a rank that fails after the gather ends its process (the abort mark).
    result = run_ranks(audit(tmp_path), env={FAULT_ENV: f"1:{stage}:raise"}, timeout=BOUND)
    assert not result.timed_out, result.codes
    assert result.codes == [3, 3], result.output(0) + result.output(1)
    report = read_report(tmp_path / "report.json")
    assert report["verdict"] == "error"
    assert any(e["rank"] == 1 and e["stage"] == stage for e in report["errors"]), report
