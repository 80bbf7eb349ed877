"""The lease client's telemetry: what a job's leases cost the GPU worker, per layer and phase.

`LeaseCounters` is what `gpuworker.lease_client.LeaseClient` adds to on its per-layer path:
plain mutable totals and one list per (layer, phase) bucket, so a round trip or a copy
(`count_copy`) costs a few in-place additions. `LeaseCounters.snapshot` freezes them into
`LeaseClientStats` (with a `LayerLeaseClientStats` per bucket) for the job's stats reply.
Kept apart from the protocol so the accounting and its report format are read in one place.
The coordinator's own view of the same leases is `coordinator.leases`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuworker.slots import COPY

__all__ = ["DECODE", "END_STEP", "PREFILL", "LayerLeaseClientStats", "LeaseClientStats", "LeaseCounters"]

DECODE, PREFILL = "decode", "prefill"
END_STEP = -1  # the `layer` of the fence round trip after a forward pass (not a layer visit)


@dataclass(frozen=True, slots=True)
class LayerLeaseClientStats:
    """One layer's share of a job, for one phase (a visit of one route row is decode)."""

    layer: int  # END_STEP: the fences sent after forward passes
    phase: str  # DECODE | PREFILL
    visits: int = 0
    round_trips: int = 0
    wait_ms: float = 0.0  # routes -> lease and fence -> lease/fenced round trips (a split visit: its part's wait)
    copy_ms: float = 0.0  # slots -> mx arrays
    experts: int = 0  # experts leased (unique per visit)
    hits: int = 0  # of which already resident (the coordinator's count)
    bytes_copied: int = 0
    exposed_copy_ms: float = 0.0  # of copy_ms, what no compute overlapped (all but later decode parts)
    shared_visits: int = 0  # visits leased through the lease words (no round trip)


@dataclass(frozen=True, slots=True)
class LeaseClientStats:
    """What the lease client saw since its last `reset_stats` (a job, in `gpuworker.main`)."""

    round_trips: int = 0
    leases: int = 0
    lease_wait_ms: float = 0.0
    bytes_copied: int = 0
    copy_ms: float = 0.0
    wrap_path: str = COPY
    layers: tuple[LayerLeaseClientStats, ...] = ()  # per (layer, phase), sorted
    compute_lanes: int = 1  # MLX streams a decode wave's parts ran on (copy path)
    lane_parts: tuple[int, ...] = ()  # decode parts handed out per lane
    # Decode visits: how long each waited for its lease (a shared lease, or the routes -> lease
    # round trip), and why a visit of the shared path took messages instead.
    visit_wait_p50_ms: float = 0.0
    visit_wait_p99_ms: float = 0.0
    shared_visits: int = 0
    shared_misses: int = 0  # an expert was not resident (or a race was lost)
    shared_behind: int = 0  # the coordinator had not yet processed every message sent
    # Copy ahead (gpuworker.copy_ahead): "on", "stopped" (found too few routed experts staged), "off".
    copy_ahead: str = "off"
    copied_ahead: int = 0  # experts copied ahead (their bytes and time are in bytes_copied/copy_ms)
    found_ahead: int = 0  # routed experts a visit found copied ahead ...
    routed_ahead: int = 0  # ... of the routed experts of the visits a copied-ahead set served
    # Split visits (gpuworker.split_visit): decode visits that missed and computed their resident
    # experts while the lease was on its way, and how many experts they computed so.
    split_visits: int = 0
    split_early_experts: int = 0


@dataclass(slots=True)
class LeaseCounters:
    """The running totals behind `LeaseClientStats` (seconds, not milliseconds)."""

    round_trips: int = 0
    leases: int = 0
    wait_s: float = 0.0
    bytes_copied: int = 0
    copy_s: float = 0.0
    wrap_path: str = COPY
    # (layer, phase) -> [visits, round trips, wait s, copy s, experts, hits, bytes copied, exposed copy s,
    #                    shared visits]
    layers: dict[tuple[int, str], list] = field(default_factory=dict)
    lane_parts: list[int] = field(default_factory=list)  # decode parts handed out per compute lane
    visit_waits: list[float] = field(default_factory=list)  # seconds per decode visit
    shared_misses: int = 0
    shared_behind: int = 0
    split_visits: int = 0
    split_early_experts: int = 0

    def bucket(self, layer: int, phase: str) -> list:
        found = self.layers.get((layer, phase))
        if found is None:
            found = self.layers[layer, phase] = [0, 0, 0.0, 0.0, 0, 0, 0, 0.0, 0]
        return found

    def count_copy(self, bucket: list, elapsed: float, copied: int, path: str, *, exposed: bool) -> None:
        """A copy of leased slots into mx arrays, of `bucket`'s layer; `exposed`: no compute overlapped it."""
        self.wrap_path = path
        self.bytes_copied += copied
        self.copy_s += elapsed
        bucket[3] += elapsed
        bucket[6] += copied
        if exposed:
            bucket[7] += elapsed

    def snapshot(self, *, compute_lanes: int, ahead=None) -> LeaseClientStats:
        """The totals so far, in milliseconds, buckets sorted by (phase, layer)."""
        layers = tuple(
            LayerLeaseClientStats(layer, phase, c[0], c[1], c[2] * 1e3, c[3] * 1e3, c[4], c[5], c[6], c[7] * 1e3, c[8])
            for (layer, phase), c in sorted(self.layers.items(), key=lambda item: (item[0][1], item[0][0]))
        )
        waits = sorted(self.visit_waits)
        return LeaseClientStats(
            self.round_trips,
            self.leases,
            self.wait_s * 1e3,
            self.bytes_copied,
            self.copy_s * 1e3,
            self.wrap_path,
            layers,
            compute_lanes,
            tuple(self.lane_parts),
            _quantile(waits, 0.5) * 1e3,
            _quantile(waits, 0.99) * 1e3,
            sum(c[8] for c in self.layers.values()),
            self.shared_misses,
            self.shared_behind,
            "off" if ahead is None else "on" if ahead.on else "stopped",
            0 if ahead is None else ahead.staged,
            0 if ahead is None else ahead.used,
            0 if ahead is None else ahead.routed,
            self.split_visits,
            self.split_early_experts,
        )


def _quantile(ordered: list[float], q: float) -> float:
    """The `q` quantile of sorted values (nearest rank); 0 for none."""
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]
