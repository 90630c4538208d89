"""``fsdpcheck run`` on real training scripts, unmodified, as real ranks (env://).

The clean-stack corpus: a plain FSDP2 script in the style of PyTorch's examples
(``examples/scripts/fsdp2_train.py``: meta init, ``reset_parameters``, DCP save and resume) is
``consistent`` and bitwise transparent (the same losses and final weights as without
fsdpcheck); each of its faulty twins is found on every rank with the same exit code: layers
its ``reset_parameters`` never reaches (the published example's bug, one line), a checkpoint
only rank 0 sees, mixed precision on rank 1 only, an extra micro-batch on rank 1. Then what
``run`` does with the script's own ends (an exception, ``sys.exit``, a rank that dies), and
that nothing of fsdpcheck is left on the script's path after the watched step.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from fsdpcheck.children.launch import TEARDOWN_ABORT, LaunchResult, free_port, launch
from tests.conftest import QUIET_ENV, REPO, run_plain, torchrun_fsdpcheck

TRAIN = REPO / "examples" / "scripts" / "fsdp2_train.py"
TITAN = REPO / "examples" / "scripts" / "titan_train.py"
LIGHTNING = REPO / "examples" / "scripts" / "lightning_train.py"
PROBE = REPO / "tests" / "workers" / "run_probe.py"
WATCH_TIMEOUT = 20  # fsdpcheck run --timeout: every case must end well inside the job's limit
JOB_LIMIT = 120.0


def job(
    argv: Sequence[str],
    *,
    rank_args: Callable[[int], Sequence[str]] | None = None,
    cwd: Path = REPO,
    ranks: int = 2,
) -> LaunchResult:
    """``ranks`` env:// ranks of ``python ARGV``; ``rank_args``: what one rank alone is given."""
    return launch(
        list(argv),
        ranks,
        env={**QUIET_ENV, "OMP_NUM_THREADS": "1"},
        rank_args=rank_args,
        timeout=JOB_LIMIT,
        cwd=str(cwd),
    )


def plain_finished(result: LaunchResult) -> None:
    """A plain run of the script (no fsdpcheck) ended well. torch keeps a destroyed gloo group
    alive in its caches (DTensor's sharding cache holds the mesh), and the interpreter's
    teardown now and then aborts on its threads after the script is done ("terminate called
    without an active exception", -6): that is torch's, and fsdpcheck's exit skips it."""
    for rank, code in enumerate(result.codes):
        assert code == 0 or result.aborted_in_teardown(rank), result.output(rank)


def plain_launch_finished(done: subprocess.CompletedProcess) -> None:
    """``plain_finished`` for a launcher's job: exit 0, or the launcher's exit 1 where the
    failed ranks in its summary are that teardown abort (-6, torch's words on stderr) and the
    ranks the launcher then ended with SIGTERM (-15) while they were still tearing down."""
    output = done.stdout[-3000:] + done.stderr[-3000:]
    if done.returncode == 0:
        return
    codes = set(re.findall(r"exitcode\s*:\s*(-?\d+)", done.stderr))
    teardown = "-6" in codes and codes <= {"-6", "-15"} and TEARDOWN_ABORT in done.stderr
    assert done.returncode == 1 and teardown, output


def checked(
    script: Path | str, args: Sequence[str], report: Path, *options: str, **kwargs
) -> LaunchResult:
    run = ["-m", "fsdpcheck", "run", "--timeout", str(WATCH_TIMEOUT), "--json", str(report)]
    return job([*run, *options, str(script), *args], **kwargs)


def findings(report: Path) -> dict[str, list[dict]]:
    data = json.loads(report.read_text())
    kinds: dict[str, list[dict]] = {}
    for finding in data["findings"]:
        kinds.setdefault(finding["kind"], []).append(finding)
    return kinds


def _weights(folder: Path) -> dict[str, bytes]:
    from safetensors.torch import load_file

    return {k: v.numpy().tobytes() for k, v in load_file(folder / "weights.safetensors").items()}


