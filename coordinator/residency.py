"""The residency manager: which expert lives in which slab slot, and when.

A faithful port of the reference policy (residency.ts). Slots have a role
(working bank, a sparse layer's resident LRU, pinned, disabled) and a phase
(idle, loading, ready, leased). Misses load into the working bank; on the
fenced release of a wave each miss is promoted into its layer's LRU victim
(idle first) or an idle pinned slot, and the victim slot joins the working
bank. Only one wave is active at a time, so a leased slot can never be
shared with, or evicted beneath, another reader.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence

from coordinator.residency_backend import EMPTY_HINT_SNAPSHOT, ExpertIOHintSnapshot, ExpertResidencyBackend
from coordinator.residency_types import (
    Classification,
    ExpertDemandTelemetry,
    ExpertHintTelemetry,
    ExpertPolicyTelemetry,
    ExpertRepinEvent,
    ExpertResidencyLeaseEntry,
    ExpertResidencyMapEntry,
    ExpertResidencySnapshot,
    IOCounters,
    ResidencyError,
    ResidencyPressureError,
    StaleLeaseError,
)
from coordinator.slot_table import SlotRecord, SlotTable
from shared.checks import require_int
from shared.plan import ExpertResidencyPlan
from shared.segments import ExpertResidencyLocation

Locate = Callable[[int, int], ExpertResidencyLocation]
RouteObserver = Callable[[int, object], None]
BeforeMissSubmit = Callable[[tuple[ExpertResidencyLeaseEntry, ...]], Awaitable[None] | None]


class ExpertBatchLease:
    """The slots of one wave; release exactly once, after the fence."""

    def __init__(self, manager: ExpertResidencyManager, entries: Iterable[ExpertResidencyLeaseEntry]) -> None:
        self._manager: ExpertResidencyManager | None = manager
        self.entries: tuple[ExpertResidencyLeaseEntry, ...] = tuple(entries)

    @property
    def released(self) -> bool:
        return self._manager is None

    def release_fenced(self) -> None:
        """Release after every graph reading these slots was evaluated and dropped."""
        manager = self._manager
        if manager is None:
            raise ResidencyError("expert batch lease has already been released")
        try:
            manager.release_fenced(self.entries)
        finally:
            self._manager = None


class ExpertResidencyManager:
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
    ) -> None:
        if not isinstance(plan, ExpertResidencyPlan):
            raise TypeError(f"plan must be an ExpertResidencyPlan, got {type(plan).__name__}")
        layer_ids = tuple(require_int(layer, "sparse layer id") for layer in sparse_layer_ids)
        if len(layer_ids) != plan.sparse_layers or len(set(layer_ids)) != len(layer_ids):
            raise ValueError(
                f"sparse_layer_ids must contain each of the plan's {plan.sparse_layers} sparse "
                f"layers exactly once, got {list(layer_ids)}"
            )
        if backend.slots != plan.total_slots:
            raise ValueError(f"expert backend has {backend.slots} slots; plan requires {plan.total_slots}")
        pins = [
            (require_int(layer, "pinned layer"), require_int(expert, "pinned expert id"))
            for layer, expert in (pinned or ())
        ]
        if len(pins) != plan.pinned_slots:
            raise ValueError(f"expert pinned set has {len(pins)} entries; plan reserves {plan.pinned_slots}")
        if len(set(pins)) != len(pins):
            duplicate = next(pin for pin in pins if pins.count(pin) > 1)
            raise ValueError(f"duplicate pinned expert {duplicate[0]}:{duplicate[1]}")
        for layer, expert in pins:
            if layer not in layer_ids:
                raise ValueError(f"pinned expert {layer}:{expert} is not in a sparse layer")

        self.plan = plan
        self.sparse_layer_ids = layer_ids
        self._backend = backend
        self._locate = locate
        self._usage = usage
        self._route_observer = route_observer
        self._pinned = pins
        self._pinned_keys = set(pins)
        self._active = False
        self._clock = 0
        self._generation = 0
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._pressure_evictions = 0
        self._repin_swaps = 0
        self._demand = IOCounters()
        self._policy = IOCounters()
        self._hint_candidates = 0
        self._hint_resident_skipped = 0
        self._hint_submit_errors = 0
        self._hint_baseline = self._backend_hint_snapshot()

        # Slot ids are laid out working bank first, then each layer's LRU, then
        # pins; roles move between ids later, the ids themselves never do.
        self._table = SlotTable(backend)
        # Aliases of the table's indexes, for the policy code below.
        self._slots = self._table.slots
        self._working = self._table.working
        self._layer_slots = self._table.layer_slots
        self._lookup = self._table.lookup
        for _ in range(plan.working_slots):
            self._working.add(self._table.new_slot("working", None).id)
        for layer in layer_ids:
            self._layer_slots[layer] = {self._table.new_slot("layer", layer).id for _ in range(plan.slots_per_layer)}
        while len(self._slots) < plan.total_slots:
            self._table.new_slot("pinned", None)

    # -- the demand path ---------------------------------------------------

    async def acquire_block(
        self,
        layer: int,
        expert_ids: Sequence[int],
        before_miss_submit: BeforeMissSubmit | None = None,
        classification: Classification = "demand",
    ) -> ExpertBatchLease:
        """Lease slots holding every expert of one deduplicated wave of `layer`.

        Hits are leased at once; `before_miss_submit` sees them before any miss
        is submitted. On any failure everything this call started is cancelled,
        drained and discarded, hits go back to ready, and the error re-raises.
        """
        if self._active:
            raise ResidencyError("another expert wave is active; waves are serial")
        layer = require_int(layer, "layer")
        if layer not in self._layer_slots:
            raise ValueError(f"layer {layer} is not a sparse residency layer")
        if classification not in ("demand", "policy"):
            raise ValueError(f"classification must be 'demand' or 'policy', got {classification!r}")
        unique = [require_int(expert, "expert id") for expert in expert_ids]
        if len(set(unique)) != len(unique):
            raise ValueError(f"expert block must already be deduplicated, got {unique}")
        if len(unique) > self.plan.working_slots:
            raise ValueError(
                f"expert block has {len(unique)} unique experts; working capacity is {self.plan.working_slots}"
            )

        counters = self._demand if classification == "demand" else self._policy
        self._active = True
        entries: list[ExpertResidencyLeaseEntry] = []
        loaded: list[SlotRecord] = []
        try:
            for expert in unique:
                slot = self._lookup.get((layer, expert))
                if slot is None:
                    continue
                record = self._slots[slot]
                if record.phase != "ready":
                    raise ResidencyError(f"resident expert {layer}:{expert} is {record.phase}, not ready")
                self._backend.lease(record.id, record.generation, "gpu")
                record.phase = "leased"
                self._clock += 1
                record.last_use = self._clock
                entries.append(self._table.entry(record, hit=True))

            hit_ids = {entry.expert_id for entry in entries}
            misses = [expert for expert in unique if expert not in hit_ids]
            if before_miss_submit is not None:
                outcome = before_miss_submit(tuple(entries))
                if inspect.isawaitable(outcome):
                    await outcome
            scratch = sorted(
                (self._slots[i] for i in self._working if self._slots[i].phase in ("idle", "ready")),
                key=lambda record: record.id,
            )
            if len(scratch) < len(misses):
                raise ResidencyError(f"working tier has {len(scratch)} free slots for {len(misses)} misses")
            submitted_at: dict[int, float] = {}
            for expert, record in zip(misses, scratch):
                if record.phase == "ready":
                    self._table.forget(record)
                location = self._locate(layer, expert)
                if location.layer != layer or location.expert_id != expert:
                    raise ResidencyError(
                        f"expert locator returned {location.layer}:{location.expert_id} for {layer}:{expert}"
                    )
                generation = self._generation + 1
                self._backend.submit_segments(record.id, generation, location.segments)
                # Only a submitted load owns the slot: a refused submit leaves it idle.
                self._generation = generation
                record.generation = generation
                record.layer, record.expert_id, record.phase = layer, expert, "loading"
                loaded.append(record)
                submitted_at[record.id] = time.perf_counter()
                counters.loads += 1
                counters.read_operations += len(location.segments)
                counters.read_bytes += sum(segment.length for segment in location.segments)

            failure: BaseException | None = None
            if loaded:
                foreground_started = time.perf_counter()
                outcomes = await asyncio.gather(
                    *(self._timed_wait(record, submitted_at[record.id], counters) for record in loaded),
                    return_exceptions=True,
                )
                counters.foreground_wait_ms.append((time.perf_counter() - foreground_started) * 1e3)
                for record, outcome in zip(loaded, outcomes):
                    record.phase = "ready"
                    if isinstance(outcome, BaseException):
                        failure = failure or outcome
                        continue
                    self._lookup[(layer, record.expert_id)] = record.id
                    self._backend.lease(record.id, record.generation, "gpu")
                    record.phase = "leased"
                    self._clock += 1
                    record.last_use = self._clock
                    entries.append(self._table.entry(record, hit=False))
            if failure is not None:
                raise failure
        except BaseException as error:
            await self._abort_acquire(error, entries, loaded)
            raise AssertionError("unreachable") from error  # _abort_acquire always raises

        # A failed acquire served no request, so it counts neither hit nor miss;
        # the bytes it did read still show in loads/read_bytes telemetry.
        hits = sum(1 for entry in entries if entry.hit)
        counters.hits += hits
        counters.misses += len(entries) - hits
        if classification == "demand":
            self._hits += hits
            self._misses += len(entries) - hits
        order = {expert: index for index, expert in enumerate(unique)}
        entries.sort(key=lambda entry: order[entry.expert_id])
        return ExpertBatchLease(self, entries)

    def release_fenced(self, entries: Sequence[ExpertResidencyLeaseEntry]) -> None:
        """End the active wave once the GPU worker has fenced every slot in it."""
        if not self._active:
            raise ResidencyError("no active expert batch lease")
        for entry in entries:
            record = self._slots[entry.slot] if 0 <= entry.slot < len(self._slots) else None
            if record is None or record.phase != "leased" or record.generation != entry.generation:
                # Which slots the reader still holds is unknown now: leave every
                # leased slot leased (never reused) rather than guess.
                self._active = False
                raise StaleLeaseError(
                    f"stale expert lease {entry.layer}:{entry.expert_id} "
                    f"(slot {entry.slot}, generation {entry.generation})"
                )
        protected = {entry.slot for entry in entries}
        errors: list[BaseException] = []
        for entry in entries:
            record = self._slots[entry.slot]
            try:
                self._backend.release_gpu_fenced(record.id, record.generation)
                record.phase = "ready"
            except Exception as error:
                errors.append(error)
                self._table.disable(record)
        if errors:
            for entry in entries:
                record = self._slots[entry.slot]
                if entry.hit or record.phase != "ready":
                    continue
                self._table.try_forget(record, errors)
            self._active = False
            raise ExceptionGroup("expert lease release failed", errors)

        try:
            misses = [entry for entry in reversed(entries) if not entry.hit]
            promoted: set[int] = set()
            for entry in misses:
                record = self._slots[entry.slot]
                if (entry.layer, entry.expert_id) in self._pinned_keys:
                    target = next((s for s in self._slots if s.role == "pinned" and s.phase == "idle"), None)
                    if target is not None:
                        self._table.swap_roles(record, target, "pinned", None)
                        promoted.add(record.id)
                        continue
                target = self._table.layer_victim(entry.layer, protected)
                if target is None:
                    continue
                if target.phase == "ready":
                    self._table.forget(target, keep_layer=True)
                    self._evictions += 1
                self._table.swap_roles(record, target, "layer", entry.layer)
                promoted.add(record.id)
            for entry in misses:
                if entry.slot not in promoted:
                    self._table.forget(self._slots[entry.slot])
        finally:
            self._active = False

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
        """LFRU swaps the ledger suggests, one per layer at most (no ledger: none)."""
        self._require_safe_point("live repin")
        if self._usage is None:
            return []
        candidates = []
        for layer in self.sparse_layer_ids:
            ids = [expert for pin_layer, expert in self._pinned if pin_layer == layer]
            candidate = self._usage.lfru_candidate(layer, ids)
            if candidate is not None:
                candidates.append(candidate)
        return candidates

    async def apply_repin(self, candidate) -> ExpertRepinEvent:
        """Swap a cold pin for a hot resident expert; roles move, bytes do not."""
        self._require_safe_point("live repin")
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

    # -- advisory hints, routes, telemetry ----------------------------------

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
                segments = location.hint_segments if location.hint_segments is not None else location.segments
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

    def drain_demand_telemetry(self) -> ExpertDemandTelemetry:
        """Return and reset the model forward's I/O telemetry."""
        telemetry, self._demand = self._demand.drain(), IOCounters()
        return telemetry

    def drain_policy_telemetry(self) -> ExpertPolicyTelemetry:
        """Return and reset preload / live-repin I/O, kept apart from demand."""
        telemetry, self._policy = self._policy.drain(), IOCounters()
        return telemetry

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
    def active(self) -> bool:
        """True while a wave is leased (not a safe point)."""
        return self._active

    @property
    def pinned(self) -> tuple[tuple[int, int], ...]:
        return tuple(self._pinned)

    # -- internals ---------------------------------------------------------

    def _require_safe_point(self, what: str) -> None:
        if self._active:
            raise ResidencyError(f"{what} requires a model safe point (a wave is active)")

    def _backend_hint_snapshot(self) -> ExpertIOHintSnapshot:
        telemetry = getattr(self._backend, "hint_telemetry", None)
        return telemetry() if telemetry is not None else EMPTY_HINT_SNAPSHOT

    async def _timed_wait(self, record: SlotRecord, submitted_at: float, counters: IOCounters) -> None:
        try:
            await self._backend.wait(record.id, record.generation)
        finally:
            counters.disk_service_ms.append((time.perf_counter() - submitted_at) * 1e3)

    async def _drain(self, record: SlotRecord) -> asyncio.CancelledError | None:
        """Wait until a cancelled load has ended, whatever the read's outcome.

        Returns a cancellation of the caller that arrived meanwhile, for the
        caller to re-raise once the manager is consistent again.
        """
        drain = asyncio.ensure_future(self._backend.wait(record.id, record.generation))
        cancelled = None
        while not drain.done():
            try:
                await asyncio.shield(drain)
            except asyncio.CancelledError as again:
                if drain.done() and drain.cancelled():
                    break
                cancelled = again
            except Exception:
                break
        if drain.done() and not drain.cancelled():
            drain.exception()  # retrieved: the outcome is irrelevant here
        return cancelled

    async def _abort_acquire(
        self,
        error: BaseException,
        entries: list[ExpertResidencyLeaseEntry],
        loaded: list[SlotRecord],
    ) -> None:
        """Undo a failed acquire and re-raise. No lease has left the coordinator
        yet, so releasing its slots here cannot race a reader."""
        errors: list[BaseException] = []
        cancelled: asyncio.CancelledError | None = None
        try:
            for entry in entries:
                record = self._slots[entry.slot]
                if record.phase == "leased":
                    try:
                        self._backend.release_gpu_fenced(record.id, record.generation)
                        record.phase = "ready"
                    except Exception as cleanup_error:
                        errors.append(cleanup_error)
                        self._table.disable(record)
            for record in loaded:
                if record.role == "disabled":
                    continue
                if record.phase == "loading":
                    try:
                        self._backend.cancel(record.id, record.generation)
                    except Exception as cleanup_error:
                        errors.append(cleanup_error)
                    # The slot must be quiescent before it can be reused, so the
                    # drain outlasts a further cancellation; that one re-raises below.
                    cancelled = await self._drain(record) or cancelled
                    record.phase = "ready"
                if record.phase == "ready":
                    self._table.try_forget(record, errors)
        finally:
            self._active = False
        if cancelled is not None and not isinstance(error, asyncio.CancelledError):
            raise cancelled from error  # the caller asked to stop; the load error rides along
        if errors:
            raise BaseExceptionGroup("expert acquire failed and cleanup was incomplete", [error, *errors])
        raise error


__all__ = ["BeforeMissSubmit", "ExpertBatchLease", "ExpertResidencyManager", "Locate", "RouteObserver"]
