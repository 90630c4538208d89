"""The store's host (rank 0 under env:// ranks) stays, after it concluded a failed run, until
the other live ranks took the end of the run: the store ends with its process, and a rank that
finds it gone learns only that, not the diagnosis. Threads stand in for ranks, each with its
own client of one real TCPStore that rank 0 serves."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from fsdpcheck.distributed import liveness
from fsdpcheck.distributed.setup import DistContext
from fsdpcheck.records import RankError
from fsdpcheck.vocab import ErrorKind, Stage


def _context(rank: int, world: int, store: object) -> DistContext:
    return DistContext(
        rank=rank, local_rank=rank, world_size=world, backend="gloo", device_type="cpu",
        timeout=30.0, side_channel=None, owns_default_group=False, store=store,
    )  # fmt: skip


@pytest.fixture
def ranks(monkeypatch: pytest.MonkeyPatch):
    """Three ranks' contexts: rank 0 serves the store, ranks 1 and 2 are its clients."""
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    world = 3
    server = dist.TCPStore(
        "127.0.0.1", 0, world, True, timedelta(seconds=30), wait_for_workers=False
    )

    def client() -> dist.Store:
        return dist.TCPStore("127.0.0.1", server.port, world, False, timedelta(seconds=30))

    stores = [server, client(), client()]
    return [_context(r, world, dist.PrefixStore("run", s)) for r, s in enumerate(stores)]


def _later(seconds: float, work) -> threading.Thread:
    def run() -> None:
        time.sleep(seconds)
        work()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _lingered(ctx: DistContext) -> float:
    start = time.monotonic()
    liveness.linger(ctx)
    return time.monotonic() - start


def test_the_host_waits_for_the_live_rank_and_not_for_the_dead_one(ranks) -> None:
    host, dead, live = ranks
    assert liveness.hosts_store(host) and not liveness.hosts_store(live)
    liveness.mark_stage(dead, "build")
    for ctx in (host, live):
        liveness.mark_stage(ctx, "gather")
    watches = [liveness.AbortWatch(ctx).__enter__() for ctx in (host, live)]  # rank 1: dead
    try:
        errors = liveness.diagnose_peers(host, TimeoutError("gather"), own=None)
        assert [(e.rank, str(e.stage)) for e in errors] == [(1, "build")]
        ended = _later(0.5, lambda: liveness.mark_ended(live))
        waited = _lingered(host)
        ended.join()
    finally:
        for watch in watches:
            watch.__exit__(None, None, None)
    # Until rank 2 took the end of the run (0.5 s, less the moment the thread took to start),
    # and never for rank 1, whose heartbeat stopped.
    assert 0.4 <= waited < liveness.linger_bound(3), waited


def test_the_host_goes_at_its_bound_when_a_live_rank_never_comes(
    ranks, monkeypatch: pytest.MonkeyPatch
) -> None:
    host, _, live = ranks
    monkeypatch.setattr(liveness, "linger_bound", lambda world: 0.5)
    liveness.mark_ended(live)  # rank 1 is not known dead: waited for
    waited = _lingered(host)
    assert 0.5 <= waited < 3, waited