def test_the_fsdp2_script_is_consistent_and_bitwise_transparent(tmp_path: Path) -> None:
    plain_out, run_out, report = tmp_path / "plain", tmp_path / "run", tmp_path / "report.json"
    args = ["--steps", "3", "--n-layers", "2"]
    plain_finished(job([str(TRAIN), *args, "--out", str(plain_out)]))
    result = checked(TRAIN, [*args, "--out", str(run_out)], report)
    assert result.codes == [0, 0], result.output(0) + result.output(1)
    data = json.loads(report.read_text())
    assert data["verdict"] == "consistent", data["findings"]
    assert json.loads((run_out / "losses.json").read_text()) == json.loads(
        (plain_out / "losses.json").read_text()
    )
    assert _weights(run_out) == _weights(plain_out)
    # The job went on after the watched step and printed its own lines after the verdict.
    output = result.output(0)
    assert output.index("verdict: consistent") < output.index("step 3 loss")


def test_a_resume_from_dcp_is_checked_against_the_checkpoint(tmp_path: Path) -> None:
    """Both ranks resume from the DCP folder the script saved: the model matches it (the
    checkpoint the script loaded is the source), and the run stays transparent."""
    ckpt, report = tmp_path / "ckpt", tmp_path / "report.json"
    plain_finished(job([str(TRAIN), "--steps", "2", "--checkpoint-dir", str(ckpt)]))
    shutil.copytree(ckpt, tmp_path / "plain-ckpt")
    plain_args = ["--steps", "2", "--checkpoint-dir", str(tmp_path / "plain-ckpt")]
    plain_finished(job([str(TRAIN), *plain_args, "--out", str(tmp_path / "plain")]))
    args = ["--steps", "2", "--checkpoint-dir", str(ckpt), "--out", str(tmp_path / "run")]
    result = checked(TRAIN, args, report)
    assert result.codes == [0, 0], result.output(0) + result.output(1)
    data = json.loads(report.read_text())
    assert data["verdict"] == "consistent", data["findings"]
    assert data["source_check"]["passed"] and data["source_check"]["checked"] > 0
    assert data["checkpoint"]["path"].endswith("step-2")
    assert "resumed from step 2" in result.output(0)
    losses = [json.loads((tmp_path / d / "losses.json").read_text()) for d in ("plain", "run")]
    assert losses[0] == losses[1]
    assert _weights(tmp_path / "run") == _weights(tmp_path / "plain")


def _unreached_layers(tmp_path: Path) -> Path:
    """The published example's bug: the model's reset_parameters never reaches its layers."""
    source = TRAIN.read_text()
    edited = source.replace("            layer.reset_parameters()\n", "            pass\n")
    assert edited != source
    script = tmp_path / "fsdp2_train_unreached.py"
    script.write_text(edited)
    return script


