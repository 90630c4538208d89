"""``check_model(source=PATH)`` / ``audit --source PATH``: the checkpoint on disk as the
reference. Every rank proves that each of its local shards and persistent buffers equals the
matching slice of the checkpoint, reading only that slice; nothing is gathered but the verdicts.

Comparing ranks with each other cannot see a load that is wrong the same way on every rank (q/k
rows permuted by the loader, a transpose, a cast): against the checkpoint it shows.

Formats: safetensors (one file, or a sharded ``model.safetensors.index.json``), read by slice:
a run of whole rows (a dim-0 shard) straight from the byte range the file's header names, any
other cut with ``safe_open(...).get_slice``; DCP directories (``.metadata`` and
``__R_N.distcp``), read with ``torch.distributed.checkpoint.load`` into DTensors shaped like
this rank's own (its mesh and placements), so DCP's planner reads exactly this rank's chunks.
DCP runs without collectives (``no_dist``): a rank that cannot read never keeps the others
waiting. Nothing is written, and nothing is unpickled beyond DCP's own ``.metadata``.

Names go through the model's state dict (wrapper levels such as ``_checkpoint_wrapped_module.``
are not in it; ``_orig_mod.`` is looked up without it, as DCP names compiled modules), and
through its load_state_dict hooks where its state dict is rewritten (torchtitan's fused
``wqkv`` saved as ``wq``/``wk``/``wv``): those source entries are read whole, because the hooks
need them whole, and the fused tensor's slice is cut from what the hooks make of them.

Both sides are compared bitwise where the rank holds them (each rank has its shard and, now, its
slice of the checkpoint: a digest of either would cost more than the comparison, and nothing has
to travel). A mismatch says what it looks like where that can be told, from reads of the same
size: a cast
(equal once the checkpoint's values are cast to the model's dtype), transposed, another shard
dim, rows in another order, another entry's bytes."""

from __future__ import annotations

import json
import logging
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from fsdpcheck.loader.names import placement, state_dict_names, through_hooks_source
from fsdpcheck.loader.shards import expected_shard
from fsdpcheck.loader.verify import _same_bytes
from fsdpcheck.model.resume import METADATA, checkpoint_record
from fsdpcheck.records import VerifyResult
from fsdpcheck.vocab import SourceLook

log = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"
_WRAPPER_LEVELS = ("_orig_mod", "_checkpoint_wrapped_module")
_PREFIXES = ("", "model.")  # torchtitan and Stateful apps save the model under "model"
_MAX_OTHERS = 16  # other entries of the same shape a mismatch is compared with
# Mismatches per rank whose look is worked out from more reads (a load wrong everywhere must not
# cost a read of the checkpoint per tensor); the rest are reported as they are.
_EXPLAINED = 8
_HEADER_BYTES = 100_000_000  # the most a safetensors header may hold
_ROWS_SORTED = 1 << 16  # rows past this are not sorted to tell a permutation


# ---------------------------------------------------------------- readers


@dataclass(frozen=True)
class _Cut:
    """One read: ``entry`` cut the way ``placements`` cut it on this rank's ``mesh`` (None:
    the whole entry)."""

    entry: str
    placements: tuple[Any, ...] | None = None
    mesh: Any = None


