"""The deterministic fill (--init rank0/all without a checkpoint) and verify's checksum: pure,
single-process, fast."""

from __future__ import annotations

import threading

import pytest
import torch

from fsdpcheck.model import checksum as checksum_module
from fsdpcheck.model.build import _from_config, _load_config, build
from fsdpcheck.model.checksum import _BLOCK_ROWS, _COLS, checksum, checksums
from fsdpcheck.model.resolve import resolve

_CHUNK = _COLS * _BLOCK_ROWS  # words in a block


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.int64, torch.bool]
)
def test_checksum_catches_every_single_changed_element(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    per_word = 8 // torch.empty(0, dtype=dtype).element_size()
    words = 2 * _CHUNK + 13  # two whole blocks and a short third, whatever the element size
    base = (torch.randn(words * per_word - 3, generator=gen) * 50).to(dtype)
    want = checksum(base)
    edges = [0, 1, 7, _COLS - 1, _COLS, _CHUNK - 1, _CHUNK, 2 * _CHUNK + 12]
    positions = [w * per_word for w in edges if w * per_word < base.numel()]
    positions += [base.numel() - 1]
    positions += torch.randint(0, base.numel(), (12,), generator=gen).tolist()
    for position in positions:
        changed = base.clone()
        raw = changed.view(-1).view(torch.uint8)
        size = base.element_size()
        for bit in (0, 7):  # the lowest bit of the element's first byte, and its top bit
            flipped = raw.clone()
            flipped[position * size + (size - 1 if bit == 7 else 0)] ^= 1 << bit
            got = checksum(flipped.view(dtype))
            assert got[:16] != want[:16], (position, bit)  # sum 1 alone always sees it


def test_checksum_catches_swaps_and_top_bit_pairs() -> None:
    base = torch.arange(1000, dtype=torch.float32)
    swapped = base.clone()
    swapped[[10, 500]] = swapped[[500, 10]]
    assert checksum(swapped) != checksum(base)
    words = torch.zeros(64, dtype=torch.int64)
    pair = words.clone()
    pair[3] = pair[9] = -(2**63)  # a pair of top bits: cancels in a plain odd-weighted sum
    assert checksum(pair) != checksum(words)
    assert checksum(base.reshape(10, 100)) == checksum(base)  # values in row-major order


def test_checksum_catches_sign_flips_and_moves_the_grid_sums_alone_would_miss() -> None:
    gen = torch.Generator().manual_seed(1)
    values = torch.randn(3 * _CHUNK + 7, dtype=torch.float64, generator=gen)
    want = checksum(values)
    assert checksum(-values) != want  # every word differs in its top bit only
    swapped = values.clone()
    swapped[5], swapped[9] = -values[9], -values[5]  # same row: v and -v trade places
    assert checksum(swapped) != want
    column = values.clone()
    column[7] = -column[7]
    column[7 + _COLS] = -column[7 + _COLS]  # same column, two rows: top bits only
    assert checksum(column) != want
    words = values.view(torch.int64)
    corners = words.clone()  # +d -d / -d +d in two blocks: every row and column sum as before
    for (i, j), sign in {(0, 1): 1, (0, 2): -1, (_BLOCK_ROWS, 1): -1, (_BLOCK_ROWS, 2): 1}.items():
        corners[i * _COLS + j] += sign * 12345
    assert checksum(corners.view(torch.float64)) != want  # the blocks' multipliers differ
    rows = values.clone()
    rows[: 2 * _COLS] = torch.cat([values[_COLS : 2 * _COLS], values[:_COLS]])  # rows swapped
    assert checksum(rows) != want


def test_checksum_does_not_depend_on_how_the_work_is_split(monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = [torch.randn(10 * _CHUNK + 3), torch.randn(17).to(torch.bfloat16)]
    whole = checksums(tensors, threads=1)
    monkeypatch.setattr(checksum_module, "_SPAN_BLOCKS", 1)  # one job per 1 MiB block
    assert checksums(tensors, threads=1) == whole
    assert checksums(tensors, threads=3) == whole
    # CUDA reduces many blocks per kernel: the same path, several blocks per step, same sums.
    for blocks in (3, checksum_module._GPU_CHUNK_BLOCKS):
        monkeypatch.setattr(checksum_module, "_chunk_blocks", lambda device, n=blocks: n)
        monkeypatch.setattr(checksum_module, "_SPAN_BLOCKS", 7)
        assert checksums(tensors, threads=2) == whole, blocks


def _tiny_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 4-column grid in blocks of 2 rows (and weight tables made for it), so that a few
    hundred bytes cross every edge."""
    monkeypatch.setattr(checksum_module, "_COLS", 4)
    monkeypatch.setattr(checksum_module, "_BLOCK_ROWS", 2)
    monkeypatch.setattr(checksum_module, "_tables", {})


def _by_definition(raw: torch.Tensor) -> str:
    """The checksum as the module docstring defines it, word by word in Python integers."""
    nbytes = raw.numel()
    padded = torch.zeros(-(-nbytes // 8) * 8, dtype=torch.uint8)
    padded[:nbytes] = raw
    words = padded.view(torch.int64).tolist()
    # Sum 2's words: each read 4 bytes on (bytes 8n + 4 to 8n + 12), zeros past the end.
    data = bytes(padded.tolist()) + bytes(4)
    late = [
        int.from_bytes(data[8 * n + 4 : 8 * n + 12], "little", signed=True)
        for n in range(len(words))
    ]
    cols, block_rows, cpu = checksum_module._COLS, checksum_module._BLOCK_ROWS, torch.device("cpu")
    rows = max(1, -(-len(words) // cols))
    blocks = -(-rows // block_rows)
    sums = []
    for k in (0, 1):
        a = checksum_module._odd_hashes(checksum_module._ROW_SEEDS[k], 0, rows, cpu).tolist()
        m = checksum_module._odd_hashes(checksum_module._BLOCK_SEEDS[k], 0, blocks, cpu).tolist()
        b = checksum_module._column_weights(k, cpu).tolist()
        total = 0
        for index, word in enumerate(late if k else words):
            i, j = divmod(index, cols)
            total += word * (a[i] + m[i // block_rows] * b[j])
        sums.append(total & (2**64 - 1))
    return f"{sums[0]:016x}{sums[1]:016x}{nbytes:x}"


def test_checksum_is_its_definition_however_the_work_is_cut(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A 4-column grid in blocks of 2 rows, so that a few hundred bytes cross every edge: short
    # last rows and blocks, unaligned starts, spans of 1..n blocks, CPU's one block per step
    # and CUDA's many (with its column sums weighted per step). Scratch starts as garbage, so
    # an entry the code forgets to write shows: a new thread scratch for every call (the CPU
    # loop's is kept between calls, and would hold the previous call's right values).
    _tiny_grid(monkeypatch)
    real_empty = torch.empty

    def garbage(*args: object, **kwargs: object) -> torch.Tensor:
        out = real_empty(*args, **kwargs)
        return out.fill_(-0x5A5A5A5A5A5A5A5B) if out.dtype == torch.int64 else out

    monkeypatch.setattr(torch, "empty", garbage)
    gen = torch.Generator().manual_seed(2)
    source = torch.randint(0, 256, (300,), dtype=torch.uint8, generator=gen)
    for nbytes in [*range(0, 80), 127, 128, 129, 191, 255]:
        for offset in (0, 3):
            raw = source[offset : offset + nbytes]
            want = _by_definition(raw)
            for step in (1, 3):
                monkeypatch.setattr(checksum_module, "_chunk_blocks", lambda device, n=step: n)
                for span in (1, 2, 64):
                    monkeypatch.setattr(checksum_module, "_SPAN_BLOCKS", span)
                    monkeypatch.setattr(checksum_module, "_local", threading.local())
                    assert checksums([raw], threads=1)[0] == want, (nbytes, offset, step, span)


def test_many_small_tensors_digested_together_are_each_their_definition(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Tensors of at most one block are laid end to end and summed per tensor: each must still
    # be weighed from its own first word, its last word followed by zeros (not by the next
    # tensor's bytes), however the batches fall and whichever of them are empty or unaligned.
    _tiny_grid(monkeypatch)
    limit = checksum_module._small_limit()
    assert limit == 64
    gen = torch.Generator().manual_seed(5)
    source = torch.randint(0, 256, (400,), dtype=torch.uint8, generator=gen)
    sizes = [0, 64, 1, 8, 0, 13, 63, 65, 200, 7, 64, 0, 40, 16, 3]
    raws, at = [], 0
    for i, size in enumerate(sizes):
        raws.append(source[at + i % 3 : at + i % 3 + size])  # some start off a word's edge
        at += size
    want = [_by_definition(raw) for raw in raws]
    for batch in (1, 24, 64, 1 << 20):  # one tensor per batch, a few, all the small ones
        monkeypatch.setattr(checksum_module, "_SMALL_BATCH_BYTES", batch)
        for threads in (1, 3):
            assert checksums(raws, threads=threads) == want, (batch, threads)
    # Typed tensors as the verify and fingerprint pass them: the bytes decide, not the dtype.
    values = torch.randn(5).to(torch.bfloat16)
    flags = torch.tensor([True, False, True])
    assert checksums([values, flags]) == [
        _by_definition(values.view(torch.uint8)),
        _by_definition(flags.view(torch.uint8)),
    ]
    counted = checksum_module.checksums_and_non_finite(
        [torch.tensor([1.0, float("nan"), float("inf")]), torch.arange(3), values]
    )
    assert [bad for _, bad in counted] == [2, 0, 0]


def test_the_thread_s_kept_scratch_serves_calls_in_and_out_of_inference_mode() -> None:
    # A rollout digests under inference_mode, a trainer outside it, on the same thread.
    values = torch.randn(3 * _CHUNK + 5).to(torch.bfloat16)
    done = {}

    def digest() -> None:  # a thread of its own: its scratch is first made in inference mode
        with torch.inference_mode():
            done["inside"] = checksums([values], threads=1)[0]
        done["outside"] = checksums([values], threads=1)[0]
        with torch.inference_mode():
            done["again"] = checksums([values], threads=1)[0]

    worker = threading.Thread(target=digest)
    worker.start()
    worker.join()
    assert done == dict.fromkeys(("inside", "outside", "again"), checksum(values.clone()))


def test_checksum_of_empty_and_offset_views() -> None:
    values = torch.randn(7).to(torch.bfloat16)
    assert checksum(values[7:]) == checksum(torch.zeros(0, dtype=torch.bfloat16))
    assert checksum(values.narrow(0, 5, 0)) == checksum(values[:0])
    assert checksum(values[1:]) == checksum(values[1:].clone())


def test_checksum_ignores_alignment_threads_and_strides() -> None:
    full = torch.randn(3 * _CHUNK + 5).to(torch.bfloat16)
    part = full[3:]  # starts 6 bytes into an aligned allocation
    assert part.data_ptr() % 8 != 0
    assert checksum(part) == checksum(part.clone())
    one, many = checksums([full, part], threads=1), checksums([full, part], threads=4)
    assert one == many
    matrix = torch.randn(64, 48)
    assert checksum(matrix.t()) == checksum(matrix.t().contiguous())
    lone = torch.randn(4)[::4]  # one element through a stride of 4
    assert checksum(lone) == checksum(lone.clone())
    assert checksum(torch.empty(3, device="meta")) is None
    assert checksum(torch.zeros(0)) != checksum(torch.zeros(1))


@pytest.mark.parametrize("spec", ["hazard", "tiny-gemma3"])
def test_fill_keeps_the_modules_real_buffers_and_is_the_same_on_every_rank(spec: str) -> None:
    resolved = resolve(spec, rank=0)
    rank0 = build(resolved, rank=0, init="rank0", seed=3)
    assert rank0.info.init_values == "deterministic-fill"
    # Buffers: exactly what an ordinary CPU build of the model computes (RoPE, embed_scale).
    config = _load_config(resolved, text_only=False, trust_remote_code=False)
    reference = _from_config(config, False)
    expected = dict(reference.named_buffers())
    got = dict(rank0.model.named_buffers())
    assert got.keys() == expected.keys() and got
    for name, buf in got.items():
        assert buf.dtype == expected[name].dtype and torch.equal(buf, expected[name]), name
    # --init all: every rank fills the same values for the same seed; another seed differs.
    other_rank = build(resolved, rank=1, init="all", seed=3)
    reseeded = build(resolved, rank=0, init="rank0", seed=4)
    for name, tensor in rank0.full_state_dict.items():
        assert torch.equal(tensor, other_rank.full_state_dict[name]), name
    params = dict(rank0.model.named_parameters())
    assert all(not p.is_meta for p in params.values())
    changed = [n for n, p in reseeded.model.named_parameters() if not torch.equal(p, params[n])]
    assert len(changed) == len(params)
    # Tensors get different values (a name-dependent start in the pattern), not one shared fill.
    digests = {checksum(p) for p in params.values() if p.numel() > 64}
    assert len(digests) == len({id(p) for p in params.values() if p.numel() > 64})


def test_every_rank_builds_a_checkpoint_model_in_one_mode(tmp_path) -> None:
    # --init rank0 (the default): rank 0 reads the checkpoint (from_pretrained: eval mode), the
    # others build on meta (from_config: training mode). The module-state check must not see
    # that as a rank whose model trains otherwise (it did: exit 1 on every clean hub audit).
    from transformers import AutoModelForCausalLM

    from fsdpcheck.checks.module_state import module_differences
    from fsdpcheck.model.module_state import module_state
    from fsdpcheck.model.presets import PRESETS

    AutoModelForCausalLM.from_config(PRESETS["tiny-llama"].make_config()).save_pretrained(tmp_path)
    resolved = resolve(str(tmp_path), rank=0)
    rank0 = build(resolved, rank=0, init="rank0")
    assert rank0.info.init_values == "checkpoint"
    others = [build(resolved, rank=1, init="rank0"), build(resolve("tiny-llama", rank=0), rank=0)]
    assert module_differences(module_state(rank0.model), module_state(others[0].model)) == []
    assert {b.model.training for b in (rank0, *others)} == {False}


def test_fill_keeps_tied_weights_tied() -> None:
    resolved = resolve("tiny-gemma3", rank=0)
    model = build(resolved, rank=0, init="rank0").model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert build(resolve("hazard", rank=0), rank=0, init="meta").info.init_values is None


def test_rank0s_in_place_comparison_is_bitwise() -> None:
    from fsdpcheck.loader.verify import _same_bytes

    full = torch.randn(1001).to(torch.bfloat16)
    part = full[3:]  # not 8-byte aligned: narrower words
    assert _same_bytes(part, part.clone())
    flipped = part.clone()
    flipped.view(torch.int16)[500] ^= 1
    assert not _same_bytes(part, flipped)
    nan = torch.tensor([float("nan"), 1.0])
    assert _same_bytes(nan, nan.clone())  # the same bytes, though NaN != NaN
    assert not _same_bytes(torch.tensor([0.0]), torch.tensor([-0.0]))  # equal values, not bytes


def test_shares_cut_anywhere_add_up_to_the_definition(monkeypatch: pytest.MonkeyPatch) -> None:
    # Sum 2 reads each word 4 bytes on, so a part's last word reaches into the next part: each
    # part weighs its own bytes alone and the parts' shares must still add up, at every cut.
    _tiny_grid(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    raw = torch.randint(0, 256, (203,), dtype=torch.uint8, generator=gen)
    want = _by_definition(raw)
    for first in (0, 1, 4, 8, 31, 32, 64, 65, 100):
        for second in (first, first + 3, first + 8, first + 64, 203):
            cuts = [0, first, min(second, 203), 203]
            shares = [
                checksum_module.share(raw[a:b].clone(), [a], [b - a])
                for a, b in zip(cuts, cuts[1:], strict=False)
            ]
            assert checksum_module.combine(shares, 203) == want, cuts


def test_a_region_s_lead_weight_is_the_grid_s_weight() -> None:
    # The weight of one word in Python integers (a region's first word) and the grid's own, in
    # torch int64 arithmetic, must agree bit for bit, or shares stop adding up.
    index = torch.tensor([0, 1, 2, 5, _COLS - 1, _COLS, _CHUNK, 2**40 + 7, 2**50 + 3])
    for k in (0, 1):
        want = checksum_module._place_weights(k, index).tolist()
        got = [checksum_module._as_signed(checksum_module._weight(k, i)) for i in index.tolist()]
        assert got == want, k


def test_sum_2_s_in_place_view_reads_host_memory_only() -> None:
    # The fast path reads sum 2's words through the bytes' address; a tensor on another device
    # (meta stands in: it has no memory) gets them computed, never read from the host.
    words = torch.arange(5, dtype=torch.int64) * 0x0101010101010101
    view = checksum_module._late_view(words)
    assert view.tolist() == checksum_module._late_words(words)[:-1].tolist()
    elsewhere = checksum_module._late_view(torch.empty(5, dtype=torch.int64, device="meta"))
    assert elsewhere.is_meta and elsewhere.shape == (4,)
