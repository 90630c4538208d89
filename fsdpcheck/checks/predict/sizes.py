"""Bytes per tensor, as a broadcast moves them: what decides a hang from a silent fill."""

from __future__ import annotations

from fsdpcheck.records import TensorRecord

ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1,
    "bits8": 1, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1, "bits16": 2,
    "qint8": 1, "quint8": 1, "quint4x2": 1, "quint2x4": 1, "qint32": 4,
    "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2, "complex32": 4,
    "int32": 4, "uint32": 4, "float32": 4,
    "int64": 8, "uint64": 8, "float64": 8, "complex64": 8,
    "complex128": 16,
}  # fmt: skip


def itemsize(dtype: str | None) -> int | None:
    """Bytes per element of a torch dtype name (``float32`` or ``torch.float32``)."""
    if dtype is None:
        return None
    return ITEMSIZE.get(dtype.removeprefix("torch."))


def nbytes(t: TensorRecord | None) -> int | None:
    size = itemsize(t.dtype) if t is not None else None
    return None if size is None else t.numel * size


def sizes(a: TensorRecord | None, b: TensorRecord | None) -> tuple[int | None, int | None]:
    """Bytes of both sides; for a dtype missing from :data:`ITEMSIZE` on both sides alike,
    element counts stand in (same dtype: bytes are proportional to elements)."""
    size_a, size_b = nbytes(a), nbytes(b)
    if (size_a is None or size_b is None) and a is not None and b is not None:
        if a.dtype == b.dtype:
            return a.numel, b.numel
    return size_a, size_b