def _box(shape: Sequence[int], cut: _Cut) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's local shape and global offset of ``cut``: DTensor's own arithmetic, the
    one DCP saves and loads by."""
    if cut.placements is None:
        return tuple(shape), (0,) * len(shape)

    local, offset = compute_local_shape_and_global_offset(
        torch.Size(shape), cut.mesh, list(cut.placements)
    )
    return tuple(local), tuple(offset)


_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class _Safetensors:
    """Entries from each file's own header (8 bytes of length, then JSON: dtype, shape, byte
    range); a cut that is a run of whole rows (a dim-0 shard, a whole tensor) is read with
    ``readinto`` straight into its tensor, any other cut with ``safe_open(...).get_slice``.
    Reading beats faulting in a mapping of the file page by page (``get_slice``'s views)."""

    format = "safetensors"

    def __init__(self, files: Mapping[str, Path]) -> None:
        self._files = dict(files)  # entry -> file
        self._where: dict[str, int] = {}  # entry -> its first byte in its file
        self._handles: dict[Path, Any] = {}
        self.entries: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for file in dict.fromkeys(self._files.values()):
            with open(file, "rb") as handle:
                size = int.from_bytes(handle.read(8), "little")
                if size > _HEADER_BYTES:  # safetensors' own limit: not a safetensors file
                    raise ValueError(f"{file}: a header of {size} bytes (a damaged file?)")
                header = json.loads(handle.read(size))
            for name, info in header.items():
                dtype = _ST_DTYPES.get(info["dtype"]) if name != "__metadata__" else None
                if dtype is not None and self._files.get(name) == file:
                    self.entries[name] = (tuple(info["shape"]), dtype)
                    self._where[name] = 8 + size + int(info["data_offsets"][0])

    def read(self, cuts: Sequence[_Cut]) -> dict[_Cut, torch.Tensor]:
        return {cut: got.clone() for cut, got in self.stream(cuts)}

    def stream(self, cuts: Sequence[_Cut]) -> Iterator[tuple[_Cut, torch.Tensor]]:
        """Each cut in turn, in one scratch buffer reused from cut to cut (fresh memory would
        be faulted in page by page: that, not the copy, is what reading costs); a cut is valid
        until the next one is asked for."""
        scratch = torch.empty(0, dtype=torch.uint8)
        opened: dict[Path, Any] = {}
        try:
            for cut in cuts:
                shape, dtype = self.entries[cut.entry]
                local, offset = _box(shape, cut)
                file = self._files[cut.entry]
                if tuple(local[1:]) != tuple(shape[1:]):  # not a run of whole rows
                    yield cut, self._sliced(cut, file, local, offset)
                    continue
                if file not in opened:
                    opened[file] = open(file, "rb")  # noqa: SIM115 (closed below)
                nbytes = _nbytes(local, dtype)
                if scratch.numel() < nbytes:
                    scratch = torch.empty(nbytes, dtype=torch.uint8)
                into = scratch[:nbytes]
                _read_rows(opened[file], self._where[cut.entry], local, offset, into)
                yield cut, into.view(dtype).reshape(tuple(local))
        finally:
            for handle in opened.values():
                handle.close()

    def _sliced(
        self, cut: _Cut, file: Path, local: Sequence[int], offset: Sequence[int]
    ) -> torch.Tensor:
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = safe_open(str(file), framework="pt")
        index = tuple(slice(o, o + n) for o, n in zip(offset, local, strict=True))
        return handle.get_slice(cut.entry)[index].reshape(tuple(local))  # empty: flat


def _nbytes(local: Sequence[int], dtype: torch.dtype) -> int:
    count = 1
    for size in local:
        count *= int(size)
    return count * torch.empty((), dtype=dtype).element_size()


def _read_rows(
    handle: Any, first: int, local: Sequence[int], offset: Sequence[int], into: torch.Tensor
) -> None:
    """Rows ``offset[0]`` on of an entry whose bytes start at ``first``, read into ``into``
    (bytes)."""
    if not into.numel():
        return
    row = into.numel() // int(local[0]) if local else 0
    handle.seek(first + (int(offset[0]) * row if local else 0))
    got = handle.readinto(memoryview(into.numpy()))
    if got != into.numel():
        raise OSError(f"{handle.name}: {got} bytes read of {into.numel()} (a truncated file)")


class _Dcp:
    format = "dcp"

    def __init__(self, path: Path) -> None:
        self._path = path
        stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        self.entries = {
            name: (tuple(meta.size), meta.properties.dtype)
            for name, meta in stored.items()
            if isinstance(meta, TensorStorageMetadata)
        }

    def read(self, cuts: Sequence[_Cut]) -> dict[_Cut, torch.Tensor]:
        """One ``dcp.load`` per round of distinct entries (a state dict holds a key once)."""
        out: dict[_Cut, torch.Tensor] = {}
        pending = list(cuts)
        while pending:
            round_: dict[str, _Cut] = {}
            later = []
            for cut in pending:
                if cut.entry in round_:
                    later.append(cut)
                else:
                    round_[cut.entry] = cut
            payload: dict[str, Any] = {}
            for entry, cut in round_.items():
                shape, dtype = self.entries[entry]
                local, _ = _box(shape, cut)
                buffer = torch.empty(local, dtype=dtype)
                if cut.placements is None:
                    payload[entry] = buffer
                else:
                    payload[entry] = DTensor.from_local(
                        buffer,
                        cut.mesh,
                        list(cut.placements),
                        run_check=False,
                        shape=torch.Size(shape),
                        stride=_contiguous_stride(shape),
                    )
            with warnings.catch_warnings():  # "assuming ... a single process": as meant
                warnings.simplefilter("ignore", UserWarning)
                reader = dcp.FileSystemReader(str(self._path))
                dcp.load(payload, storage_reader=reader, no_dist=True)
            for entry, cut in round_.items():
                value = payload[entry]
                out[cut] = value.to_local() if isinstance(value, DTensor) else value
            pending = later
        return out


def _stream_all(reader: Any, cuts: Sequence[_Cut]) -> Iterator[tuple[_Cut, torch.Tensor]]:
    """``reader.stream`` where it has one, else its reads (DCP: one ``dcp.load`` for all)."""
    if hasattr(reader, "stream"):
        yield from reader.stream(cuts)
        return
    read = reader.read(cuts)
    for cut in cuts:
        yield cut, read[cut]


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(stride))


