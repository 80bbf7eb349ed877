"""Leased slab slots -> mx.arrays, by the one path the backend allows.

A slot holds one expert: its tensors at the offsets of the store's in-slot
layout (`shared.store.SlotTensor`: name, dtype, shape, offset, nbytes). Two
paths, chosen once by a capability check:

- zero copy (Metal, mlx >= 0.32.1): `mx.asarray(host_view, copy=False)` wraps
  the page-aligned slot without copying; the tensors are MLX slices of it.
  Such arrays read the slab itself, which is why the fence may only follow
  their last use (eval) *and* their release.
- copy (CPU, CUDA, and Metal when the wrap is refused): every tensor is copied
  once, exactly its bytes, when the array is built. The arrays never alias the
  slab afterwards.

Telemetry (`WrapStats`, `SlotCounters`) says which path ran and how many
bytes were copied; that copy is part of the lease on CPU and CUDA.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
import numpy as np

from shared.safetensors_index import DTYPE_SIZES, mlx_dtype, numpy_dtype

__all__ = [
    "COPY",
    "ZERO_COPY",
    "SlotCounters",
    "SlotCountersSnapshot",
    "SlotTensorLike",
    "WrapStats",
    "mlx_storage_dtype",
    "slot_arrays",
    "zero_copy_supported",
]

logger = logging.getLogger(__name__)

COPY = "copy"
ZERO_COPY = "zero_copy"
# Metal's newBufferWithBytesNoCopy wants page-aligned memory (16 KiB on Apple silicon).
_ZERO_COPY_ALIGNMENT = 16 * 1024


class SlotTensorLike(Protocol):
    """What `slot_arrays` needs of one in-slot tensor (shared.store.SlotTensor fits)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class WrapStats:
    """What one `slot_arrays` call did."""

    path: str  # COPY or ZERO_COPY
    tensors: int
    nbytes: int  # bytes of the tensors handed out
    bytes_copied: int  # host bytes copied into MLX (0 on the zero-copy path)


@dataclass(frozen=True, slots=True)
class SlotCountersSnapshot:
    copy_calls: int
    zero_copy_calls: int
    bytes_copied: int
    bytes_wrapped: int


class SlotCounters:
    """Running totals of `WrapStats`, for the worker's telemetry."""

    def __init__(self) -> None:
        self._copy_calls = 0
        self._zero_copy_calls = 0
        self._bytes_copied = 0
        self._bytes_wrapped = 0

    def add(self, stats: WrapStats) -> None:
        if stats.path == ZERO_COPY:
            self._zero_copy_calls += 1
            self._bytes_wrapped += stats.nbytes
        else:
            self._copy_calls += 1
        self._bytes_copied += stats.bytes_copied

    def snapshot(self) -> SlotCountersSnapshot:
        return SlotCountersSnapshot(self._copy_calls, self._zero_copy_calls, self._bytes_copied, self._bytes_wrapped)


def _version_at_least(version: str, minimum: tuple[int, ...]) -> bool:
    parts = []
    for piece in version.split(".")[: len(minimum)]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts) >= minimum


@functools.cache
def zero_copy_supported() -> bool:
    """Whether `mx.asarray(view, copy=False)` really wraps host memory here.

    Needs Metal as the default device and mlx >= 0.32.1; then a probe on a
    page-aligned buffer decides (MLX raises ValueError rather than copying
    when it cannot adopt the buffer). On CPU and CUDA MLX refuses
    ("Cannot import a CPU array without a copy"), so the probe is not even run.
    """
    try:
        metal = mx.metal.is_available() and mx.default_device() == mx.gpu
    except (AttributeError, RuntimeError):
        metal = False
    if not metal or not _version_at_least(mx.__version__, (0, 32, 1)):
        return False
    import mmap

    probe = mmap.mmap(-1, _ZERO_COPY_ALIGNMENT)
    try:
        view = np.frombuffer(probe, dtype=np.uint8)
        view[:4] = (1, 2, 3, 4)
        wrapped = mx.asarray(view, copy=False)
        view[0] = 9  # a true wrap sees the write
        ok = int(wrapped[0].item()) == 9
        del wrapped, view
    except (ValueError, TypeError, RuntimeError) as error:
        logger.info("zero-copy slot wrap unavailable: %s", error)
        ok = False
    finally:
        try:
            probe.close()
        except BufferError:  # MLX still holds the probe; leave it to the GC
            pass
    return ok


def mlx_storage_dtype(dtype: str) -> mx.Dtype:
    """The MLX dtype a slot tensor comes back as; MLX has no fp8 type, so F8 stays uint8
    (what mlx-lm's fp8/mxfp8 code expects to reinterpret itself)."""
    return mx.uint8 if dtype.startswith("F8_") else mlx_dtype(dtype)


