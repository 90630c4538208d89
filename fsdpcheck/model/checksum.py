"""A value checksum that runs at memory bandwidth, on the tensor's own device, in parallel.

``verify_load`` compares every rank's shards with rank 0's source slices; rank 0 reads the whole
source once, so the checksum must cost about what reading the bytes costs. A cryptographic hash
(blake2b) runs at ~0.8 GB/s on one core and needs the bytes on the host; this checksum is two
position-weighted sums of the tensor's bytes read as 64-bit words, in wrapping int64 arithmetic
(mod 2^64): ~6 GB/s per core in torch, on CPU or CUDA alike, and split across threads.

Why it catches what verify must catch:
- Any single changed element, always. An element of 1, 2, 4 or 8 bytes lies inside one 64-bit
  word (its offset is a multiple of its size). Changing it changes that word by some d,
  0 < |d| < 2^64, so the first sum changes by w * d mod 2^64, where w is the word's weight: the
  product of an odd table weight and an odd per-chunk multiplier, hence odd, hence invertible
  mod 2^64; w * d = 0 mod 2^64 would need d = 0.
- Several changed elements (moved rows, a shifted shard, another tensor's bytes): every word
  position has its own pseudo-random odd weight, so a difference vector goes unseen only if
  its weighted sum vanishes mod 2^64: about 2^-64 for unstructured differences. Mod 2^64 is
  weak where differences sit only in the words' top bits (d = 2^63 in two words cancels:
  w_i + w_j is even), so the second sum weighs the words shifted down by 32 bits
  (``x >> 32``), with its own weights: a difference confined to high bits shows up there with
  32 fewer trailing zeros. Both must vanish for a miss; for any two-word difference that is
  below about 2^-32. Verify does not face an adversary crafting collisions (the bytes come from
  the user's own checkpoint and loader), only bugs, and bugs do not aim at weight tables.
- Integer sums are exact, so the result does not depend on the order of the reduction, the
  number of threads, the device or the memory alignment of the tensor: rank 0 digesting a slice
  of its CPU source and another rank digesting its CUDA shard get the same number for the same
  bytes.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from fsdpcheck.dist.environment import worker_threads

_CHUNK = 2**17  # words (1 MiB) per weight table: one chunk's product stays in the CPU's cache
_BLOCK_CHUNKS = 16  # chunks per torch call on CPU (16 MiB of words)
_GPU_BLOCK_CHUNKS = 256  # on CUDA: fewer, larger kernels
_MASK64 = (1 << 64) - 1
# Per-chunk multipliers (A * chunk + B) | 1, different for the two sums: odd, position-dependent.
_CHUNK_MUL = ((0x9E3779B97F4A7C15, 0x632BE59BD9B4E019), (0xD6E8FEB86659FD93, 0x2545F4914F6CDD1D))
_SEEDS = (0x5F3759DF, 0x1B873593)

_tables: dict[tuple[int, str], torch.Tensor] = {}
_tables_lock = threading.Lock()
_scratch = threading.local()


def _as_signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _weights(which: int, device: torch.device) -> torch.Tensor:
    """One table of ``_CHUNK`` odd pseudo-random int64 weights (fixed: every rank the same)."""
    key = (which, str(device))
    with _tables_lock:
        table = _tables.get(key)
        if table is None:
            gen = torch.Generator().manual_seed(_SEEDS[which])
            low = torch.randint(0, 2**31, (_CHUNK,), dtype=torch.int64, generator=gen)
            high = torch.randint(0, 2**31, (_CHUNK,), dtype=torch.int64, generator=gen)
            table = ((high << 33) ^ (low << 1) | 1).to(device)
            _tables[key] = table
    return table


def _chunk_multipliers(which: int, first: int, count: int, device: torch.device) -> torch.Tensor:
    a, b = (_as_signed(x) for x in _CHUNK_MUL[which])
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


def _span(raw: torch.Tensor, first_chunk: int, last_chunk: int) -> tuple[int, int]:
    """The two sums over chunks ``first_chunk:last_chunk`` of ``raw`` (8 * _CHUNK bytes each)."""
    device = raw.device
    cuda = device.type == "cuda"
    step = _GPU_BLOCK_CHUNKS if cuda else _BLOCK_CHUNKS
    tables = [_weights(k, device) for k in (0, 1)]
    totals = [torch.zeros((), dtype=torch.int64, device=device) for _ in (0, 1)]
    chunk_bytes = 8 * _CHUNK
    for start in range(first_chunk, last_chunk, step):
        stop = min(start + step, last_chunk)
        words = _words(raw[start * chunk_bytes : stop * chunk_bytes])
        full, tail = divmod(words.numel(), _CHUNK)
        rows = full + (1 if tail else 0)
        out = _product_buffer(rows * _CHUNK, device)
        for k in (0, 1):
            sums = torch.empty(rows, dtype=torch.int64, device=device)
            if full:
                product = out[: full * _CHUNK].view(full, _CHUNK)
                _weigh(words[: full * _CHUNK].view(full, _CHUNK), tables[k], product, k)
                torch.sum(product, dim=1, out=sums[:full])
            if tail:
                part = out[:tail]
                _weigh(words[full * _CHUNK :], tables[k][:tail], part, k)
                sums[full] = part.sum()
            totals[k] += (sums * _chunk_multipliers(k, start, rows, device)).sum()
    return int(totals[0].item()) & _MASK64, int(totals[1].item()) & _MASK64


def _weigh(words: torch.Tensor, table: torch.Tensor, out: torch.Tensor, which: int) -> None:
    """``out`` = the words (sum 0) or the words shifted down by 32 bits (sum 1), times weights."""
    if which == 0:
        torch.mul(words, table, out=out)
    else:
        torch.bitwise_right_shift(words, 32, out=out)
        out.mul_(table)


def _product_buffer(numel: int, device: torch.device) -> torch.Tensor:
    """Per-thread scratch for the products: allocated once, not once per block."""
    if device.type != "cpu":
        return torch.empty(numel, dtype=torch.int64, device=device)
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < numel:
        buf = _scratch.buf = torch.empty(max(numel, _BLOCK_CHUNKS * _CHUNK), dtype=torch.int64)
    return buf[:numel]


def _format(sums: tuple[int, int], nbytes: int) -> str:
    return f"{sums[0]:016x}{sums[1]:016x}{nbytes:x}"


def checksum(tensor: torch.Tensor) -> str | None:
    """The checksum of ``tensor``'s values (its bytes in row-major order); None on meta."""
    return checksums([tensor])[0]