def open_source(path: str | os.PathLike[str]) -> _Safetensors | _Dcp:
    """The reader for ``path``: a ``.safetensors`` file, a sharded safetensors index (or the
    directory holding one, or a single ``.safetensors`` file), or a DCP directory (or a root
    whose ``LATEST`` file names one)."""
    found = checkpoint_record(path)  # a checkpoint root's LATEST resolved, as --resume does
    root = Path(found.path) if found.path else Path(path)
    if root.is_dir():
        if (root / METADATA).is_file():
            return _Dcp(root)
        if (root / SAFETENSORS_INDEX).is_file():
            root = root / SAFETENSORS_INDEX
        else:
            files = sorted(root.glob("*.safetensors"))
            if len(files) != 1:
                raise FileNotFoundError(
                    f"{root} holds no DCP .metadata, no {SAFETENSORS_INDEX} and "
                    f"{len(files)} .safetensors files (one expected)"
                )
            root = files[0]
    if root.name.endswith(".json"):
        weight_map = json.loads(root.read_text())["weight_map"]
        return _Safetensors({k: root.parent / v for k, v in weight_map.items()})
    if root.is_file():
        with safe_open(str(root), framework="pt") as handle:
            names = list(handle.keys())
        return _Safetensors(dict.fromkeys(names, root))
    raise FileNotFoundError(f"{root} does not exist on this rank")


# ---------------------------------------------------------------- the model's side


@dataclass(frozen=True)
class _Mine:
    """One tensor this rank checks: its state-dict names (aliases of a tie after the first)."""

    names: tuple[str, ...]
    kind: str  # "param" | "buffer"
    tensor: torch.Tensor  # as the model holds it (a DTensor where sharded)

    @property
    def local(self) -> torch.Tensor:
        t = self.tensor.detach()
        return t.to_local() if getattr(t, "placements", None) is not None else t

    @property
    def cut_placements(self) -> tuple[Any, ...] | None:
        placements = getattr(self.tensor, "placements", None)
        return tuple(placements) if placements is not None else None


def _mine(model: nn.Module) -> tuple[list[_Mine], Any]:
    where = placement(model)
    names = state_dict_names(model, where.placed)
    out = []
    seen: set[int] = set()
    for kind, pairs in (("param", model.named_parameters()), ("buffer", model.named_buffers())):
        for path, tensor in pairs:
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            if id(tensor) in names:
                out.append(_Mine(names[id(tensor)], kind, tensor))
            elif kind == "param":  # reached only through the load hooks (fused): by its path
                fused = [k for k in where.fused if where.placed.get(k) is tensor]
                out.append(_Mine(tuple(fused) or (path,), kind, tensor))
            # a buffer outside the state dict is non-persistent: no checkpoint holds it
    return out, where


def _entry_for(names: Sequence[str], entries: Mapping[str, Any]) -> str | None:
    """The checkpoint's entry for a tensor: its state-dict names, then without wrapper levels,
    each also under ``model.``."""
    for name in names:
        plain = ".".join(p for p in name.split(".") if p not in _WRAPPER_LEVELS)
        for candidate in dict.fromkeys((name, plain)):
            for prefix in _PREFIXES:
                if prefix + candidate in entries:
                    return prefix + candidate
    return None


# ---------------------------------------------------------------- the check


