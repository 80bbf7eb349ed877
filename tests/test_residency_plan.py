"""Unit tests of the pure residency functions (shared/plan.py, shared/waves.py, shared/segments.py).

Each expectation is worked out by hand from the reference (residency.ts):
the layout arithmetic, the stable batch union, the hint-segment skip and the
nearest-rank percentiles.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from coordinator.residency_types import ExpertLatencySummary, summarize_expert_latencies
from shared.checks import require_int
from shared.plan import DEFAULT_EXPERT_WORKING_SLOTS, ExpertResidencyPlan, plan_expert_residency
from shared.segments import ExpertIOHintSegment, ExpertIOSegment, ExpertResidencyLocation, build_expert_hint_segments
from shared.waves import ExpertUnionEntry, build_expert_batch_union

# -- require_int -------------------------------------------------------------


def test_require_int_accepts_python_and_numpy_integers() -> None:
    assert require_int(0, "x") == 0
    assert require_int(7, "x", minimum=1) == 7
    value = require_int(np.int64(5), "x")
    assert value == 5 and type(value) is int
    assert type(require_int(np.uint8(3), "x")) is int


@pytest.mark.parametrize("value", [1.0, 2.5, True, False, "3", None, np.float64(1.0), np.bool_(True), [1]])
def test_require_int_refuses_non_integers_with_type_error(value) -> None:
    with pytest.raises(TypeError, match=r"^count must be an integer"):
        require_int(value, "count")


def test_require_int_minimum_messages() -> None:
    with pytest.raises(ValueError, match=r"^count must be positive, got 0$"):
        require_int(0, "count", minimum=1)
    with pytest.raises(ValueError, match=r"^count must be >= 0, got -1$"):
        require_int(-1, "count")
    with pytest.raises(ValueError, match=r"^count must be >= 3, got 2$"):
        require_int(2, "count", minimum=3)


# -- plan_expert_residency -----------------------------------------------------


def _plan(**overrides):
    arguments = dict(
        budget_bytes=1000, fixed_bytes=100, slot_bytes=10, sparse_layers=3, working_slots=4, pinned_experts=2
    )
    arguments.update(overrides)
    return plan_expert_residency(**arguments)


def test_plan_exact_layout_arithmetic() -> None:
    # variable = 1000 - 100 - (4 + 2) * 10 = 840; per layer = 840 // (3 * 10) = 28.
    plan = _plan()
    assert plan == ExpertResidencyPlan(
        budget_bytes=1000,
        fixed_bytes=100,
        slot_bytes=10,
        sparse_layers=3,
        working_slots=4,
        pinned_slots=2,
        slots_per_layer=28,
        resident_slots=84,
        total_slots=90,
        slab_bytes=900,
        planned_bytes=1000,
    )


def test_plan_floors_the_per_layer_slots() -> None:
    # variable = 1029 - 100 - 60 = 869 -> 869 // 30 = 28 (29 would need 870).
    plan = _plan(budget_bytes=1029)
    assert (plan.slots_per_layer, plan.total_slots, plan.slab_bytes, plan.planned_bytes) == (28, 90, 900, 1000)
    plan = _plan(budget_bytes=1030)
    assert (plan.slots_per_layer, plan.total_slots, plan.slab_bytes, plan.planned_bytes) == (29, 93, 930, 1030)
    assert plan.planned_bytes <= plan.budget_bytes


def test_plan_defaults_working_64_pinned_0_uncapped() -> None:
    plan = plan_expert_residency(budget_bytes=10_000, fixed_bytes=0, slot_bytes=10, sparse_layers=2)
    assert plan.working_slots == DEFAULT_EXPERT_WORKING_SLOTS == 64
    assert plan.pinned_slots == 0
    # (10000 - 640) // 20 = 468.
    assert plan.slots_per_layer == 468
    assert plan.resident_slots == 936
    assert plan.total_slots == 64 + 936
    explicit_none = plan_expert_residency(
        budget_bytes=10_000,
        fixed_bytes=0,
        slot_bytes=10,
        sparse_layers=2,
        working_slots=None,
        pinned_experts=None,
        max_slots_per_layer=None,
    )
    assert explicit_none == plan


def test_plan_cap_limits_slots_per_layer_only_downward() -> None:
    capped = _plan(max_slots_per_layer=5)
    assert (capped.slots_per_layer, capped.resident_slots, capped.total_slots) == (5, 15, 21)
    assert (capped.slab_bytes, capped.planned_bytes) == (210, 310)
    assert capped.budget_bytes == 1000
    assert _plan(max_slots_per_layer=28).slots_per_layer == 28
    assert _plan(max_slots_per_layer=1000).slots_per_layer == 28
    assert _plan(max_slots_per_layer=1).slots_per_layer == 1


def test_plan_exact_floor_fits_with_one_slot_per_layer() -> None:
    # fixed 100 + (4 working + 2 pinned + 3 layers) * 10 = 190.
    plan = _plan(budget_bytes=190)
    assert (plan.slots_per_layer, plan.resident_slots, plan.total_slots, plan.planned_bytes) == (1, 3, 9, 190)


def test_plan_refusal_names_every_part() -> None:
    with pytest.raises(ValueError) as caught:
        _plan(budget_bytes=189)
    message = str(caught.value)
    assert message == (
        "expert residency budget cannot start: 189 bytes does not fit 100 fixed + 4 working "
        "+ 2 pinned + one slot for each of 3 sparse layers, at 10 bytes per slot (needs 190 bytes)"
    )


def test_plan_refusal_counts_pinned_slots() -> None:
    _plan(budget_bytes=190, pinned_experts=2)
    with pytest.raises(ValueError, match=r"0 fixed \+ 1 working \+ 5 pinned \+ one slot for each of 1 sparse layers"):
        plan_expert_residency(
            budget_bytes=6, fixed_bytes=0, slot_bytes=1, sparse_layers=1, working_slots=1, pinned_experts=5
        )


def test_plan_refuses_fixed_bytes_alone_over_budget() -> None:
    with pytest.raises(ValueError, match="cannot start: 100 bytes does not fit 101 fixed"):
        plan_expert_residency(budget_bytes=100, fixed_bytes=101, slot_bytes=1, sparse_layers=1, working_slots=1)


def test_plan_accepts_zero_fixed_and_zero_pinned_and_numpy_ints() -> None:
    plan = plan_expert_residency(
        budget_bytes=np.int64(12),
        fixed_bytes=np.int32(0),
        slot_bytes=np.uint16(1),
        sparse_layers=np.int64(2),
        working_slots=np.int8(2),
        pinned_experts=np.int64(0),
    )
    assert (plan.slots_per_layer, plan.total_slots) == (5, 12)
    assert all(type(getattr(plan, f.name)) is int for f in dataclasses.fields(plan))


@pytest.mark.parametrize(
    "name",
    [
        "budget_bytes",
        "fixed_bytes",
        "slot_bytes",
        "sparse_layers",
        "working_slots",
        "pinned_experts",
        "max_slots_per_layer",
    ],
)
@pytest.mark.parametrize("bad", [10.0, 2.5, True, False, "10", np.float32(3)])
def test_plan_type_errors(name: str, bad) -> None:
    with pytest.raises(TypeError, match=name):
        _plan(**{name: bad})


@pytest.mark.parametrize(
    "name, bad",
    [
        ("budget_bytes", 0),
        ("budget_bytes", -1),
        ("fixed_bytes", -1),
        ("slot_bytes", 0),
        ("slot_bytes", -10),
        ("sparse_layers", 0),
        ("sparse_layers", -3),
        ("working_slots", 0),
        ("working_slots", -1),
        ("pinned_experts", -1),
        ("max_slots_per_layer", 0),
        ("max_slots_per_layer", -1),
    ],
)
def test_plan_value_errors(name: str, bad: int) -> None:
    with pytest.raises(ValueError, match=f"^{name} must be"):
        _plan(**{name: bad})


def test_plan_is_keyword_only_and_frozen() -> None:
    with pytest.raises(TypeError):
        plan_expert_residency(1000, 100, 10, 3)  # type: ignore[misc]
    plan = _plan()
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.total_slots = 1  # type: ignore[misc]


# -- build_expert_batch_union ------------------------------------------------


def test_union_is_row_major_rank_major_and_stable() -> None:
    waves = build_expert_batch_union([[5, 2], [2, 7], [9, 5]])
    assert len(waves) == 1
    assert waves[0].expert_ids == (5, 2, 7, 9)
    assert waves[0].entries == (
        ExpertUnionEntry(5, ((0, 0), (2, 1))),
        ExpertUnionEntry(2, ((0, 1), (1, 0))),
        ExpertUnionEntry(7, ((1, 1),)),
        ExpertUnionEntry(9, ((2, 0),)),
    )


def test_union_repeated_expert_within_a_row_collects_both_ranks() -> None:
    (wave,) = build_expert_batch_union([[3, 3, 1]])
    assert wave.entries == (ExpertUnionEntry(3, ((0, 0), (0, 1))), ExpertUnionEntry(1, ((0, 2),)))


def test_union_waves_split_at_the_limit() -> None:
    routes = [[0, 1], [2, 3], [4, 0]]
    waves = build_expert_batch_union(routes, 2)
    assert [wave.expert_ids for wave in waves] == [(0, 1), (2, 3), (4,)]
    # The consumers of a repeated expert all stay with its first position.
    assert waves[0].entries[0] == ExpertUnionEntry(0, ((0, 0), (2, 1)))
    assert [wave.expert_ids for wave in build_expert_batch_union(routes, 5)] == [(0, 1, 2, 3, 4)]
    assert [wave.expert_ids for wave in build_expert_batch_union(routes, 6)] == [(0, 1, 2, 3, 4)]
    assert [wave.expert_ids for wave in build_expert_batch_union(routes, 1)] == [(0,), (1,), (2,), (3,), (4,)]


def test_union_default_limit_is_the_default_working_bank() -> None:
    routes = [[expert] for expert in range(DEFAULT_EXPERT_WORKING_SLOTS + 1)]
    waves = build_expert_batch_union(routes)
    assert [len(wave.entries) for wave in waves] == [DEFAULT_EXPERT_WORKING_SLOTS, 1]
    assert waves[1].entries == (ExpertUnionEntry(64, ((64, 0),)),)


def test_union_empty_inputs() -> None:
    assert build_expert_batch_union([]) == []
    assert build_expert_batch_union([[], []]) == []
    assert build_expert_batch_union(np.zeros((0, 4), dtype=np.int32)) == []
    assert build_expert_batch_union(np.zeros((3, 0), dtype=np.int32)) == []


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64, np.uint8, np.uint32, np.uint64])
def test_union_accepts_2d_integer_arrays(dtype) -> None:
    routes = np.array([[5, 2], [2, 7]], dtype=dtype)
    (wave,) = build_expert_batch_union(routes)
    assert wave.entries == (
        ExpertUnionEntry(5, ((0, 0),)),
        ExpertUnionEntry(2, ((0, 1), (1, 0))),
        ExpertUnionEntry(7, ((1, 1),)),
    )
    assert all(type(expert) is int for expert in wave.expert_ids)


def test_union_accepts_rows_of_numpy_arrays_and_tuples() -> None:
    (wave,) = build_expert_batch_union([np.array([4, 1], dtype=np.int16), (1, 6)])
    assert wave.expert_ids == (4, 1, 6)
    assert all(type(expert) is int for expert in wave.expert_ids)
    assert wave.entries[1].consumers == ((0, 1), (1, 0))


def test_union_matches_a_numpy_array_and_its_list() -> None:
    rng = np.random.default_rng(7)
    routes = rng.integers(0, 12, size=(9, 3))
    assert build_expert_batch_union(routes, 4) == build_expert_batch_union(routes.tolist(), 4)


@pytest.mark.parametrize("shape", [(6,), (2, 3, 1), ()])
def test_union_refuses_arrays_that_are_not_2d(shape) -> None:
    with pytest.raises(ValueError, match="2-D"):
        build_expert_batch_union(np.zeros(shape, dtype=np.int32))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.bool_, object])
def test_union_refuses_non_integer_dtypes(dtype) -> None:
    with pytest.raises(TypeError, match="integers"):
        build_expert_batch_union(np.zeros((2, 2), dtype=dtype))


def test_union_refuses_invalid_ids_naming_row_and_rank() -> None:
    with pytest.raises(ValueError, match=r"^route 1 rank 0 has invalid expert -1$"):
        build_expert_batch_union([[0, 1], [-1, 2]])
    with pytest.raises(ValueError, match=r"^route 0 rank 1 has invalid expert -3$"):
        build_expert_batch_union(np.array([[0, -3]], dtype=np.int64))
    with pytest.raises(TypeError, match=r"^route 0 rank 1 has invalid expert 1\.0$"):
        build_expert_batch_union([[0, 1.0]])
    with pytest.raises(TypeError, match=r"^route 2 rank 0 has invalid expert True$"):
        build_expert_batch_union([[0], [1], [True]])
    with pytest.raises(TypeError, match=r"^route 0 rank 0 has invalid expert '3'$"):
        build_expert_batch_union([["3"]])
    with pytest.raises(TypeError, match=r"route 0 rank 0 has invalid expert None"):
        build_expert_batch_union([[None]])


@pytest.mark.parametrize("routes", ["01", b"01", 5, None, {1, 2}])
def test_union_refuses_routes_that_are_not_a_sequence_of_rows(routes) -> None:
    with pytest.raises(TypeError):
        build_expert_batch_union(routes)


@pytest.mark.parametrize("row", [3, "12", b"12", None])
def test_union_refuses_rows_that_are_not_sequences(row) -> None:
    with pytest.raises(TypeError, match=r"^route 1 must be a sequence"):
        build_expert_batch_union([[0], row])


@pytest.mark.parametrize("limit, error", [(0, ValueError), (-1, ValueError), (2.0, TypeError), (True, TypeError)])
def test_union_refuses_a_bad_wave_limit(limit, error) -> None:
    with pytest.raises(error, match="max_unique_per_wave"):
        build_expert_batch_union([[0]], limit)


def test_union_result_is_immutable() -> None:
    (wave,) = build_expert_batch_union([[1, 2]])
    assert isinstance(wave.entries, tuple) and isinstance(wave.entries[0].consumers, tuple)
    with pytest.raises(dataclasses.FrozenInstanceError):
        wave.entries[0].expert_id = 9  # type: ignore[misc]


# -- build_expert_hint_segments --------------------------------------------------


SEGMENTS = [
    ExpertIOSegment(file=1, offset=1000, length=100, destination=0),  # spans the scale offset
    ExpertIOSegment(file=1, offset=5000, length=20, destination=100),  # wholly after it
    ExpertIOSegment(file=2, offset=0, length=60, destination=0),  # ends exactly at it: dropped
    ExpertIOSegment(file=2, offset=300, length=50, destination=10),  # ends exactly at it: dropped
    ExpertIOSegment(file=2, offset=700, length=51, destination=10),  # one byte past it
    ExpertIOSegment(file=3, offset=64, length=8, destination=0),  # wholly before it: dropped
]


def test_hint_segments_buffered_mode_hints_every_full_segment() -> None:
    hints = build_expert_hint_segments(SEGMENTS, 60, False)
    assert hints == [ExpertIOHintSegment(s.file, s.offset, s.length) for s in SEGMENTS]
    assert build_expert_hint_segments(SEGMENTS, 10**9, False) == hints


def test_hint_segments_no_cache_mode_hints_only_the_scale_tail() -> None:
    assert build_expert_hint_segments(SEGMENTS, 60, True) == [
        ExpertIOHintSegment(1, 1060, 40),  # skip 60
        ExpertIOHintSegment(1, 5000, 20),  # skip max(0, 60 - 100) = 0
        ExpertIOHintSegment(2, 750, 1),  # skip 50 of 51
    ]


def test_hint_segments_no_cache_scale_zero_keeps_everything_and_beyond_drops_everything() -> None:
    assert build_expert_hint_segments(SEGMENTS, 0, True) == [
        ExpertIOHintSegment(s.file, s.offset, s.length) for s in SEGMENTS
    ]
    assert build_expert_hint_segments(SEGMENTS, 120, True) == []
    assert build_expert_hint_segments(SEGMENTS, 119, True) == [ExpertIOHintSegment(1, 5019, 1)]


def test_hint_segments_no_cache_flag_is_truthiness() -> None:
    assert build_expert_hint_segments(SEGMENTS, 60, 1) == build_expert_hint_segments(SEGMENTS, 60, True)
    assert build_expert_hint_segments(SEGMENTS, 60, 0) == build_expert_hint_segments(SEGMENTS, 60, False)


def test_hint_segments_empty_input() -> None:
    assert build_expert_hint_segments([], 0, True) == []
    assert build_expert_hint_segments((), 5, False) == []


@pytest.mark.parametrize("scale, error", [(-1, ValueError), (1.0, TypeError), (True, TypeError), ("4", TypeError)])
def test_hint_segments_refuse_bad_scale_offset(scale, error) -> None:
    with pytest.raises(error, match="scale_offset"):
        build_expert_hint_segments(SEGMENTS, scale, True)
    with pytest.raises(error, match="scale_offset"):
        build_expert_hint_segments(SEGMENTS, scale, False)


def test_location_keeps_segments_immutable() -> None:
    location = ExpertResidencyLocation(0, 1, [SEGMENTS[0]], [ExpertIOHintSegment(1, 2, 3)])
    assert location.segments == (SEGMENTS[0],)
    assert location.hint_segments == (ExpertIOHintSegment(1, 2, 3),)
    assert ExpertResidencyLocation(0, 1, SEGMENTS).hint_segments is None


# -- summarize_expert_latencies ---------------------------------------------------


def test_latency_summary_empty() -> None:
    assert summarize_expert_latencies([]) == ExpertLatencySummary(0, 0.0, 0.0, 0.0, 0.0, 0.0)
    assert summarize_expert_latencies(iter(())) == ExpertLatencySummary()


def test_latency_summary_single_sample() -> None:
    assert summarize_expert_latencies([7.5]) == ExpertLatencySummary(1, 7.5, 7.5, 7.5, 7.5, 7.5)


def test_latency_summary_nearest_rank_on_ten() -> None:
    samples = list(range(1, 11))
    random.Random(3).shuffle(samples)
    # p50: ceil(5) - 1 = index 4 -> 5; p95: ceil(9.5) - 1 = 9 -> 10; p99: ceil(9.9) - 1 = 9 -> 10.
    assert summarize_expert_latencies(samples) == ExpertLatencySummary(10, 55.0, 5.0, 10.0, 10.0, 10.0)


def test_latency_summary_nearest_rank_on_hundred_and_twenty() -> None:
    samples = [float(v) for v in range(100, 0, -1)]
    assert summarize_expert_latencies(samples) == ExpertLatencySummary(100, 5050.0, 50.0, 95.0, 99.0, 100.0)
    # 20 samples: p50 index 9 -> 10; p95 ceil(19.0) - 1 = 18 -> 19; p99 ceil(19.8) - 1 = 19 -> 20.
    assert summarize_expert_latencies(range(1, 21)) == ExpertLatencySummary(20, 210.0, 10.0, 19.0, 20.0, 20.0)


def test_latency_summary_three_unsorted_with_duplicates() -> None:
    # p50: ceil(1.5) - 1 = 1 -> 2; p95: ceil(2.85) - 1 = 2 -> 3.
    assert summarize_expert_latencies([3, 1, 2]) == ExpertLatencySummary(3, 6.0, 2.0, 3.0, 3.0, 3.0)
    assert summarize_expert_latencies([4, 4, 1, 4]) == ExpertLatencySummary(4, 13.0, 4.0, 4.0, 4.0, 4.0)
    # p50 of two is the lower one: ceil(1.0) - 1 = 0.
    assert summarize_expert_latencies([9, 2]) == ExpertLatencySummary(2, 11.0, 2.0, 9.0, 9.0, 9.0)


def test_latency_summary_returns_floats_and_does_not_mutate_input() -> None:
    samples = [3, 1, 2]
    summary = summarize_expert_latencies(samples)
    assert samples == [3, 1, 2]
    assert all(type(value) is float for value in (summary.total_ms, summary.p50_ms, summary.max_ms))
    assert type(summary.count) is int
