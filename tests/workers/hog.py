"""A bounded load generator, as a busy CI runner or another engineer's test run is: ``--cpus``
processes spinning on the CPU, and one that allocates ``--mib`` MiB, touches every page, frees
it and starts again, all for at most ``--seconds``. Run by tests that must hold on a loaded
machine (tests/ranks/test_memory.py); they end it with its process group.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time


def _spin(deadline: float) -> None:
    x = 0
    while time.monotonic() < deadline:
        for i in range(10_000):
            x ^= i


def _churn(deadline: float, mib: int) -> None:
    page = os.sysconf("SC_PAGE_SIZE")
    while time.monotonic() < deadline:
        block = bytearray(mib * 2**20)
        for i in range(0, len(block), page):  # every page made resident, as a real job does
            block[i] = 1
        del block


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpus", type=int, default=2)
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--seconds", type=float, default=300.0)
    args = parser.parse_args()
    deadline = time.monotonic() + args.seconds
    workers = [multiprocessing.Process(target=_spin, args=(deadline,)) for _ in range(args.cpus)]
    workers.append(multiprocessing.Process(target=_churn, args=(deadline, args.mib)))
    for w in workers:
        w.start()
    print("hog running", flush=True)
    for w in workers:
        w.join()


if __name__ == "__main__":
    main()
