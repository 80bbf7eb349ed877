"""The residency manager: the core's slot leasing plus the policy around it.

`ExpertResidencyManager` is `coordinator.residency_core.ResidencyCore` (the
slots, the pins and the serial wave of leases) with its prefetch path
(`coordinator.residency_prefetch`) and the operations that run beside the
lease path:

- safe-point policy (only while no wave is active): pressure correction
  (evict least-recent resident experts, disabling their slots, until the
  footprint fits the budget), the pinned preload, and LFRU live repin (swap a
  cold pin for a hot resident expert: roles move, bytes do not; only under a
  replacement policy whose pins are fixed, like the seed's `lru`);
- advisory hints (readahead of predicted experts; never touch a slot) and
  route recording into the usage ledger;
- views: the hint telemetry, the snapshot and the residency map.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from coordinator.prefetch import PrefetchBook
from coordinator.replacement import ReplacementPolicy
from coordinator.residency_backend import EMPTY_HINT_SNAPSHOT, ExpertIOHintSnapshot, ExpertResidencyBackend
from coordinator.residency_core import Locate
from coordinator.residency_prefetch import PrefetchingCore
from coordinator.residency_types import (
    ExpertHintTelemetry,
    ExpertRepinEvent,
    ExpertResidencyMapEntry,
    ExpertResidencySnapshot,
    ResidencyError,
    ResidencyPressureError,
)
from shared.checks import require_int
from shared.plan import ExpertResidencyPlan
from shared.segments import ExpertIOHintSegment

RouteObserver = Callable[[int, object], None]


class ExpertResidencyManager(PrefetchingCore):
    """Deterministic, serial-forward residency policy over a fixed slab."""

    def __init__(
        self,
        *,
        plan: ExpertResidencyPlan,
        sparse_layer_ids: Sequence[int],
        backend: ExpertResidencyBackend,
        locate: Locate,
        pinned: Sequence[tuple[int, int]] | None = None,
        usage: object | None = None,
        route_observer: RouteObserver | None = None,
        prefetch: PrefetchBook | None = None,
        replacement: str | ReplacementPolicy = "lru",
    ) -> None:
        super().__init__(
            plan=plan,
            sparse_layer_ids=sparse_layer_ids,
            backend=backend,
            locate=locate,
            pinned=pinned,
            prefetch=prefetch,
            replacement=replacement,
        )
        self._usage = usage
        self._route_observer = route_observer
        self._pressure_evictions = 0
        self._repin_swaps = 0
        self._hint_candidates = 0
        self._hint_resident_skipped = 0
        self._hint_submit_errors = 0
        self._hint_baseline = self._backend_hint_snapshot()

    # -- the shared lease path --------------------------------------------

    def record_hits(self, layer: int, expert_ids: Sequence[int]) -> None:
        """A decode visit the GPU worker leased itself through the lease words (every expert was
        resident, its slot published): what `acquire_block` and `release_fenced` of those hits do
        to the policy (recency, hit counts, the replacement policy's touch, prefetch use), without
        a lease. An expert no longer resident when this arrives (a safe point evicted it after the
        worker's lease; its slot was claimed only once the worker had left) counts as a hit and
        touches nothing: no decision is made here."""
        if self._active and self._active_layer == layer:
            raise ResidencyError(f"layer {layer} has an active wave; a visit of it cannot be recorded now")
        unique = [require_int(expert, "expert id") for expert in expert_ids]
        for expert in unique:
            slot = self._lookup.get((layer, expert))
            record = self._slots[slot] if slot is not None else None
            if record is None or record.phase not in ("ready", "leased"):
                continue
            self._clock += 1
            record.last_use = self._clock
            if record.prefetched:
                record.prefetched = False
                self._prefetch_used(record, None)
        self._demand.hits += len(unique)
        self._hits += len(unique)
        self._replacement.touch(layer, unique)

    # -- safe-point policy -------------------------------------------------

    def correct_for_pressure(self) -> ExpertResidencySnapshot:
        """Evict oldest unpinned resident slots until the footprint fits the budget.

        Capacity only moves downward: an evicted slot is disabled for the run.
        Every sparse layer keeps at least one slot.
        """
        self._require_safe_point("physical-pressure correction")
        footprint = self._backend.physical_footprint()
        while footprint > self.plan.budget_bytes:
            candidates = [
                record
                for record in self._slots
                if record.role == "layer" and record.phase == "ready" and len(self._layer_slots[record.layer]) > 1
            ]
            if not candidates:
                break
            victim = min(candidates, key=lambda record: (record.last_use, record.id))
            layer = victim.layer
            self._table.forget(victim)
            self._layer_slots[layer].discard(victim.id)
            victim.role, victim.layer = "disabled", None
            self._pressure_evictions += 1
            footprint = self._backend.physical_footprint()
        if footprint > self.plan.budget_bytes:
            raise ResidencyPressureError(
                f"expert physical footprint {footprint} exceeds budget "
                f"{self.plan.budget_bytes}, and no evictable capacity remains"
            )
        return self.snapshot(footprint)

    def limit_layer_slots(self, per_layer: int) -> int:
        """Keep at most `per_layer` resident slots per sparse layer (at least one); disable the rest.

        The slab is sized once the processes' memory is measured (coordinator.footprint): the
        disabled slots are never loaded, so their pages are never allocated. Idle slots go first,
        then the least recent ready ones. Returns how many slots were disabled."""
        self._require_safe_point("sizing the slab")
        keep = max(1, per_layer)
        disabled = 0
        for layer, ids in self._layer_slots.items():
            # Kept first: slots busy loading, then the most recent ready ones; idle ones go first.
            order = {"idle": 2, "ready": 1}
            records = sorted((self._slots[i] for i in ids), key=lambda r: (order.get(r.phase, 0), -r.last_use, r.id))
            for record in records[keep:]:
                if record.phase not in order:
                    continue
                if record.phase == "ready":
                    self._table.forget(record)
                self._layer_slots[layer].discard(record.id)
                record.role, record.layer = "disabled", None
                disabled += 1
        return disabled

    async def preload_pinned(self) -> None:
        """Load the configured pinned experts before the first model forward."""
        self._require_safe_point("pinned preload")
        for layer in self.sparse_layer_ids:
            ids = [expert for pin_layer, expert in self._pinned if pin_layer == layer]
            step = self.plan.working_slots
            for begin in range(0, len(ids), step):
                lease = await self.acquire_block(layer, ids[begin : begin + step], None, "policy")
                lease.release_fenced()

    def repin_candidates(self) -> list:
        """LFRU swaps the ledger suggests, one per layer at most (no ledger: none).

        None either under a replacement policy with adaptive pins: it re-ranks the pins at every
        promotion already, and a second ranking by the ledger's heat would only move the label
        (or load an expert the policy did not keep) without changing what it would evict.
        """
        self._require_safe_point("live repin")
        if self._usage is None or self._replacement.adaptive_pins:
            return []
        candidates = []
        for layer in self.sparse_layer_ids:
            ids = [expert for pin_layer, expert in self._pinned if pin_layer == layer]
            candidate = self._usage.lfru_candidate(layer, ids)
            if candidate is not None:
                candidates.append(candidate)
        return candidates

    async def apply_repin(self, candidate) -> ExpertRepinEvent:
        """Swap a cold pin for a hot resident expert; roles move, bytes do not.

        Only for fixed pins: under adaptive pins the policy alone decides what a pin holds (and its
        load of the hot expert could evict the cold pin itself), so a swap is refused.
        """
        self._require_safe_point("live repin")
        if self._replacement.adaptive_pins:
            raise ResidencyError(f"live repin is for fixed pins; {self._replacement.name} ranks its pins itself")
        layer, cold, hot = candidate.layer, candidate.cold_expert_id, candidate.hot_expert_id
        if (layer, cold) not in self._pinned_keys or (layer, hot) in self._pinned_keys:
            raise ResidencyError(f"stale live-repin candidate {layer}: {cold} -> {hot}")
        if (layer, hot) not in self._lookup:
            lease = await self.acquire_block(layer, [hot], None, "policy")
            lease.release_fenced()
        hot_slot = self._lookup.get((layer, hot))
        cold_slot = self._lookup.get((layer, cold))
        if hot_slot is None or cold_slot is None:
            raise ResidencyError(f"live repin could not materialize both {layer}:{hot} and {layer}:{cold}")
        hot_record, cold_record = self._slots[hot_slot], self._slots[cold_slot]
        if not (
            hot_record.role == "layer"
            and hot_record.phase == "ready"
            and cold_record.role == "pinned"
            and cold_record.phase == "ready"
        ):
            raise ResidencyError("live repin requires ready resident and pinned slots")
        layer_slots = self._layer_slots[layer]
        layer_slots.discard(hot_record.id)
        layer_slots.add(cold_record.id)
        hot_record.role, cold_record.role = "pinned", "layer"
        cold_record.last_use = 0  # the demoted pin is the layer's next LRU victim
        self._pinned_keys.discard((layer, cold))
        self._pinned_keys.add((layer, hot))
        self._pinned[self._pinned.index((layer, cold))] = (layer, hot)
        self._repin_swaps += 1
        return ExpertRepinEvent(layer=layer, evicted_pin=cold, admitted_pin=hot, gain=candidate.gain)

    # -- advisory hints, routes, views ---------------------------------------

    def hint_experts(self, layer: int, expert_ids: Sequence[int]) -> None:
        """Queue readahead for predicted experts; never allocates or mutates slots.

        Queue pressure and hint failures are counted, not raised: demand
        loading stays the correctness path.
        """
        layer = require_int(layer, "layer")
        if layer not in self._layer_slots:
            raise ValueError(f"layer {layer} is not a sparse residency layer")
        ids = list(dict.fromkeys(require_int(expert, "hinted expert id") for expert in expert_ids))
        hint = getattr(self._backend, "hint_segments", None)
        for expert in ids:
            self._hint_candidates += 1
            if (layer, expert) in self._lookup:
                self._hint_resident_skipped += 1
                continue
            try:
                location = self._locate(layer, expert)
                segments = location.hint_segments
                if segments is None:  # warm the whole expert: its load segments, as readahead ranges
                    segments = tuple(ExpertIOHintSegment(x.file, x.offset, x.length) for x in location.segments)
                if not segments:
                    continue
                if hint is None:
                    raise ResidencyError("expert backend has no advisory hint queue")
                hint(segments)
            except Exception:
                self._hint_submit_errors += 1

    def record_routes(self, layer: int, routes) -> None:
        """Count the full router output (every row × rank) before deduplication."""
        layer = require_int(layer, "layer")
        if layer not in self._layer_slots:
            raise ValueError(f"layer {layer} is not a sparse residency layer")
        if self._usage is not None:
            self._usage.record_routes(layer, routes)
        if self._route_observer is not None:
            self._route_observer(layer, routes)

    def drain_hint_telemetry(self) -> ExpertHintTelemetry:
        """Return and reset advisory-hint telemetry since the previous drain."""
        current = self._backend_hint_snapshot()
        prior = self._hint_baseline

        def delta(name: str) -> int:
            return max(0, getattr(current, name) - getattr(prior, name))

        telemetry = ExpertHintTelemetry(
            candidates=self._hint_candidates,
            resident_skipped=self._hint_resident_skipped,
            submit_errors=self._hint_submit_errors,
            submitted=delta("submitted"),
            completed=delta("completed"),
            dropped=delta("dropped"),
            operations=delta("operations"),
            bytes=delta("bytes"),
            errors=delta("errors"),
            queue_depth=current.queue_depth,
            in_flight=current.in_flight,
        )
        self._hint_candidates = self._hint_resident_skipped = self._hint_submit_errors = 0
        self._hint_baseline = current
        return telemetry

    def snapshot(self, physical_footprint: int | None = None) -> ExpertResidencySnapshot:
        roles = [record.role for record in self._slots]
        phases = [record.phase for record in self._slots]
        return ExpertResidencySnapshot(
            clock=self._clock,
            generation=self._generation,
            working=roles.count("working"),
            resident=roles.count("layer"),
            pinned=roles.count("pinned"),
            disabled=roles.count("disabled"),
            loading=phases.count("loading"),
            leased=phases.count("leased"),
            physical_footprint=(
                self._backend.physical_footprint() if physical_footprint is None else physical_footprint
            ),
            budget_bytes=self.plan.budget_bytes,
            hits=self._hits,
            misses=self._misses,
            evictions=self._evictions,
            pressure_evictions=self._pressure_evictions,
            repin_swaps=self._repin_swaps,
        )

    def residency_map(self) -> list[ExpertResidencyMapEntry]:
        """Every ready resident or pinned expert, with its ledger entry if any."""
        result = []
        for record in self._slots:
            if record.role not in ("layer", "pinned") or record.phase != "ready":
                continue
            if record.layer is None or record.expert_id is None:
                continue
            usage = self._usage.entry(record.layer, record.expert_id) if self._usage is not None else None
            result.append(
                ExpertResidencyMapEntry(
                    slot=record.id,
                    layer=record.layer,
                    expert_id=record.expert_id,
                    tier="pinned" if record.role == "pinned" else "resident",
                    last_use=record.last_use,
                    usage=usage,
                )
            )
        return result

    @property
    def pinned(self) -> tuple[tuple[int, int], ...]:
        return tuple(self._pinned)

    @property
    def replacement(self) -> str:
        """The replacement policy's name (coordinator.replacement)."""
        return self._replacement.name

    # -- internals ---------------------------------------------------------

    def _require_safe_point(self, what: str) -> None:
        if self._active:
            raise ResidencyError(f"{what} requires a model safe point (a wave is active)")

    def _backend_hint_snapshot(self) -> ExpertIOHintSnapshot:
        telemetry = getattr(self._backend, "hint_telemetry", None)
        return telemetry() if telemetry is not None else EMPTY_HINT_SNAPSHOT


__all__ = ["ExpertResidencyManager", "RouteObserver"]
