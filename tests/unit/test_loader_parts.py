"""The loader's pure parts: layout checks, shard arithmetic, message planning, method choice."""

from __future__ import annotations

import json

import pytest


def _covers(plan, numels) -> None:
    """Every element of every shard is in exactly one piece, pieces never overlap in a bucket."""
    seen: dict[int, list[tuple[int, int]]] = {}
    for message in plan:
        spans = []
        for piece in message.pieces:
            itemsize = numels[piece.index][1]
            assert piece.offset % 16 == 0
            spans.append((piece.offset, piece.offset + (piece.stop - piece.start) * itemsize))
            seen.setdefault(piece.index, []).append((piece.start, piece.stop))
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
        assert message.size == max(end for _, end in spans)
        if message.direct:
            assert len(message.pieces) == 1 and message.pieces[0].offset == 0
    for index, (numel, _) in enumerate(numels):
        ranges = sorted(seen.get(index, []))
        assert sum(b - a for a, b in ranges) == numel
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))


def test_source_problems_are_named() -> None:
    import torch

    from fsdpcheck.loader.agree import source_problems

    state = (("a", (4,), "float32"), ("b", (2, 2), "float32"))
    assert source_problems(0, state, {"a": torch.zeros(4), "b": torch.zeros(2, 2)}) == []
    problems = source_problems(0, state, {"a": torch.zeros(5), "c": torch.zeros(1)})
    assert problems == [
        "rank 0's full state dict lacks b",
        "rank 0's full state dict has keys the model lacks: c",
        "rank 0's full state dict has a with shape [5], the model [4]",
    ]
    assert "no full state dict" in source_problems(0, state, None)[0]


@pytest.mark.parametrize(
    ("rows", "world", "sizes"),
    [(255, 2, [128, 127]), (1, 2, [1, 0]), (5, 4, [2, 2, 1, 0]), (8, 4, [2, 2, 2, 2])],
)
def test_shard_of_follows_torch_chunk(rows: int, world: int, sizes: list[int]) -> None:
    import torch
    from torch.distributed.tensor import Shard

    from fsdpcheck.loader.shards import shard_of

    full = torch.arange(rows * 3).reshape(rows, 3)
    shards = [shard_of(full, [Shard(0)], [world], [r]) for r in range(world)]
    assert [s.shape[0] for s in shards] == sizes
    assert all(s.shape[1] == 3 for s in shards)
    assert torch.equal(torch.cat(shards), full)


def test_shard_of_second_dim_and_replicate() -> None:
    import torch
    from torch.distributed.tensor import Replicate, Shard

    from fsdpcheck.loader.shards import shard_of

    full = torch.arange(12).reshape(3, 4)
    assert torch.equal(shard_of(full, [Shard(1)], [2], [1]), full[:, 2:])
    assert torch.equal(shard_of(full, [Replicate(), Shard(0)], [2, 2], [1, 0]), full[:2])


def test_verify_result_round_trips() -> None:
    from fsdpcheck.loader.verify import VerifyResult
    from fsdpcheck.records import from_dict, to_dict

    result = VerifyResult(
        ran=True,
        passed=False,
        checked=13,
        mismatches=({"name": "w", "kind": "param", "ranks": [1, 3], "reason": "differs"},),
    )
    data = json.loads(json.dumps(to_dict(result)))
    assert from_dict(VerifyResult, data) == result


def test_mismatch_message_lists_every_difference_and_groups_ranks() -> None:
    from fsdpcheck.loader.agree import Exchange as _Exchange
    from fsdpcheck.loader.agree import layout_differences

    def exchange(rank: int, *buffers: tuple) -> _Exchange:
        return _Exchange(rank, tuple(buffers), (), ())

    ref = ("a", (8,), "float32"), ("b", (4,), "float32")
    by_rank = {
        0: exchange(0, *ref),
        1: exchange(1, *ref),
        2: exchange(2, ("a", (16,), "float32"), ref[1]),
        3: exchange(3, ("a", (16,), "float32"), ref[1]),
        4: exchange(4, ref[0], ("b", (4,), "bfloat16"), ("c", (2,), "int64")),
        5: exchange(5, ref[0]),
    }
    lines = layout_differences(by_rank, 0, "buffers", "buffer")
    assert lines == [
        "ranks 2,3: buffer 'a' is shape [16], float32; on rank 0 shape [8], float32",
        "rank 4: buffer 'b' is shape [4], bfloat16; on rank 0 shape [4], float32",
        "rank 4: has buffer 'c' (shape [2], int64) that rank 0 does not",
        "rank 5: lacks buffer 'b' that rank 0 has",
    ]


