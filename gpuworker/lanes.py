"""Compute lanes: MLX streams that a decode wave's parts run on side by side.

MLX's CPU backend runs each stream on a thread of its own, and its
quantized matmuls are single-threaded: one stream uses one core however many
the machine has (mlx-lm decodes at the same speed pinned to one core). A
decode wave's experts are independent (`StreamedSwitch` computes them in
parts whose outputs put side by side are the single call's, bit for bit), so
parts on different streams compute the same bytes on more cores.

Lane 0 is the current default stream, the one the model runs on (mlx-lm's
`generate_step` runs on a stream of its own); lane i > 0 is a stream of its
own on the default device, made on first use and kept for the process. On a GPU
(Metal, CUDA) one device runs every stream, so `resolve_lanes` picks one
lane there unless told otherwise. `decode_parts` cuts a decode wave into the
parts the lanes take turns on.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from shared.config import MAX_COMPUTE_LANES as MAX_LANES
from shared.config import check_compute_lanes
from shared.scheduling import available_cores

__all__ = [
    "AUTO_CPU_LANES",
    "MAX_LANES",
    "available_cores",
    "decode_parts",
    "lane_stream",
    "part_lanes",
    "resolve_lanes",
]

# Two lanes were measured on 2 vCPUs (decode about 1.2-1.3x faster end to end, bit for bit);
# more cores may take more lanes, which `--compute-lanes` allows but auto does not pick untested.
AUTO_CPU_LANES = 2
_STREAMS: dict[tuple[int, str], mx.Stream] = {}  # (lane, device name) -> the lane's stream


def resolve_lanes(requested: int | None) -> tuple[int, str]:
    """(lanes, why): `requested` when given (1..MAX_LANES), else auto: up to AUTO_CPU_LANES on
    the CPU device, bounded by the cores available, and 1 on a GPU."""
    if requested is not None:
        return check_compute_lanes(requested, name="compute lanes"), "requested"
    device = mx.default_device()
    if device.type != mx.DeviceType.cpu:
        return 1, f"auto: {device} runs every stream on one device"
    cores = available_cores()
    lanes = max(1, min(AUTO_CPU_LANES, cores))
    return lanes, f"auto: CPU device, {cores} cores available"


# MLX's CPU backend compiles each new fused kernel (an `mx.compile`d function, e.g. mlx-lm's
# swiglu, or its sampler at a temperature not seen before: the value is baked into the kernel) by
# running g++ as a child process: ~108 MiB peak RSS here, ~0.6 s. The kernels are cached on disk
# (per MLX version), but a new temperature always compiles, so the budget keeps room for one.
CPU_JIT_COMPILER_BYTES = 128 * 2**20


def jit_compiler_bytes() -> int:
    """Room the budget keeps for the compiler the device's backend starts (0: it compiles in-process)."""
    return CPU_JIT_COMPILER_BYTES if mx.default_device().type == mx.DeviceType.cpu else 0


def lane_stream(lane: int) -> mx.Stream:
    """The MLX stream of compute lane `lane` (0: the current default stream)."""
    if isinstance(lane, bool) or not isinstance(lane, int) or not 0 <= lane < MAX_LANES:
        raise ValueError(f"lane must be an int in [0, {MAX_LANES}), got {lane!r}")
    if lane == 0:
        return mx.default_stream(mx.default_device())
    device = mx.default_device()
    key = (lane, str(device))  # mx.Device compares by identity: key it by its name
    stream = _STREAMS.get(key)
    if stream is None:
        stream = _STREAMS[key] = mx.new_stream(device)
    return stream


def decode_parts(experts: Sequence[int], *, lanes: int = 1) -> tuple[tuple[int, ...], ...]:
    """A decode wave's experts (rank order) in parts for `lanes` compute lanes; part j runs on
    lane j % lanes.

    Rounds of one part per lane, 1 expert each, then 2, 4, ...; when the rest
    is less than two such rounds it is spread evenly over the lanes instead.
    Copying part j+1 then hides under the compute before it whenever an
    expert computes in at least twice the time it copies; the lanes end with
    loads within one expert of each other; few parts, few extra kernel calls.
    One lane: 1, 2, 4, ... with the rest merged into the last (8 -> 1, 2, 5);
    two: 8 -> 1, 1, 3, 3."""
    experts, parts, start, size = tuple(experts), [], 0, 1
    if len(experts) < 2:
        return ()
    while start < len(experts):
        rest = len(experts) - start
        if rest < 2 * size * lanes:  # the last round: the rest, evenly, smaller shares first
            for share in sorted(rest // lanes + (lane < rest % lanes) for lane in range(lanes)):
                if share:
                    parts.append(experts[start : start + share])
                    start += share
            break
        for _ in range(lanes):
            parts.append(experts[start : start + size])
            start += size
        size *= 2
    return tuple(parts)


def part_lanes(parts: int, lanes: int) -> tuple[int, ...]:
    """The lane of each of `parts` decode parts: part j runs on lane j % lanes (`decode_parts`)."""
    return tuple(j % lanes for j in range(parts))
