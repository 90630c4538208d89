"""Scale simulation: fsdpcheck's gather, agreement trees and failure diagnosis with many
lightweight ranks (no model, no transformers), on a real TCPStore and real gloo groups.

Each rank is a thread; a process hosts at most ``--per-proc`` of them (each rank holds a socket
per peer it talks to, and a process has a limited number of file descriptors). Threads get their
own c10d world (torch's ``ThreadLocalWorld``, as torch's multi-threaded test groups use), so
``fsdpcheck.distributed.gather.gather_records`` and ``wire.span`` run unchanged on real gloo
groups.

Bytes are counted at the call site, per rank: a wrapper around every ``torch.distributed``
call the code issues (send, recv, gather, broadcast, all_to_all_single) adds the payload this
rank hands over for delivery to other ranks (a broadcast: the source's tensor once; gloo may
forward it along a tree, which the per-process socket counts of scripts/bench/workers/gather.py
show).

    python scripts/bench/workers/scale.py gather --world 256     # prints one JSON line
    python scripts/bench/workers/scale.py span --world 64      # wire.span: layout check, watch
    python scripts/bench/workers/scale.py tree --world 256     # the watch's store tree
    python scripts/bench/workers/scale.py diagnose --world 256
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("TORCH_GLOO_LAZY_INIT", "1")  # connect a pair only when it talks

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

_sent = threading.local()  # this thread's (rank's) bytes handed to the wire


def _count(n: int) -> None:
    _sent.bytes = getattr(_sent, "bytes", 0) + int(n)
    _sent.calls = getattr(_sent, "calls", 0) + 1


def _install_counters() -> None:
    """Wrap the torch.distributed calls fsdpcheck issues; count what each rank sends."""
    c10d = dist.distributed_c10d
    send, gather, broadcast, a2a = c10d.send, c10d.gather, c10d.broadcast, c10d.all_to_all_single

    def counted_send(tensor, dst=None, group=None, tag=0, group_dst=None):
        _count(tensor.numel() * tensor.element_size())
        return send(tensor, dst, group, tag, group_dst=group_dst)

    def counted_gather(tensor, gather_list=None, dst=None, group=None, **kw):
        if gather_list is None:  # not the destination
            _count(tensor.numel() * tensor.element_size())
        return gather(tensor, gather_list, dst, group, **kw)

    def counted_broadcast(tensor, src=None, group=None, **kw):
        if dist.get_rank(group) == (src if src is not None else 0):
            _count(tensor.numel() * tensor.element_size())
        return broadcast(tensor, src, group, **kw)

    def counted_a2a(
        output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kw
    ):  # noqa: E501
        me = dist.get_rank(group)
        world = dist.get_world_size(group)
        item = input.element_size()
        if input_split_sizes is None:
            splits = [input.numel() // world] * world
        else:
            splits = list(input_split_sizes)
        _count(sum(s for i, s in enumerate(splits) if i != me) * item)
        return a2a(output, input, output_split_sizes, input_split_sizes, group, **kw)

    for module in (dist, c10d):
        module.send = counted_send
        module.gather = counted_gather
        module.broadcast = counted_broadcast
        module.all_to_all_single = counted_a2a


def _thread_worlds() -> None:
    """One c10d world per thread; process-group names are registered per process in C++, so
    that registry is skipped (only eager calls on group objects are used here)."""
    from torch.testing._internal.distributed.multi_threaded_pg import ThreadLocalWorld

    dist.distributed_c10d._world = ThreadLocalWorld()
    dist.distributed_c10d._register_process_group = lambda name, pg: None


def _record(rank: int, world: int, divergent: bool):
    """A rank's record: 64 buffers and 256 parameters, as a mid-size model's fingerprint."""
    from fsdpcheck.distributed.environment import env_record
    from fsdpcheck.records import Fingerprint, RankRecord, TensorRecord

    buffers = tuple(
        TensorRecord(f"model.layers.{i}.rotary.inv_freq", (64,), "float32", "cpu", False)
        for i in range(64)
    )
    if divergent:
        buffers = tuple(reversed(buffers))
    params = tuple(
        TensorRecord(f"model.layers.{i // 8}.p{i % 8}.weight", (4096, 4096), "bfloat16", "cpu")
        for i in range(256)
    )
    fp = Fingerprint("post-wrap", buffers, params, tuple(p.name for p in params))
    return RankRecord(env=env_record(rank, rank, world, "gloo"), pre_wrap=fp, post_wrap=fp)


def _rank_main(what: str, rank: int, world: int, port: int, repeats: int, out: dict) -> None:
    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=300))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300)
    )
    try:
        results = {}
        if what == "gather":
            from fsdpcheck.distributed.gather import gather_records

            variants = {"agree": False, "one-divergent": rank == world - 1}
            for name, divergent in variants.items():
                record = _record(rank, world, divergent)
                gather_records(record, None, rank=rank, world_size=world)  # warm-up: connect
                times, sent = [], []
                for _ in range(repeats):
                    dist.barrier()
                    _sent.bytes, _sent.calls = 0, 0
                    start = time.perf_counter()
                    got = gather_records(record, None, rank=rank, world_size=world)
                    times.append(time.perf_counter() - start)
                    sent.append(_sent.bytes)
                results[name] = {
                    "seconds": times,
                    "sent": max(sent),
                    "groups": len(got.records) if got is not None else None,
                }
        else:  # span: the layout check's round (words and rank 0's inline buffers), the watch's
            from fsdpcheck.distributed.wire import span
            from fsdpcheck.loader.agree import inline_capacity_for

            capacity = inline_capacity_for(world)
            layout = [0, 0, 0, 0, *(1 << 60 for _ in range(6))]
            variants = {  # words, attached bytes
                "layout": (layout, capacity),
                # The same round without rank 0's inline buffers: the bytes that must not grow
                # with the ranks, measured apart from the capacity (which is set per world).
                "layout-words": (layout, 0),
                "watch": ([1, 0, *(1 << 60 for _ in range(6))], 0),
            }
            for name, (words, attached) in variants.items():
                payload = bytes([7]) * attached if rank == 0 else b""
                span(words, None, size=world, attached=attached, attachment=payload)  # connect
                times, sent = [], []
                for _ in range(repeats):
                    dist.barrier()
                    _sent.bytes, _sent.calls = 0, 0
                    start = time.perf_counter()
                    got = span(words, None, size=world, attached=attached, attachment=payload)
                    times.append(time.perf_counter() - start)
                    sent.append(_sent.bytes)
                assert got.same() and got.attachment == bytes([7]) * attached
                results[name] = {"seconds": times, "sent": max(sent), "attached": attached}
        dist.barrier()
        out[rank] = results
    finally:
        dist.destroy_process_group()


def _host(args: argparse.Namespace) -> int:
    """A child process: run ranks ``--first`` .. ``--last`` as threads, print their results."""
    _thread_worlds()
    _install_counters()
    out: dict[int, dict] = {}
    threads = [
        threading.Thread(
            target=_rank_main, args=(args.what, r, args.world, args.port, args.repeats, out)
        )
        for r in range(args.first, args.last)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("@ranks " + json.dumps(out), flush=True)
    return 0 if len(out) == args.last - args.first else 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_collectives(what: str, world: int, repeats: int, per_proc: int) -> dict:
    port = _free_port()
    master = dist.TCPStore(  # noqa: F841  (serves the children until this returns)
        "127.0.0.1", port, world, True, timeout=timedelta(seconds=300), wait_for_workers=False
    )
    children = []
    for first in range(0, world, per_proc):
        last = min(world, first + per_proc)
        argv = [sys.executable, __file__, "--host", what, "--world", str(world)]
        argv += ["--port", str(port), "--first", str(first), "--last", str(last)]
        argv += ["--repeats", str(repeats)]
        children.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    ranks: dict[int, dict] = {}
    errors = []
    for child in children:
        stdout, stderr = child.communicate(timeout=600)
        for line in stdout.decode().splitlines():
            if line.startswith("@ranks "):
                ranks.update({int(k): v for k, v in json.loads(line[7:]).items()})
        if child.returncode:
            errors.append(stderr.decode()[-2000:])
    if len(ranks) != world:
        raise RuntimeError(f"{what} at {world} ranks: {len(ranks)} reported\n" + "\n".join(errors))
    summary = {"what": what, "world": world, "processes": len(children), "variants": {}}
    for variant in ranks[0]:
        sent = [ranks[r][variant]["sent"] for r in range(world)]
        rank0 = ranks[0][variant]["seconds"]
        summary["variants"][variant] = {
            "rank0_seconds_median": statistics.median(rank0),
            "rank0_seconds": rank0,
            "sent_rank0": sent[0],
            "sent_max_other": max(sent[1:]),
            "sent_others_distinct": sorted(set(sent[1:])),
            "sent_total": sum(sent),
            "groups": ranks[0][variant].get("groups"),
            "attached": ranks[0][variant].get("attached"),
        }
    return summary


class CountingStore:
    """A store client that counts the calls made through it."""

    def __init__(self, store: dist.Store, counts: dict, lock: threading.Lock):
        self._store, self._counts, self._lock = store, counts, lock

    def __getattr__(self, name: str):
        method = getattr(self._store, name)

        def call(*args, **kwargs):
            with self._lock:
                self._counts[name] = self._counts.get(name, 0) + 1
            return method(*args, **kwargs)

        return call


def run_tree(world: int, repeats: int) -> dict:
    """The watch's agreement through the store: ``world`` ranks as threads of this process,
    each with its own store client, agreeing on ``repeats`` all_reduces back to back (after a
    warm-up). Counts each rank's store calls and bytes left, and its thread's CPU time."""
    from fsdpcheck.checks.step import CollectiveCall
    from fsdpcheck.step.watch import CollectiveWatch

    port = _free_port()
    timeout = timedelta(seconds=300)
    master = dist.TCPStore("127.0.0.1", port, world, True, timeout=timeout, wait_for_workers=False)
    members = tuple(range(world))
    start_line = threading.Barrier(world)
    out: dict[int, dict] = {}

    def rank_main(rank: int) -> None:
        counts: dict[str, int] = {}  # this rank's own
        client = dist.TCPStore("127.0.0.1", port, world, False, timeout=timeout)
        store = CountingStore(client, counts, threading.Lock())
        watch = CollectiveWatch(None, world, {}, store=store, rank=rank, timeout=300.0)

        def agree(i: int) -> None:
            call = CollectiveCall(i, "all_reduce", "default_pg", members, 1024, "float32")
            watch._agree(call)
            watch.calls.append(call)

        for i in range(2):
            agree(i)
        start_line.wait()
        calls, sent, cpu = sum(counts.values()), watch.channel_bytes, time.thread_time()
        polls = counts.get("check", 0)
        start = time.perf_counter()
        for i in range(2, 2 + repeats):
            agree(i)
        seconds = time.perf_counter() - start
        out[rank] = {
            "seconds": seconds,
            "calls": sum(counts.values()) - calls,
            "polls": counts.get("check", 0) - polls,
            "bytes": watch.channel_bytes - sent,
            "cpu": time.thread_time() - cpu,
        }

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    del master
    per = {r: {k: v / repeats for k, v in o.items()} for r, o in out.items()}
    calls = sorted(p["calls"] for p in per.values())
    fixed = sorted(p["calls"] - p["polls"] for p in per.values())
    return {
        "sets_and_reads_per_rank_max": fixed[-1],
        "sets_and_reads_per_rank_median": statistics.median(fixed),
        "polls_per_rank_median": statistics.median(p["polls"] for p in per.values()),
        "what": "tree",
        "world": world,
        "repeats": repeats,
        "rank0_seconds_per_collective": per[0]["seconds"],
        "slowest_seconds_per_collective": max(p["seconds"] for p in per.values()),
        "store_calls_per_rank_median": statistics.median(calls),
        "store_calls_per_rank_max": calls[-1],
        "store_calls_per_rank_min": calls[0],
        "bytes_per_rank_max": max(p["bytes"] for p in per.values()),
        "cpu_seconds_per_rank_median": statistics.median(p["cpu"] for p in per.values()),
        "store_calls_all": sum(p["calls"] for p in per.values()),
    }


def run_diagnose(world: int, dead: int) -> dict:
    """Every rank but ``dead`` reaches the gather and gives up; all call diagnose_peers at once.
    Rank ``dead`` marked 'build' and never beat. Counts the store calls diagnosis makes."""
    from fsdpcheck.distributed import liveness
    from fsdpcheck.distributed.setup import DistContext

    port = _free_port()
    timeout = timedelta(seconds=120)
    master = dist.TCPStore("127.0.0.1", port, world, True, timeout=timeout, wait_for_workers=False)
    counts: dict[str, int] = {}
    lock = threading.Lock()

    def ctx_for(rank: int, store) -> DistContext:
        return DistContext(
            rank=rank, local_rank=rank, world_size=world, backend="gloo", device_type="cpu",
            timeout=60.0, side_channel=None, owns_default_group=False, store=store,
        )  # fmt: skip

    def client() -> dist.TCPStore:
        return dist.TCPStore("127.0.0.1", port, world, False, timeout=timeout)

    clients = [client() for _ in range(world)]
    beats = [client() for _ in range(world)]
    for r in range(world):
        liveness.mark_stage(ctx_for(r, clients[r]), "build" if r == dead else "gather")
    watches = [liveness.AbortWatch(ctx_for(r, beats[r])) for r in range(world) if r != dead]
    for w in watches:
        w.__enter__()
    time.sleep(liveness.heartbeat_interval(world))  # every live rank has beaten once
    results: dict[int, list] = {}
    seconds: dict[int, float] = {}

    def give_up(rank: int) -> None:
        ctx = ctx_for(rank, CountingStore(clients[rank], counts, lock))
        start = time.perf_counter()
        errors = liveness.diagnose_peers(ctx, TimeoutError("gather timed out"), own=None)
        seconds[rank] = time.perf_counter() - start
        results[rank] = [(e.rank, e.stage) for e in errors]

    threads = [threading.Thread(target=give_up, args=(r,)) for r in range(world) if r != dead]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    for w in watches:
        w.__exit__(None, None, None)
    named = {tuple(map(tuple, v)) for v in results.values()}
    del master
    return {
        "what": "diagnose",
        "world": world,
        "dead_rank": dead,
        "store_calls": sum(counts.values()),
        "store_calls_by_kind": counts,
        "wall_seconds": wall,
        "slowest_rank_seconds": max(seconds.values()),
        "every_rank_names_the_dead_rank": named == {((dead, "build"),)},
        "heartbeat_interval": liveness.heartbeat_interval(world),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("gather", "span", "tree", "diagnose"))
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--per-proc", type=int, default=32)
    parser.add_argument("--host", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--first", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--last", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.host:
        return _host(args)
    if args.what == "diagnose":
        summary = run_diagnose(args.world, dead=args.world // 2)
    elif args.what == "tree":
        summary = run_tree(args.world, args.repeats)
    else:
        summary = run_collectives(args.what, args.world, args.repeats, args.per_proc)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