def checksums(tensors: Sequence[torch.Tensor], *, threads: int | None = None) -> list[str | None]:
    """Checksums of many tensors: CPU work split into spans of chunks across ``threads``
    (default :func:`worker_threads`; torch releases the GIL inside its kernels), CUDA tensors
    digested on their device."""
    raws: list[torch.Tensor | None] = []
    for t in tensors:
        raws.append(None if t.device.type == "meta" else _bytes_of(t))
    chunk_bytes = 8 * _CHUNK
    jobs: list[tuple[int, int, int]] = []  # (tensor index, first chunk, last chunk)
    per_job = _BLOCK_CHUNKS * 4
    for i, raw in enumerate(raws):
        if raw is None:
            continue
        chunks = max(1, -(-raw.numel() // chunk_bytes))
        step = chunks if raw.device.type != "cpu" else per_job
        jobs.extend((i, c, min(c + step, chunks)) for c in range(0, chunks, step))
    workers = threads if threads is not None else worker_threads()
    totals = [[0, 0] for _ in raws]

    def run(job: tuple[int, int, int]) -> tuple[int, tuple[int, int]]:
        i, first, last = job
        return i, _span(raws[i], first, last)

    if workers > 1 and len(jobs) > 1:
        with ThreadPoolExecutor(workers, thread_name_prefix="fsdpcheck-checksum") as pool:
            results = list(pool.map(run, jobs))
    else:
        results = [run(job) for job in jobs]
    for i, (a, b) in results:
        totals[i][0] = (totals[i][0] + a) & _MASK64
        totals[i][1] = (totals[i][1] + b) & _MASK64
    return [
        None if raw is None else _format((totals[i][0], totals[i][1]), raw.numel())
        for i, raw in enumerate(raws)
    ]
