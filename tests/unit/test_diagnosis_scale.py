"""After a failure, one rank diagnoses and the others read its findings: O(world) store calls in
all, not O(world^2), and none of them is taken for dead while it waits. Threads stand in for
ranks on one real store: in-process (HashStore), or a TCPStore with a client per rank."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist

from fsdpcheck.distributed import liveness
from fsdpcheck.distributed.setup import DistContext


class CountingStore:
    """Forwards to a store and counts the calls made through it."""

    def __init__(self, store: dist.Store, counts: list[int], lock: threading.Lock):
        self._store, self._counts, self._lock = store, counts, lock

    def __getattr__(self, name: str):
        method = getattr(self._store, name)

        def call(*args, **kwargs):
            with self._lock:
                self._counts[0] += 1
            return method(*args, **kwargs)

        return call


def test_one_rank_diagnoses_and_every_rank_names_the_dead_one() -> None:
    world, dead = 16, 5
    store = dist.HashStore()

    def ctx(rank: int, through: object) -> DistContext:
        return DistContext(
            rank=rank, local_rank=rank, world_size=world, backend="gloo", device_type="cpu",
            timeout=30.0, side_channel=None, owns_default_group=False, store=through,
        )  # fmt: skip

    for r in range(world):
        liveness.mark_stage(ctx(r, store), "build" if r == dead else "gather")
    watches = [liveness.AbortWatch(ctx(r, store)) for r in range(world) if r != dead]
    for watch in watches:
        watch.__enter__()
    counts, lock, found = [0], threading.Lock(), {}

    def give_up(rank: int) -> None:
        errors = liveness.diagnose_peers(
            ctx(rank, CountingStore(store, counts, lock)), TimeoutError("gather"), own=None
        )
        found[rank] = [(e.rank, str(e.stage)) for e in errors]

    try:
        threads = [threading.Thread(target=give_up, args=(r,)) for r in range(world) if r != dead]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        for watch in watches:
            watch.__exit__(None, None, None)
    assert len(found) == world - 1
    assert all(errors == [(dead, "build")] for errors in found.values()), found
    # One diagnosing rank: a few calls per key; every other rank: add, wait, get.
    assert counts[0] <= 8 * world, counts[0]


def test_a_rank_waiting_for_the_diagnosis_beats_on_and_is_not_named() -> None:
    # Ranks 0 and 1 give up together on a dead rank 2, each with its own client of one real
    # TCPStore, as processes have. Rank 1 waits in the store for rank 0's findings while rank 0
    # watches the heartbeats for three intervals: rank 1's beats must go on through that wait
    # (a TCPStore client serves one call at a time, so beats through the waiting client stop).
    world, dead = 3, 2
    server = dist.TCPStore(
        "127.0.0.1", 0, world, True, timedelta(seconds=30), wait_for_workers=False
    )

    def ctx(rank: int) -> DistContext:
        client = dist.TCPStore("127.0.0.1", server.port, world, False, timedelta(seconds=30))
        return DistContext(
            rank=rank, local_rank=rank, world_size=world, backend="gloo", device_type="cpu",
            timeout=30.0, side_channel=None, owns_default_group=False,
            store=dist.PrefixStore("run", client),
        )  # fmt: skip

    contexts = [ctx(r) for r in range(world)]
    for r, context in enumerate(contexts):
        liveness.mark_stage(context, "build" if r == dead else "gather")
    watches = [liveness.AbortWatch(contexts[r]).__enter__() for r in range(world) if r != dead]
    found: dict[int, list[tuple[int, str]]] = {}

    def give_up(rank: int) -> None:
        errors = liveness.diagnose_peers(contexts[rank], TimeoutError("gather"), own=None)
        found[rank] = [(e.rank, str(e.stage)) for e in errors]

    try:
        first = threading.Thread(target=give_up, args=(0,))
        first.start()
        time.sleep(0.3)  # rank 0 diagnoses; rank 1 waits for what it publishes
        give_up(1)
        first.join(timeout=60)
    finally:
        for watch in watches:
            watch.__exit__(None, None, None)
    assert found == {0: [(dead, "build")], 1: [(dead, "build")]}, found


def test_the_heartbeat_s_own_client_and_its_fallbacks() -> None:
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=30), wait_for_workers=False)
    shared = dist.PrefixStore("run", server)
    own = liveness.own_client(shared)
    assert own is not shared
    own.add("beats", 1)  # the same server and prefix: the shared client sees it
    assert shared.get("beats") == b"1"

    class Unclonable(dist.Store):  # a store of the script's own: clone() is not implemented
        pass

    class NoClone:  # not a torch Store at all
        pass

    for store in (Unclonable(), NoClone()):
        assert liveness.own_client(store) is store