FAULTS = {
    # name: (script maker, rank 1's own arguments, the finding kind every rank stops on)
    "layers-never-initialised": (_unreached_layers, [], "uninitialized"),
    "checkpoint-only-rank-0-sees": (None, ["--checkpoint-dir", "{empty}"], "step"),
    "mixed-precision-on-rank-1": (None, ["--mixed-precision"], "wrap-plan"),
    "extra-micro-batch-on-rank-1": (None, ["--grad-accum", "2"], "launch"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_every_faulty_twin_is_found_on_every_rank(tmp_path: Path, fault: str) -> None:
    make, own, kind = FAULTS[fault]
    script = make(tmp_path) if make else TRAIN
    ckpt, empty, report = tmp_path / "ckpt", tmp_path / "empty", tmp_path / "report.json"
    empty.mkdir()
    args = ["--steps", "2", "--n-layers", "3"]
    if fault == "checkpoint-only-rank-0-sees":
        plain_finished(
            job([str(TRAIN), "--steps", "1", "--n-layers", "3", "--checkpoint-dir", str(ckpt)])
        )
        args += ["--checkpoint-dir", str(ckpt)]
    rank1 = [a.format(empty=empty) for a in own]
    result = checked(script, args, report, rank_args=lambda r: rank1 if r == 1 else [])
    assert result.codes == [1, 1], result.output(0) + result.output(1)
    assert result.elapsed < WATCH_TIMEOUT, "a finding must stop every rank inside --timeout"
    found = findings(report)
    assert kind in found, found
    if fault == "layers-never-initialised":
        (unwritten,) = found["uninitialized"]
        assert unwritten["ranks"] == [0, 1]
        problems = unwritten["details"]["problems"]
        names = {p["name"] for p in problems}
        # every tensor of every decoder layer, and nothing else, whatever its garbage holds
        assert names == {n for n in names if n.startswith("layers.")}
        assert {n.split(".")[1] for n in names} == {"0", "1", "2"}
        assert len(names) == 3 * 10
        assert "layers.0-2 (3 modules)" in unwritten["summary"]
        assert "Transformer.reset_parameters" in unwritten["summary"]
    if fault == "checkpoint-only-rank-0-sees":
        (step,) = found["step"]
        assert "the first forward of an FSDP model" in step["summary"]
        assert "fsdp2_train.py" in step["summary"]  # the script's own line


def test_the_clean_twins_of_the_faults_stay_consistent(tmp_path: Path) -> None:
    """Every rank given the same flags the faults give one: mixed precision and two
    micro-batches on both ranks, and a checkpoint both ranks see."""
    ckpt, report = tmp_path / "ckpt", tmp_path / "report.json"
    plain_finished(job([str(TRAIN), "--steps", "1", "--checkpoint-dir", str(ckpt)]))
    args = ["--steps", "2", "--mixed-precision", "--grad-accum", "2", "--checkpoint-dir", str(ckpt)]
    result = checked(TRAIN, args, report)
    assert result.codes == [0, 0], result.output(0) + result.output(1)
    assert json.loads(report.read_text())["verdict"] == "consistent"


def test_after_the_watched_step_nothing_of_fsdpcheck_is_on_the_path(tmp_path: Path) -> None:
    out, report = tmp_path / "out", tmp_path / "report.json"
    result = checked(PROBE, ["--out", str(out), "--steps", "3"], report, "--watch-steps", "2")
    assert result.codes == [0, 0], result.output(0) + result.output(1)
    for rank in (0, 1):
        path = json.loads((out / f"rank{rank}.json").read_text())["path"]
        watched, after = path[0], path[2]
        assert watched["dispatch_modes"] == ["CollectiveWatch"]  # step 1 of the 2 watched
        assert after["dispatch_modes"] == []
        assert after["forward_pre_hooks"] == after["optimizer_pre_hooks"] == 0
        assert after["optimizer_post_hooks"] == 0
        assert "fsdpcheck" not in after["fully_shard"] + after["to_empty"]
        assert "fsdpcheck" not in after["fsdp_state_init"]
        # The watch's patches and the session's own thread: on while it runs, gone after.
        assert all("fsdpcheck" in where for where in watched["patched"].values()), watched
        assert not any("fsdpcheck" in where for where in after["patched"].values()), after
        assert "fsdpcheck-abort-watch" in watched["threads"]
        assert after["threads"] == []
    # The watch's keys deleted once every rank concluded: what stays is the run's liveness
    # marks, a few per rank (issue 37: a job that checks often must not grow the store).
    records = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    during = [r["path"][0]["store_keys"] - r["store_keys_at_start"] for r in records]
    left = [r["path"][2]["store_keys"] - r["store_keys_at_start"] for r in records]
    assert all(n < 20 for n in left), (during, left)
    assert all(d > n for d, n in zip(during, left, strict=True)), (during, left)
    data = json.loads(report.read_text())
    assert data["verdict"] == "consistent"


def test_steps_stops_the_job_with_the_verdict(tmp_path: Path) -> None:
    out, report = tmp_path / "out", tmp_path / "report.json"
    result = checked(PROBE, ["--out", str(out), "--steps", "5"], report, "--steps", "2")
    assert result.codes == [0, 0], result.output(0)
    assert not out.exists()  # stopped after step 2, before the script's own end
    assert json.loads(report.read_text())["verdict"] == "consistent"


def test_the_script_s_own_exception_in_the_watched_step_is_named(tmp_path: Path) -> None:
    out, report = tmp_path / "out", tmp_path / "report.json"
    result = checked(PROBE, ["--out", str(out), "--raise-at", "0"], report)
    assert result.codes == [3, 3], result.output(0) + result.output(1)
    assert "ValueError: rank 1 broke at step 0" in result.output(1)  # its own traceback
    assert "run_probe.py" in result.output(1).split("Traceback")[1]
    assert "fsdpcheck/script" not in result.output(1).split("Traceback")[1]
    errors = json.loads(report.read_text())["errors"]
    assert any(e["rank"] == 1 and "rank 1 broke at step 0" in e["message"] for e in errors)
    # The headline names the rank that raised, not rank 0 that waited for it (issue 37).
    said = "rank 1 failed at step: rank 1's step raised: ValueError: rank 1 broke at step 0"
    assert said in result.output(0), result.output(0)


def test_an_exception_after_the_watch_is_the_script_s_own(tmp_path: Path) -> None:
    out, report = tmp_path / "out", tmp_path / "report.json"
    result = checked(PROBE, ["--out", str(out), "--raise-at", "2"], report)
    assert result.codes[1] == 1, result.output(1)  # as Python ends it
    assert "ValueError: rank 1 broke at step 2" in result.output(1)
    assert json.loads(report.read_text())["verdict"] == "consistent"


def test_sys_exit_keeps_its_code_and_a_script_without_fsdp_gets_a_note(tmp_path: Path) -> None:
    out, report = tmp_path / "out", tmp_path / "report.json"
    exited = checked(PROBE, ["--out", str(out), "--exit-code", "4"], report)
    assert exited.codes == [4, 4], exited.output(0)
    ddp = checked(PROBE, ["--out", str(out), "--ddp"], report)
    assert ddp.codes == [0, 0], ddp.output(0) + ddp.output(1)
    for rank in (0, 1):
        assert "never called fully_shard: nothing was checked" in ddp.output(rank)
    strict = checked(PROBE, ["--out", str(out), "--ddp"], report, "--strict")
    assert strict.codes == [2, 2], strict.output(0)


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_rank_that_dies_in_the_watched_step_is_named(tmp_path: Path, ranks: int) -> None:
    """Rank 0 waits in the watch for the dead rank's part; its stopped heartbeat names it
    gone before the timeout (after 10 s, the least a heartbeat must stand still), and rank 0
    exits 3. The report blames the dead rank, not the one that waited for it: the watch's
    loss unwound rank 0's script, but it is no exception of the script's (no traceback).
    On 3 ranks rank 1 alone is named, and rank 2 ends with exit 3 too, with the diagnosis as
    its own message: rank 0 hosts the store under env:// ranks, and it concludes first, so it
    waits for rank 2 to take the diagnosis before it goes (the store's loss was rank 2's
    message before)."""
    out, report = tmp_path / "out", tmp_path / "report.json"
    result = checked(PROBE, ["--out", str(out), "--die-at", "0"], report, ranks=ranks)
    assert result.codes[1] == 9
    assert result.codes[0] == 3, result.output(0)
    if ranks == 3:
        assert result.codes[2] == 3, result.output(2)
        assert "rank 1 died during stage 'step'" in result.output(2), result.output(2)
    assert result.elapsed < WATCH_TIMEOUT * 2.5
    (died,) = json.loads(report.read_text())["errors"]
    assert died["rank"] == 1 and "rank 1 died during stage 'step'" in died["message"], died
    assert "rank 1 stopped beating" in died["message"], died  # not the timeout's "within"
    assert "rank 1 failed at step: rank 1 died" in result.output(0)
    assert "Traceback" not in result.ranks[0].stderr, result.ranks[0].stderr


def test_a_rank_late_in_the_watched_step_is_waited_for(tmp_path: Path) -> None:
    """The dead rank's clean twin: rank 1 sleeps before its first forward, longer than a
    stopped heartbeat takes to name a rank gone (10 s, after a second of waiting, under this
    timeout); alive, it beats on, and the run is consistent."""
    out, report = tmp_path / "out", tmp_path / "report.json"
    args = ["--out", str(out), "--steps", "1", "--stall-at", "0", "--stall-seconds", "15"]
    result = checked(PROBE, args, report, "--timeout", "20")
    assert result.codes == [0, 0], result.output(0) + result.output(1)
    assert json.loads(report.read_text())["verdict"] == "consistent"


def test_a_module_runs_as_python_m_would(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    args = ["--steps", "1", "--out", str(tmp_path / "out")]
    result = checked("-m", ["examples.scripts.fsdp2_train", *args], report)
    assert result.codes == [0, 0], result.output(0) + result.output(1)
    assert json.loads(report.read_text())["verdict"] == "consistent"


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_torchtitan_style_trainer_and_its_uneven_data_split(tmp_path: Path) -> None:
    """Clean (8 sequences over 2 ranks): consistent, the same losses and shards as without
    fsdpcheck. Its twin (5 sequences): rank 0 runs one micro-batch more in every step, with
    the same command line on both ranks; only the step watch sees it."""
    report = tmp_path / "report.json"
    plain_finished(job([str(TITAN), "--samples", "8", "--out", str(tmp_path / "plain")]))
    clean = checked(TITAN, ["--samples", "8", "--out", str(tmp_path / "run")], report)
    assert clean.codes == [0, 0], clean.output(0) + clean.output(1)
    assert json.loads(report.read_text())["verdict"] == "consistent"
    assert _files(tmp_path / "run") == _files(tmp_path / "plain")
    uneven = checked(TITAN, ["--samples", "5"], report)
    assert uneven.codes == [1, 1], uneven.output(0) + uneven.output(1)
    (step,) = findings(report)["step"]
    assert "all-gather of the root module" in step["summary"]
    assert "the end of the watched step at titan_train.py" in step["summary"]


def _lightning_without_reset(tmp_path: Path) -> Path:
    """The norm's init under another name: Lightning cannot re-initialise it after to_empty."""
    source = LIGHTNING.read_text()
    edited = source.replace("def reset_parameters(self):", "def init_weights(self):").replace(
        "self.reset_parameters()", "self.init_weights()"
    )
    assert edited != source
    script = tmp_path / "lightning_no_reset.py"
    script.write_text(edited)
    return script


def test_lightning_s_fsdp2_strategy_and_a_module_it_cannot_initialise(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    plain_finished(job([str(LIGHTNING), "--out", str(tmp_path / "plain")]))
    clean = checked(LIGHTNING, ["--out", str(tmp_path / "run")], report)
    assert clean.codes == [0, 0], clean.output(0) + clean.output(1)
    assert json.loads(report.read_text())["verdict"] == "consistent"
    assert _files(tmp_path / "run") == _files(tmp_path / "plain")
    broken = checked(_lightning_without_reset(tmp_path), [], report)
    assert broken.codes == [1, 1], broken.output(0) + broken.output(1)
    (unwritten,) = findings(report)["uninitialized"]
    names = {p["name"] for p in unwritten["details"]["problems"]}
    assert names == {"blocks.0.norm.weight", "blocks.1.norm.weight", "norm.weight"}


def test_accelerate_launch_runs_the_script_checked(tmp_path: Path) -> None:
    """``accelerate launch -m fsdpcheck run script.py``: accelerate's launcher (torch's elastic
    agent and ACCELERATE_* variables; gloo on a host without GPUs), the clean script and its
    twin whose layers are never initialised."""
    accelerate = str(Path(sys.executable).with_name("accelerate"))
    for script, code, verdict in (
        (TRAIN, 0, "consistent"),
        (_unreached_layers(tmp_path), 1, "inconsistent"),
    ):
        report = tmp_path / f"{verdict}.json"
        argv = [
            accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(free_port()), "-m", "fsdpcheck", "run",
            "--timeout", str(WATCH_TIMEOUT), "--json", str(report), str(script), "--steps", "2",
        ]  # fmt: skip
        done = run_plain(argv, env={**QUIET_ENV, "OMP_NUM_THREADS": "1"}, timeout=JOB_LIMIT)
        assert (done.returncode != 0) == bool(code), done.stdout + done.stderr
        data = json.loads(report.read_text())
        assert (data["verdict"], data["exit_code"], data["world_size"]) == (verdict, code, 2)


def test_run_checked_is_the_same_check_as_a_call(tmp_path: Path) -> None:
    """``fsdpcheck.run_checked(train, ...)``, as a Ray actor calls it: the clean function goes on
    after the watched step; its twin that all-reduces on rank 1 only is stopped on both ranks,
    and neither process is ended by the call. Where rank 1 dies in the watched step, rank 0's
    call returns the run's outcome naming it (exit code 3), and raises nothing of fsdpcheck's."""
    worker = REPO / "tests" / "workers" / "run_checked_worker.py"
    for variant, code in (("clean", 0), ("extra", 1)):
        out = tmp_path / variant
        result = job([str(worker), str(out), variant])
        assert result.codes == [0, 0], result.output(0) + result.output(1)
        records = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
        assert [r["exit_code"] for r in records] == [code, code], records
        assert [r["report"] for r in records] == [True, False]
    out = tmp_path / "dies"
    result = job([str(worker), str(out), "dies"])
    assert result.codes == [0, 9], result.output(0) + result.output(1)
    record = json.loads((out / "rank0.json").read_text())
    assert record["exit_code"] == 3 and record["report"], record
    assert "rank 1 died" in record["headline"], record


def test_ctrl_c_ends_the_script_as_it_would_without_fsdpcheck(tmp_path: Path) -> None:
    """SIGINT on rank 1 after the watched step: its KeyboardInterrupt's traceback, and the
    process killed by SIGINT (-2), as Python ends it; nothing of fsdpcheck's in between."""
    out, report = tmp_path / "out", tmp_path / "report.json"
    # A shell's `cmd &` starts pytest with SIGINT ignored, the ranks inherit that, and Python
    # then ignores the signal, with fsdpcheck or without (measured: exit 0, no traceback). A
    # handler here is reset to the default in the ranks, as in a terminal.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        result = checked(PROBE, ["--out", str(out), "--sigint-at", "2"], report)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert result.codes[1] == -2, result.output(1)
    assert "KeyboardInterrupt" in result.output(1)
    assert "Aborted" not in result.output(1)  # click's own word for it, never shown
    assert json.loads(report.read_text())["verdict"] == "consistent"


HF_TRAINER = REPO / "examples" / "scripts" / "hf_trainer_train.py"
# accelerate turns an FSDP plugin into DDP on a host without GPUs: this lets it take its FSDP2
# path on CPU, the script unchanged (tests/workers/cpu_fsdp_gate/sitecustomize.py)
CPU_FSDP_GATE = {"PYTHONPATH": str(REPO / "tests" / "workers" / "cpu_fsdp_gate")}


def test_an_hf_trainer_with_fsdp2_under_accelerate_launch(tmp_path: Path) -> None:
    """Clean: consistent, the same logged losses as the script alone. Twin: rank 1 alone
    accumulates two micro-batches per step (env:// ranks, rank 1 given the flag): stopped on
    both ranks before its first step runs a collective rank 0 never issues."""
    accelerate = str(Path(sys.executable).with_name("accelerate"))
    env = {**QUIET_ENV, **CPU_FSDP_GATE, "OMP_NUM_THREADS": "1"}

    def launched(out: Path, *run: str) -> None:
        argv = [
            accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(free_port()), *run, str(HF_TRAINER), "--out", str(out),
        ]  # fmt: skip
        done = run_plain(argv, env=env, timeout=JOB_LIMIT)
        if run:  # fsdpcheck's exit skips the teardown that can abort the script alone
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        else:
            plain_launch_finished(done)

    report = tmp_path / "report.json"
    launched(tmp_path / "plain")
    launched(tmp_path / "run", "-m", "fsdpcheck", "run", "--json", str(report))
    data = json.loads(report.read_text())
    assert data["verdict"] == "consistent", data["findings"]
    for rank in (0, 1):
        name = f"losses{rank}.json"
        assert (tmp_path / "run" / name).read_text() == (tmp_path / "plain" / name).read_text()
    twin = launch(
        ["-m", "fsdpcheck", "run", "--timeout", str(WATCH_TIMEOUT), "--json", str(report),
         str(HF_TRAINER), "--out", str(tmp_path / "twin")],
        2, env={**env}, rank_args=lambda r: ["--grad-accum", "2"] if r == 1 else [],
        timeout=JOB_LIMIT, cwd=str(REPO),
    )  # fmt: skip
    assert twin.codes == [1, 1], twin.output(0) + twin.output(1)
    kinds = findings(report)
    assert "launch" in kinds, kinds


def test_under_torchrun_the_verdict_is_torchrun_s_failure_summary(tmp_path: Path) -> None:
    """As the README runs it: torchrun's own agent. The twin whose layers are never initialised
    fails the job, and torchrun's summary names fsdpcheck's cause (its error file)."""
    report = tmp_path / "report.json"
    argv = torchrun_fsdpcheck(2, "run", "--json", str(report), str(_unreached_layers(tmp_path)))
    done = run_plain(argv, env={**QUIET_ENV, "OMP_NUM_THREADS": "1"}, timeout=JOB_LIMIT)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "fsdpcheck: tensors are not initialised on ranks 0,1" in done.stderr
    assert json.loads(report.read_text())["exit_code"] == 1