@pytest.mark.parametrize("bucket", [1024, 4096, 2**20, 256 * 2**20])
def test_plan_covers_every_element_once_within_the_bucket_size(bucket: int) -> None:
    from fsdpcheck.loader.transfer import plan_messages as _plan

    numels = [(3, 4), (0, 4), (5000, 4), (1, 2), (700, 2), (300_000, 4), (7, 8), (2**19, 4)]
    plan = _plan(numels, bucket)
    _covers(plan, numels)
    assert all(m.size <= bucket for m in plan)
    assert _plan(numels, bucket) == plan  # pure: both ends derive the same messages


def test_plan_sends_large_shards_alone_and_packs_small_ones() -> None:
    from fsdpcheck.loader.transfer import plan_messages as _plan

    numels = [(10, 4), (2**20, 4), (20, 4)]
    plan = _plan(numels, 256 * 2**20)
    assert [(m.direct, [p.index for p in m.pieces]) for m in plan] == [
        (True, [1]),
        (False, [0, 2]),
    ]


@pytest.mark.parametrize(
    ("shape", "placements", "mesh_shape"),
    [
        ((255, 3), ("S0",), (2,)),
        ((1, 4), ("S0",), (2,)),
        ((5, 2), ("S0",), (4,)),
        ((0, 2), ("S0",), (2,)),
        ((6, 4), ("S1",), (2,)),
        ((7, 3), ("R", "S0"), (2, 2)),
        ((9, 5), ("S0", "S0"), (2, 3)),
        ((4, 6), ("S1", "S0"), (3, 2)),
        ((3,), ("R",), (2,)),
    ],
)
def test_local_shape_is_the_shape_shard_of_cuts(shape, placements, mesh_shape) -> None:
    import itertools

    import torch
    from torch.distributed.tensor import Replicate, Shard

    from fsdpcheck.loader.shards import local_shape as _local_shape
    from fsdpcheck.loader.shards import shard_of

    parsed = [Replicate() if p == "R" else Shard(int(p[1])) for p in placements]
    full = torch.empty(shape)
    for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
        expected = tuple(shard_of(full, parsed, mesh_shape, coordinate).shape)
        assert _local_shape(shape, parsed, mesh_shape, coordinate) == expected


def test_choose_is_one_decision_from_everyones_entries() -> None:
    from fsdpcheck.loader.transfer import choose_method as _choose

    ranks = [0, 1, 2, 3]
    same = [("d", None)] * 4
    assert _choose("bucketed", same, ranks) == ("bucketed", None)
    assert _choose("dcp", same, ranks) == ("dcp", None)
    method, reason = _choose("bucketed", [("d", None), None, ("d", None), None], ranks)
    assert (method, reason) == ("dcp", "ranks 1,3 asked for method='dcp'")
    method, reason = _choose(
        "bucketed", [("d", None), ("d", "x is odd"), ("d", "y"), same[0]], ranks
    )
    assert method == "dcp"
    assert reason == "not covered by the bucketed path: rank 1: x is odd; and 1 more ranks"
    method, reason = _choose("bucketed", [("d", None), ("e", None), ("e", None), same[0]], ranks)
    assert method == "dcp" and reason.startswith("ranks 1,2 shard, tie or bucket")


def test_bad_method_and_bucket_size_are_input_errors() -> None:
    from torch import nn

    from fsdpcheck.errors import InputError
    from fsdpcheck.loader.load import load_full_state_dict

    with pytest.raises(InputError, match="method='fast'"):
        load_full_state_dict(nn.Linear(2, 2), {}, method="fast")
    with pytest.raises(InputError, match="bucket_bytes=10 is below"):
        load_full_state_dict(nn.Linear(2, 2), {}, bucket_bytes=10)