def verify_source(
    model: nn.Module | None,
    path: str | os.PathLike[str],
    *,
    group: Any = None,
) -> VerifyResult:
    """Collective over ``group`` (gloo, bounded by its timeout; None: the default group): every
    rank checks its own tensors against ``path`` and sends rank 0 (the group's first rank) its
    mismatches. Rank 0 returns them all, each rank its own; a rank that could not read sends
    that instead, so no rank waits for another's failure."""
    ranks = list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    rank = dist.get_rank()
    try:
        if model is None:
            raise RuntimeError("this rank built no model")
        mine = check_rank(model, path, rank)
    except Exception as exc:  # this rank's failure travels in the gather, as a mismatch
        log.warning("rank %d: --source %s could not be checked", rank, path, exc_info=True)
        failed = {
            "name": "*",
            "kind": "source",
            "rank": rank,
            "looks_like": str(SourceLook.UNREADABLE),
            "reason": f"could not be read on this rank: {type(exc).__name__}: {exc}",
        }
        mine = _RankCheck(0, (failed,))
    gathered: list[Any] | None = [None] * len(ranks) if rank == ranks[0] else None
    dist.gather_object(mine, gathered, dst=ranks[0], group=group)
    reports = gathered if gathered is not None else [mine]
    mismatches = tuple(m for r in reports for m in r.mismatches)
    checked = max((r.checked for r in reports), default=0)
    return VerifyResult(
        ran=True, passed=not mismatches, checked=checked, mismatches=_grouped(mismatches)
    )


@dataclass(frozen=True)
class _RankCheck:
    checked: int
    mismatches: tuple[Mapping[str, Any], ...]


def check_rank(model: nn.Module, path: str | os.PathLike[str], rank: int) -> _RankCheck:
    """This rank alone: each of its tensors against its slice of ``path``."""
    # The state dict first: a model whose state-dict hooks gather (a fused DTensor) runs a
    # collective there, which every rank must reach whatever it finds on disk.
    tensors, where = _mine(model)
    reader = open_source(path)
    fused = set(where.fused)
    mismatches: list[dict[str, Any]] = []
    plain: list[tuple[_Mine, str, _Cut]] = []
    hooked: list[_Mine] = []
    for mine in tensors:
        entry = _entry_for(mine.names, reader.entries)
        if entry is None and mine.names[0] in fused:
            hooked.append(mine)
        elif entry is None:
            mismatches.append(_mismatch(mine, rank, SourceLook.MISSING, "not in the checkpoint"))
        else:
            placements = mine.cut_placements
            mesh = mine.tensor.device_mesh if placements is not None else None
            plain.append((mine, entry, _Cut(entry, placements, mesh)))
    streamed = _stream_all(reader, [cut for _, _, cut in plain])
    for (mine, entry, cut), (_, expected) in zip(plain, streamed, strict=True):
        explain = len(mismatches) < _EXPLAINED
        found = _judge(mine, entry, expected, cut, reader, rank, explain)
        if found is not None:
            mismatches.append(found)
    if hooked:
        mismatches.extend(_judge_hooked(model, hooked, where, reader, rank))
    log.debug(
        "rank %d: %d tensors against %s (%s): %d differ",
        rank,
        len(tensors),
        path,
        reader.format,
        len(mismatches),
    )
    return _RankCheck(len(tensors), tuple(mismatches))


def _judge_hooked(
    model: nn.Module, hooked: Sequence[_Mine], where: Any, reader: Any, rank: int
) -> list[dict[str, Any]]:
    """Tensors only the load hooks reach: the entries they derive from, read whole, through the
    hooks, then this rank's slice of what they make."""
    derived = [e for e in where.derived if _entry_for([e], reader.entries) is not None]
    cuts = {e: _Cut(_entry_for([e], reader.entries)) for e in derived}
    read = reader.read(list(cuts.values()))
    made = through_hooks_source(where, model, {e: read[c] for e, c in cuts.items()})
    out = []
    for mine in hooked:
        full = made.get(mine.names[0])
        if full is None:
            out.append(_mismatch(mine, rank, SourceLook.MISSING, "no checkpoint entry reaches it"))
            continue
        expected = expected_shard(full, mine.tensor, rank)
        found = _compare(mine, expected, rank, None, None)
        if found is not None:
            placements = mine.cut_placements
            if placements is not None:  # where the shard sits in the fused tensor
                cut = _Cut(mine.names[0], placements, mine.tensor.device_mesh)
                shape, offset = _box(tuple(full.shape), cut)
                found.update(slice=_slice_text(offset, shape), offset=list(offset))
                found["placements"] = [str(p) for p in placements]
                first = found.get("first")
                if first:
                    pairs = zip(first["index"], offset, strict=True)
                    first["full_index"] = [i + o for i, o in pairs]
            out.append(found)
    return out