def test_nobody_else_lingers(ranks, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    # Another rank, or a host whose store a launcher's agent serves (torchrun), or a FileStore
    # (no host): none waits for the others, who take nothing from it.
    host, live, _ = ranks
    assert _lingered(live) < 0.5
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert not liveness.hosts_store(host)
    assert _lingered(host) < 0.5
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")
    file_store = _context(0, 3, dist.PrefixStore("run", dist.FileStore(str(tmp_path / "s"), 3)))
    assert not liveness.hosts_store(file_store)


def test_a_library_watch_takes_the_abort_mark_and_disarm_hands_it_over(ranks) -> None:
    host, giver, rank2 = ranks
    watch = liveness.AbortWatch(rank2).__enter__()  # a library call's: it never ends the process
    guarded = watch.guarded(rank2.store)  # what the rank's step watch reads the store through
    try:
        guarded.set("step/end/2", "1")
        assert guarded.check(["step/end/2"])
        error = RankError(1, Stage.GATHER, "rank 1 died during stage 'gather'", ErrorKind.RUNTIME)
        watch.stop_if_over()  # not over yet: nothing raised
        liveness.signal_abort(giver, [error])  # rank 1 gave up (give_up's steps)
        liveness.mark_ended(giver)
        deadline = time.monotonic() + 10
        while not host.store.check(["fsdpcheck/ended/2"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        # Taken: the watch marked rank 2's end, so the host goes without waiting for it.
        assert _lingered(host) < 0.5
        assert watch.disarm() == [error]
        with pytest.raises(ConnectionError, match="a peer gave up on the run"):
            watch.stop_if_over()  # before a collective the ranks that gave up will not join
        # The step stops at its next store call, which never reaches the (live) store.
        with pytest.raises(ConnectionError, match="a peer gave up on the run: rank 1 died"):
            guarded.check(["step/end/2"])
        assert liveness.is_collective_failure(ConnectionError("a peer gave up on the run: x"))
        # And it beats no more: the run is over, and the store's host may go.
        before = liveness.heartbeats(host.store, [2])
        time.sleep(2.5 * liveness.heartbeat_interval(3))
        assert liveness.heartbeats(host.store, [2]) == before
    finally:
        watch.__exit__(None, None, None)


def test_a_watch_disarmed_first_never_takes_the_mark(ranks) -> None:
    host, giver, rank2 = ranks
    watch = liveness.AbortWatch(rank2).__enter__()
    try:
        assert watch.disarm() is None  # this rank concludes by itself: it reads the diagnosis
        error = RankError(1, Stage.GATHER, "rank 1 died", ErrorKind.RUNTIME)
        liveness.signal_abort(giver, [error])
        time.sleep(2.5 * liveness.heartbeat_interval(3))  # two beats read the mark
        assert watch.aborted is None
    finally:
        watch.__exit__(None, None, None)
    assert not host.store.check(["fsdpcheck/ended/2"])


# Rank 0 of two, serving the store: it concluded a failed run (mark_ended), and its process
# ends; rank 1 (a thread on a client of its own) takes the end of the run DELAY s later.
_HOST_EXITS = """
import atexit, sys, threading, time
from datetime import timedelta
import torch.distributed as dist
from fsdpcheck.distributed import liveness
from fsdpcheck.distributed.setup import DistContext

delay = float(sys.argv[1])
server = dist.TCPStore("127.0.0.1", 0, 2, True, timedelta(seconds=30), wait_for_workers=False)
client = dist.TCPStore("127.0.0.1", server.port, 2, False, timedelta(seconds=30))

def ctx(rank, store):
    return DistContext(rank=rank, local_rank=rank, world_size=2, backend="gloo",
                       device_type="cpu", timeout=30.0, owns_default_group=False,
                       store=dist.PrefixStore("run", store))

host, peer = ctx(0, server), ctx(1, client)
# Exit handlers run last registered first: this one after the linger mark_ended registers.
atexit.register(lambda: print(time.monotonic(), flush=True))
liveness.mark_ended(host)
later = threading.Timer(delay, liveness.mark_ended, args=(peer,))
later.daemon = True
later.start()
print(time.monotonic(), flush=True)
"""


@pytest.mark.parametrize("delay", [0.0, 1.5])
def test_the_host_keeps_the_store_up_at_exit_until_the_other_rank_took_the_end(
    delay: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    import subprocess
    import sys

    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    done = subprocess.run(
        [sys.executable, "-c", _HOST_EXITS, str(delay)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    ended, after_linger = map(float, done.stdout.split())
    stayed = after_linger - ended  # the exit handlers before the last one: the linger
    # The exit handler waited for rank 1's mark: until it came, and hardly at all once it had.
    if delay:
        assert delay - 0.1 <= stayed < liveness.linger_bound(2), stayed
    else:
        assert stayed < 1.0, stayed


def test_a_rank_that_took_the_end_of_the_run_is_not_called_dead(ranks) -> None:
    # Its abort watch stops beating once it took the mark (alive, concluding): a rank that
    # diagnoses late, from the heartbeats alone, must not name it dead. A rank that never beat
    # again and said nothing is.
    host, concluded, dead = ranks
    liveness.mark_ended(concluded)
    assert liveness.dead_ranks(host) == {2}
