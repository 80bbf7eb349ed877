"""What the I/O backend answers with: its errors, a load's completion timing, its counters."""

from __future__ import annotations

from dataclasses import dataclass


class BackendStateError(RuntimeError):
    """A call the slot's phase (or the workers' state) forbids (e.g. submit into a leased slot)."""


class IOWorkerStartError(RuntimeError):
    """Workers did not all become ready; the message carries exit codes and stderr."""


class StaleGenerationError(BackendStateError):
    """A call naming a generation the slot no longer (or never) holds."""


class ExpertLoadError(RuntimeError):
    """A load that failed; names the slot, generation and, for a read error, file and offset."""

    def __init__(
        self,
        message: str,
        *,
        slot: int,
        generation: int,
        code: str | None = None,
        file: int | None = None,
        offset: int | None = None,
    ) -> None:
        super().__init__(message)
        self.slot, self.generation, self.code, self.file, self.offset = slot, generation, code, file, offset


@dataclass(frozen=True, slots=True)
class LoadCompletion:
    slot: int
    generation: int
    worker: int
    bytes: int
    service_ms: float  # the worker's read time
    queued_ms: float  # time queued inside the worker
    latency_ms: float  # submit to reply, as seen here


@dataclass(frozen=True, slots=True)
class BackendTelemetry:
    submitted: int = 0
    completed: int = 0
    failed: int = 0
    cancels_sent: int = 0
    stale_completions: int = 0
    bad_replies: int = 0
    worker_errors: int = 0
    bytes: int = 0
    in_flight: int = 0
    workers_lost: int = 0
    workers_hung: int = 0  # of those lost, killed as hung (silent past their progress deadline)
    resubmitted: int = 0  # loads of a lost worker sent again (to another or its restarted one)


__all__ = [
    "BackendStateError",
    "BackendTelemetry",
    "ExpertLoadError",
    "IOWorkerStartError",
    "LoadCompletion",
    "StaleGenerationError",
]