@pytest.mark.parametrize("rows", [8, 10, 7, 3])
def test_shard_of_cuts_fsdp2_over_tp_as_dtensor_lays_it_out(rows: int) -> None:
    """FSDP2 over a TP DTensor: (_StridedShard(0, split_factor=tp), Shard(0)) on (dp, tp), TP's
    cut first; torch's own offset arithmetic is the reference."""
    import itertools

    import torch
    from torch.distributed.tensor import Shard

    placement_types = pytest.importorskip("torch.distributed.tensor.placement_types")
    utils = pytest.importorskip("torch.distributed.tensor._utils")
    reference = getattr(utils, "_compute_local_shape_and_global_offset", None)
    if reference is None or not hasattr(placement_types, "_StridedShard"):
        pytest.skip("this torch has no _StridedShard")
    from fsdpcheck.loader.shards import local_shape, shard_of

    placements = [placement_types._StridedShard(0, split_factor=2), Shard(0)]
    full = torch.arange(rows * 3).reshape(rows, 3)
    for coordinate in itertools.product(range(2), range(2)):
        (length, _), (offset, _) = reference((rows, 3), (2, 2), list(coordinate), placements)
        cut = shard_of(full, placements, (2, 2), coordinate)
        assert torch.equal(cut, full[offset : offset + length]), coordinate
        assert local_shape((rows, 3), placements, (2, 2), coordinate) == tuple(cut.shape)


def test_prefault_makes_fresh_receive_buffers_resident_and_changes_no_byte() -> None:
    """What the bucketed receive does to shards ``to_empty()`` just allocated, on a thread of
    its own while the receives run: every page resident (RSS grows by the buffers) and no
    byte changed, so it may overlap what gloo writes (MADV_POPULATE_WRITE, Linux >= 5.14)."""
    import torch

    from fsdpcheck.loader.transfer import Prefault
    from fsdpcheck.model.memory import rss

    before = rss()
    # above glibc's largest mmap threshold (32 MiB): fresh pages, whatever the process freed
    fresh = [torch.empty(64 * 2**20, dtype=torch.uint8) for _ in range(3)]
    prefault = Prefault(fresh)
    prefault.start()
    prefault.join()
    assert rss() - before >= 190 * 2**20
    seen = torch.arange(3 * 4096 + 7, dtype=torch.bfloat16)
    kept = seen.clone()
    tiny = torch.full((100,), 5, dtype=torch.uint8)
    prefault = Prefault([seen[5:], tiny])  # unaligned starts and ends: whole pages around them
    prefault.start()
    prefault.join()
    assert torch.equal(seen, kept) and (tiny == 5).all()


@pytest.mark.parametrize("threads", [1, 2])
def test_first_touch_writes_one_byte_per_page_and_leaves_the_rest(threads: int) -> None:
    """Where the pages cannot be populated without a write: one zero per page, before any
    receive is posted; tensors smaller than a page are left alone."""
    import mmap

    import torch

    from fsdpcheck.loader.transfer import first_touch

    seen = torch.full((3 * mmap.PAGESIZE + 7,), 7, dtype=torch.bfloat16)
    tiny = torch.full((100,), 5, dtype=torch.uint8)
    first_touch([seen, tiny], threads)
    raw = seen.view(torch.uint8)
    starts = torch.zeros_like(raw, dtype=torch.bool)
    starts[:: mmap.PAGESIZE] = True
    assert (raw[starts] == 0).all() and (raw[~starts] != 0).all()
    assert (tiny == 5).all()


def test_prefault_ahead_populates_every_buffer_on_its_thread_and_changes_no_byte() -> None:
    """``ahead`` (the audit's receiving ranks, while they wait for rank 0): nothing of it runs
    on the caller's thread but a one-page probe, the first buffer included, and no byte
    changes, so the receives need not wait for it."""
    import torch

    from fsdpcheck.loader.transfer import Prefault, _populate
    from fsdpcheck.model.memory import rss

    if not _populate(torch.zeros(1)):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14): the next test")
    before = rss()
    fresh = [torch.empty(64 * 2**20, dtype=torch.uint8) for _ in range(3)]
    seen = torch.arange(3 * 4096 + 7, dtype=torch.bfloat16)
    kept = seen.clone()
    prefault = Prefault([torch.tensor(3.0), *fresh, seen[5:]])  # a 0-d buffer first
    prefault.start(ahead=True)
    assert prefault._thread is not None  # every page, the first buffer's too, on the thread
    prefault.before_receives()
    prefault.join()
    assert rss() - before >= 190 * 2**20
    assert torch.equal(seen, kept)