def _check_layout(layout: Sequence[SlotTensorLike], slot_bytes: int) -> None:
    names = set()
    for tensor in layout:
        if tensor.name in names:
            raise ValueError(f"slot layout names tensor {tensor.name!r} twice")
        names.add(tensor.name)
        size = DTYPE_SIZES.get(tensor.dtype)
        if size is None:
            raise ValueError(f"tensor {tensor.name!r}: unknown safetensors dtype {tensor.dtype!r}")
        if tensor.nbytes != size * math.prod(tensor.shape):
            raise ValueError(
                f"tensor {tensor.name!r}: {tensor.nbytes} bytes do not hold {tensor.dtype} x {list(tensor.shape)}"
            )
        if tensor.offset < 0 or tensor.offset + tensor.nbytes > slot_bytes:
            raise ValueError(
                f"tensor {tensor.name!r}: bytes [{tensor.offset}, {tensor.offset + tensor.nbytes}) "
                f"are outside the {slot_bytes}-byte slot"
            )


def _slot_window_start(buffer, slot: int, slot_bytes: int, *, size: int | None = None) -> int:
    """Where one slot starts in the slab buffer, checked to lie inside it (`size`: the
    buffer's, when the caller already knows it)."""
    if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)) or slot < 0:
        raise ValueError(f"slot must be a non-negative int, got {slot!r}")
    if isinstance(slot_bytes, bool) or not isinstance(slot_bytes, (int, np.integer)) or slot_bytes <= 0:
        raise ValueError(f"slot_bytes must be a positive int, got {slot_bytes!r}")
    if size is None:
        size = memoryview(buffer).nbytes
    start = int(slot) * int(slot_bytes)
    if start + slot_bytes > size:
        end = start + slot_bytes
        raise ValueError(f"slot {slot} of {slot_bytes} bytes ends at byte {end}, past the {size}-byte slab")
    return start


def _slot_window(buffer, slot: int, slot_bytes: int) -> np.ndarray:
    """A uint8 numpy view (no copy) of one slot of the slab buffer."""
    start = _slot_window_start(buffer, slot, slot_bytes)
    return np.frombuffer(buffer, dtype=np.uint8, count=int(slot_bytes), offset=start)


def _copy_tensor(window: np.ndarray, tensor: SlotTensorLike) -> mx.array:
    """One copy of exactly the tensor's bytes; BF16 comes back through uint16."""
    stored = np.frombuffer(
        window, dtype=numpy_dtype(tensor.dtype), count=math.prod(tensor.shape), offset=tensor.offset
    ).reshape(tensor.shape)
    array = mx.array(stored)  # mx.array copies host memory when it is built
    target = mlx_storage_dtype(tensor.dtype)
    if array.dtype != target:
        array = array.view(target)  # same width: BF16 <- uint16
    return array


def _carve(base: mx.array, layout: Sequence[SlotTensorLike]) -> dict[str, mx.array]:
    """The tensors of a slot as slices/views of one uint8 MLX array of the whole slot."""
    tensors = {}
    for tensor in layout:
        target = mlx_storage_dtype(tensor.dtype)
        piece = base[tensor.offset : tensor.offset + tensor.nbytes]
        tensors[tensor.name] = piece.view(target).reshape(tensor.shape)
    return tensors


def _wrap_zero_copy(window: np.ndarray, layout: Sequence[SlotTensorLike]) -> dict[str, mx.array]:
    """Wrap the whole (page-aligned) slot once, then carve tensors out of it in MLX.

    Wrapping per tensor would not work: tensor offsets inside a slot follow the
    file's alignment, not the page size Metal needs.
    """
    base = mx.asarray(window, copy=False)
    return _carve(base, layout)


def slot_arrays(
    buffer,
    slot: int,
    slot_bytes: int,
    layout: Sequence[SlotTensorLike],
    *,
    zero_copy: bool | None = None,
) -> tuple[dict[str, mx.array], WrapStats]:
    """The tensors of the expert in `slot`, as `{name: mx.array}`, and what it cost.

    `buffer`: the whole slab (anything with the buffer protocol: mmap,
    bytearray, numpy uint8 array). `zero_copy`: None picks by
    `zero_copy_supported()`; True insists (ValueError where unsupported);
    False forces the copy path.
    """
    window = _slot_window(buffer, slot, slot_bytes)
    _check_layout(layout, int(slot_bytes))
    nbytes = sum(tensor.nbytes for tensor in layout)
    if zero_copy is None:
        zero_copy = zero_copy_supported()
    elif zero_copy and not zero_copy_supported():
        raise ValueError("zero-copy slot wrapping needs Metal and mlx >= 0.32.1")
    if zero_copy:
        address = window.__array_interface__["data"][0]
        if address % _ZERO_COPY_ALIGNMENT:
            raise ValueError(f"slot {slot} starts at an address not aligned to {_ZERO_COPY_ALIGNMENT} bytes")
        return _wrap_zero_copy(window, layout), WrapStats(ZERO_COPY, len(layout), nbytes, 0)
    tensors = {tensor.name: _copy_tensor(window, tensor) for tensor in layout}
    return tensors, WrapStats(COPY, len(layout), nbytes, nbytes)
