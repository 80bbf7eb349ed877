"""Advisory readahead (hint) totals over the I/O workers, the replaced ones' included."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from coordinator.residency_backend import ExpertIOHintSnapshot
from shared.io_messages import HintStatus

_RETIRED = ("completed", "dropped", "operations", "bytes", "errors")


@dataclass(slots=True)
class HintTotals:
    """This side's hint counts, and the last status of every worker that was replaced, so the
    totals never go backwards."""

    submitted: int = 0  # messages sent
    dropped: int = 0  # refused here: every queue full
    errors: int = 0  # could not be sent
    retired: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_RETIRED, 0))

    def retire(self, status: HintStatus) -> None:
        """A replaced worker's counters join the totals."""
        for name in _RETIRED:
            self.retired[name] += getattr(status, name)

    def snapshot(self, statuses: Iterable[HintStatus], *, outstanding: int, in_flight: int) -> ExpertIOHintSnapshot:
        """Cumulative counters: `statuses` of every current worker; `outstanding` and `in_flight`
        over the live ones. Dropped counts both this side's refusals and the workers' queue drops."""
        current = dict.fromkeys(_RETIRED, 0)
        for status in statuses:
            for name in _RETIRED:
                current[name] += getattr(status, name)
        return ExpertIOHintSnapshot(
            submitted=self.submitted,
            completed=self.retired["completed"] + current["completed"],
            dropped=self.retired["dropped"] + self.dropped + current["dropped"],
            operations=self.retired["operations"] + current["operations"],
            bytes=self.retired["bytes"] + current["bytes"],
            errors=self.retired["errors"] + self.errors + current["errors"],
            queue_depth=max(0, outstanding - in_flight),
            in_flight=in_flight,
        )


__all__ = ["HintTotals"]
