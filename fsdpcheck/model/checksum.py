"""A value checksum that runs at memory bandwidth, on the tensor's own device, in parallel.

``verify_load`` compares every rank's shards with rank 0's source slices, so the checksum must
cost about what reading the bytes costs. A cryptographic hash (blake2b) runs at ~0.8 GB/s on one
core and needs the bytes on the host. This checksum reads the tensor's bytes as 64-bit words laid
out in a grid of ``_COLS`` columns (row-major, the last row short) and sums them in wrapping
int64 arithmetic (mod 2^64), with no multiplication over the bulk of the data: each block of
``_BLOCK_ROWS`` rows (1 MiB, so its second read comes from cache) gives its row sums and its
column sums, and only those sums are weighted. Sum 1 is over the words, sum 2 over the words
read 4 bytes on (word n's bytes 4 to 11: its high half as the low half, the next word's low
half as the high half; zeros past the end), which on the CPU is a second view of the same
memory, read in place with no pass of writes. A few GB/s per core in torch (the ``digests``
and ``weight-sync`` rows of ``make bench`` measure it), on CPU or CUDA alike, split across
threads.

Word (i, j) of block q weighs a_i + m_q * b_j: a_i a hashed odd weight per row, b_j a
pseudo-random even weight per column, m_q a hashed odd multiplier per block. What that catches:
- Any single changed element, always. An element of 1, 2, 4 or 8 bytes lies inside one 64-bit
  word, so changing it changes one word by some d, 0 < |d| < 2^64; the word's weight is odd,
  hence invertible mod 2^64, so sum 1 changes.
- Data moved across rows or blocks (a shifted shard, swapped tensors, another tensor's bytes)
  or within a row: the row sums, weighted per row, or the column sums, weighted per column and
  block, change unless the weighted difference vanishes mod 2^64 (about 2^-64 for data a bug
  moves). Blind spots, both inside one 1 MiB block, where the column sums are not weighted
  per row: a permutation of whole rows shows only where the rows' sums differ (rows whose
  words are permutations of each other, such as one-hot rows, swapped there go unseen), and
  four equal changes +d, -d / -d, +d at the corners of a rectangle cancel. Loader bugs move
  tensors, shards and offsets, which do not make these patterns outside contrived data.
- Differences in the words' top bits only (a sign flipped in two places, a float64 tensor
  negated): mod 2^64 those cancel in pairs in sum 1, so sum 2 weighs the words read 4 bytes
  on, where a word's top bit is bit 31: each is 2^31 and they cancel only if their weights do
  mod 2^33 (about 2^-33). A region of words (a span, a shard) ends its last word read 4 bytes
  on with zeros, and its first word's low half, the high half of the word before it, is
  weighed apart (``_lead``), so regions add up like the parts of any cut.
- Integer sums are exact, so the result does not depend on the order of the reduction, the
  number of threads, the device or the memory alignment of the tensor: blocks are the same
  1 MiB everywhere (CUDA only reduces many per kernel), so rank 0 digesting a slice of its CPU
  source and another rank digesting its CUDA shard get the same number for the same bytes.
Non-finite values are counted in the same pass, while each block is in cache: a float sum of the
block's elements is finite unless one of them is NaN or ±Inf (or the sum overflows, which only
costs an exact recount; float16 reads its exponent bits instead), so a clean tensor costs one
more reduction per block, not another read.

Verify does not face an adversary crafting collisions (the bytes come from the user's own
checkpoint and loader), only bugs, and bugs do not aim at weight tables.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from fsdpcheck.model.threads import worker_threads

_COLS = 8192  # words per grid row (64 KiB)
_BLOCK_ROWS = 16  # rows per block: 1 MiB, read twice (the second time from cache)
_SPAN_BLOCKS = 64  # blocks per job for the thread pool (64 MiB)
_GPU_CHUNK_BLOCKS = 256  # blocks per kernel on CUDA (256 MiB): few, large kernels
_MASK64 = (1 << 64) - 1
# Seeds of the hashed row weights and block multipliers, one pair per sum.
_ROW_SEEDS = (0x9E3779B97F4A7C15, 0xD6E8FEB86659FD93)
_BLOCK_SEEDS = (0xBF58476D1CE4E5B9, 0xC2B2AE3D27D4EB4F)
_COLUMN_SEEDS = (0x5F3759DF, 0x1B873593)
# splitmix64's constants (Steele, Lea and Flood 2014), as signed int64.
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB

_tables: dict[tuple[int, str], torch.Tensor] = {}
# _tables' keys past the two sums' column weights (0 and 1): both of them stacked, and the small
# tensors' weight table.
_BOTH_COLUMNS, _SMALL_TABLE = 2, 3
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
            gen = torch.Generator().manual_seed(_COLUMN_SEEDS[which])
            low = torch.randint(0, 2**31, (_COLS,), dtype=torch.int64, generator=gen)
            high = torch.randint(0, 2**31, (_COLS,), dtype=torch.int64, generator=gen)
            table = ((high << 33) ^ (low << 1)).to(device)
            _tables[key] = table
    return table


@functools.lru_cache(maxsize=1024)  # at most 1024 rows each (a span): 8 MiB in all
def _odd_hashes(seed: int, first: int, count: int, device: torch.device) -> torch.Tensor:
    """splitmix64 of ``seed + index * golden`` for ``count`` indices from ``first``, made odd.
    (Arithmetic shifts where splitmix has logical ones: still a fixed mix, the same on every
    device, which is all the weights need.) Kept: a sync or verify weighs the same rows and
    blocks at every step; callers never write into it."""
    return _odd_hashes_at(
        seed, torch.arange(first, first + count, dtype=torch.int64, device=device)
    )


@functools.lru_cache(maxsize=1024)
def _on_host(seeds: tuple[int, int], first: int, count: int) -> tuple[list[int], list[int]]:
    """:func:`_odd_hashes` of both ``seeds`` as Python ints (the CPU loop's ``alpha``)."""
    cpu = torch.device("cpu")
    return _odd_hashes(seeds[0], first, count, cpu).tolist(), _odd_hashes(
        seeds[1], first, count, cpu
    ).tolist()


# (2, rows) each: on CPU a span of at most 1024 rows (8 MiB in all); on a device a span is a
# whole tensor, 16 bytes per 64 KiB row of it (1/4096 of the tensors digested, on the device).
@functools.lru_cache(maxsize=512)
def _row_weights(first: int, count: int, device: torch.device) -> torch.Tensor:
    """Both sums' row weights, (2, ``count``): one multiply for both at the end of a span."""
    return torch.stack([_odd_hashes(_ROW_SEEDS[k], first, count, device) for k in (0, 1)])


def _both_column_weights(device: torch.device) -> torch.Tensor:
    """Both sums' column weights, (2, ``_COLS``)."""
    key = (_BOTH_COLUMNS, str(device))
    table = _tables.get(key)  # a dict read is atomic: at worst two threads stack it alike
    if table is None:
        table = _tables[key] = torch.stack([_column_weights(k, device) for k in (0, 1)])
    return table


_local = threading.local()  # per thread: the CPU loop's scratch, reused from span to span


def _scratch(
    rows: int, blocks: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row sums (2, ``rows``), the gathered column sums (2, ``_COLS``, zeroed), one step's
    column sums (2, ``blocks``, ``_COLS``), sum 2's words of a step where they are computed
    (:func:`_late_words`)): on CPU a thread's own, kept between spans (a digest of many small
    shards makes one span each); on a device, new."""
    shape = (min(blocks * _BLOCK_ROWS, rows), _COLS)
    if device.type != "cpu" or blocks != 1 or rows > _SPAN_BLOCKS * _BLOCK_ROWS:
        return (
            torch.empty(2, rows, dtype=torch.int64, device=device),
            torch.zeros(2, _COLS, dtype=torch.int64, device=device),
            torch.empty(2, blocks, _COLS, dtype=torch.int64, device=device),
            torch.empty(shape, dtype=torch.int64, device=device),
        )
    kept = getattr(_local, "scratch", None)
    if kept is None or kept[3].shape != (_BLOCK_ROWS, _COLS) or kept[0].shape[1] < rows:
        # Normal tensors whatever the caller's mode: ones made under inference_mode could not be
        # written to by a later call outside it (the reverse is allowed).
        with torch.inference_mode(False):
            kept = _local.scratch = (
                torch.empty(2, _SPAN_BLOCKS * _BLOCK_ROWS, dtype=torch.int64),
                torch.empty(2, _COLS, dtype=torch.int64),
                torch.empty(2, 1, _COLS, dtype=torch.int64),
                torch.empty(_BLOCK_ROWS, _COLS, dtype=torch.int64),
            )
    row_sums, gathered, column_sums, late = kept
    return row_sums[:, :rows], gathered.zero_(), column_sums, late[: shape[0]]


def _odd_hashes_at(seed: int, index: torch.Tensor) -> torch.Tensor:
    """:func:`_odd_hashes` at any int64 ``index`` tensor."""
    x = index * _as_signed(_GOLDEN) + _as_signed(seed)
    x = (x ^ (x >> 30)) * _as_signed(_MIX1)
    x = (x ^ (x >> 27)) * _as_signed(_MIX2)
    return (x ^ (x >> 31)) | 1


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().reshape(-1)
    # Not contiguous, or one element seen through a stride: torch calls that contiguous, but
    # view(uint8) refuses it (torch.randn(4)[::4]).
    if flat.numel() and flat.stride(0) != 1:
        flat = flat.clone(memory_format=torch.contiguous_format)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(torch.uint8)


def _word_count(raw: torch.Tensor) -> int:
    return -(-raw.numel() // 8)


def _words(raw: torch.Tensor, first: int, last: int) -> torch.Tensor:
    """Words ``first:last`` of ``raw`` (uint8, flat) as int64: a view where ``raw`` is aligned
    and long enough, else a zero-padded copy of just these words."""
    part = raw[first * 8 : last * 8]
    # view() needs the byte offset into the storage aligned, and the data behind it too.
    aligned = part.storage_offset() % 8 == 0 and part.data_ptr() % 8 == 0
    if aligned and part.numel() == (last - first) * 8:
        return part.view(torch.int64)
    padded = torch.zeros((last - first) * 8, dtype=torch.uint8, device=raw.device)
    padded[: part.numel()].copy_(part)
    return padded.view(torch.int64)


_LOW32 = 0xFFFFFFFF


def _high_half(words: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Each word's top 32 bits as an unsigned number (``words >>> 32``)."""
    return torch.bitwise_right_shift(words, 32, out=out).bitwise_and_(_LOW32)


