"""One rank of the agreement trees on 5 gloo ranks (more than a root and one child): the
side channel's ``span`` and the watch's store tree, each clean and with the failure it must
name. Writes ``rank<N>.json``: one entry per case.

argv: --out DIR
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.distributed as dist
from hooked import rank, write

from fsdpcheck.distributed.wire import post_span, span
from fsdpcheck.step.watch import ChannelLost, CollectiveWatch, StepDiverged

TIMEOUT = 3.0


class Counted:
    """The run's store, under a prefix of the case's own, counting the sets and reads made
    through it."""

    def __init__(self, store, prefix: str):
        self._store = dist.PrefixStore(prefix, store)
        self.calls = 0

    def __getattr__(self, name: str):
        method = getattr(self._store, name)

        def call(*args, **kwargs):
            self.calls += name != "check"  # polls apart: their number depends on timing
            return method(*args, **kwargs)

        return call


def spans(me: int, world: int) -> dict:
    agreed = span([7, me, -me], None, size=world, root=3, attached=16, attachment=b"from 3")
    return {
        "low": list(agreed.low),
        "high": list(agreed.high),
        "same": [agreed.same(0, 1), agreed.same(1, 2)],
        "attachment": agreed.attachment.rstrip(b"\0").decode(),
        "sent": agreed.sent,
    }


def small_spans(me: int) -> dict:
    """``span`` over groups of 4 and 3 members (a star: every member under the root), the root
    not the group's first member; odd members post their first receives ahead (post_span)."""
    out = {}
    for members in ([0, 1, 2, 3], [1, 4, 2]):
        group = dist.new_group(members, backend="gloo")  # every rank creates it
        if me not in members:
            continue
        # a group ranks its members in global rank order, whatever order they are listed in
        index, size, root = dist.get_rank(group), len(members), len(members) - 2
        posted = post_span(3, group, size=size, root=root) if index % 2 else None
        agreed = span(
            [7, index, -index],
            group,
            size=size,
            root=root,
            attached=16,
            attachment=f"root {root}".encode() if index == root else b"not the root",
            posted=posted,
        )
        out[str(size)] = {
            "low": list(agreed.low),
            "high": list(agreed.high),
            "attachment": agreed.attachment.rstrip(b"\0").decode(),
            "sent": agreed.sent,
            "root": index == root,
        }
    return out


def watched(case: str, me: int, world: int, store) -> dict:
    """A few all_reduces under the watch (``nostore``: over the side channel); the case's
    rank does something else at the third."""
    counted = Counted(store, f"tree/{case}") if case != "nostore-differ" else None
    watch = CollectiveWatch(None, world, {}, store=counted, rank=me, timeout=TIMEOUT)
    odd = me == 3 and case != "agree"
    group = dist.new_group([0, 1, 2], backend="gloo")  # every rank creates it; 3 and 4 skip it
    start, raised, calls = time.monotonic(), "", []
    try:
        with watch:
            for i in range(3):
                if case == "silent" and odd and i == 2:
                    time.sleep(TIMEOUT + 2)  # stuck elsewhere past the others' timeout
                    break
                if case == "ended" and odd and i == 2:
                    break
                size = 5 if odd and i == 2 and case.endswith("differ") else 4
                before = counted.calls if counted else 0
                if case == "unnamed" and i == 2:
                    # One tensor more than the group has members, rank 3's sizes off by one:
                    # the digests differ, and no field the comparison reads says why.
                    sizes = [2 + (odd and j == 0) for j in range(world + 1)]
                    outputs = [torch.empty(2) for _ in range(world + 1)]
                    dist.all_to_all(outputs, [torch.ones(n) for n in sizes])
                    continue
                dist.all_reduce(torch.ones(size))
                calls.append(counted.calls - before if counted else 0)
                if me in (0, 1, 2) and counted is not None:
                    dist.all_reduce(torch.ones(2), group=group)  # 3 and 4 take no part
        watch.finish(raised=False)
    except StepDiverged:
        raised = "diverged"
    except ChannelLost as exc:
        raised = f"lost: silent {list(exc.silent)}"
    return {
        "raised": raised,
        "at": watch.at,
        "state": watch.state,
        "reason": watch.reason,
        "peers": {str(v.rank): v.state for v in watch.peers},
        "calls": calls,
        "bytes": watch.channel_bytes,
        "exchanges": watch.exchanges,
        "seconds": round(time.monotonic() - start, 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    me, world = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()
    record = {"span": spans(me, world), "small": small_spans(me)}
    for case in ("agree", "differ", "ended", "silent", "nostore-differ", "unnamed"):
        record[case] = watched(case, me, world, store)
        dist.barrier()
    write(args.out, record)
    dist.destroy_process_group()
    assert me == rank()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
