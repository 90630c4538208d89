"""A part's share of the verify checksum, by position (``checksum.share`` / ``combine``), and
``compare_digests`` over records: pure, no processes."""

from __future__ import annotations

import pytest
import torch

from fsdpcheck import compare_digests, state_digests
from fsdpcheck.model.checksum import checksum, combine, share
from fsdpcheck.records import StateDigests, TensorDigest
from fsdpcheck.vocab import ExitCode, SyncDifference, Verdict


def _rows(full: torch.Tensor, parts: int) -> list:
    """Shares of ``torch.chunk`` along dim 0 (FSDP2's cut): one run each."""
    shares, at = [], 0
    row = full[0].numel() if full.dim() > 1 and full.shape[0] else 1
    for chunk in torch.chunk(full, parts, 0):
        shares.append(share(chunk.contiguous(), [at * row], [chunk.numel()]))
        at += chunk.shape[0]
    return shares


def _columns(full: torch.Tensor, parts: int) -> list:
    """Shares of ``torch.chunk`` along dim 1 (tensor parallelism's row-wise cut): a run a row."""
    shares, at = [], 0
    rows, width = full.shape
    for chunk in torch.chunk(full, parts, 1):
        starts = [r * width + at for r in range(rows)]
        shares.append(share(chunk.contiguous(), starts, [chunk.shape[1]] * rows))
        at += chunk.shape[1]
    return shares


CASES = [
    ((7, 5), torch.bfloat16, 2),  # rows of 10 bytes: shards start inside 64-bit words
    ((3, 3), torch.float16, 4),  # a chunk past the last: torch.chunk gives 3
    ((768, 1024), torch.float32, 2),  # 3 MiB: the second shard covers a whole 1 MiB block
    ((300, 1031), torch.int8, 3),  # odd bytes per row, blocks cut mid-row
    ((384, 1024), torch.float32, 3),  # 1.5 MiB: a shard across a block boundary, no whole block
    ((0, 4), torch.float32, 2),  # empty
]


@pytest.mark.parametrize(("shape", "dtype", "parts"), CASES)
def test_shares_of_dim_0_shards_add_up_to_the_whole_checksum(shape, dtype, parts) -> None:
    torch.manual_seed(0)
    full = (torch.randn(shape) * 10).to(dtype)
    nbytes = full.numel() * full.element_size()
    assert combine(_rows(full, parts), nbytes) == checksum(full)


@pytest.mark.parametrize(
    ("shape", "dtype", "parts"),
    [
        ((9, 41), torch.bfloat16, 2),
        ((40, 64), torch.float32, 2),
        ((33, 16), torch.int64, 4),
        # runs cut inside words at every byte of a word, across grid rows and a 1 MiB block
        ((70, 2**15 + 3), torch.int8, 3),
    ],
)
def test_shares_of_dim_1_shards_add_up_to_the_whole_checksum(shape, dtype, parts) -> None:
    torch.manual_seed(1)
    full = (torch.randn(shape) * 10).to(dtype)
    nbytes = full.numel() * full.element_size()
    assert combine(_columns(full, parts), nbytes) == checksum(full)


def test_a_moved_or_changed_shard_changes_the_combined_checksum() -> None:
    torch.manual_seed(2)
    full = torch.randn(10, 6)
    nbytes = full.numel() * full.element_size()
    top, bottom = full[:5].contiguous(), full[5:].contiguous()
    swapped = [share(bottom, [0], [30]), share(top, [30], [30])]  # same bytes, other places
    assert combine(swapped, nbytes) != checksum(full)
    changed = bottom.clone()
    changed[2, 3] += 1
    assert combine([share(top, [0], [30]), share(changed, [30], [30])], nbytes) != checksum(full)


def test_state_digests_of_whole_tensors_needs_no_process_group() -> None:
    model = torch.nn.Linear(3, 2)
    model.register_buffer("running", torch.zeros(2))
    model.register_buffer("inv_freq", torch.ones(2), persistent=False)
    found = state_digests(model)
    assert list(found.tensors) == ["weight", "bias", "running"] and found.sharded == 0
    assert found.tensors["weight"] == TensorDigest((2, 3), "torch.float32", checksum(model.weight))
    assert state_digests(model.state_dict()) == found


def _record(**tensors: tuple) -> StateDigests:
    return StateDigests({n: TensorDigest(*t) for n, t in tensors.items()})


def test_compare_digests_names_each_difference() -> None:
    a = _record(
        same=((2,), "torch.float32", "aa"),
        value=((2,), "torch.float32", "aa"),
        dtype=((2,), "torch.bfloat16", "aa"),
        shape=((2, 2), "torch.float32", "aa"),
        unread=((2,), "torch.float32", None),
        only_a=((1,), "torch.float32", "aa"),
    )
    b = _record(
        same=((2,), "torch.float32", "aa"),
        value=((2,), "torch.float32", "bb"),
        dtype=((2,), "torch.float16", "aa"),
        shape=((4,), "torch.float32", "aa"),
        unread=((2,), "torch.float32", "aa"),
        only_b=((1,), "torch.float32", "aa"),
    )
    result = compare_digests(a, b)
    assert result.verdict == Verdict.INCONSISTENT and result.exit_code == ExitCode.FINDINGS
    assert result.compared == 5
    assert {d.name: d.difference for d in result.differences} == {
        "value": SyncDifference.VALUE,
        "dtype": SyncDifference.DTYPE,
        "shape": SyncDifference.SHAPE,
        "unread": SyncDifference.UNREAD,
        "only_a": SyncDifference.MISSING,
        "only_b": SyncDifference.MISSING,
    }
    clean = compare_digests(b, b)
    assert clean.consistent and clean.exit_code == ExitCode.CONSISTENT and not clean.differences


def test_dim_1_shards_laid_out_in_chunks_add_up(monkeypatch: pytest.MonkeyPatch) -> None:
    # A dim-1 shard is laid out in zeros a bounded number of rows at a time: many chunks here,
    # each starting inside a word (rows of 41 bytes), the words cut between parts unsent.
    from fsdpcheck.model import checksum as module

    monkeypatch.setattr(module, "_SPREAD_BYTES", 1024)
    torch.manual_seed(2)
    full = (torch.randn(300, 41) * 10).to(torch.int8)
    shares = _columns(full, 3)
    assert all(not s.fragments for s in shares)
    assert combine(shares, full.numel()) == checksum(full)


def test_a_comparison_reads_as_a_summary() -> None:
    same = StateDigests({"w": TensorDigest((2, 3), "torch.float32", "a1")})
    other = StateDigests(
        {
            "w": TensorDigest((2, 3), "torch.float32", "b2"),
            "extra": TensorDigest((1,), "torch.float32", "c3"),
        }
    )
    assert str(compare_digests(same, same)) == "consistent: 1 tensor compared, every one agrees"
    text = str(compare_digests(same, other))
    assert text.startswith("inconsistent: 2 differences over 1 tensor compared")
    assert "extra: missing (only in the second digests)" in text
    assert "w: value (values differ (checksum a1 vs b2))" in text
