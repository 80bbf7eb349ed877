"""gpuworker.slots: leased slots -> mx.arrays (copy path here; zero copy only on Metal)."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest

from gpuworker import slots, stacking
from gpuworker.slots import COPY, ZERO_COPY, SlotCounters, slot_arrays, zero_copy_supported

SLOT = 16 * 1024


@dataclass(frozen=True)
class Tensor:  # duck-types shared.store.SlotTensor
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _sources() -> dict[str, tuple[str, mx.array]]:
    """One tensor per dtype the store hands out, with values that survive the round trip."""
    rng = np.random.default_rng(0)
    values = rng.standard_normal((8, 16)).astype(np.float32)
    return {
        "gate_proj.weight": ("F32", mx.array(values)),
        "gate_proj.scales": ("F16", mx.array(values[:4]).astype(mx.float16)),
        "up_proj.weight": ("BF16", mx.array(values[4:]).astype(mx.bfloat16)),
        "up_proj.biases": ("BF16", mx.array(values[:2, :3]).astype(mx.bfloat16)),  # odd byte count
        "down_proj.weight": ("U32", mx.array(rng.integers(0, 2**32, (8, 2), dtype=np.uint32))),
        "down_proj.scales": ("U8", mx.array(rng.integers(0, 256, (8, 1), dtype=np.uint8))),
        "down_proj.bias": ("I8", mx.array(rng.integers(-128, 128, (5,), dtype=np.int8))),
        "fc1.bias": ("I32", mx.array(rng.integers(-1000, 1000, (3,), dtype=np.int32))),
    }


def _raw(array: mx.array) -> bytes:
    if array.dtype == mx.bfloat16:
        array = array.view(mx.uint16)
    return np.array(array).tobytes()


def _fill(buffer, slot: int, sources, *, start: int = 8) -> tuple[Tensor, ...]:
    """Write `sources` into `slot` at unaligned offsets, as a store layout would place them."""
    view = np.frombuffer(buffer, dtype=np.uint8)
    layout, cursor = [], start
    for name, (dtype, array) in sources.items():
        data = _raw(array)
        base = slot * SLOT + cursor
        view[base : base + len(data)] = np.frombuffer(data, dtype=np.uint8)
        layout.append(Tensor(name, dtype, tuple(array.shape), cursor, len(data)))
        cursor += len(data) + 2  # gaps, like O_DIRECT slack
    return tuple(layout)


def test_copy_path_values_equal_sources_and_do_not_alias_the_slab():
    buffer = bytearray(3 * SLOT)
    sources = _sources()
    layout = _fill(buffer, 1, sources)
    arrays, stats = slot_arrays(buffer, 1, SLOT, layout, zero_copy=False)
    assert stats.path == COPY
    assert stats.tensors == len(sources)
    assert stats.bytes_copied == stats.nbytes == sum(tensor.nbytes for tensor in layout)
    for name, (_, source) in sources.items():
        assert arrays[name].dtype == source.dtype, name
        assert arrays[name].shape == source.shape, name
        assert mx.array_equal(arrays[name], source).item(), name
    # The slot is reused by the next lease: the arrays must not change.
    buffer[:] = b"\xff" * len(buffer)
    for name, (_, source) in sources.items():
        assert mx.array_equal(arrays[name], source).item(), name


def test_default_path_here_is_the_copy_path():
    buffer = np.zeros(2 * SLOT, dtype=np.uint8)
    layout = _fill(buffer, 0, _sources())
    if not zero_copy_supported():
        _arrays, stats = slot_arrays(buffer, 0, SLOT, layout)
        assert stats.path == COPY
        with pytest.raises(ValueError, match="zero-copy"):
            slot_arrays(buffer, 0, SLOT, layout, zero_copy=True)


def test_copy_path_over_a_real_slab_releases_its_buffer():
    slab_module = pytest.importorskip("shared.slab")
    sources = _sources()
    with slab_module.Slab.create(total_slots=2, slot_bytes=SLOT) as slab:
        layout = _fill(slab.buffer, 1, sources)
        arrays, _stats = slot_arrays(slab.buffer, 1, SLOT, layout)
        view = np.frombuffer(slab.buffer, dtype=np.uint8)
        view[:] = 0
        del view
        for name, (_, source) in sources.items():
            assert mx.array_equal(arrays[name], source).item(), name
        slab.close()  # BufferError if slot_arrays left a numpy view of the slab exported
        assert slab.closed


def test_carving_used_by_the_zero_copy_path():
    """The zero-copy path carves tensors out of one uint8 array of the slot; check it on CPU."""
    buffer = bytearray(SLOT)
    sources = _sources()
    layout = _fill(buffer, 0, sources)
    base = mx.array(np.frombuffer(bytes(buffer), dtype=np.uint8))
    carved = slots._carve(base, layout)
    for name, (_, source) in sources.items():
        assert carved[name].dtype == source.dtype and mx.array_equal(carved[name], source).item(), name


@pytest.mark.skipif(not zero_copy_supported(), reason="zero-copy wrapping needs Metal and mlx >= 0.32.1")
def test_zero_copy_path_aliases_the_slab():  # pragma: no cover - Metal only
    import mmap

    buffer = mmap.mmap(-1, 2 * SLOT)  # page aligned, like the slab
    sources = _sources()
    layout = _fill(buffer, 1, sources)
    arrays, stats = slot_arrays(buffer, 1, SLOT, layout)
    assert stats.path == ZERO_COPY and stats.bytes_copied == 0
    for name, (_, source) in sources.items():
        assert mx.array_equal(arrays[name], source).item(), name
    first = layout[0]
    view = np.frombuffer(buffer, dtype=np.float32, count=1, offset=SLOT + first.offset)
    view[0] = 12345.0  # a true wrap sees writes to the slot
    assert arrays[first.name].reshape(-1)[0].item() == 12345.0


def test_layout_and_slot_are_checked():
    buffer = bytearray(2 * SLOT)
    good = Tensor("w", "F32", (4,), 0, 16)
    with pytest.raises(ValueError, match="outside"):
        slot_arrays(buffer, 0, SLOT, [Tensor("w", "F32", (4,), SLOT - 8, 16)])
    with pytest.raises(ValueError, match="do not hold"):
        slot_arrays(buffer, 0, SLOT, [Tensor("w", "F32", (4,), 0, 12)])
    with pytest.raises(ValueError, match="unknown"):
        slot_arrays(buffer, 0, SLOT, [Tensor("w", "Q4", (4,), 0, 16)])
    with pytest.raises(ValueError, match="twice"):
        slot_arrays(buffer, 0, SLOT, [good, good])
    with pytest.raises(ValueError, match="past"):
        slot_arrays(buffer, 2, SLOT, [good])
    with pytest.raises(ValueError, match="slot must"):
        slot_arrays(buffer, -1, SLOT, [good])


def test_counters_accumulate():
    buffer = bytearray(SLOT)
    layout = _fill(buffer, 0, _sources())
    counters = SlotCounters()
    for _ in range(3):
        _, stats = slot_arrays(buffer, 0, SLOT, layout, zero_copy=False)
        counters.add(stats)
    snapshot = counters.snapshot()
    assert snapshot.copy_calls == 3 and snapshot.zero_copy_calls == 0
    assert snapshot.bytes_copied == 3 * sum(tensor.nbytes for tensor in layout)


# ---------------------------------------------------------------------------------------------
# Stacked, one copy: slots straight into [n, ...] arrays (what the lease client hands the module)


def _random_sources(seed: int) -> dict[str, tuple[str, mx.array]]:
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((8, 16)).astype(np.float32)
    return {
        "gate_proj.weight": ("U32", mx.array(rng.integers(0, 2**32, (8, 4), dtype=np.uint32))),
        "gate_proj.scales": ("F32", mx.array(values[:, :2])),
        "gate_proj.biases": ("BF16", mx.array(values[:3]).astype(mx.bfloat16)),
        "up_proj.scales": ("F16", mx.array(values[:2, :3]).astype(mx.float16)),  # odd byte count
    }


def _filled(slots_and_seeds, *, order=None):
    buffer = bytearray(6 * SLOT)
    layouts = {}
    for slot, seed in slots_and_seeds:
        sources = _random_sources(seed)
        if order is not None:
            sources = {name: sources[name] for name in order}
        layouts[slot] = _fill(buffer, slot, sources, start=8 + 16 * slot)
    return buffer, layouts


@pytest.mark.parametrize("max_pooled", [8, 2], ids=["pooled", "fresh"])
def test_stacked_equals_stack_of_copies_bit_for_bit(max_pooled):
    names = list(_random_sources(0))
    buffer, layouts = _filled([(4, 1), (1, 2), (3, 3)], order=names)
    # One slot's layout names the same tensors in another order (stores order them by file offset).
    buffer2, reordered = _filled([(5, 4)], order=list(reversed(names)))
    buffer[5 * SLOT : 6 * SLOT] = buffer2[5 * SLOT : 6 * SLOT]
    layouts.update(reordered)
    slots_ = [4, 1, 5, 3]
    pool = stacking.StackBuffers(max_pooled=max_pooled)
    stacked, stats = stacking.stacked_slot_arrays(buffer, slots_, SLOT, [layouts[s] for s in slots_], pool)
    singles = [slot_arrays(buffer, s, SLOT, layouts[s], zero_copy=False)[0] for s in slots_]
    assert stats.path == COPY and stats.bytes_copied == stats.nbytes == sum(
        t.nbytes for s in slots_ for t in layouts[s]
    )
    assert set(stacked) == set(names)
    for name in names:
        want = mx.stack([single[name] for single in singles])
        got = stacked[name]
        assert got.dtype == want.dtype and got.shape == want.shape
        assert _raw(got) == _raw(want), name  # the same bytes: the kernels see the same input
    # The slab is not aliased: scribbling on it changes nothing already handed out.
    before = {name: _raw(array) for name, array in stacked.items()}
    np.frombuffer(buffer, dtype=np.uint8)[:] = 0xFF
    assert {name: _raw(array) for name, array in stacked.items()} == before


def test_pooled_buffers_are_reused_and_rewritten():
    buffer, layouts = _filled([(0, 1), (1, 2), (2, 3), (3, 4)], order=list(_random_sources(0)))
    pool = stacking.StackBuffers(max_pooled=4)
    first, _ = stacking.stacked_slot_arrays(buffer, [0, 1], SLOT, [layouts[0], layouts[1]], pool)
    kept = {name: array for name, array in first.items()}
    second, _ = stacking.stacked_slot_arrays(buffer, [2, 3], SLOT, [layouts[2], layouts[3]], pool)
    for name, array in second.items():
        assert array is kept[name]  # the same MLX array, overwritten in place
        want = mx.stack([slot_arrays(buffer, s, SLOT, layouts[s], zero_copy=False)[0][name] for s in (2, 3)])
        assert _raw(array) == _raw(want)
    assert pool.pooled_bytes == sum(t.nbytes for t in layouts[0]) * 2
    fresh = stacking.StackBuffers(max_pooled=1)
    _one, _ = stacking.stacked_slot_arrays(buffer, [0, 1], SLOT, [layouts[0], layouts[1]], fresh)
    assert fresh.pooled_bytes == 0  # larger than max_pooled: not kept


def test_stacked_refuses_mismatched_layouts():
    buffer, layouts = _filled([(0, 1), (1, 2)], order=list(_random_sources(0)))
    short = layouts[1][:-1]
    with pytest.raises(ValueError, match="same tensors"):
        stacking.stacked_slot_arrays(buffer, [0, 1], SLOT, [layouts[0], short], stacking.StackBuffers())
    with pytest.raises(ValueError, match="slots but"):
        stacking.stacked_slot_arrays(buffer, [0, 1], SLOT, [layouts[0]], stacking.StackBuffers())
