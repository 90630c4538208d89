"""``--source``: every rank's shards against their slices of the checkpoint on disk, against
one read of the whole checkpoint, side by side in one 2-rank job."""

from __future__ import annotations

from bench.measure import marked, median, require, run_ranks
from bench.result import Line, Row
from bench.settings import Settings, shown, worker
from bench.text import fmt_s

GOAL = 1.2  # source verify / one read of the checkpoint


def row_source(s: Settings) -> Row:
    row = Row(
        "source",
        "source verify",
        "`--source` / `check_model(source=)` on 2 ranks (a stack of bfloat16 linear layers, "
        "one safetensors file, FSDP2-sharded): every rank reads and compares its own slices, "
        "against rank 0 reading the whole checkpoint once, in turns from a warm page cache",
    )
    layers = 12 if s.quick else 48
    argv = [worker("source"), "--layers", str(layers), "--repeats", str(s.repeats)]
    argv += ["--scratch", str(s.scratch)]
    result = run_ranks(argv, 2, timeout=1800)
    require(result, [0, 0], "source verify on 2 ranks")
    record = marked(result, "@bench ")[0]
    row.raw = record
    seconds = {k: median(v) for k, v in record["seconds"].items()}
    verify, read = seconds["source verify"], seconds["read the checkpoint once"]
    gb = record["checkpoint_bytes"] / 1e9
    ratio = verify / max(read, 1e-9)
    row.lines.append(
        Line(
            "source verify / time to read the checkpoint once",
            f"{ratio:.2f}×",
            f"≤ {GOAL}×",
            ratio <= GOAL,
            f"{fmt_s(verify)} on {record['world_size']} ranks for {record['tensors']} tensors "
            f"vs {fmt_s(read)} for one read of {gb:.2f} GB "
            f"({gb / max(read, 1e-9):.1f} GB/s)",
            ratio,
        )
    )
    dcp, dcp_read = seconds["source verify (DCP)"], seconds["read the DCP checkpoint once"]
    dcp_gb = record["dcp_bytes"] / 1e9
    row.lines.append(
        Line(
            "source verify (DCP) / time to read its files once",
            f"{dcp / max(dcp_read, 1e-9):.2f}×",
            "informational",
            None,
            f"{fmt_s(dcp)} on {record['world_size']} ranks (dcp.load of each rank's own chunks "
            f"into DTensors like its own, no_dist) vs {fmt_s(dcp_read)} for one read of its "
            f"{dcp_gb:.2f} GB of .distcp files",
            dcp / max(dcp_read, 1e-9),
        )
    )
    row.notes.append(
        "Each rank reads only its slices (a dim-0 shard is one run of bytes: readinto one "
        "scratch buffer reused from tensor to tensor, so no fresh memory is faulted in; other "
        "cuts through safe_open(...).get_slice) and compares them with its local shards "
        "bitwise, in int64 words; only the verdicts are gathered. The baseline is one plain "
        "read() of the whole file into memory. DCP (informational): DCP's FileSystemReader "
        "deserialises each chunk it reads (torch.load) into fresh memory and copies it into "
        "the DTensor the rank gives it, so a rank's half costs two passes over fresh memory "
        "before the comparison; the DCP path keeps DCP's own reader and planner rather than "
        "parse .distcp files itself. Command: "
        f"{shown(worker('source'))}."
    )
    return row
