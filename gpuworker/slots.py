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

from native import _slotcopy
from shared.safetensors_index import DTYPE_SIZES, mlx_dtype, numpy_dtype

__all__ = [
    "COPY",
    "ZERO_COPY",
    "SlotCounters",
    "SlotCountersSnapshot",
    "SlotTensorLike",
    "StackBuffers",
    "WrapStats",
    "mlx_storage_dtype",
    "slot_arrays",
    "stacked_slot_arrays",
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


@functools.lru_cache(maxsize=4096)
def _stack_names(layout: tuple, slot_bytes: int) -> tuple[str, ...]:
    """The tensor names of a checked layout, in its order (layouts are immutable and cached by
    the store: each is checked once)."""
    _check_layout(layout, slot_bytes)
    return tuple(tensor.name for tensor in layout)


@functools.lru_cache(maxsize=65536)
def _stack_offsets(layout: tuple, first: tuple, slot_bytes: int) -> tuple[int, ...]:
    """The offsets in `layout` of `first`'s tensors, in `first`'s order; both must hold the same
    tensors (name, dtype, shape)."""
    _check_layout(layout, slot_bytes)
    by_name = {tensor.name: tensor for tensor in layout}
    if sorted((t.name, t.dtype, tuple(t.shape)) for t in layout) != sorted(
        (t.name, t.dtype, tuple(t.shape)) for t in first
    ):
        raise ValueError("stacked slots must hold the same tensors (name, dtype, shape)")
    return tuple(by_name[tensor.name].offset for tensor in first)


def _slot_window_start(buffer, slot: int, slot_bytes: int) -> int:
    """Where one slot starts in the slab buffer, checked to lie inside it."""
    if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)) or slot < 0:
        raise ValueError(f"slot must be a non-negative int, got {slot!r}")
    if isinstance(slot_bytes, bool) or not isinstance(slot_bytes, (int, np.integer)) or slot_bytes <= 0:
        raise ValueError(f"slot_bytes must be a positive int, got {slot_bytes!r}")
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


# --------------------------------------------------------------------------- stacked, one copy


class StackBuffers:
    """MLX arrays of shape [n, *tensor shape] that a wave's slots are copied into.

    The streamed module needs each tensor of a wave stacked over the wave's
    experts. Building per-expert arrays and then `mx.stack`ing them copies
    every byte twice (slot -> MLX, MLX -> stacked); copying each slot's
    tensors straight into rows of a stacked MLX array copies them once, and
    the result is the same bytes, so the module computes bit for bit what it
    computed before. MLX arrays are immutable as far as MLX knows: writing one
    through its (CPU) buffer is only sound because the writer is the only
    holder of the array between waves (the module drops the arrays it was
    given, and evaluates every output that read them, before the wave's fence,
    which precedes the next wave's copy), and because the pool's own reference
    keeps MLX from donating the buffer to an op's output.

    Sets of at most `max_pooled` experts are kept and reused, per (n, tensor
    specs): a decode wave always has top-k experts, so one set serves every
    layer of every token; at most `max_sets` sets are kept. A batched decode
    wave (the union of several rows' experts: up to `max_rows`, its size
    varying from layer to layer) takes the first n rows of a kept set of the
    next power of two, when that set is at most `max_batch_bytes`. Larger
    waves (prefill) get fresh buffers each time, which MLX frees (to its
    cache) once the wave is done, so prefill does not pin working-bank-sized
    memory.
    """

    def __init__(
        self, *, max_pooled: int = 64, max_sets: int = 2, max_rows: int = 0, max_batch_bytes: int = 32 << 20
    ) -> None:
        self._sets: dict[tuple, dict[str, tuple[np.ndarray, mx.array]]] = {}
        self._max_pooled = max_pooled
        self._max_sets = max_sets
        self._max_rows = max_rows
        self._max_batch_bytes = max_batch_bytes

    def clear(self) -> None:
        self._sets.clear()

    @property
    def pooled_bytes(self) -> int:
        return sum(raw.nbytes for buffers in self._sets.values() for raw, _ in buffers.values())

    def get(self, n: int, layout: Sequence[SlotTensorLike], *, tag: int = -1) -> dict[str, tuple[np.ndarray, mx.array]]:
        """{name: (writable uint8 numpy view [n, nbytes], the MLX array [n, *shape])}.

        `tag` tells apart sets in use at the same time (the parts of one wave)."""
        rows = n
        if n > self._max_pooled:
            rows = 1 << (n - 1).bit_length()
            if n > self._max_rows or rows * sum(t.nbytes for t in layout) > self._max_batch_bytes:
                return {t.name: _stack_buffer(n, t) for t in layout}
        key = (tag, rows, _pool_key(tuple(layout)))
        found = self._sets.pop(key, None)
        if found is None:
            found = {t.name: _stack_buffer(rows, t) for t in layout}
        self._sets[key] = found  # most recently used last
        while len(self._sets) > self._max_sets:
            del self._sets[next(iter(self._sets))]
        if rows == n:
            return found
        return {name: (raw[:n], array[:n]) for name, (raw, array) in found.items()}  # the same memory


