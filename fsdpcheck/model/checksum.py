"""A value checksum that runs at memory bandwidth, on the tensor's own device, in parallel.

``verify_load`` compares every rank's shards with rank 0's source slices, so the checksum must
cost about what reading the bytes costs. A cryptographic hash (blake2b) runs at ~0.8 GB/s on one
core and needs the bytes on the host. This checksum reads the tensor's bytes as 64-bit words laid
out in a grid of ``_COLS`` columns (row-major, the last row short), and sums them in wrapping
int64 arithmetic (mod 2^64), with no multiplication over the bulk of the data: each block of
rows (1 MiB, so its second read comes from cache) gives its row sums and adds to the column
sums, and only those sums are weighted. Sum 1 is over the words, sum 2 over the words shifted
down by 32 bits. ~7 GB/s per core in torch, on CPU or CUDA alike, split across threads.

Why it catches what verify must catch:
- Any single changed element, always. An element of 1, 2, 4 or 8 bytes lies inside one 64-bit
  word (its offset is a multiple of its size). Changing it changes word (i, j) by some d,
  0 < |d| < 2^64, so sum 1 changes by (a_i + b_j) * d mod 2^64, where the row weight a_i is odd
  and the column weight b_j even: the word's weight is odd, hence invertible mod 2^64, and
  (a_i + b_j) * d = 0 mod 2^64 would need d = 0.
- Moved elements (swapped rows or buffers, a shifted shard, another tensor's bytes): word
  (i, j) weighs a_i + m_q * b_j, with pseudo-random odd row weights a_i, even column weights b_j
  and an odd multiplier m_q for each block q of rows, so a move between rows changes the
  weighted row sums and a move within a row the weighted column sums; a difference goes unseen
  only if its weighted sum vanishes mod 2^64, about 2^-64 for differences a bug makes. (Four
  equal changes +d, -d, -d, +d at the corners of a rectangle inside one 1 MiB block cancel;
  a bug that moves bytes does not make that pattern except in contrived data.)
- Differences in the words' top bits only (a sign flipped in two places, a float64 tensor
  negated): mod 2^64, 2^63 times an even weight sum cancels, so sum 2 weighs the words shifted
  down by 32 bits, where those differences are 2^31 each and sum exactly in int64.
- Integer sums are exact, so the result does not depend on the order of the reduction, the
  number of threads, the device or the memory alignment of the tensor: rank 0 digesting a slice
  of its CPU source and another rank digesting its CUDA shard get the same number for the same
  bytes.
Verify does not face an adversary crafting collisions (the bytes come from the user's own
checkpoint and loader), only bugs, and bugs do not aim at weight tables.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from fsdpcheck.dist.environment import worker_threads

_COLS = 8192  # words per grid row (64 KiB)
_BLOCK_ROWS = 16  # rows per block: 1 MiB, read twice (the second time from cache)
_SPAN_BLOCKS = 64  # blocks per job for the thread pool (64 MiB)
_GPU_BLOCK_ROWS = 4096  # on CUDA: 256 MiB per block, few large kernels
_MASK64 = (1 << 64) - 1
# Row weights (A * row + B) | 1 and block multipliers (C * block + D) | 1: odd, one pair per sum.
_ROW_MUL = ((0x9E3779B97F4A7C15, 0x632BE59BD9B4E019), (0xD6E8FEB86659FD93, 0x2545F4914F6CDD1D))
_BLOCK_MUL = ((0xBF58476D1CE4E5B9, 0x94D049BB133111EB), (0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9))
_SEEDS = (0x5F3759DF, 0x1B873593)

_tables: dict[tuple[int, str], torch.Tensor] = {}
_tables_lock = threading.Lock()


def _as_signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _column_weights(which: int, device: torch.device) -> torch.Tensor:
    """``_COLS`` even pseudo-random int64 weights (fixed: every rank the same)."""
    key = (which, str(device))
    with _tables_lock:
        table = _tables.get(key)
        if table is None:
            gen = torch.Generator().manual_seed(_SEEDS[which])
            low = torch.randint(0, 2**31, (_COLS,), dtype=torch.int64, generator=gen)
            high = torch.randint(0, 2**31, (_COLS,), dtype=torch.int64, generator=gen)
            table = ((high << 33) ^ (low << 1)).to(device)
            _tables[key] = table
    return table


def _odd_weights(
    constants: tuple[int, int], first: int, count: int, device: torch.device
) -> torch.Tensor:
    a, b = (_as_signed(x) for x in constants)
    index = torch.arange(first, first + count, dtype=torch.int64, device=device)
    return index * a + b | 1


def _words(raw: torch.Tensor) -> torch.Tensor:
    """``raw`` (uint8, flat) as int64 words; a copy, zero-padded, where it is not aligned."""
    if raw.numel() % 8 == 0 and raw.data_ptr() % 8 == 0:
        return raw.view(torch.int64)
    padded = torch.zeros(-(-raw.numel() // 8) * 8, dtype=torch.uint8, device=raw.device)
    padded[: raw.numel()].copy_(raw)
    return padded.view(torch.int64)


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(torch.uint8)


def _block_rows(device: torch.device) -> int:
    return _GPU_BLOCK_ROWS if device.type == "cuda" else _BLOCK_ROWS


def _span(words: torch.Tensor, first_block: int, last_block: int) -> tuple[int, int]:
    """The two sums over blocks ``first_block:last_block`` of the grid of ``words``."""
    device = words.device
    per_block = _block_rows(device)
    rows = -(-words.numel() // _COLS)  # the last one may be short
    first_row, last_row = first_block * per_block, min(last_block * per_block, rows)
    count = last_row - first_row
    blocks = last_block - first_block
    row_sums = torch.empty(2, count, dtype=torch.int64, device=device)
    column_sums = torch.empty(2, blocks, _COLS, dtype=torch.int64, device=device)
    shifted = torch.empty(min(per_block, count), _COLS, dtype=torch.int64, device=device)
    for q in range(blocks):
        start = first_row + q * per_block
        stop = min(start + per_block, last_row)
        block = words[start * _COLS : stop * _COLS]
        full, tail = divmod(block.numel(), _COLS)
        at = start - first_row
        for k in (0, 1):
            if k == 0:
                grid = block[: full * _COLS].view(full, _COLS)
            else:
                grid = shifted[:full]
                torch.bitwise_right_shift(block[: full * _COLS].view(full, _COLS), 32, out=grid)
            torch.sum(grid, 1, out=row_sums[k, at : at + full])
            torch.sum(grid, 0, out=column_sums[k, q])
            if tail:  # the short last row of the tensor
                rest = block[full * _COLS :]
                rest = rest if k == 0 else torch.bitwise_right_shift(rest, 32)
                row_sums[k, at + full] = rest.sum()
                column_sums[k, q, :tail] += rest
    result = []
    for k in (0, 1):
        weighted_rows = row_sums[k] * _odd_weights(_ROW_MUL[k], first_row, count, device)
        per_block_columns = (column_sums[k] * _column_weights(k, device)).sum(1)
        multipliers = _odd_weights(_BLOCK_MUL[k], first_block, blocks, device)
        total = weighted_rows.sum() + (per_block_columns * multipliers).sum()
        result.append(int(total.item()) & _MASK64)
    return result[0], result[1]


def _format(sums: tuple[int, int], nbytes: int) -> str:
    return f"{sums[0]:016x}{sums[1]:016x}{nbytes:x}"


def checksum(tensor: torch.Tensor) -> str | None:
    """The checksum of ``tensor``'s values (its bytes in row-major order); None on meta."""
    return checksums([tensor])[0]


