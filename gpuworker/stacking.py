"""Leased slots copied straight into stacked MLX arrays: the copy path's one copy (CPU, CUDA).

A streamed module computes a wave from each expert tensor stacked over the wave's experts
(`[n, *shape]`). `StackBuffers` keeps MLX-owned arrays of that shape with writable host views
of their memory, and `stack_into` copies the slots' tensors into rows of them in one native call
(`native/slotcopy.c`). Which layout a slot has is checked once per layout object (`_stack_spec`):
a decode layer copies top-k experts per token, and re-checking (or even hashing) their layouts
each time cost more than the bytes.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from gpuworker.slots import COPY, SlotTensorLike, WrapStats, _check_layout, _slot_window_start, mlx_storage_dtype
from native import _slotcopy
from shared.safetensors_index import numpy_dtype

__all__ = ["StackBuffers", "stack_into", "stacked_slot_arrays"]


@dataclass(frozen=True, slots=True)
class _StackSpec:
    """One checked layout, as a stacked copy needs it: its tensors in name order (the order of
    the pool's buffers), their in-slot offsets and lengths, and the pool key they share."""

    key: tuple  # sorted (name, dtype, shape): layouts that stack together have the same key
    tensors: tuple  # the layout's tensors, sorted by name
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]


# id(layout) -> (layout, slot_bytes, spec). Keyed by identity, not by value: hashing a tuple of
# dataclasses costs microseconds, and a decode layer looks up top-k layouts per token. The entry
# holds the layout itself, so its id cannot be reused while the entry lives; only tuples (which the
# store hands out, one per expert, immutable) are kept.
_SPECS: dict[int, tuple[tuple, int, _StackSpec]] = {}
_KEYS: dict[tuple, tuple] = {}  # equal keys -> one object, so specs compare keys by identity
_MAX_SPECS = 1 << 16


def _stack_spec(layout: Sequence[SlotTensorLike], slot_bytes: int) -> _StackSpec:
    """`layout` checked (once per layout object) and sorted by tensor name."""
    entry = _SPECS.get(id(layout))
    if entry is not None and entry[0] is layout and entry[1] == slot_bytes:
        return entry[2]
    _check_layout(layout, slot_bytes)
    tensors = tuple(sorted(layout, key=lambda tensor: tensor.name))
    key = _pool_key(tensors)  # the pool's own key: sorted (name, dtype, shape), as `tensors` are
    spec = _StackSpec(
        key=_KEYS.setdefault(key, key),
        tensors=tensors,
        offsets=tuple(t.offset for t in tensors),
        lengths=tuple(t.nbytes for t in tensors),
    )
    if type(layout) is tuple:
        if len(_SPECS) >= _MAX_SPECS:
            _SPECS.clear()
        _SPECS[id(layout)] = (layout, slot_bytes, spec)
    return spec


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

    def get(
        self, n: int, layout: Sequence[SlotTensorLike], *, tag: int = -1, key: tuple | None = None
    ) -> dict[str, tuple[np.ndarray, mx.array]]:
        """{name: (writable uint8 numpy view [n, nbytes], the MLX array [n, *shape])}.

        `tag` tells apart sets in use at the same time (the parts of one wave); `key`: the
        layout's sorted (name, dtype, shape), when the caller has it."""
        rows = n
        if n > self._max_pooled:
            rows = 1 << (n - 1).bit_length()
            if n > self._max_rows or rows * sum(t.nbytes for t in layout) > self._max_batch_bytes:
                return {t.name: _stack_buffer(n, t) for t in layout}
        key = (tag, rows, _pool_key(tuple(layout)) if key is None else key)
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
    spec = _stack_spec(layouts[0], int(slot_bytes))
    target = pool.get(len(slots), spec.tensors, tag=tag, key=spec.key)
    wrap = stack_into(buffer, slots, slot_bytes, layouts, target)
    return {name: array for name, (_, array) in target.items()}, wrap


def stack_into(
    buffer,
    slots: Sequence[int],
    slot_bytes: int,
    layouts: Sequence[Sequence[SlotTensorLike]],
    target: Mapping[str, tuple[np.ndarray, mx.array]],
    *,
    row: int = 0,
) -> WrapStats:
    """Copy the experts in `slots` into rows `row`, `row` + 1, ... of a `StackBuffers` set
    (`{name: (raw [m, nbytes], array)}`), one native call for all of them."""
    if len(slots) != len(layouts) or not slots:
        raise ValueError(f"{len(slots)} slots but {len(layouts)} layouts")
    slot_bytes = int(slot_bytes)
    specs = [_stack_spec(layout, slot_bytes) for layout in layouts]
    first = specs[0]
    if any(spec.key is not first.key for spec in specs):
        raise ValueError("stacked slots must hold the same tensors (name, dtype, shape)")
    size = memoryview(buffer).nbytes
    starts = [_slot_window_start(buffer, slot, slot_bytes, size=size) for slot in slots]
    end = row + len(slots)
    # One native call for every tensor of every slot (72 small copies for a decode layer of 8
    # experts of 9 tensors: in Python their interpreter time outweighed the bytes); it refuses
    # rows past the set's end.
    _slotcopy.stack(
        buffer,
        [target[tensor.name][0][row:end] for tensor in first.tensors],
        first.lengths,
        [start + offset for start, spec in zip(starts, specs) for offset in spec.offsets],
    )
    nbytes = sum(first.lengths) * len(slots)
    return WrapStats(COPY, len(first.lengths) * len(slots), nbytes, nbytes)
