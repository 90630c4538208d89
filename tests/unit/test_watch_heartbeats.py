"""The watch names a waited-for peer gone once its heartbeat has stood still long enough, and
never a peer that beats, ended its step, or never beat; where another rank already gave up on
the run, it gives up naming nobody. One real in-process store (HashStore) holds the heartbeat
counters as the ranks' abort watches leave them; the clock is the test's, so each case is exact.
The dead rank in real processes, and its clean twin (a rank late but alive): tests/ranks/
test_run.py."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from fsdpcheck.checks.step import FINISHED
from fsdpcheck.distributed import liveness
from fsdpcheck.step import watch as watch_module
from fsdpcheck.step.watch import ChannelLost, CollectiveWatch

TIMEOUT = 40.0  # a quarter of it: 10 s, the least a heartbeat must stand still
ALIVE = "fsdpcheck/alive/{}"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(watch_module.time, "monotonic", clock)
    return clock


def _waiting(clock: Clock, store) -> tuple[CollectiveWatch, float]:
    """Rank 0's watch of a 2-rank world, and the deadline of a wait that starts now."""
    watch = CollectiveWatch(None, 2, {}, store=store, rank=0, timeout=TIMEOUT)
    return watch, clock.now + TIMEOUT


def _wait_until(clock: Clock, watch: CollectiveWatch, deadline: float, at: float) -> None:
    """The wait's reads, as its loop makes them (each poll asks; the watch reads once a
    second), from the start of the wait to ``at`` seconds into it."""
    start = clock.now
    while clock.now < start + at:
        clock.now += 0.25
        watch._raise_if_gone((1,), deadline, "at all_reduce (train.py:1)")


def test_a_peer_whose_heartbeat_stands_still_is_named_gone_after_ten_seconds(clock):
    store = dist.HashStore()
    store.add(ALIVE.format(1), 7)
    watch, deadline = _waiting(clock, store)
    _wait_until(clock, watch, deadline, 10.75)  # first read at 1 s: still for 9.75 s
    with pytest.raises(ChannelLost) as lost:
        _wait_until(clock, watch, deadline, 1.0)
    assert lost.value.silent == (1,)
    message = str(lost.value.cause)
    assert "rank 1 stopped beating (no heartbeat for 10s)" in message, message
    assert "at all_reduce (train.py:1)" in message
    # A peer's failure, not this rank's own: the audit's --step path names the peer.
    assert liveness.is_collective_failure(lost.value.cause)


def test_a_peer_that_beats_ended_or_never_beat_is_waited_for(clock):
    beating, ended, silent = dist.HashStore(), dist.HashStore(), dist.HashStore()
    beating.add(ALIVE.format(1), 1)
    ended.add(ALIVE.format(1), 3)
    ended.set("step/end/1", FINISHED)  # its step is over: the wait's own reads see why
    for store in (beating, ended, silent):  # silent: no abort watch beats there
        watch, deadline = _waiting(clock, store)
        for _ in range(30):  # 30 s of waiting, the peer beating once a second
            _wait_until(clock, watch, deadline, 1.0)
            if store is beating:
                store.add(ALIVE.format(1), 1)


def test_a_wait_shorter_than_an_interval_reads_no_heartbeat(clock):
    class Counting:
        def __init__(self) -> None:
            self.store, self.calls = dist.HashStore(), 0

        def __getattr__(self, name: str):
            self.calls += 1
            return getattr(self.store, name)

    store = Counting()
    watch, deadline = _waiting(clock, store)
    _wait_until(clock, watch, deadline, 0.75)
    assert store.calls == 0


def test_where_another_rank_gave_up_this_one_gives_up_naming_nobody(clock):
    store = dist.HashStore()
    store.add(ALIVE.format(1), 2)
    watch, deadline = _waiting(clock, store)
    _wait_until(clock, watch, deadline, 5.0)
    store.set("fsdpcheck/abort", "[]")  # rank 1 lost a peer of its own and gave up
    with pytest.raises(ChannelLost) as lost:
        _wait_until(clock, watch, deadline, 7.0)
    assert lost.value.silent == ()
    assert "another rank gave up on the run" in str(lost.value.cause)