def checksums(tensors: Sequence[torch.Tensor], *, threads: int | None = None) -> list[str | None]:
    """Checksums of many tensors: CPU work split into spans of blocks across ``threads``
    (default :func:`worker_threads`; torch releases the GIL inside its kernels), CUDA tensors
    digested on their device."""
    words: list[torch.Tensor | None] = []
    sizes: list[int] = []
    for t in tensors:
        raw = None if t.device.type == "meta" else _bytes_of(t)
        words.append(None if raw is None else _words(raw))
        sizes.append(0 if raw is None else raw.numel())
    jobs: list[tuple[int, int, int]] = []  # (tensor index, first block, last block)
    for i, w in enumerate(words):
        if w is None:
            continue
        rows = max(1, -(-w.numel() // _COLS))
        blocks = -(-rows // _block_rows(w.device))
        step = blocks if w.device.type != "cpu" else _SPAN_BLOCKS
        jobs.extend((i, b, min(b + step, blocks)) for b in range(0, blocks, step))
    workers = threads if threads is not None else worker_threads()
    totals = [[0, 0] for _ in words]

    def run(job: tuple[int, int, int]) -> tuple[int, tuple[int, int]]:
        i, first, last = job
        return i, _span(words[i], first, last)

    if workers > 1 and len(jobs) > 1:
        with ThreadPoolExecutor(workers, thread_name_prefix="fsdpcheck-checksum") as pool:
            results = list(pool.map(run, jobs))
    else:
        results = [run(job) for job in jobs]
    for i, (a, b) in results:
        totals[i][0] = (totals[i][0] + a) & _MASK64
        totals[i][1] = (totals[i][1] + b) & _MASK64
    return [
        None if w is None else _format((totals[i][0], totals[i][1]), sizes[i])
        for i, w in enumerate(words)
    ]
