"""``diff`` over saved records: the audit's analysis over files, rank assignment, bad input,
and the ``diff`` command in-process (no torch processes, no ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from synthetic import EMBED, FULL, K_PROJ, Q_PROJ, SCALE, SLIDING, analyse, tensor
from typer.testing import CliRunner

from fsdpcheck.checks.groups import group_ranks
from fsdpcheck.cli import app
from fsdpcheck.errors import InputError
from fsdpcheck.offline.diff import diff_fingerprints, diff_records
from fsdpcheck.offline.files import (
    FINGERPRINT_SCHEMA,
    FingerprintFile,
    format_path,
    read_inputs,
    write_fingerprint,
)
from fsdpcheck.records import (
    EnvRecord,
    Fingerprint,
    ModelInfo,
    RankError,
    RankRecord,
    Report,
    from_dict,
    to_dict,
)

ROTARY = (SCALE, FULL, SLIDING)
SWAPPED = (SCALE, SLIDING, FULL)


# ---------------------------------------------------------------- synthetic records


def _fingerprint(stage: str, order=ROTARY) -> Fingerprint:
    sizes = {SCALE: (1,), FULL: (16,), SLIDING: (8,)}
    buffers = tuple(tensor(n, sizes[n], persistent=n == SCALE) for n in order)
    placements = ("Shard(dim=0)",) if stage == "post-wrap" else None
    shapes = {EMBED: (32, 8), Q_PROJ: (8, 8), K_PROJ: (8, 8)}
    params = tuple(tensor(n, s, placements=placements) for n, s in shapes.items())
    keys = (*shapes, SCALE)
    return Fingerprint(snapshot=stage, buffers=buffers, params=params, state_dict_keys=keys)


def _record(rank: int, order=ROTARY, torch="2.13.0+cpu", host="node0", error=None) -> RankRecord:
    env = EnvRecord(rank, rank, 2, host, "gloo", "3.11.9", torch, "5.24.0", str(rank))
    if error is not None:
        return RankRecord(env=env, error=error)
    return RankRecord(env, _fingerprint("pre-wrap", order), _fingerprint("post-wrap", order))


MODEL = ModelInfo(
    "hazard", "preset", "hazard", None, "HazardForCausalLM", "float32", "rank0", False
)


def _save(directory: Path, name: str, record: RankRecord, **extra) -> Path:
    content = FingerprintFile(record=record, model=MODEL, **extra)
    return write_fingerprint(content, directory / name)


def test_diff_is_the_audits_analysis_over_saved_records(tmp_path: Path) -> None:
    a, b = _record(0), _record(1, SWAPPED)
    report = diff_fingerprints([_save(tmp_path, "a.json", a), _save(tmp_path, "b.json", b)])
    groups = group_ranks({0: a.group_digest(), 1: b.group_digest()})
    assert report.findings == tuple(analyse(groups, {0: a, 1: b}))
    assert (report.verdict, report.exit_code, report.world_size) == ("inconsistent", 1, 2)
    assert [f.kind for f in report.findings] == ["buffer-order"]
    assert report.findings[0].cause == "construction-time"
    verdicts = {p.name: p.verdict for p in report.loaders}
    assert verdicts["named-buffers-order"] == "hang" and verdicts["sorted-names"] == "ok"
    # The audit's JSON schema, and it round-trips.
    assert report.schema == "fsdpcheck.report/2"
    as_json = json.loads(json.dumps(to_dict(report)))
    assert to_dict(from_dict(Report, as_json)) == as_json
    assert [i["path"] for i in report.options["inputs"]] == [
        str(tmp_path / f"{n}.json") for n in "ab"
    ]


def test_identical_records_are_consistent(tmp_path: Path) -> None:
    report = diff_fingerprints([_save(tmp_path, f"r{r}.json", _record(r)) for r in (0, 1)])
    assert (report.verdict, report.exit_code, report.findings) == ("consistent", 0, ())
    assert not report.options["positional"]
    assert [g.ranks for g in report.groups] == [(0, 1)]


def test_ranks_come_from_the_records_not_the_argument_order(tmp_path: Path) -> None:
    three = _save(tmp_path, "x.json", _record(3, SWAPPED))
    zero = _save(tmp_path, "y.json", _record(0))
    report = diff_fingerprints([three, zero])
    assert [i["rank"] for i in report.options["inputs"]] == [0, 3]
    assert report.findings[0].ranks == (3,) and report.findings[0].reference_rank == 0


def test_two_files_claiming_one_rank_take_positions_in_argument_order(tmp_path: Path) -> None:
    """Today's rank 0 against last week's rank 0, on another torch: an env finding."""
    today = _save(tmp_path, "today.json", _record(0, torch="2.13.0+cpu", host="new"))
    week = _save(tmp_path, "lastweek.json", _record(0, torch="2.12.1+cpu", host="old"))
    report = diff_fingerprints([week, today])
    assert report.options["positional"]
    assert [(i["rank"], i["recorded_rank"], i["host"]) for i in report.options["inputs"]] == [
        (0, 0, "old"),
        (1, 0, "new"),
    ]
    assert any("argument order" in w and "today.json" in w for w in report.warnings)
    assert [f.kind for f in report.findings] == ["env"]
    assert "torch 2.12.1+cpu on rank 0 but 2.13.0+cpu on rank 1" in report.findings[0].summary
    assert [env.rank for env in report.environment] == [0, 1]
    assert report.hosts == {"new": (1,), "old": (0,)}


def test_a_recorded_failure_is_the_report_error(tmp_path: Path) -> None:
    failed = _record(1, error=RankError(1, "build", "boom", "runtime"))
    report = diff_fingerprints(
        [_save(tmp_path, "0.json", _record(0)), _save(tmp_path, "1.json", failed)]
    )
    assert (report.verdict, report.exit_code) == ("error", 3)
    assert report.errors[0].rank == 1 and report.errors[0].stage == "build"


def test_a_directory_means_its_fingerprints_and_skips_other_json(tmp_path: Path) -> None:
    for rank in (0, 1):
        _save(tmp_path, f"rank{rank}.json", _record(rank))
    (tmp_path / "report.json").write_text(json.dumps({"schema": "fsdpcheck.report/1"}))
    (tmp_path / "notes.txt").write_text("not json")
    inputs = read_inputs([tmp_path, tmp_path / "rank1.json"])
    assert [Path(f.path).name for f in inputs.files] == ["rank0.json", "rank1.json"]
    assert inputs.skipped == (
        "report.json: not a fingerprint (an fsdpcheck report (--json output))",
    )
    assert inputs.duplicates == (str(tmp_path / "rank1.json"),)
    report = diff_records(inputs)
    assert any("skipped report.json" in w for w in report.warnings)


def _bad_input(paths) -> str:
    with pytest.raises(InputError) as caught:
        diff_fingerprints(paths)
    message = str(caught.value)
    assert "\n" not in message  # one paragraph
    return message


def test_bad_inputs_are_one_paragraph_naming_the_file_and_fix(tmp_path: Path) -> None:
    good = _save(tmp_path, "good.json", _record(0))
    other = _save(tmp_path, "other.json", _record(1))
    truncated = tmp_path / "truncated.json"
    truncated.write_text(good.read_text()[:50])
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"schema": "fsdpcheck.report/1", "verdict": "consistent"}))
    newer = tmp_path / "newer.json"
    newer.write_text(
        json.dumps({**json.loads(good.read_text()), "schema": "fsdpcheck.fingerprint/5"})
    )
    older = tmp_path / "older.json"  # /3: value digests of the checksum before this one's sum 2
    older.write_text(
        json.dumps({**json.loads(good.read_text()), "schema": "fsdpcheck.fingerprint/3"})
    )
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"schema": FINGERPRINT_SCHEMA, "record": [1, 2]}))
    empty = tmp_path / "empty"
    empty.mkdir()

    assert "missing.json does not exist" in _bad_input([good, tmp_path / "missing.json"])
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    assert f"cannot read {binary}" in _bad_input([good, binary])
    assert "truncated.json is not JSON" in _bad_input([good, truncated])
    assert "report.json is not an fsdpcheck fingerprint: it is an fsdpcheck report" in _bad_input(
        [good, report]
    )
    mixed = _bad_input([good, newer])
    assert "mix schema versions" in mixed and "newer.json" in mixed
    assert "fsdpcheck.fingerprint/5" in _bad_input([newer, newer.with_name("newer.json")])
    assert "re-create the fingerprints" in _bad_input([older, older])
    assert "broken.json has the fingerprint schema marker but its record is malformed" in (
        _bad_input([good, broken])
    )
    assert "at least two fingerprints" in _bad_input([good])
    assert "no fingerprint was found" in _bad_input([empty])
    assert "at least two" in _bad_input([good, good])  # the same file twice is one fingerprint
    assert diff_fingerprints([good, other]).exit_code == 0


def test_paths_take_placeholders_and_unwritable_paths_are_bad_input(tmp_path: Path) -> None:
    env = _record(3).env
    assert format_path(tmp_path / "{host}-rank{rank}-of{world_size}.json", env).name == (
        "node0-rank3-of2.json"
    )
    with pytest.raises(InputError, match="placeholder"):
        format_path(tmp_path / "{node}.json", env)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(InputError, match="cannot write the fingerprint"):
        write_fingerprint(FingerprintFile(record=_record(0)), blocker / "sub" / "fp.json")
    saved = write_fingerprint(FingerprintFile(record=_record(0)), tmp_path / "deep" / "fp.json")
    data = json.loads(saved.read_text())
    assert next(iter(data)) == "schema" and data["schema"] == FINGERPRINT_SCHEMA
    assert data["fsdpcheck"] and data["created"].endswith("Z")
    assert not [p for p in saved.parent.iterdir() if p.name.endswith(".tmp")]


def test_diff_command_renders_the_report_and_writes_json(tmp_path: Path) -> None:
    a = _save(tmp_path, "a.json", _record(0))
    b = _save(tmp_path, "b.json", _record(1, SWAPPED))
    out = tmp_path / "diff.json"
    result = CliRunner().invoke(app, ["diff", str(a), str(b), "--json", str(out)])
    assert result.exit_code == 1, result.output
    assert "fsdpcheck diff" in result.output and "✗ buffer-order" in result.output
    assert f"rank 1 ← {b}" in result.output
    report = from_dict(Report, json.loads(out.read_text()))
    assert report.verdict == "inconsistent" and report.findings[0].kind == "buffer-order"


def test_diff_command_bad_input_exits_2_without_traceback(tmp_path: Path) -> None:
    a = _save(tmp_path, "a.json", _record(0))
    foreign = tmp_path / "foreign.json"
    foreign.write_text('{"hello": 1}')
    result = CliRunner().invoke(app, ["diff", str(a), str(foreign)])
    assert result.exit_code == 2
    assert "not an fsdpcheck fingerprint" in result.output
    assert "Traceback" not in result.output


def test_fingerprint_and_diff_have_help_with_examples() -> None:
    for command in ("fingerprint", "diff"):
        result = CliRunner().invoke(app, [command, "--help"])
        assert result.exit_code == 0, result.output
        assert "Examples" in result.output and "Exit codes" in result.output


def test_the_rank_comes_from_the_launcher_without_a_group(monkeypatch) -> None:
    from fsdpcheck.offline.files import process_identity

    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    identity = process_identity()
    assert (identity.rank, identity.local_rank, identity.world_size) == (3, 1, 4)
    assert process_identity(rank=2).rank == 2
    monkeypatch.setenv("RANK", "three")
    with pytest.raises(InputError, match=r"RANK='three' is not an integer.*--rank N"):
        process_identity()


def test_fingerprint_refuses_an_unwritable_out_before_building(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    out = blocker / "fp" / "rank{rank}.json"
    result = CliRunner().invoke(
        app, ["fingerprint", "--model", "hazard", "--rank", "5", "--out", str(out)]
    )
    assert result.exit_code == 2, result.output
    assert f"rank 5: cannot write the fingerprint to {blocker}/fp/rank5.json" in result.output
    assert "Traceback" not in result.output


def test_diff_needs_no_torch(tmp_path: Path) -> None:
    """Comparing files is pure: the diff command runs on a laptop without touching torch."""
    import subprocess
    import sys

    for rank, order in ((0, ROTARY), (1, SWAPPED)):
        _save(tmp_path, f"rank{rank}.json", _record(rank, order))
    code = (
        "import sys; from fsdpcheck.cli import app\n"
        f"sys.argv = ['fsdpcheck', 'diff', {str(tmp_path)!r}]\n"
        "try: app()\nexcept SystemExit as exc: code = exc.code\n"
        "assert 'torch' not in sys.modules, 'diff imported torch'\n"
        "sys.exit(code)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert "diff imported torch" not in result.stderr  # exit 1 either way
    assert result.returncode == 1, result.stderr
    assert "✗ buffer-order" in result.stdout


def test_diff_junit_and_annotations(tmp_path: Path) -> None:
    import xml.etree.ElementTree as ET

    a = _save(tmp_path, "a.json", _record(0))
    b = _save(tmp_path, "b.json", _record(1, SWAPPED))
    junit = tmp_path / "diff.xml"
    args = ["diff", str(a), str(b), "--junit", str(junit), "--annotations", "github"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, result.output
    assert "::error title=fsdpcheck diff%3A buffer-order::" in result.output
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite.get("name") == "fsdpcheck.diff"
    order = [c for c in suite.iter("testcase") if c.get("name") == "buffer-order"]
    assert order[0].get("classname") == "fsdpcheck.diff.checks"
    assert order[0].find("failure") is not None
    # The clean twin: the same record twice, as ranks 0 and 1.
    twin = CliRunner().invoke(
        app, ["diff", str(a), str(_save(tmp_path, "c.json", _record(1))), "--junit", str(junit)]
    )
    assert twin.exit_code == 0, twin.output
    assert ET.parse(junit).getroot().get("failures") == "0"


def test_diff_unwritable_output_is_bad_input_before_reading(tmp_path: Path) -> None:
    a = _save(tmp_path, "a.json", _record(0))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = CliRunner().invoke(app, ["diff", str(a), str(a), "--junit", f"{blocker}/d.xml"])
    assert result.exit_code == 2
    assert "is a file, not a folder" in result.output and "Traceback" not in result.output


def test_offline_identity_reads_srun_and_mpirun_variables(monkeypatch) -> None:
    from fsdpcheck.offline.files import process_identity

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    identity = process_identity()
    assert (identity.rank, identity.local_rank, identity.world_size) == (3, 1, 4)
    for name in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "8")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "2")
    identity = process_identity()
    assert (identity.rank, identity.local_rank, identity.world_size) == (2, 2, 8)


@pytest.mark.parametrize(
    "damage",
    [
        lambda r: r["env"].__setitem__("rank", "5"),
        lambda r: r["env"].__setitem__("host", None),
        lambda r: r["pre_wrap"]["buffers"][0].__setitem__("shape", None),
        lambda r: r["pre_wrap"]["buffers"][0].__setitem__("shape", "abc"),
        lambda r: r.__setitem__("ties", [None]),
    ],
    ids=["rank-text", "host-null", "shape-null", "shape-text", "ties-null"],
)
def test_a_damaged_record_with_the_marker_is_bad_input(tmp_path: Path, damage) -> None:
    good = _save(tmp_path, "rank0.json", _record(0))
    bad = _save(tmp_path, "rank1.json", _record(1))
    data = json.loads(bad.read_text())
    damage(data["record"])
    bad.write_text(json.dumps(data))
    result = CliRunner().invoke(app, ["diff", str(good), str(bad)])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