def _mismatch(mine: _Mine, rank: int, look: SourceLook, reason: str, **more: Any) -> dict:
    return {
        "name": mine.names[0],
        "kind": mine.kind,
        "rank": rank,
        "looks_like": str(look),
        "reason": reason,
        **more,
    }


def _judge(
    mine: _Mine,
    entry: str,
    expected: torch.Tensor,
    cut: _Cut,
    reader: Any,
    rank: int,
    explain: bool,
) -> dict[str, Any] | None:
    found = _compare(mine, expected, rank, cut, reader, explain)
    if found is not None and entry != mine.names[0]:
        found["entry"] = entry
    return found


def _compare(
    mine: _Mine,
    expected: torch.Tensor,
    rank: int,
    cut: _Cut | None,
    reader: Any,
    explain: bool = True,
) -> dict[str, Any] | None:
    """``explain``: the look may be worked out from more reads of the checkpoint."""
    local = mine.local
    if local.is_meta:
        return _mismatch(mine, rank, SourceLook.META, "still on meta (never materialised)")
    same_shape = tuple(local.shape) == tuple(expected.shape)
    if same_shape and local.dtype == expected.dtype:
        # On the shard's own device: the slice crosses to it once; nothing comes back.
        if _same_bytes(local, expected.to(local.device, non_blocking=False)):
            return None
    local = local.cpu()  # a mismatch: worked out on the host, where the checkpoint is
    where = _where(mine, expected, cut, reader)
    if not same_shape:
        look, why = _look_other(local, cut, reader) if explain else (None, "")
        reason = f"local shape {list(local.shape)}, the checkpoint's slice {list(expected.shape)}"
        return _mismatch(mine, rank, look or SourceLook.SHAPE, _why(reason, why), **where)
    cast = expected.to(local.dtype) if local.dtype != expected.dtype else expected
    if cast is not expected and _same_bytes(local, cast):
        return _mismatch(
            mine,
            rank,
            SourceLook.CAST,
            f"cast on load: the checkpoint holds {_dtype(expected.dtype)}, this rank "
            f"{_dtype(local.dtype)} (equal after the cast)",
            checkpoint_dtype=_dtype(expected.dtype),
            model_dtype=_dtype(local.dtype),
            **where,
        )
    first = _first_difference(local, cast, where.get("offset"))
    look, why = None, ""
    if _same_rows(local, cast):
        look, why = SourceLook.PERMUTED_ROWS, "the same rows in another order"
    elif explain:
        look, why = _look_other(local, cut, reader)
    reason = _why("values differ from the checkpoint", why)
    if cast is not expected:  # compared after the cast: say so, and which dtypes
        reason += f" (compared cast from its {_dtype(expected.dtype)} to {_dtype(local.dtype)})"
    return _mismatch(mine, rank, look or SourceLook.VALUES, reason, first=first, **where)


def _why(reason: str, why: str) -> str:
    return f"{reason}: {why}" if why else reason


def _where(mine: _Mine, expected: torch.Tensor, cut: _Cut | None, reader: Any) -> dict:
    if cut is None:
        return {"slice": _slice_text((0,) * expected.dim(), tuple(expected.shape))}
    shape, _ = reader.entries[cut.entry]
    local, offset = _box(shape, cut)
    out = {"slice": _slice_text(offset, local), "offset": list(offset)}
    if cut.placements is not None:
        out["placements"] = [str(p) for p in cut.placements]
    return out