def test_prefault_stop_ends_the_thread_without_populating_the_rest() -> None:
    """``stop`` (the audit after its load, or where the load was skipped): the thread looks at
    it between pieces of ``_POPULATE_PIECE`` bytes, so a stopped prefault faults in at most a
    piece more and its thread is gone when ``stop`` returns."""
    import torch

    from fsdpcheck.loader.transfer import _POPULATE_PIECE, Prefault, _populate
    from fsdpcheck.model.memory import rss

    if not _populate(torch.zeros(1)):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    fresh = [torch.empty(4 * _POPULATE_PIECE, dtype=torch.uint8) for _ in range(2)]
    before = rss()
    prefault = Prefault(fresh)
    prefault._stopped.set()  # stopped before its thread looked once
    prefault.start(ahead=True)
    prefault.stop()
    assert not prefault._thread.is_alive()
    assert rss() - before < _POPULATE_PIECE  # the one-page probe at most
    running = Prefault(fresh)
    running.start(ahead=True)
    running.stop()
    assert not running._thread.is_alive()


def test_prefault_ahead_without_populate_writes_on_its_thread_and_receives_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A kernel without MADV_POPULATE_WRITE (before Linux 5.14): the thread writes one zero per
    page, so ``before_receives`` waits for it; every page is written once it returns."""
    import mmap
    import threading

    import torch

    from fsdpcheck.loader import transfer

    release = threading.Event()
    touched = transfer.first_touch

    def slow_touch(buffers, threads):  # held until the test has seen the thread still running
        release.wait(10)
        touched(buffers, threads)

    monkeypatch.setattr(transfer, "_populate", lambda buffer: False)
    monkeypatch.setattr(transfer, "first_touch", slow_touch)
    seen = torch.full((3 * mmap.PAGESIZE + 7,), 7, dtype=torch.bfloat16)
    prefault = transfer.Prefault([seen])
    prefault.start(ahead=True)
    assert prefault._thread.is_alive()
    release.set()
    prefault.before_receives()
    assert not prefault._thread.is_alive()
    raw = seen.view(torch.uint8)
    assert (raw[:: mmap.PAGESIZE] == 0).all()


def test_receive_ahead_gives_meta_shards_memory_and_keeps_real_buffers() -> None:
    """A receiving rank's model on meta: every tensor real after it, the real non-persistent
    buffers' values kept (the load does not move them again), each storage faulted in once,
    found without the model's state-dict hooks (which only rank 0's state dict may run); a
    model with nothing on meta is left alone (None)."""
    import torch
    from torch import nn

    from fsdpcheck.loader.load import receive_ahead

    def on_save(*args):  # as a fused wqkv's redistribute: a collective rank 0 would not join
        raise AssertionError("receive_ahead ran the model's state-dict hooks")

    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(4096, 64), nn.Linear(64, 4096, bias=False))
    model[1].weight = model[0].weight  # tied, as an LM head is
    model.register_buffer("inv_freq", torch.arange(8.0), persistent=False)
    model._register_state_dict_hook(on_save)
    prefault = receive_ahead(model)
    assert prefault is not None
    prefault.before_receives()
    prefault.join()
    assert not any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    assert torch.equal(model.inv_freq, torch.arange(8.0))
    # Every state-dict tensor's memory faulted in, each storage once (what the load receives;
    # to_empty() gives tied weights storages of their own, which the load fills by alias).
    faulted = [b.data_ptr() for b in prefault._buffers]
    assert sorted(faulted) == sorted({p.data_ptr() for p in model.parameters()})
    assert receive_ahead(model) is None


def test_flat_pack_and_unpack_round_trip_every_shape() -> None:
    """The buffers' one flat tensor and back: 0-d (Gemma's embed_scale), 1-D (RoPE's
    inv_freq), 2-D, and a transposed (non-contiguous) buffer, each value where it was."""
    import torch

    from fsdpcheck.loader.load import _pack_flat, _unpack_flat

    source = [
        torch.tensor(3.5),
        torch.arange(8, dtype=torch.float32),
        torch.arange(6, dtype=torch.float32).reshape(2, 3) + 100,
        (torch.arange(6, dtype=torch.float32).reshape(2, 3) + 200).t(),
    ]
    flat = _pack_flat(source, torch.device("cpu"))
    assert flat.shape == (1 + 8 + 6 + 6,)
    assert flat.tolist() == [v for t in source for v in t.reshape(-1).tolist()]
    targets = [torch.zeros_like(t) for t in source[:3]] + [torch.zeros(2, 3).t()]
    _unpack_flat(flat, targets)
    for got, want in zip(targets, source, strict=True):
        assert torch.equal(got, want)


def _verify_parts():
    """A plain module (no DTensors: every rank's slice of a parameter is the whole of it) and a
    source for it, keyed as verify pairs them; one parameter converted from float32, one the
    source lacks."""
    import torch
    from torch import nn

    from fsdpcheck.loader.verify import _tensors

    model = nn.Module()
    model.a = nn.Parameter(torch.randn(40, 3))
    model.b = nn.Parameter(torch.randn(7).to(torch.bfloat16))
    model.c = nn.Parameter(torch.randn(5))
    model.register_buffer("scale", torch.arange(4.0))
    source = {"a": model.a.detach().clone(), "b": model.b.detach().float(), "scale": model.scale}
    source["a"][3, 1] += 1.0  # rank 0's own shard differs from the source
    return _tensors(model), source


def test_verify_digests_ahead_of_the_load_are_those_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The other ranks' slices digested on a thread before the load, then rank 0's own shards
    # and the buffers after it: the same expectation as all of it after the load, and the
    # pass after the load cuts no other rank's slice.
    from fsdpcheck.loader import verify

    tensors, source = _verify_parts()
    ranks = [0, 1, 2]
    whole = verify._expect(tensors, source, ranks, 0)
    ahead = verify.ExpectedAhead(tensors, source, ranks, 0)
    assert ahead.made_for(source, ranks)
    assert not ahead.made_for(dict(source), ranks) and not ahead.made_for(source, [0, 1])
    others = ahead.result()
    cut: list[int] = []
    real_cut = verify.expected_shard

    def counted(full, param, rank, cache):
        cut.append(rank)
        return real_cut(full, param, rank, cache)

    monkeypatch.setattr(verify, "expected_shard", counted)
    split = verify._expect(tensors, source, ranks, 0, others=others)
    assert split == whole
    assert set(cut) == {0}  # rank 0's own slices only
    assert {key for key in whole.digests if key[0] == "param"} == {
        ("param", name, rank) for name in ("a", "b") for rank in (1, 2)
    }
    assert whole.problems == {("a", 0): "values differ from the source state dict", ("b", 0): ""}


def test_verify_digests_ahead_stop_between_parameters_and_batches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import threading

    from fsdpcheck.errors import FsdpcheckError
    from fsdpcheck.loader import verify

    tensors, source = _verify_parts()
    # Held in the first parameter's slice, then in the first batch's checksum (every slice its
    # own batch): stop() must end the thread there, with nothing more digested.
    for hold in ("expected_shard", "checksums"):
        monkeypatch.setattr(verify, "_AHEAD_BATCH_BYTES", 1)
        entered, gate = threading.Event(), threading.Event()
        real = getattr(verify, hold)
        calls: list[object] = []

        def held(*args, real=real, calls=calls, entered=entered, gate=gate, **kwargs):
            calls.append(args[0])
            entered.set()
            gate.wait(10)
            return real(*args, **kwargs)

        monkeypatch.setattr(verify, hold, held)
        ahead = verify.ExpectedAhead(tensors, source, [0, 1], 0)
        assert entered.wait(10)
        threading.Timer(0.2, gate.set).start()
        ahead.stop()  # returns once the thread is gone, after the step it was in
        assert len(calls) == 1, hold
        assert not ahead._thread.is_alive()
        assert len(ahead._slices.batches.done) == (1 if hold == "checksums" else 0)
        with pytest.raises(FsdpcheckError, match="stopped"):
            ahead.result()
        monkeypatch.setattr(verify, hold, real)


def test_verify_digests_ahead_that_failed_are_worked_out_after_the_load() -> None:
    # A speed-up only: where the thread failed, verify digests every slice itself, and a
    # source entry that is no tensor is then named as rank 0's error.
    from fsdpcheck.errors import FsdpcheckError
    from fsdpcheck.loader import verify

    tensors, source = _verify_parts()
    broken = {**source, "a": "not a tensor"}
    ahead = verify.ExpectedAhead(tensors, broken, [0, 1], 0)
    with pytest.raises(FsdpcheckError, match="failed: TypeError: rank 0's source entry 'a'"):
        ahead.result()
    assert verify._digested_ahead(ahead, broken, [0, 1]) is None
    with pytest.raises(TypeError, match="is a str, not a tensor"):
        verify._expect(tensors, broken, [0, 1], 0)
    good = verify.ExpectedAhead(tensors, source, [0, 1], 0)
    assert verify._digested_ahead(good, dict(source), [0, 1]) is None  # not this source
    assert not good._thread.is_alive()
