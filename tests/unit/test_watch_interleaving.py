"""The watch's waits for a peer read the peer's end mark before its progress, so a peer that
moves on and finishes between two reads is never taken for one that ended without it (issue 37:
false ``step`` findings on the three-stage ring and chain, on a loaded machine).

One real in-process store (HashStore). The peer is played by the store itself: right after the
watch first finds the peer's key missing, the peer leaves it and then its end mark, as a peer
that took the pair and finished its step does between two of the watch's reads."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from fsdpcheck.checks.step import FINISHED, CollectiveCall
from fsdpcheck.records import to_dict
from fsdpcheck.step.watch import CollectiveWatch, StepDiverged, _Owed

GROUP = "ring"
RANKS = (0, 1)


class PeerMovesAfterMiss:
    """A store whose peer, once the watch has found ``key`` missing, leaves ``writes`` (in
    order): the interleaving a descheduled rank sees on a loaded machine."""

    def __init__(self, key: str, writes: list[tuple[str, str]]):
        self._store, self._key, self._writes = dist.HashStore(), key, writes
        self.moved = False

    def check(self, keys: list[str]) -> bool:
        found = self._store.check(keys)
        if not found and self._key in keys and not self.moved:
            self.moved = True
            for key, value in self._writes:
                self._store.set(key, value)
        return found

    def __getattr__(self, name: str):
        return getattr(self._store, name)


def _call(op: str, peer: int) -> CollectiveCall:
    return CollectiveCall(
        seq=0, op=op, group=GROUP, group_ranks=RANKS, numel=4, dtype="float32",
        where="train.py:1", peer=peer,
    )  # fmt: skip


def _watch(store: PeerMovesAfterMiss) -> CollectiveWatch:
    return CollectiveWatch(None, 2, {}, store=store, rank=0, timeout=5.0)


def test_a_send_issued_ahead_whose_peer_takes_it_and_finishes_between_reads_is_confirmed():
    # rank 0 sent to rank 1 ahead of its pair; rank 1 receives it and finishes its step
    send = _call("send", 1)
    theirs = "step/p/0-1/0/r"
    store = PeerMovesAfterMiss(
        theirs, [(theirs, json.dumps(to_dict(_call("recv", 0)))), ("step/end/1", FINISHED)]
    )
    watch = _watch(store)
    owed = _Owed(send, 0, theirs)
    watch._owed.append(owed)
    watch._confirm(owed)
    assert store.moved and not watch.diverged, watch.reason


@pytest.mark.parametrize("progress", ["released", "issued"])
def test_a_peer_batch_that_moves_on_and_finishes_between_reads_is_waited_for(progress):
    # rank 1's batch (number 0) holds the pair of rank 0's receive: released (or issued), then
    # rank 1 finishes its step
    recv = _call("recv", 1)
    key = f"step/{progress}/1"
    store = PeerMovesAfterMiss(key, [(key, "1"), ("step/end/1", FINISHED)])
    watch = _watch(store)
    if progress == "released":
        watch._await_release(recv, 0, peer=1, batch=0)
    else:
        watch._await_issued({1: (0, recv, 0)})
    assert store.moved and not watch.diverged, watch.reason


def test_a_peer_that_finished_without_the_pair_is_still_a_finding():
    # the clean twin's failing side: rank 1 ended its step and never left its receive
    send = _call("send", 1)
    theirs = "step/p/0-1/0/r"
    store = PeerMovesAfterMiss("never", [])
    store.set("step/end/1", FINISHED)
    watch = _watch(store)
    owed = _Owed(send, 0, theirs)
    watch._owed.append(owed)
    with pytest.raises(StepDiverged):
        watch._confirm(owed)
    assert watch.reason.startswith("the pair never comes: rank 1 finished its step")