def _slice_text(offset: Sequence[int], shape: Sequence[int]) -> str:
    return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(offset, shape, strict=True)) + "]"


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _first_difference(
    local: torch.Tensor, expected: torch.Tensor, offset: Sequence[int] | None
) -> dict[str, Any] | None:
    """The first element (row-major) whose bytes differ: its index in the local shard and in
    the full tensor, and both values."""
    if local.numel() == 0:
        return None
    words = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    kind = words.get(local.element_size())
    a, b = local.contiguous(), expected.contiguous()
    differs = a.view(kind) != b.view(kind) if kind is not None else a != b
    where = differs.reshape(-1).nonzero()
    if not where.numel():
        return None
    flat = int(where[0])
    index = [int(i) for i in torch.unravel_index(torch.tensor(flat), local.shape)]
    full = [i + o for i, o in zip(index, offset or [0] * len(index), strict=True)]
    return {
        "index": index,
        "full_index": full,
        "model": a.reshape(-1)[flat].item(),
        "checkpoint": b.reshape(-1)[flat].item(),
    }


def _same_rows(local: torch.Tensor, expected: torch.Tensor) -> bool:
    """The same multiset of rows (dim 0) in another order: q/k heads permuted on load."""
    if local.dim() < 2 or not 2 <= local.shape[0] <= _ROWS_SORTED:
        return False
    a = local.contiguous().view(torch.uint8).reshape(local.shape[0], -1)
    b = expected.contiguous().view(torch.uint8).reshape(expected.shape[0], -1)
    return sorted(bytes(r) for r in a.numpy()) == sorted(bytes(r) for r in b.numpy())


def _look_other(
    local: torch.Tensor, cut: _Cut | None, reader: Any
) -> tuple[SourceLook | None, str]:
    """Reads of the same size that may explain a difference: the entry cut along its other dim
    (a transpose, or the wrong shard dim), then other entries of the same shape (another
    tensor's bytes)."""
    if cut is None:
        return None, ""
    try:
        return _look_other_reads(local, cut, reader)
    except Exception:  # a diagnosis only: the mismatch stands without it
        log.debug("the mismatch of %s could not be explained", cut.entry, exc_info=True)
        return None, ""


def _look_other_reads(local: torch.Tensor, cut: _Cut, reader: Any) -> tuple[SourceLook | None, str]:
    shape, dtype = reader.entries[cut.entry]
    if len(shape) == 2:
        other = _swapped(cut)
        got = reader.read([other])[other].to(local.dtype)
        if tuple(got.T.shape) == tuple(local.shape) and _same_bytes(local, got.T.contiguous()):
            return SourceLook.TRANSPOSED, "it holds the transpose of the checkpoint's slice"
        if other.placements is not None and got.numel() == local.numel():
            flat = got.reshape(local.shape)
            if _same_bytes(local, flat):
                dims = [str(p) for p in other.placements]
                return SourceLook.SHARD_DIM, (
                    f"it holds the checkpoint's slice cut as {dims} (another shard dim), "
                    "laid into this shard's shape"
                )
    others = [
        e for e, (s, _) in reader.entries.items() if e != cut.entry and tuple(s) == tuple(shape)
    ][:_MAX_OTHERS]
    cuts = [_Cut(e, cut.placements, cut.mesh) for e in others]
    for other, got in reader.read(cuts).items():
        if tuple(got.shape) == tuple(local.shape) and _same_bytes(local, got.to(local.dtype)):
            return SourceLook.OTHER_TENSOR, f"it holds the checkpoint's {other.entry}"
    return None, ""


def _swapped(cut: _Cut) -> _Cut:
    """``cut`` along the other dim of a 2-D entry (the whole entry stays whole)."""
    if cut.placements is None:
        return cut

    swapped = tuple(Shard(1 - p.dim % 2) if type(p) is Shard else p for p in cut.placements)
    return _Cut(cut.entry, swapped, cut.mesh)


def _grouped(mismatches: Sequence[Mapping[str, Any]]) -> tuple[dict[str, Any], ...]:
    """One mismatch per tensor and look, with the ranks it holds for and each rank's slice."""
    by: dict[tuple[str, str, str], dict[str, Any]] = {}
    for m in mismatches:
        key = (str(m["name"]), str(m["kind"]), str(m["looks_like"]))
        entry = by.setdefault(
            key,
            {
                "name": key[0],
                "kind": key[1],
                "looks_like": key[2],
                "reason": m["reason"],
                "ranks": [],
                "per_rank": [],
            },
        )
        entry["ranks"].append(int(m["rank"]))
        entry["per_rank"].append({k: v for k, v in m.items() if k not in ("name", "kind")})
    return tuple(sorted(by.values(), key=lambda e: (e["name"], e["looks_like"])))
