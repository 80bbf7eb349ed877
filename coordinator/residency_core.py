"""The residency manager's core: the slots, the pins and the one wave of leases at a time.

A faithful port of the reference policy (residency.ts). Slots have a role
(working bank, a sparse layer's resident slots, pinned, disabled) and a phase
(idle, loading, ready, leased). Misses load into the working bank; on the
fenced release of a wave each miss is promoted into its layer's victim (idle
first, then the replacement policy's choice: coordinator.replacement; the
seed's LRU by default) or an idle pinned slot, and the victim slot joins the
working bank. Only one wave is active at a time, so a leased slot can never be
shared with, or evicted beneath, another reader. A failed acquire is undone
(loads cancelled and drained, hits back to ready) before its error re-raises.

`ResidencyCore` is this lease path and nothing else; the manager built on it
(coordinator.residency.ExpertResidencyManager) adds the safe-point policy,
the advisory hints and routes, the hint telemetry and the views.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Sequence

from coordinator.load_waits import drain_load, timed_wait
from coordinator.replacement import ReplacementPolicy, choose_victim, replacement_policy
from coordinator.residency_backend import ExpertResidencyBackend
from coordinator.residency_types import (
    Classification,
    ExpertBatchLease,
    ExpertDemandTelemetry,
    ExpertPolicyTelemetry,
    ExpertResidencyLeaseEntry,
    IOCounters,
    ResidencyError,
    StaleLeaseError,
)
from coordinator.slot_table import SlotRecord, SlotTable
from shared.checks import require_int
from shared.plan import ExpertResidencyPlan
from shared.segments import ExpertResidencyLocation

Locate = Callable[[int, int], ExpertResidencyLocation]
BeforeMissSubmit = Callable[[tuple[ExpertResidencyLeaseEntry, ...]], Awaitable[None] | None]


class ResidencyCore:
    """Deterministic, serial-forward slot leasing over a fixed slab (validated plan, pins, slot table)."""

    def __init__(
        self,
        *,
        plan: ExpertResidencyPlan,
        sparse_layer_ids: Sequence[int],
        backend: ExpertResidencyBackend,
        locate: Locate,
        pinned: Sequence[tuple[int, int]] | None = None,
        replacement: str | ReplacementPolicy = "lru",
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
        self._pinned = pins
        self._pinned_keys = set(pins)
        self._replacement = replacement_policy(replacement)
        # Optional hooks, looked up once: a backend that batches a turn's loads sends them now
        # (`send_submitted`); a policy that folds visits in later does it when the loop is idle (`settle`).
        self._send_submitted: Callable[[], None] | None = getattr(backend, "send_submitted", None)
        self._settle: Callable[[], None] | None = getattr(self._replacement, "settle", None)
        self._active = False
        self._active_layer: int | None = None  # the layer of the active wave
        self._clock = 0
        self._generation = 0
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._demand = IOCounters()
        self._policy = IOCounters()

        # Slot ids are laid out working bank first, then each layer's LRU, then
        # pins; roles move between ids later, the ids themselves never do.
        self._table = SlotTable(backend)
        # Aliases of the table's indexes, for the lease path here and the manager's policy.
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

    @property
    def slot_table(self) -> SlotTable:
        """The slot records and lookup (what `coordinator.lease_publisher` publishes)."""
        return self._table

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
        self._active, self._active_layer = True, layer
        entries: list[ExpertResidencyLeaseEntry] = []
        loaded: list[SlotRecord] = []
        try:
            in_flight = self._lease_resident(layer, unique, entries)
            waiting = {record.expert_id for record in in_flight}
            misses = [expert for expert in unique if expert not in waiting and (layer, expert) not in self._lookup]
            if before_miss_submit is not None:
                outcome = before_miss_submit(tuple(entries))
                if inspect.isawaitable(outcome):
                    await outcome
            submitted_at: dict[int, float] = {}
            self._submit_misses(layer, misses, loaded, submitted_at, counters)
            if loaded and self._send_submitted is not None:  # the wave's reads leave before it waits
                self._send_submitted()
            if in_flight:  # the misses read while the prefetches in flight land: neither waits for the other
                refetch, failure = await asyncio.gather(
                    self._await_in_flight(in_flight, entries),
                    self._land_misses(layer, loaded, submitted_at, counters, entries),
                )
            else:  # awaited directly: each task and gather between a read's reply and the lease is a turn of the loop
                refetch, failure = [], await self._land_misses(layer, loaded, submitted_at, counters, entries)
            if refetch and failure is None:  # a prefetch read failed: its expert is a plain miss now
                again: list[SlotRecord] = []
                self._submit_misses(layer, refetch, again, submitted_at, counters)
                loaded += again
                failure = await self._land_misses(layer, again, submitted_at, counters, entries)
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
            self._replacement.touch(layer, unique)
            if self._settle is not None:  # when the loop is idle: after the lease this returns has been sent
                asyncio.get_running_loop().call_soon(self._settle)
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
            by_expert = {entry.expert_id: entry for entry in misses}  # one wave: one layer
            # The order matters only when some miss must meet a resident: idle slots are taken first.
            if misses and len(by_expert) > self._table.idle_layer_slots(misses[0].layer):
                order = self._replacement.promotion_order(misses[0].layer, list(by_expert))
                misses = [by_expert[expert] for expert in order]
            promoted: set[int] = set()
            for entry in misses:
                record = self._slots[entry.slot]
                if (entry.layer, entry.expert_id) in self._pinned_keys:
                    target = next((s for s in self._slots if s.role == "pinned" and s.phase == "idle"), None)
                    if target is not None:
                        self._table.swap_roles(record, target, "pinned", None)
                        promoted.add(record.id)
                        continue
                target = choose_victim(
                    self._replacement, self._table, entry.layer, protected, pinned=(self._pinned, self._pinned_keys)
                )
                if target is None or not self._replacement.admit(entry.layer, entry.expert_id, target):
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

    def _lease_hit(self, record: SlotRecord, entries: list[ExpertResidencyLeaseEntry], waited_ms: float | None) -> None:
        self._backend.lease(record.id, record.generation, "gpu")
        record.phase = "leased"
        self._clock += 1
        record.last_use = self._clock
        entries.append(self._table.entry(record, hit=True))
        if record.prefetched:
            record.prefetched = False
            self._prefetch_used(record, waited_ms)

    def _lease_resident(
        self, layer: int, unique: list[int], entries: list[ExpertResidencyLeaseEntry]
    ) -> list[SlotRecord]:
        """Lease the wave's ready residents; the ones a prefetch is still reading are returned, to wait for."""
        in_flight: list[SlotRecord] = []
        for expert in unique:
            slot = self._lookup.get((layer, expert))
            if slot is None:
                continue
            record = self._slots[slot]
            if record.phase == "loading":  # a prefetch still reading it: wait for that read, not a second
                in_flight.append(record)
            elif record.phase != "ready":
                raise ResidencyError(f"resident expert {layer}:{expert} is {record.phase}, not ready")
            else:
                self._lease_hit(record, entries, None)
        return in_flight

    def _submit_misses(
        self,
        layer: int,
        misses: list[int],
        loaded: list[SlotRecord],
        submitted_at: dict[int, float],
        counters: IOCounters,
    ) -> None:
        """Read each miss into a free slot of the working bank (`loaded` collects them)."""
        scratch = sorted(
            (self._slots[i] for i in self._working if self._slots[i].phase in ("idle", "ready")),
            key=lambda record: record.id,
        )
        if len(scratch) < len(misses):
            raise ResidencyError(f"working tier has {len(scratch)} free slots for {len(misses)} misses")
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

    async def _land_misses(
        self,
        layer: int,
        loaded: list[SlotRecord],
        submitted_at: dict[int, float],
        counters: IOCounters,
        entries: list[ExpertResidencyLeaseEntry],
    ) -> BaseException | None:
        """Wait for the misses' reads and lease them; the first read error, if any (the caller raises it)."""
        if not loaded:
            return None
        foreground_started = time.perf_counter()
        if len(loaded) == 1:  # a decode wave's usual single miss: no task and gather to wait through
            outcomes: list[BaseException | None] = [None]
            try:
                await timed_wait(self._backend, loaded[0], submitted_at[loaded[0].id], counters)
            except Exception as error:
                outcomes = [error]
        else:
            outcomes = await asyncio.gather(
                *(timed_wait(self._backend, record, submitted_at[record.id], counters) for record in loaded),
                return_exceptions=True,
            )
        counters.foreground_wait_ms.append((time.perf_counter() - foreground_started) * 1e3)
        failure: BaseException | None = None
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
        return failure

    async def _await_in_flight(self, records: list[SlotRecord], entries: list[ExpertResidencyLeaseEntry]) -> list[int]:
        """Wait for reads in flight into resident slots (only the prefetch path starts those:
        `coordinator.residency_prefetch`); the experts to read again as misses."""
        if records:
            raise ResidencyError(f"slots {[record.id for record in records]} are loading outside a wave")
        return []

    def _prefetch_used(self, record: SlotRecord, waited_ms: float | None) -> None:
        """A demand lease took an expert a prefetch read (`waited_ms`: it waited for the read)."""

    # -- telemetry of the lease path ----------------------------------------

    def drain_demand_telemetry(self) -> ExpertDemandTelemetry:
        """Return and reset the model forward's I/O telemetry."""
        telemetry, self._demand = self._demand.drain(), IOCounters()
        return telemetry

    def drain_policy_telemetry(self) -> ExpertPolicyTelemetry:
        """Return and reset preload / live-repin I/O, kept apart from demand."""
        telemetry, self._policy = self._policy.drain(), IOCounters()
        return telemetry

    @property
    def active(self) -> bool:
        """True while a wave is leased (not a safe point)."""
        return self._active

    # -- internals ---------------------------------------------------------

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
                    cancelled = await drain_load(self._backend, record) or cancelled
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


__all__ = ["BeforeMissSubmit", "Locate", "ResidencyCore"]
