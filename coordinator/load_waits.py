"""How the residency core waits for its backend's loads: timed, or drained after a cancel."""

from __future__ import annotations

import asyncio
import time

from coordinator.residency_backend import ExpertResidencyBackend
from coordinator.residency_types import IOCounters
from coordinator.slot_table import SlotRecord


async def timed_wait(
    backend: ExpertResidencyBackend, record: SlotRecord, submitted_at: float, counters: IOCounters
) -> None:
    """Wait for the slot's load; its time since `submitted_at` is a disk service sample, failed or not."""
    try:
        await backend.wait(record.id, record.generation)
    finally:
        counters.disk_service_ms.append((time.perf_counter() - submitted_at) * 1e3)


async def drain_load(backend: ExpertResidencyBackend, record: SlotRecord) -> asyncio.CancelledError | None:
    """Wait until a cancelled load has ended, whatever the read's outcome.

    Returns a cancellation of the caller that arrived meanwhile, for the
    caller to re-raise once the manager is consistent again.
    """
    drain = asyncio.ensure_future(backend.wait(record.id, record.generation))
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


__all__ = ["drain_load", "timed_wait"]