def _late_words(words: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Sum 2's words over the region ``words`` (int64, flat): word n read 4 bytes on, its high
    half joined to word n + 1's low half, the region's last word to zeros. Any device."""
    late = _high_half(words, out)
    if words.numel() > 1:
        late[:-1] += torch.bitwise_left_shift(words[1:], 32)
    return late


def _late_view(words: torch.Tensor) -> torch.Tensor:
    """:func:`_late_words` but for the region's last word, in place: the ``n - 1`` words that
    start 4 bytes into ``words`` (int64, contiguous, ``n >= 1``), read through a view of the
    same memory, so the checksum makes no pass of writes. torch views need the byte offset
    aligned to the element, so the view is made over the bytes' address: host memory only;
    another device's words (xpu, mps, ...) are computed instead. The caller keeps ``words``
    alive while it is read."""
    count = words.numel() - 1
    if count <= 0:
        return words[:0]
    if words.device.type != "cpu":
        return _late_words(words)[:-1]
    at = (ctypes.c_char * (count * 8)).from_address(words.data_ptr() + 4)
    return torch.frombuffer(at, dtype=torch.int64, count=count)


def _late_into(words: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """:func:`_late_words` written into ``out``. On the host, a copy of :func:`_late_view` and the
    last word's high half: a copy runs at memory speed, int64 shifts at a fraction of it (a
    short tensor's span, all of it outside a complete block, went that way)."""
    count = words.numel()
    if words.device.type != "cpu" or count < 2:
        return _late_words(words, out)
    out[: count - 1].copy_(_late_view(words))
    _high_half(words[count - 1 :], out[count - 1 :])
    return out


def _weight(k: int, index: int) -> int:
    """Sum ``k``'s weight of word ``index`` of the whole tensor's grid, a_i + m_q * b_j, in
    Python integers (one per region: torch calls would cost more than a block's sums)."""
    row, column = divmod(index, _COLS)
    by_row = _odd_hash(_ROW_SEEDS[k], row)
    by_block = _odd_hash(_BLOCK_SEEDS[k], row // _BLOCK_ROWS)
    by_column = int(_column_weights(k, torch.device("cpu"))[column])
    return (by_row + by_block * by_column) & _MASK64


def _odd_hash(seed: int, index: int) -> int:
    """:func:`_odd_hashes_at` of one index, in Python integers with the same int64 wrapping
    and arithmetic shifts."""
    x = _as_signed(index * _as_signed(_GOLDEN) + _as_signed(seed))
    x = _as_signed((x ^ (x >> 30)) * _as_signed(_MIX1))
    x = _as_signed((x ^ (x >> 27)) * _as_signed(_MIX2))
    return (x ^ (x >> 31)) | 1


def _lead(words: torch.Tensor, first_row: int) -> torch.Tensor:
    """Sum 2's term of a region's first word (``words[0]``, at row ``first_row`` of the whole
    tensor's grid, column 0) that its region does not hold: its low half is the high half of
    the word before it, read 4 bytes on (the previous region ends that word with zeros). A
    0-dim tensor on the words' device; zero for an empty region or the tensor's first word."""
    index = first_row * _COLS
    if not words.numel() or index == 0:
        return torch.zeros((), dtype=torch.int64, device=words.device)
    weight = _as_signed(_weight(1, index - 1))
    return torch.bitwise_left_shift(words[0], 32) * weight


def _chunk_blocks(device: torch.device) -> int:
    """Blocks reduced per kernel: one on CPU (it stays in cache), many on CUDA."""
    return _GPU_CHUNK_BLOCKS if device.type == "cuda" else 1


def _floats(tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor``'s values as a flat real float tensor over the same bytes (complex as its real
    and imaginary parts); None for dtypes that hold no NaN or Inf."""
    flat = tensor.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if not flat.dtype.is_floating_point or flat.dtype.itemsize > 8:
        return None
    return flat if flat.is_contiguous() else flat.contiguous()


# float16's NaN and ±Inf: every exponent bit set, so (bits & 0x7FFF) >= 0x7C00.
_FP16_EXPONENT = 0x7C00


def _probe(part: torch.Tensor) -> torch.Tensor:
    """True (a 0-dim tensor) where ``part`` may hold NaN or ±Inf: a sum is not finite unless
    every element is (or it overflowed: float16's past 65504, where the exact count, from the
    exponent bits, says 0)."""
    if part.dtype.itemsize == 1:  # float8: no kernels of its own
        part = part.float()
    return ~part.sum().isfinite()


def _count_non_finite(values: torch.Tensor) -> int:
    if values.numel() == 0:
        return 0
    if values.dtype == torch.float16:  # isfinite is slow on 16-bit floats; the bits are not
        return int(((values.view(torch.int16) & 0x7FFF) >= _FP16_EXPONENT).sum())
    if values.dtype.itemsize == 1:  # float8: torch has no isfinite for it
        values = values.float()
    return values.numel() - int(torch.isfinite(values).sum())


def _elements(values: torch.Tensor, first_word: int, last_word: int) -> torch.Tensor:
    size = values.dtype.itemsize  # 1, 2, 4 or 8: a word holds whole elements
    return values[first_word * 8 // size : min(last_word * 8 // size, values.numel())]


def _span(
    raw: torch.Tensor,
    first_block: int,
    last_block: int,
    values: torch.Tensor | None = None,
    *,
    block_offset: int = 0,
) -> tuple[int, int, int | None]:
    """The two sums over blocks ``first_block:last_block`` of the grid of ``raw``'s words, and
    how many NaN and ±Inf ``values`` (``raw`` as floats, None: not counted) hold there.
    ``block_offset``: the block of a larger tensor's grid that ``raw`` starts at (a shard's
    share of the whole tensor's checksum)."""
    device = raw.device
    step = _chunk_blocks(device)
    rows = -(-_word_count(raw) // _COLS)  # the last one may be short
    first_row, last_row = first_block * _BLOCK_ROWS, min(last_block * _BLOCK_ROWS, rows)
    count, blocks = last_row - first_row, last_block - first_block
    # Block q's column sums C_q weigh m_q * b_j; they are gathered as sum_q m_q * C_q, one
    # _COLS-long vector per sum, and weighed by b_j once at the end: the same number mod 2^64
    # as weighing each block's, with no buffer of every block's column sums (1/16 of the data,
    # whose allocation and multiplication cost as much as a read of it).
    multipliers = [
        _odd_hashes(_BLOCK_SEEDS[k], first_block + block_offset, blocks, device) for k in (0, 1)
    ]
    on_host = _on_host(_BLOCK_SEEDS, first_block + block_offset, blocks) if step == 1 else None
    row_sums, gathered, column_sums, late_out = _scratch(count, min(step, blocks), device)
    probes: list[torch.Tensor] = []
    leads: list[torch.Tensor] = []  # sum 2's terms of each region's first word (_lead)
    begin = first_block
    if on_host is not None:  # the complete blocks, with no indexing inside the loop
        begin = min(last_block, first_block + (last_row - first_row) // _BLOCK_ROWS)
        complete = begin - first_block
        at = first_block * _BLOCK_ROWS * _COLS
        flat = _words(raw, at, at + complete * _BLOCK_ROWS * _COLS)
        grids = flat.view(-1, _BLOCK_ROWS, _COLS)
        # Sum 2's words, 4 bytes on: read in place (no pass of writes), the region's last word
        # alone short of its next (it is weighed below, as the definition's region ends).
        late = _late_view(flat) if complete else flat
        size = _BLOCK_ROWS * _COLS
        row_views = [row_sums[k, : complete * _BLOCK_ROWS].view(-1, _BLOCK_ROWS) for k in (0, 1)]
        sums = [column_sums[k, 0] for k in (0, 1)]
        for q, grid, rows0, rows1 in zip(
            range(complete), grids.unbind(0), *(v.unbind(0) for v in row_views), strict=True
        ):
            if values is not None:  # these bytes are in cache now
                start = (first_block + q) * _BLOCK_ROWS * _COLS
                probes.append(_probe(_elements(values, start, start + _BLOCK_ROWS * _COLS)))
            torch.sum(grid, 1, out=rows0)
            torch.sum(grid, 0, out=sums[0])
            gathered[0].add_(sums[0], alpha=on_host[0][q])
            if q + 1 < complete:
                high = late[q * size : (q + 1) * size].view(_BLOCK_ROWS, _COLS)
                torch.sum(high, 1, out=rows1)
                torch.sum(high, 0, out=sums[1])
            else:  # the last block: its last word's next lies outside the region (zero)
                top = late[q * size : (q + 1) * size - _COLS].view(_BLOCK_ROWS - 1, _COLS)
                bottom = late[(q + 1) * size - _COLS :]
                final = _high_half(flat[-1:])
                torch.sum(top, 1, out=rows1[:-1])
                rows1[-1:] = bottom.sum() + final
                torch.sum(top, 0, out=sums[1])
                sums[1][:-1] += bottom
                sums[1][-1:] += final
            gathered[1].add_(sums[1], alpha=on_host[1][q])
        if complete and first_row + block_offset * _BLOCK_ROWS:  # a tensor's first word: none
            leads.append(_lead(flat, first_row + block_offset * _BLOCK_ROWS))

    for block in range(begin, last_block, step):
        start = block * _BLOCK_ROWS
        stop = min(start + step * _BLOCK_ROWS, last_row)
        words = _words(raw, start * _COLS, min(stop * _COLS, _word_count(raw)))
        if values is not None:  # these bytes are in cache now
            probes.append(_probe(_elements(values, start * _COLS, stop * _COLS)))
        full, tail = divmod(words.numel(), _COLS)
        whole = full // _BLOCK_ROWS  # complete blocks among the full rows
        used = whole + (1 if full > whole * _BLOCK_ROWS or tail or not whole else 0)
        at, q = start - first_row, block - first_block
        late = _late_into(words, late_out.view(-1)[: words.numel()])
        if start + block_offset * _BLOCK_ROWS:  # a tensor's first word has no lead
            leads.append(_lead(words, start + block_offset * _BLOCK_ROWS))
        for k in (0, 1):
            read = words if k == 0 else late
            grid = read[: full * _COLS].view(full, _COLS)
            torch.sum(grid, 1, out=row_sums[k, at : at + full])
            sums = column_sums[k]
            if whole == 1:  # CPU: one block per step (a plain column sum is the fast kernel)
                torch.sum(grid[:_BLOCK_ROWS], 0, out=sums[0])
            elif whole:
                blocked = grid[: whole * _BLOCK_ROWS].view(whole, _BLOCK_ROWS, _COLS)
                torch.sum(blocked, 1, out=sums[:whole])
            if full > whole * _BLOCK_ROWS:  # the tensor's last block, short
                torch.sum(grid[whole * _BLOCK_ROWS :], 0, out=sums[whole])
            elif tail or not whole:  # a last block of the short row alone, or an empty tensor
                sums[whole].zero_()
            if tail:  # the tensor's last row, short
                rest = read[full * _COLS :]
                row_sums[k, at + full] = rest.sum()
                sums[whole, :tail] += rest
            if on_host is not None:  # one block: a fused multiply-add of one row, no temporary
                gathered[k].add_(sums[0], alpha=on_host[k][q])
            else:
                gathered[k] += (sums[:used] * multipliers[k][q : q + used, None]).sum(0)
    global_row = first_row + block_offset * _BLOCK_ROWS
    totals = (row_sums * _row_weights(global_row, count, device)).sum(1)
    totals += (gathered * _both_column_weights(device)).sum(1)
    if leads:
        totals[1] += torch.stack(leads).sum()
    result = [int(total) & _MASK64 for total in totals.tolist()]
    bad = None
    if values is not None:
        bad = 0
        if probes and bool(torch.stack(probes).any()):
            first, last = first_row * _COLS, last_row * _COLS
            bad = _count_non_finite(_elements(values, first, last))
    return result[0], result[1], bad


# Small host tensors are digested together, up to _SMALL_BATCH_BYTES at a time: a span's few
# dozen torch calls cost about 0.3 ms whatever its size, which is most of the time for the norms
# that make up most of a model's tensors (209 of the 340 shards of a 1B model on a rank are under
# 3 KiB). Weighed word by word (a multiply and a running sum per word, where a span reads each
# word into two sums), they cost more per byte, so only tensors up to _SMALL_BYTES go that way.
_SMALL_BYTES = 32 << 10
_SMALL_BATCH_BYTES = 64 << 10


def _small_limit() -> int:
    """The most bytes of a tensor digested with others: at most one block, whose words all
    weigh row and column weights of block 0."""
    return min(_SMALL_BYTES, _BLOCK_ROWS * _COLS * 8)


def _small_weights() -> torch.Tensor:
    """Both sums' weights of the words a small tensor can hold, (2, ``_small_limit() // 8``):
    word n weighs a_i + m_0 * b_j, i = n // _COLS, j = n % _COLS (all in block 0)."""
    key = (_SMALL_TABLE, "cpu")
    table = _tables.get(key)  # a dict read is atomic: at worst two threads make it alike
    if table is None:
        cpu = torch.device("cpu")
        rows = torch.stack([_odd_hashes(_ROW_SEEDS[k], 0, _BLOCK_ROWS, cpu) for k in (0, 1)])
        first = torch.stack([_odd_hashes(_BLOCK_SEEDS[k], 0, 1, cpu) for k in (0, 1)])
        table = rows[:, :, None] + first[:, :, None] * _both_column_weights(cpu)[:, None, :]
        words = _small_limit() // 8
        table = _tables[key] = table.reshape(2, -1)[:, :words].contiguous()
    return table


def _small_sums(raws: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """The two sums of each of ``raws`` (host bytes, at most one block each), by the definition
    word by word rather than by row and column sums: their words laid end to end, each weighed
    by its place in its own tensor, and summed per tensor, in a dozen torch calls for all."""
    counts = [_word_count(raw) for raw in raws]
    total = sum(counts)
    if not total:
        return [(0, 0)] * len(raws)
    parts: list[torch.Tensor] = []
    for raw, words in zip(raws, counts, strict=True):
        parts.append(raw)
        if words * 8 != raw.numel():  # zeros to the word's end, as the grid pads it
            parts.append(torch.zeros(words * 8 - raw.numel(), dtype=torch.uint8))
    words = torch.cat(parts).view(torch.int64)
    weights = _small_weights()
    # Each tensor's words weigh the table's first words: the table cut to each length, end to end.
    placed = [torch.cat([weights[k, :n] for n in counts if n]) for k in (0, 1)]
    # Sum 2's words, each tensor's last one followed by zeros, not by the next tensor's words.
    ends = torch.tensor([n for n in counts if n], dtype=torch.int64).cumsum(0) - 1
    late = _late_words(words)
    late[ends] = _high_half(words[ends])
    # Running sums (wrapping, as every sum here) at each tensor's last word: a tensor's sums are
    # the difference from the tensor's before it.
    running = torch.stack([words * placed[0], late * placed[1]]).cumsum(1)[:, ends]
    each = torch.diff(running, dim=1, prepend=torch.zeros(2, 1, dtype=torch.int64)).tolist()
    found = iter(zip(*each, strict=True))
    sums = []
    for n in counts:
        a, b = next(found) if n else (0, 0)
        sums.append((a & _MASK64, b & _MASK64))
    return sums


def _format(sums: tuple[int, int], nbytes: int) -> str:
    return f"{sums[0]:016x}{sums[1]:016x}{nbytes:x}"


def checksum(tensor: torch.Tensor) -> str | None:
    """The checksum of ``tensor``'s values (its bytes in row-major order); None on meta."""
    return checksums([tensor])[0]


def checksums(tensors: Sequence[torch.Tensor], *, threads: int | None = None) -> list[str | None]:
    """Checksums of many tensors: CPU work split into spans of blocks across ``threads``
    (default :func:`worker_threads`; torch releases the GIL inside its kernels), CUDA tensors
    digested on their device."""
    return [digest for digest, _ in _digest(tensors, threads, count=False)]


def checksums_and_non_finite(
    tensors: Sequence[torch.Tensor], *, threads: int | None = None
) -> list[tuple[str | None, int | None]]:
    """(checksum, NaN and ±Inf elements) of each tensor, in one pass over its bytes; both None
    on meta, the count 0 for dtypes that hold no NaN (integers, bool)."""
    return _digest(tensors, threads, count=True)


def _spans(raw: torch.Tensor) -> list[tuple[int, int]]:
    """(first block, last block) of each job: 64 MiB on CPU, the whole tensor on a device."""
    rows = max(1, -(-_word_count(raw) // _COLS))
    blocks = -(-rows // _BLOCK_ROWS)
    step = blocks if raw.device.type != "cpu" else _SPAN_BLOCKS
    return [(b, min(b + step, blocks)) for b in range(0, blocks, step)]


def _digest(
    tensors: Sequence[torch.Tensor], threads: int | None, *, count: bool
) -> list[tuple[str | None, int | None]]:
    raws = [None if t.device.type == "meta" else _bytes_of(t) for t in tensors]
    floats = [
        _floats(t) if count and raw is not None else None
        for t, raw in zip(tensors, raws, strict=True)
    ]
    # A job: (tensor index, first block, last block) of one tensor, or the indices of many
    # small host tensors digested together (_small_sums).
    jobs: list[tuple[int, int, int] | list[int]] = []
    small: list[int] = []
    small_bytes = 0
    for i, raw in enumerate(raws):
        if raw is None:
            continue
        if raw.device.type == "cpu" and raw.numel() <= _small_limit():
            if small and small_bytes + raw.numel() > _SMALL_BATCH_BYTES:
                jobs.append(small)
                small, small_bytes = [], 0
            small.append(i)
            small_bytes += raw.numel()
            continue
        jobs.extend((i, first, last) for first, last in _spans(raw))
    if small:
        jobs.append(small)
    workers = threads if threads is not None else worker_threads()
    totals = [[0, 0] for _ in raws]
    bad = [0 if count and raw is not None else None for raw in raws]

    def run(
        job: tuple[int, int, int] | list[int],
    ) -> list[tuple[int, tuple[int, int, int | None]]]:
        if isinstance(job, list):
            sums = _small_sums([raws[i] for i in job])
            counted = [_count_non_finite(floats[i]) if floats[i] is not None else None for i in job]
            return [(i, (a, b, n)) for i, (a, b), n in zip(job, sums, counted, strict=True)]
        i, first, last = job
        return [(i, _span(raws[i], first, last, floats[i]))]

    def on_cpu(job: tuple[int, int, int] | list[int]) -> bool:
        return isinstance(job, list) or raws[job[0]].device.type == "cpu"

    # CUDA tensors one after another (their kernels share a stream, and each holds scratch of
    # up to 256 MiB); CPU spans across the threads.
    on_host = [job for job in jobs if on_cpu(job)]
    results = [found for job in jobs if not on_cpu(job) for found in run(job)]
    if workers > 1 and len(on_host) > 1:
        with ThreadPoolExecutor(workers, thread_name_prefix="fsdpcheck-checksum") as pool:
            results += [found for done in pool.map(run, on_host) for found in done]
    else:
        results += [found for job in on_host for found in run(job)]
    for i, (a, b, n) in results:
        totals[i][0] = (totals[i][0] + a) & _MASK64
        totals[i][1] = (totals[i][1] + b) & _MASK64
        if n:
            bad[i] += n
    return [
        (None if raw is None else _format((totals[i][0], totals[i][1]), raw.numel()), bad[i])
        for i, raw in enumerate(raws)
    ]


def non_finite_counts(
    tensors: Sequence[torch.Tensor], *, threads: int | None = None
) -> list[int | None]:
    """NaN and ±Inf elements of each tensor, without a checksum (None on meta): one float sum
    per 64 MiB span, and an exact count only where that sum is not finite."""
    floats = [None if t.device.type == "meta" else _floats(t) for t in tensors]
    span = _SPAN_BLOCKS * _BLOCK_ROWS * _COLS * 8  # bytes
    jobs = [
        (i, start, start + span // values.dtype.itemsize)
        for i, values in enumerate(floats)
        if values is not None
        for start in range(0, values.numel(), span // values.dtype.itemsize)
    ]

    def run(job: tuple[int, int, int]) -> tuple[int, int]:
        i, first, last = job
        part = floats[i][first:last]
        return i, _count_non_finite(part) if bool(_probe(part)) else 0

    workers = threads if threads is not None else worker_threads()
    if workers > 1 and len(jobs) > 1:
        with ThreadPoolExecutor(workers, thread_name_prefix="fsdpcheck-finite") as pool:
            results = list(pool.map(run, jobs))
    else:
        results = [run(job) for job in jobs]
    counts = [None if t.device.type == "meta" else 0 for t in tensors]
    for i, n in results:
        counts[i] += n
    return counts


# A part's share of the whole tensor's checksum. Both sums weigh each word by its place alone:
# word n of the whole tensor's grid (row i = n // _COLS, column j = n % _COLS, block
# q = i // _BLOCK_ROWS) adds w_n * (a_i + m_q * b_j) to sum 1, and to sum 2 its high half at n and
# its low half at n - 1 (the words read 4 bytes on). So a shard adds the same share wherever it
# is digested, given where its words sit in the whole tensor, and the shares of disjoint parts
# add up (mod 2^64) to the checksum of the whole. Words cut between two parts (a shard that
# starts or ends inside a 64-bit word) belong to neither: their bytes travel as fragments and
# are weighed once joined (zeros past the tensor's end, as the whole tensor's grid pads them).
# (A cut word could also be weighed in parts, each with the other parts' bytes zero: the parts'
# bytes are disjoint, so neither the words nor their low 32 bits carry and both sums add up.
# Equally spaced runs (_spaced_runs) are weighed so; a part may mix both ways.)


@dataclass(frozen=True)
class Share:
    """What one part of a tensor adds to the whole tensor's checksum."""

    sums: tuple[int, int]
    fragments: tuple[tuple[int, bytes], ...] = ()  # (byte offset in the whole tensor, bytes)


_FEW_RUNS = 8  # more runs than this, word-aligned and equally long: weighed in one pass
# Equally spaced runs at most this many run lengths apart (a dim-1 shard of up to 16 parts) are
# laid out in zeros and summed block by block; _SPREAD_BYTES of the whole tensor at a time.
_SPREAD = 16
_SPREAD_BYTES = 64 << 20
_INDEXED_WORDS = 1 << 20  # words weighed per pass where each word's weight is computed


def share(
    tensor: torch.Tensor,
    starts: Sequence[int],
    lengths: Sequence[int],
    *,
    threads: int | None = None,
) -> Share:
    """``tensor``'s share of the checksum of the whole tensor it is part of: its elements, in
    row-major order, are runs of ``lengths[r]`` elements starting at element ``starts[r]`` of
    the whole tensor (row-major). One run: a shard of dim 0 (FSDP2); one run per row: a shard
    of dim 1 (tensor parallelism's row-wise plan). ``threads``: for a run of more than one
    64 MiB span (default :func:`worker_threads`; 1 where the caller spreads tensors over
    threads itself)."""
    raw = _bytes_of(tensor)
    size = tensor.element_size()
    first = [s * size for s in starts]
    length = [n * size for n in lengths]
    aligned = all(b % 8 == 0 for b in first) and all(b % 8 == 0 for b in length)
    if len(first) > _FEW_RUNS and len(set(length)) == 1:
        stride = first[1] - first[0]
        spaced = all(b - a == stride for a, b in zip(first, first[1:], strict=False))
        if spaced and length[0] <= stride <= _SPREAD * length[0]:
            return Share(_spaced_runs(raw, first[0], stride, length[0], len(first), threads))
        if aligned:
            return Share(_scattered(raw, first, length[0]))
        return _cut_runs(raw, first, length[0])
    totals, fragments, at = [0, 0], [], 0
    for start, count in zip(first, length, strict=True):
        sums, cut = _run(raw[at : at + count], start, threads)
        totals = [(t + s) & _MASK64 for t, s in zip(totals, sums, strict=True)]
        fragments.extend(cut)
        at += count
    return Share((totals[0], totals[1]), tuple(fragments))


def combine(shares: Sequence[Share], nbytes: int) -> str:
    """The checksum of a whole tensor of ``nbytes`` bytes from the shares of disjoint parts that
    cover it: the same string :func:`checksum` gives for the whole tensor."""
    totals = [0, 0]
    cut: dict[int, bytearray] = {}
    for part in shares:
        totals = [(t + s) & _MASK64 for t, s in zip(totals, part.sums, strict=True)]
        for offset, data in part.fragments:
            for i, byte in enumerate(data):
                cut.setdefault((offset + i) // 8, bytearray(8))[(offset + i) % 8] = byte
    if cut:
        index = sorted(cut)
        words = [int.from_bytes(cut[w], "little", signed=True) for w in index]
        sums = _indexed(torch.tensor(words, dtype=torch.int64), torch.tensor(index))
        totals = [(t + s) & _MASK64 for t, s in zip(totals, sums, strict=True)]
    return _format((totals[0], totals[1]), nbytes)


def _run(
    raw: torch.Tensor, start: int, threads: int | None = None
) -> tuple[tuple[int, int], list[tuple[int, bytes]]]:
    """The share of ``raw`` (bytes) at byte ``start`` of the whole tensor: its whole words
    weighed in place, its cut words as fragments."""
    end = start + raw.numel()
    head = min(-(-start // 8) * 8, end)  # the first word boundary inside (or the end)
    tail = max(end // 8 * 8, head)  # the last one
    fragments = []
    if head > start:
        fragments.append((start, bytes(raw[: head - start].tolist())))
    if tail < end:
        fragments.append((tail, bytes(raw[tail - start :].tolist())))
    return _contiguous(raw[head - start : tail - start], head // 8, threads), fragments


def _contiguous(raw: torch.Tensor, first_word: int, threads: int | None = None) -> tuple[int, int]:
    """The share of whole words (``raw``: bytes, a multiple of 8) at word ``first_word`` of the
    whole tensor: the blocks it covers entirely by :func:`_span` (the checksum's own fast path,
    threaded), the rows of a block it covers in part by their row and column sums, the words of
    a row cut at either end one by one."""
    count = raw.numel() // 8
    last_word = first_word + count
    first_row, last_row = -(-first_word // _COLS), last_word // _COLS
    device = raw.device
    if first_row >= last_row:  # inside one row, or across one row boundary
        index = torch.arange(first_word, last_word, device=device)
        return _indexed(_words(raw, 0, count), index)
    head, tail = first_row * _COLS - first_word, last_row * _COLS - first_word
    parts = []
    if head:
        parts.append(_indexed(_words(raw, 0, head), torch.arange(first_word, first_word + head)))
    if tail < count:
        parts.append(_indexed(_words(raw, tail, count), torch.arange(first_word + tail, last_word)))
    first_full, last_full = -(-first_row // _BLOCK_ROWS), last_row // _BLOCK_ROWS
    if first_full >= last_full:  # no whole block: the rows, cut where a block starts
        cut = min(max(first_full * _BLOCK_ROWS, first_row), last_row)
        ranges = [(first_row, cut), (cut, last_row)]
    else:
        ranges = [(first_row, first_full * _BLOCK_ROWS), (last_full * _BLOCK_ROWS, last_row)]
    for low, high in ranges:
        if high > low:
            at = low * _COLS - first_word
            grid = _words(raw, at, at + (high - low) * _COLS).view(high - low, _COLS)
            parts.append(_rows_in_block(grid, low))
    if first_full < last_full:
        at = (first_full * _BLOCK_ROWS * _COLS - first_word) * 8
        middle = raw[at : at + (last_full - first_full) * _BLOCK_ROWS * _COLS * 8]

        def run(span: tuple[int, int]) -> tuple[int, int]:
            a, b, _ = _span(middle, span[0], span[1], block_offset=first_full)
            return a, b

        spans = _spans(middle)
        workers = threads if threads is not None else worker_threads()
        if device.type == "cpu" and workers > 1 and len(spans) > 1:
            with ThreadPoolExecutor(workers, thread_name_prefix="fsdpcheck-checksum") as pool:
                parts += pool.map(run, spans)
        else:
            parts += [run(span) for span in spans]
    totals = [0, 0]
    for sums in parts:
        totals = [(t + s) & _MASK64 for t, s in zip(totals, sums, strict=True)]
    return totals[0], totals[1]


def _rows_in_block(grid: torch.Tensor, first_row: int) -> tuple[int, int]:
    """The share of whole rows ``grid`` (int64, rows of ``_COLS`` words) from ``first_row`` of
    the whole tensor's grid, all in one block: weighted row sums plus the block's multiplier
    times the weighted column sums, as :func:`_span` weighs a block."""
    rows, device = grid.shape[0], grid.device
    block = first_row // _BLOCK_ROWS
    flat = grid.reshape(-1)
    result = []
    for k in (0, 1):
        values = grid if k == 0 else _late_words(flat).view(rows, _COLS)
        by_row = (values.sum(1) * _odd_hashes(_ROW_SEEDS[k], first_row, rows, device)).sum()
        by_column = (values.sum(0) * _column_weights(k, device)).sum()
        multiplier = _odd_hashes(_BLOCK_SEEDS[k], block, 1, device)[0]
        total = by_row + multiplier * by_column
        if k == 1:
            total += _lead(flat, first_row)
        result.append(int(total.item()) & _MASK64)
    return result[0], result[1]


def _scattered(raw: torch.Tensor, starts: Sequence[int], length: int) -> tuple[int, int]:
    """The share of equally long, word-aligned runs (byte ``starts``, ``length`` bytes each):
    each word weighed by its own place, a bounded number of words per pass."""
    per_run = length // 8
    if not per_run:
        return 0, 0
    words = _words(raw, 0, per_run * len(starts))
    first = torch.tensor(starts, dtype=torch.int64, device=raw.device) // 8
    offsets = torch.arange(per_run, device=raw.device)
    step = max(1, _INDEXED_WORDS // per_run)
    totals = [0, 0]
    for r in range(0, len(starts), step):
        index = (first[r : r + step, None] + offsets[None, :]).reshape(-1)
        sums = _indexed(words[r * per_run : r * per_run + index.numel()], index)
        totals = [(t + s) & _MASK64 for t, s in zip(totals, sums, strict=True)]
    return totals[0], totals[1]


def _spaced_runs(
    raw: torch.Tensor, origin: int, stride: int, length: int, count: int, threads: int | None
) -> tuple[int, int]:
    """The share of ``count`` runs of ``length`` bytes, ``stride`` bytes apart from byte
    ``origin`` (a dim-1 shard): laid at their places in zeros, a bounded number of rows at a
    time, and summed by the block checksum's own fast path. Zero words add nothing, and a word
    whose bytes are split between parts adds up from its parts in both sums (their bytes are
    disjoint, so neither the words nor their low 32 bits carry), so cut words need no
    fragments."""
    if not length:
        return 0, 0
    lead = origin % 8
    rows = max(8, _SPREAD_BYTES // stride // 8 * 8)  # a multiple of 8: every chunk at ``lead``
    totals = [0, 0]
    for first in range(0, count, rows):
        n = min(rows, count - first)
        base = origin + first * stride - lead  # a word boundary
        size = -(-(lead + (n - 1) * stride + length) // 8) * 8
        spread = torch.zeros(size, dtype=torch.uint8, device=raw.device)
        spread.as_strided((n, length), (stride, 1), lead).copy_(
            raw[first * length : (first + n) * length].view(n, length)
        )
        sums = _contiguous(spread, base // 8, threads)
        totals = [(t + s) & _MASK64 for t, s in zip(totals, sums, strict=True)]
    return totals[0], totals[1]


def _cut_runs(raw: torch.Tensor, starts: Sequence[int], length: int) -> Share:
    """The share of equally long runs (byte ``starts``, ``length`` bytes each) that start or end
    inside a word (a dim-1 shard whose rows are not a whole number of words): each run's whole
    words gathered by where they sit in ``raw`` modulo 8 and weighed by place, a bounded number
    per pass, and its cut words' bytes read in one gather: no torch call per run."""
    device = raw.device
    start = torch.tensor(starts, dtype=torch.int64)  # per run, on the host
    end = start + length
    head = torch.minimum((start + 7) // 8 * 8, end)  # as _run cuts each run
    tail = torch.maximum(end // 8 * 8, head)
    local = torch.arange(len(starts), dtype=torch.int64) * length  # each run's byte in raw
    lead, trail = head - start, end - tail  # cut bytes at either end, 0 to 7
    pos = torch.arange(8, dtype=torch.int64)
    lead_at = (local[:, None] + pos)[pos < lead[:, None]]
    trail_at = (local[:, None] + (tail - start)[:, None] + pos)[pos < trail[:, None]]
    cut = raw[torch.cat([lead_at, trail_at]).to(device)].tolist()
    fragments, i, j = [], 0, len(lead_at)
    for s, t, n, m in zip(starts, tail.tolist(), lead.tolist(), trail.tolist(), strict=True):
        if n:
            fragments.append((s, bytes(cut[i : i + n])))
            i += n
        if m:
            fragments.append((t, bytes(cut[j : j + m])))
            j += m
    count = (tail - head) // 8  # whole words per run (two values at most)
    at = local + head - start  # the first whole word's byte in raw
    totals = [0, 0]
    for shift in sorted(set((at % 8)[count > 0].tolist())):
        runs = ((at % 8) == shift) & (count > 0)
        words = _words(raw[shift:], 0, (raw.numel() - shift) // 8)
        first, whole, n = (at[runs] - shift) // 8, head[runs] // 8, count[runs]
        widest = int(n.max())
        offsets = torch.arange(widest, dtype=torch.int64)
        step = max(1, _INDEXED_WORDS // widest)
        for r in range(0, len(first), step):
            inside = offsets[None, :] < n[r : r + step, None]
            where = (first[r : r + step, None] + offsets)[inside].to(device)
            index = (whole[r : r + step, None] + offsets)[inside]
            sums = _indexed(words[where], index)
            totals = [(t + s) & _MASK64 for t, s in zip(totals, sums, strict=True)]
    return Share((totals[0], totals[1]), tuple(fragments))


def _indexed(words: torch.Tensor, index: torch.Tensor) -> tuple[int, int]:
    """The two sums of ``words`` (int64) at word ``index`` of a whole tensor's grid, each word
    weighed by its own place: a_i + m_q * b_j, as the grid's row and column sums weigh it."""
    if not words.numel():
        return 0, 0
    index = index.to(words.device)
    total = (words * _place_weights(0, index)).sum()
    # Sum 2 word by word: word n's high half is the low half of the word read 4 bytes on at n,
    # its low half the high half of the one at n - 1 (none before the tensor's first word).
    late = (_high_half(words) * _place_weights(1, index)).sum()
    earlier = index - 1
    before = _place_weights(1, earlier.clamp(min=0)) * (earlier >= 0)
    late += (torch.bitwise_left_shift(words, 32) * before).sum()
    return int(total.item()) & _MASK64, int(late.item()) & _MASK64


def _place_weights(k: int, index: torch.Tensor) -> torch.Tensor:
    """Sum ``k``'s weight of each word ``index`` (a non-empty int64 tensor) of the whole
    tensor's grid."""
    row = index // _COLS
    # Many words share a row: hash each row (and its block) once and look the words' up, unless
    # the words are scattered over more rows than there are words.
    low, high = int(row.min()), int(row.max()) + 1
    if high - low <= row.numel():
        rows = torch.arange(low, high, dtype=torch.int64, device=index.device)
        at = row - low
    else:
        rows, at = row, None
    by_row = _odd_hashes_at(_ROW_SEEDS[k], rows)
    by_block = _odd_hashes_at(_BLOCK_SEEDS[k], rows // _BLOCK_ROWS)
    if at is not None:
        by_row, by_block = by_row[at], by_block[at]
    return by_row + by_block * _column_weights(k, index.device)[index % _COLS]