@functools.lru_cache(maxsize=4096)
def _pool_key(layout: tuple) -> tuple:
    # Sorted: layers order the same tensors differently (by file offset).
    return tuple(sorted((t.name, t.dtype, tuple(t.shape)) for t in layout))


def _stack_buffer(n: int, tensor: SlotTensorLike) -> tuple[np.ndarray, mx.array]:
    """An MLX array [n, *shape] of the tensor's MLX dtype and a writable uint8 view of its memory."""
    storage = numpy_dtype(tensor.dtype)
    base = mx.zeros((n, *tensor.shape), dtype=_mlx_dtype_of_numpy(storage))  # materialised by eval below
    target = mlx_storage_dtype(tensor.dtype)
    array = base if base.dtype == target else base.view(target)  # BF16 <- uint16: same buffer
    mx.eval(array)
    host = np.array(base, copy=False)  # a view of MLX's buffer, not a copy
    raw = host.reshape(n, -1).view(np.uint8)
    if raw.shape != (n, tensor.nbytes) or not raw.flags.writeable or not raw.flags.c_contiguous:
        raise RuntimeError(f"stack buffer for {tensor.name!r}: unexpected host view {raw.shape} {raw.flags}")
    # The array handed out must read the bytes written through `raw` (a view that copied would not).
    # Whether it does is MLX's behaviour for the dtype pair: checked once per pair (a probe syncs).
    pair = (storage.str, str(target))
    if pair not in _SHARED_PAIRS:
        raw[-1, -1] = 1
        probe = array.view(mx.uint8).reshape(n, -1)[-1, -1].item()
        raw[-1, -1] = 0
        if probe != 1:
            raise RuntimeError(f"stack buffer for {tensor.name!r}: MLX array does not share the host buffer")
        _SHARED_PAIRS.add(pair)
    return raw, array


_SHARED_PAIRS: set[tuple[str, str]] = set()  # (numpy storage, MLX dtype) pairs whose arrays share the host buffer


def _mlx_dtype_of_numpy(dtype: np.dtype) -> mx.Dtype:
    return getattr(mx, np.dtype(dtype).name)


def stacked_slot_arrays(
    buffer,
    slots: Sequence[int],
    slot_bytes: int,
    layouts: Sequence[Sequence[SlotTensorLike]],
    pool: StackBuffers,
    *,
    tag: int = -1,
) -> tuple[dict[str, mx.array], WrapStats]:
    """The tensors of the experts in `slots` (in that order), stacked: `{name: [n, *shape]}`.

    One copy per tensor per expert, straight from the slot into MLX memory
    (`StackBuffers`); the copy path only (CPU, CUDA). Every layout must name
    the same tensors with the same dtypes and shapes (offsets may differ).
    Arrays come from `pool` and are overwritten by its next use with the same
    `tag`: the caller must have evaluated and dropped everything that read
    them by then.
    """
    if len(slots) != len(layouts) or not slots:
        raise ValueError(f"{len(slots)} slots but {len(layouts)} layouts")
    first = tuple(layouts[0])
    names = _stack_names(first, int(slot_bytes))
    offsets = [_stack_offsets(tuple(layout), first, int(slot_bytes)) for layout in layouts]
    starts = [_slot_window_start(buffer, slot, slot_bytes) for slot in slots]
    target = pool.get(len(slots), first, tag=tag)
    lengths = [tensor.nbytes for tensor in first]
    # One native call for every tensor of every slot (72 small copies for a decode layer of 8
    # experts of 9 tensors: in Python their interpreter time outweighed the bytes).
    _slotcopy.stack(
        buffer,
        [target[name][0] for name in names],
        lengths,
        [start + offset for start, row in zip(starts, offsets) for offset in row],
    )
    nbytes = sum(lengths) * len(slots)
    return {name: array for name, (_, array) in target.items()}, WrapStats(
        COPY, len(first) * len(slots), nbytes, nbytes
    )
