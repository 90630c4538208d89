"""What a rank's process holds in memory: host RSS and its peak (Linux ``/proc/self/status``,
else ``getrusage``), read after glibc's ``malloc_trim`` where there is one (:func:`trim_heap`),
and CUDA's allocator where the process uses CUDA. Read per stage by the audit
(:class:`StageMeter`, reset before each stage), and once by ``check_model``, which reads the
process's peak so far and resets nothing (the process is the script's)."""

from __future__ import annotations

import ctypes
import functools
import gc
import logging
import resource
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fsdpcheck.records import MemoryRecord, StageMemory
from fsdpcheck.vocab import MemoryPeak, Stage

log = logging.getLogger(__name__)

# The stages whose memory the audit records: where a rank materialises the model (build),
# copies its shards out (wrap) and receives rank 0's weights (load).
MEASURED = (Stage.BUILD, Stage.WRAP, Stage.LOAD)


def _status(field: str) -> int | None:
    """A ``/proc/self/status`` memory field, in bytes (None: not Linux, or not there)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        log.debug("no %s in /proc/self/status", field, exc_info=True)
    return None


def rss() -> int | None:
    return _status("VmRSS")


@functools.cache
def _malloc_trim() -> Any | None:
    """glibc's ``malloc_trim``, where this process's C library has one (musl and macOS do not)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        log.debug("no malloc_trim in this process's C library", exc_info=True)
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def trim_heap() -> bool:
    """Hand the pages malloc holds free back to the kernel before RSS is read; False where
    there is no ``malloc_trim`` (the RSS is then read as the allocator left it).

    glibc keeps freed chunks below its mmap threshold resident, and the threshold rises to the
    size of the largest block freed so far (up to 32 MiB): once a script made and freed an
    8 MiB tensor, a full copy of the model in weights of a few MiB, freed after ``fully_shard``
    copied the shards out, stays in RSS (issue 37: 227 MiB of a 211 MiB model's copy). Read as
    memory the rank still holds, it hides what the rank held at its peak."""
    trim = _malloc_trim()
    if trim is None:
        return False
    try:
        trim(0)
    except Exception:  # a C library whose malloc_trim is not glibc's: read RSS as it is
        log.debug("malloc_trim failed", exc_info=True)
        return False
    return True


def _reset_peak() -> bool:
    """VmHWM back to the current RSS (Linux >= 4.0); False where the kernel or a sandbox does
    not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _maxrss() -> int:
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _cuda() -> Any | None:
    """``torch.cuda`` where this process already uses CUDA (never initialises it)."""
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "cuda"):
        return None
    try:
        return torch.cuda if torch.cuda.is_initialized() else None
    except Exception:  # a torch without a usable CUDA runtime: no CUDA numbers
        log.debug("torch.cuda is not usable", exc_info=True)
        return None


def release() -> None:
    """A full garbage collection and :func:`trim_heap`, after an audit in a process that goes
    on. FSDP2 ties every wrapped model into reference cycles (its hooks hold its state, which
    holds the module), so a model an audit built is freed only by the cyclic collector, and
    under fsdpcheck's own thresholds (``process.tune_gc``) or a busy caller that may be many
    calls later: ``run_audit`` called again and again in one process (``fsdpcheck run``, a Ray
    actor) grew by about a model a call (issue 37: 35 to 60 MiB a call for a 120 MB Llama, 2
    ranks); with this, under 1 MiB. The collection walks the whole heap (0.2 s of every rank
    after a 1B-parameter audit), so a process that ends right after skips it."""
    gc.collect()
    trim_heap()


class StageMeter:
    """Each measured stage's host RSS on entering, peak and on leaving, and CUDA's."""

    def __init__(self) -> None:
        self.stages: list[StageMemory] = []
        self.reset_denied = False  # some stage's peak came from ru_maxrss

    @contextmanager
    def measure(self, stage: Stage) -> Iterator[None]:
        # A stage that reuses pages malloc kept from earlier work raises no RSS: without them
        # its growth is what it really touched.
        trim_heap()
        start = rss()
        if start is None:  # no /proc: nothing per stage is known
            yield
            return
        file_start = _status("RssFile")
        reset = _reset_peak()
        before = 0 if reset else _maxrss()
        cuda = _cuda()
        cuda_start = None
        if cuda is not None:
            cuda.reset_peak_memory_stats()
            cuda_start = cuda.memory_allocated()
        try:
            yield
        finally:
            end = rss() or start
            # Library pages the kernel evicted under another process's memory pressure come
            # back as this rank runs their code: RSS, but nothing the stage allocated. What
            # the stage faulted in of file-backed pages is left out of its peak and end
            # (pages evicted during it can only hide growth, never invent it).
            file_end = _status("RssFile")
            gained = 0
            if file_start is not None and file_end is not None:
                gained = max(0, file_end - file_start)
            end -= gained
            if reset:
                peak = max((_status("VmHWM") or end) - gained, start, end)
            else:
                # A stage that set no new process peak peaked somewhere at or below the old
                # one: its start and end are all that is known (a lower bound).
                self.reset_denied = True
                after = _maxrss()
                peak = after - gained if after > before else max(start, end)
                peak = max(peak, start, end)
            cuda = cuda or _cuda()  # a stage may be the one that first used CUDA
            cuda_peak = None
            if cuda is not None:
                cuda_peak = cuda.max_memory_allocated()
                cuda_start = cuda_start if cuda_start is not None else 0
            self.stages.append(StageMemory(stage, start, peak, end, cuda_start, cuda_peak))

    def record(self, rank: int, model: Any = None) -> MemoryRecord:
        method = MemoryPeak.LIFETIME if self.reset_denied else MemoryPeak.STAGE
        full, shard = model_bytes(model) if model is not None else (None, None)
        return MemoryRecord(rank, method, tuple(self.stages), model_bytes=full, shard_bytes=shard)


def process_memory(rank: int, model: Any = None) -> MemoryRecord:
    """``check_model``: the process's host peak so far (VmHWM, else ru_maxrss) and its RSS
    now, CUDA's peak and current allocation where it uses CUDA; nothing is reset."""
    full, shard = model_bytes(model) if model is not None else (None, None)
    trimmed = trim_heap()  # what malloc keeps free is not what the rank holds (trim_heap)
    current = rss()
    # The high-water mark is read after the RSS and is never below it: pages touched between
    # the two reads (a few KiB) made the peak read first come out under the RSS read second.
    peak = max(_status("VmHWM") or _maxrss(), current or 0)
    cuda = _cuda()
    return MemoryRecord(
        rank,
        MemoryPeak.PROCESS,
        process_peak=peak,
        current=current,
        cuda_peak=cuda.max_memory_allocated() if cuda is not None else None,
        cuda_current=cuda.memory_allocated() if cuda is not None else None,
        model_bytes=full,
        shard_bytes=shard,
        trimmed=trimmed,
    )


def model_bytes(model: Any) -> tuple[int, int]:
    """The model in full (each parameter and buffer once: global numel x element size) and
    what this rank holds of it (its DTensors' local shards; the whole of a plain tensor)."""
    full = held = 0
    seen: set[int] = set()
    tensors = (*model.parameters(), *model.buffers())
    for t in tensors:
        if id(t) in seen:
            continue
        seen.add(id(t))
        size = t.element_size()
        full += t.numel() * size
        local = t.to_local() if hasattr(t, "to_local") else t
        held += local.numel() * size
    return full, held
