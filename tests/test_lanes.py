"""Compute lanes: how a decode wave is cut into parts per lane, which lanes run where, and
every place that takes a lane count refusing a bad one."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuworker import lanes as lanes_module
from gpuworker.expert_provider import LeasedWave
from gpuworker.lanes import AUTO_CPU_LANES, MAX_LANES, decode_parts, lane_stream, resolve_lanes
from gpuworker.lease_client import LeaseClient
from shared.commands import GpuWorkerArgs, gpu_worker_argv, parse_gpu_worker_argv
from shared.config import MAX_COMPUTE_LANES
from supervisor.options import parse_args as supervisor_args
from supervisor.system import start_system


@given(n=st.integers(0, 64), lanes=st.integers(1, MAX_LANES))
def test_decode_parts_cover_the_ranks_in_order_with_balanced_lanes(n, lanes):
    experts = tuple(range(100, 100 + n))
    parts = decode_parts(experts, lanes=lanes)
    if n < 2:
        assert parts == ()  # nothing to overlap: the module takes the wave whole
        return
    assert tuple(e for part in parts for e in part) == experts  # consecutive ranks, in order, once each
    assert all(parts) and len(parts[0]) == 1  # only one expert's copy is exposed
    loads = [sum(len(part) for j, part in enumerate(parts) if j % lanes == lane) for lane in range(lanes)]
    assert max(loads) - min(loads) <= 1
    if n >= lanes:
        assert all(loads)  # every lane computes


def test_decode_parts_known_cuts():
    sizes = lambda n, lanes: [len(part) for part in decode_parts(range(n), lanes=lanes)]  # noqa: E731
    assert sizes(8, 1) == [1, 2, 5]  # 1, 2, 4 with the remainder merged
    assert sizes(8, 2) == [1, 1, 3, 3]
    assert sizes(4, 2) == [1, 1, 1, 1] and sizes(3, 2) == [1, 2] and sizes(2, 2) == [1, 1]
    assert sizes(8, 4) == [1] * 8 and sizes(6, 2) == [1, 1, 2, 2]


def test_resolve_lanes_requested_and_auto(monkeypatch):
    assert resolve_lanes(3) == (3, "requested")
    for bad in (0, MAX_LANES + 1, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="compute lanes"):
            resolve_lanes(bad)
    assert mx.default_device().type == mx.DeviceType.cpu  # this machine; a GPU gets one lane
    monkeypatch.setattr(lanes_module, "available_cores", lambda: 1)
    assert resolve_lanes(None)[0] == 1
    monkeypatch.setattr(lanes_module, "available_cores", lambda: 64)
    lanes, why = resolve_lanes(None)
    assert lanes == AUTO_CPU_LANES and "auto" in why and "64 cores" in why
    assert MAX_LANES == MAX_COMPUTE_LANES


def test_lane_streams_are_distinct_and_lane_zero_is_the_default():
    assert lane_stream(0) == mx.default_stream(mx.default_device())
    assert lane_stream(1) == lane_stream(1) and lane_stream(1) != lane_stream(2)
    assert lane_stream(1) != lane_stream(0)
    # Lane 0 is the stream the model runs on now (mlx-lm's generate_step runs on a stream of its own).
    generation = mx.new_stream(mx.default_device())
    with mx.stream(generation):
        assert lane_stream(0) == generation and lane_stream(1) not in (generation, lane_stream(0))
    for bad in (-1, MAX_LANES, True, 1.0):
        with pytest.raises(ValueError, match="lane"):
            lane_stream(bad)
    # Work on a lane stream computes what the default stream does, and the default stream can use it.
    x = mx.arange(12, dtype=mx.float32).reshape(3, 4)
    with mx.stream(lane_stream(1)):
        y = (x @ x.T) + 1
    z = mx.concatenate([y, (x @ x.T) + 1])
    mx.eval(z)
    assert np.array_equal(np.array(z[:3]), np.array(z[3:]))


def test_part_lanes_are_checked():
    tensors = {"w": mx.zeros((1, 2))}
    kwargs = dict(stacked=True, detached=True, parts=[(1,), (2,)], take_part=lambda j: tensors)
    assert LeasedWave([1, 2], lambda: None, **kwargs).part_lanes == (0, 0)
    assert LeasedWave([1, 2], lambda: None, part_lanes=[0, 1], **kwargs).part_lanes == (0, 1)
    for bad in ([0], [0, 1, 0], [0, -1], [0, MAX_LANES], [0, True]):
        with pytest.raises(ValueError, match="part_lanes"):
            LeasedWave([1, 2], lambda: None, part_lanes=bad, **kwargs)


def test_lane_counts_are_refused_everywhere(tmp_path, capsys):
    for bad in (0, MAX_LANES + 1, True):
        with pytest.raises(ValueError, match="compute_lanes"):
            LeaseClient(None, store=None, buffer=None, total_slots=1, slot_bytes=1, working_slots=1, compute_lanes=bad)
        with pytest.raises(ValueError, match="compute_lanes"):
            start_system(model_dir=tmp_path, memory_budget=1 << 30, compute_lanes=bad)
    config = GpuWorkerArgs(model=str(tmp_path), endpoint="ipc:///tmp/x", compute_lanes=3)
    assert parse_gpu_worker_argv(gpu_worker_argv(config)) == config
    assert (
        parse_gpu_worker_argv(
            gpu_worker_argv(GpuWorkerArgs(model=str(tmp_path), endpoint="ipc:///tmp/x"))
        ).compute_lanes
        is None
    )
    for text in ("0", str(MAX_LANES + 1)):
        with pytest.raises(SystemExit):
            parse_gpu_worker_argv([*gpu_worker_argv(config), "--compute-lanes", text])
        assert "--compute-lanes must be in" in capsys.readouterr().err
    base = ["--model", str(tmp_path), "--memory-budget", "1GiB"]
    assert supervisor_args(base).compute_lanes is None
    assert supervisor_args([*base, "--compute-lanes", "auto"]).compute_lanes is None
    assert supervisor_args([*base, "--compute-lanes", "2"]).compute_lanes == 2
    for text in ("0", str(MAX_LANES + 1), "two"):
        with pytest.raises(SystemExit):
            supervisor_args([*base, "--compute-lanes", text])
