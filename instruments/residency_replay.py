"""The real residency manager replayed over a routing trace, next to the LRU and Belady baselines.

"ours" is `coordinator.residency.ExpertResidencyManager` over an `InMemoryBackend` (no I/O),
fed visit by visit as the coordinator feeds it, once per replacement policy named
(`coordinator.replacement`; results "ours:NAME", and "ours" is the first); the baselines
(`instruments.cache_policies`) get the same resident capacity per layer (`Capacity`) and the
same pins at the start. Each policy's hits come back as a `PolicyResult`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from instruments.cache_policies import simulate_belady, simulate_lru, unique_rows
from shared.trace import Trace, measure_overlap


@dataclass(frozen=True)
class PolicyResult:
    """Hits and unique lookups per layer, and visits whose experts were all resident."""

    hits: dict[int, int]
    lookups: dict[int, int]
    all_resident: int
    visits: int
    extra: dict | None = None

    @property
    def hit_rate(self) -> float:
        total = sum(self.lookups.values())
        return sum(self.hits.values()) / total if total else 0.0

    def layer_rate(self, layer: int) -> float:
        return self.hits[layer] / self.lookups[layer] if self.lookups[layer] else 0.0

    def as_json(self) -> dict:
        out = {
            "hit_rate": self.hit_rate,
            "per_layer": {str(layer): self.layer_rate(layer) for layer in sorted(self.lookups)},
            "all_resident": self.all_resident / self.visits if self.visits else 0.0,
            "hits": sum(self.hits.values()),
            "lookups": sum(self.lookups.values()),
        }
        if self.extra:
            out.update(self.extra)
        return out


@dataclass(frozen=True, kw_only=True)
class Capacity:
    """Ours: `slots_per_layer` LRU slots per layer + the pins; a `working_slots` scratch bank."""

    slots_per_layer: int
    working_slots: int
    pins: tuple[tuple[int, int], ...]
    pins_source: str

    def pins_at(self, layer: int) -> list[int]:
        return [expert for pin_layer, expert in self.pins if pin_layer == layer]

    def as_json(self, layer_ids: Sequence[int]) -> dict:
        return {
            "slots_per_layer": self.slots_per_layer,
            "working_slots": self.working_slots,
            "pinned": len(self.pins),
            "pins_source": self.pins_source,
            "pinned_per_layer": {str(layer): len(self.pins_at(layer)) for layer in layer_ids},
            "baseline_slots_per_layer": {
                str(layer): self.slots_per_layer + len(self.pins_at(layer)) for layer in layer_ids
            },
            "fairness": "lru and belady get slots_per_layer + the layer's pin count per layer "
            "and start with the pinned experts resident, as ours does; all three are "
            "demand-fetch with a scratch working bank",
        }


async def _replay_ours(trace: Trace, rows: list[list[int]], capacity: Capacity, replacement: str) -> PolicyResult:
    from coordinator.memory_backend import InMemoryBackend
    from coordinator.residency import ExpertResidencyManager
    from shared.plan import plan_expert_residency
    from shared.segments import ExpertIOSegment, ExpertResidencyLocation

    layer_ids = trace.layer_ids
    working, pinned, slots = capacity.working_slots, len(capacity.pins), capacity.slots_per_layer
    plan = plan_expert_residency(
        budget_bytes=working + pinned + len(layer_ids) * slots,
        fixed_bytes=0,
        slot_bytes=1,
        sparse_layers=len(layer_ids),
        working_slots=working,
        pinned_experts=pinned,
        max_slots_per_layer=slots,
    )
    if plan.slots_per_layer != slots:
        raise RuntimeError(f"plan gave {plan.slots_per_layer} slots per layer, asked for {slots}")
    segments = (ExpertIOSegment(0, 0, 1, 0),)
    manager = ExpertResidencyManager(
        plan=plan,
        sparse_layer_ids=layer_ids,
        backend=InMemoryBackend(plan.total_slots),
        locate=lambda layer, expert: ExpertResidencyLocation(layer, expert, segments),
        pinned=list(capacity.pins),
        usage=None,
        replacement=replacement,
    )
    if capacity.pins:
        await manager.preload_pinned()
    hits = dict.fromkeys(layer_ids, 0)
    lookups = dict.fromkeys(layer_ids, 0)
    all_resident = 0
    for layer, raw, row in zip(trace.layers.tolist(), trace.experts.tolist(), rows):
        manager.record_routes(layer, [raw])
        lease = await manager.acquire_block(layer, row)
        hit = sum(1 for entry in lease.entries if entry.hit)
        lease.release_fenced()
        hits[layer] += hit
        lookups[layer] += len(row)
        all_resident += hit == len(row)
    snap = manager.snapshot()
    extra = {
        "replacement": replacement,
        "manager": {"hits": snap.hits, "misses": snap.misses, "evictions": snap.evictions},
    }
    return PolicyResult(hits, lookups, all_resident, trace.num_visits, extra)


def _baseline(trace: Trace, rows: list[list[int]], capacity: Capacity, simulate) -> PolicyResult:
    hits: dict[int, int] = {}
    lookups: dict[int, int] = {}
    per_visit = [0] * len(rows)
    layer_of = trace.layers
    for layer in trace.layer_ids:
        index = np.flatnonzero(layer_of == layer).tolist()
        layer_rows = [rows[i] for i in index]
        pins = capacity.pins_at(layer)
        got = simulate(layer_rows, capacity=capacity.slots_per_layer + len(pins), initial=pins)
        for i, hit in zip(index, got):
            per_visit[i] = hit
        hits[layer] = sum(got)
        lookups[layer] = sum(len(row) for row in layer_rows)
    full = sum(1 for row, hit in zip(rows, per_visit) if hit == len(row))
    return PolicyResult(hits, lookups, full, len(rows))


def replay(
    trace: Trace,
    capacity: Capacity,
    *,
    replacements: Sequence[str] = ("lru",),
    rows: list[list[int]] | None = None,
) -> dict[str, PolicyResult]:
    """Ours under each of `replacements` ("ours:NAME"; "ours" is the first), LRU and Belady at one capacity.

    The default policy is the manager's own (`lru`); scripts/replay.py asks for the system's."""
    rows = unique_rows(trace.experts.tolist()) if rows is None else rows
    widest = max(len(row) for row in rows)
    if capacity.working_slots < widest:
        raise ValueError(f"--working-slots {capacity.working_slots} < {widest}, the most unique experts of one visit")
    if not replacements:
        raise ValueError("name at least one replacement policy")
    ours = {f"ours:{name}": asyncio.run(_replay_ours(trace, rows, capacity, name)) for name in replacements}
    return {
        "ours": ours[f"ours:{replacements[0]}"],
        **ours,
        "lru": _baseline(trace, rows, capacity, simulate_lru),
        "belady": _baseline(trace, rows, capacity, simulate_belady),
    }


def describe(trace: Trace, source: str) -> dict:
    """Trace facts for the report; overlap is None (not NaN) when no layer repeats."""
    layers = trace.layer_ids
    overlap = measure_overlap(trace)
    return {
        "path": source,
        "tokens": trace.num_tokens,
        "visits": trace.num_visits,
        "layers": len(layers),
        "layer_ids": list(layers),
        "experts": trace.num_experts,
        "top_k": trace.top_k,
        "overlap": overlap if overlap == overlap else None,
    }
