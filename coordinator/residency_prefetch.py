"""The residency manager's prefetch path: predicted experts read into a layer's reclaimable slots.

`PrefetchingCore` is `coordinator.residency_core.ResidencyCore` plus:

- `prefetch(layer, experts)`: each predicted expert that is neither resident
  nor already being read goes into the layer's victim slot (the same choice a
  promoted miss makes: idle first, then the replacement policy's victim,
  `coordinator.replacement.victims_in_order`: the layer ranked once per prediction),
  read as its own classification (`prefetch`), and is in the lookup at once:
  a demand lease that finds it still reading waits for that read instead of
  issuing a second one (`ResidencyCore._await_in_flight`). It never touches a
  leased or loading slot, the working bank, an expert of the same
  prediction, a pinned expert, or a layer the active wave belongs to (under a
  policy with adaptive pins, `choose_victim` may first pass a pin on, as it
  does for a promoted miss): the invariants of the lease path hold as they
  are.
- `cancel_prefetch(layer, keep)`: when a layer is visited, its reads still
  in flight for experts the visit does not route to are cancelled.

What became of each prefetched expert is counted in a `PrefetchBook`
(`coordinator.prefetch`), which may stop a layer whose prefetches do not pay.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from coordinator.prefetch import PrefetchBook
from coordinator.replacement import victims_in_order
from coordinator.residency_core import ResidencyCore
from coordinator.residency_types import ExpertResidencyLeaseEntry, IOCounters, ResidencyError
from coordinator.slot_table import SlotRecord
from shared.checks import require_int

logger = logging.getLogger(__name__)


class PrefetchingCore(ResidencyCore):
    """The lease path with prefetched experts; a `PrefetchBook` judges and counts them."""

    def __init__(self, *, prefetch: PrefetchBook | None = None, **core: object) -> None:
        super().__init__(**core)  # type: ignore[arg-type]
        self.prefetch_book = prefetch or PrefetchBook(mode="off")
        self._prefetch_io = IOCounters()  # reads the prefetch path issued (not demand, not policy)
        self._prefetch_bytes: dict[int, int] = {}  # slot -> bytes its prefetch read
        self._reads: set[asyncio.Task[None]] = set()
        self._reading: dict[int, dict[int, SlotRecord]] = {}  # layer -> slot -> its prefetch in flight
        self._table.on_prefetch_lost = self._prefetch_lost
        # A prefetched expert became resident between two messages (the lease words publish it).
        self.on_landed: Callable[[SlotRecord], None] | None = None

    # -- the prefetch path -------------------------------------------------

    def prefetch(self, layer: int, experts: Sequence[int]) -> int:
        """Read the predicted `experts` of `layer` that are not resident; how many reads were issued."""
        layer = require_int(layer, "prefetch layer")
        if layer not in self._layer_slots:
            raise ValueError(f"prefetch layer {layer} is not a sparse residency layer")
        ids = [require_int(expert, "predicted expert id") for expert in experts]
        self.prefetch_book.predicted(len(ids), layer)
        if not self.prefetch_book.enabled(layer) or (self._active and layer == self._active_layer):
            return 0
        # Resident predictions stay: none of this prediction evicts another of it.
        protected = {self._lookup[(layer, expert)] for expert in ids if (layer, expert) in self._lookup}
        issued = 0
        victims = victims_in_order(
            self._replacement, self._table, layer, protected, pinned=(self._pinned, self._pinned_keys)
        )
        for expert in ids:
            if (layer, expert) in self._lookup or (layer, expert) in self._pinned_keys:
                continue  # resident or reading already; a pin belongs in a pinned slot, not a layer's
            victim = next(victims, None)
            if victim is None or not self._read_into(victim, layer, expert):
                break
            protected.add(victim.id)  # the order holds while each slot taken is protected
            issued += 1
        return issued

    def cancel_prefetch(self, layer: int, keep: Sequence[int]) -> int:
        """Cancel `layer`'s prefetch reads still in flight for experts not in `keep`; how many."""
        reading = self._reading.get(layer)
        if not reading:  # the common case: nothing of this layer is in flight
            return 0
        wanted = set(keep)
        cancelled = 0
        for record in list(reading.values()):
            if record.phase == "loading" and record.prefetched and record.expert_id not in wanted:
                try:
                    self._backend.cancel(record.id, record.generation)
                    cancelled += 1
                except Exception as error:  # the read then simply completes
                    logger.warning("cancel of the prefetch in slot %d failed: %s", record.id, error)
        return cancelled

    def drain_prefetch_io(self):
        """Return and reset the prefetch path's read telemetry."""
        telemetry, self._prefetch_io = self._prefetch_io.drain(), IOCounters()
        return telemetry

    async def settle_prefetch(self) -> None:
        """Wait until no prefetch read is in flight (tests)."""
        while self._reads:
            await asyncio.gather(*list(self._reads), return_exceptions=True)

    # -- internals ---------------------------------------------------------

    def _read_into(self, record: SlotRecord, layer: int, expert: int) -> bool:
        location = self._locate(layer, expert)
        if location.layer != layer or location.expert_id != expert:
            raise ResidencyError(f"expert locator returned {location.layer}:{location.expert_id} for {layer}:{expert}")
        evicted = (record.layer, record.expert_id) if record.phase == "ready" else None
        generation = self._generation + 1
        try:
            self._backend.submit_segments(record.id, generation, location.segments)
        except Exception as error:  # no worker can take it now: a prefetch is advisory, and evicted nothing
            logger.info("prefetch of %d:%d not issued: %s", layer, expert, error)
            return False
        untime = getattr(self._backend, "untimed", None)
        if untime is not None:  # a prefetch is no demand wave: the job's disk and wait figures leave it out
            untime(record.id, generation)
        if evicted is not None:  # the read replaces the victim's bytes: it is evicted now
            if self._lookup.get(evicted) == record.id:
                del self._lookup[evicted]
            self._evictions += 1
            if record.prefetched:
                record.prefetched = False
                self._prefetch_lost(record)
        self._generation = generation
        record.generation, record.expert_id, record.phase = generation, expert, "loading"
        record.prefetched = True
        self._clock += 1
        record.last_use = self._clock  # as recent as a use: the next promotion does not evict it at once
        self._lookup[(layer, expert)] = record.id
        nbytes = sum(segment.length for segment in location.segments)
        self._prefetch_bytes[record.id] = nbytes
        self._prefetch_io.loads += 1
        self._prefetch_io.read_operations += len(location.segments)
        self._prefetch_io.read_bytes += nbytes
        self.prefetch_book.issued(nbytes)
        self._reading.setdefault(layer, {})[record.id] = record
        task = asyncio.get_running_loop().create_task(self._landed(record, layer, generation))
        self._reads.add(task)
        task.add_done_callback(self._reads.discard)
        return True

    async def _landed(self, record: SlotRecord, layer: int, generation: int) -> None:
        try:
            await self._backend.wait(record.id, generation)
            outcome: object = None
        except Exception as error:
            outcome = error
        finally:
            self._reading.get(layer, {}).pop(record.id, None)
        self._settle_load(record, generation, outcome)

    async def _await_in_flight(  # the demand path's wait for reads in flight
        self, records: list[SlotRecord], entries: list[ExpertResidencyLeaseEntry]
    ) -> list[int]:
        """Lease the experts whose (prefetch) reads are in flight once they land; the ones whose read
        failed are returned, to be read as plain misses."""
        if not records:
            return []
        generations = [record.generation for record in records]
        experts = [record.expert_id for record in records]
        started = time.perf_counter()
        outcomes = await asyncio.gather(
            *(self._backend.wait(record.id, generation) for record, generation in zip(records, generations)),
            return_exceptions=True,
        )
        waited_ms = (time.perf_counter() - started) * 1e3  # one wait, however many reads it covered
        refetch: list[int] = []
        for record, generation, expert, outcome in zip(records, generations, experts, outcomes):
            self._settle_load(record, generation, outcome)
            if record.phase == "ready" and record.generation == generation:
                self._lease_hit(record, entries, waited_ms)
                waited_ms = 0.0
            else:
                refetch.append(expert)  # type: ignore[arg-type]
        return refetch

    def _settle_load(self, record: SlotRecord, generation: int, outcome: object) -> None:
        """A read into a layer slot (a prefetch) ended: its expert becomes resident, or is forgotten.
        Idempotent: whoever sees the outcome first (the read's own waiter or a demand) settles it."""
        if record.phase != "loading" or record.generation != generation:
            return
        record.phase = "ready"  # a failed read: the backend holds the slot failed, a discard makes it idle
        if isinstance(outcome, BaseException):
            errors: list[BaseException] = []
            self._table.try_forget(record, errors)
            for error in errors:
                logger.warning("slot %d of a failed prefetch could not be discarded: %s", record.id, error)
        elif self.on_landed is not None:
            self.on_landed(record)

    def _prefetch_used(self, record: SlotRecord, waited_ms: float | None) -> None:
        self._prefetch_bytes.pop(record.id, None)
        self.prefetch_book.useful(record.layer if record.layer is not None else -1, waited_ms)

    def _prefetch_lost(self, record: SlotRecord) -> None:
        nbytes = self._prefetch_bytes.pop(record.id, 0)
        self.prefetch_book.wasted(record.layer if record.layer is not None else -1, nbytes)


__all__ = ["PrefetchingCore"]
