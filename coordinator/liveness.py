"""Hung workers: how long a worker that owes work may go without showing progress.

A dead child is noticed by its pid; a hung one (stopped, deadlocked, stuck in
a driver) keeps its pid and answers nothing. The coordinator cannot tell
"slow" from "hung" by heartbeats alone: a worker's heartbeat thread can beat
while its reading or computing thread is stuck. So liveness is judged on the
work itself: a worker that owes the coordinator something (an I/O worker its
outstanding loads, the GPU worker the next message of a running job) must
show progress (any message) within a deadline, and a worker that owes
nothing is never judged. The deadline scales with what is owed, so a slow
disk or a long prefill chunk is not a hang: the base timeout, plus the owed
bytes at a floor disk rate, plus a per-row allowance for computation.

A worker past its deadline is killed (SIGKILL works on a stopped process
too) and then handled exactly as a dead one: the pid watchdog sees it gone,
an I/O worker's loads are re-submitted, a GPU worker's job fails with
`worker_hung`, and the supervisor restarts it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from shared.pid_watch import PidWatch

logger = logging.getLogger(__name__)

DEFAULT_HANG_TIMEOUT_S = 10.0
# The slowest disk we still call working: a USB 2 stick reads ~20 MB/s; below 4 MiB/s is broken.
MIN_DISK_BYTES_PER_S = 4 * 2**20
# Computation allowance per row of a `routes` the GPU worker was answered for (prefill chunks
# of thousands of rows compute for seconds on a CPU).
GPU_ROW_ALLOWANCE_S = 0.01


@dataclass(frozen=True, slots=True)
class ProgressDeadline:
    """The time a worker owing work may stay silent: `timeout_s` plus what the work owed needs."""

    timeout_s: float = DEFAULT_HANG_TIMEOUT_S
    min_bytes_per_s: float = MIN_DISK_BYTES_PER_S
    per_load_s: float = 0.0  # an artificial delay per read (a test knob), so it is not a hang
    per_row_s: float = GPU_ROW_ALLOWANCE_S

    def __post_init__(self) -> None:
        for name, positive in (
            ("timeout_s", True),
            ("min_bytes_per_s", True),
            ("per_load_s", False),
            ("per_row_s", False),
        ):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (value > 0 or (value == 0 and not positive))
            ):
                raise ValueError(f"ProgressDeadline.{name} must be {'> 0' if positive else '>= 0'}, got {value!r}")

    def io_allowance(self, *, owed_bytes: int, owed_loads: int) -> float:
        return self.timeout_s + owed_bytes / self.min_bytes_per_s + owed_loads * self.per_load_s

    def gpu_allowance(self, *, rows: int) -> float:
        return self.timeout_s + rows * self.per_row_s


@dataclass(slots=True)
class GpuProgress:
    """Whether the GPU worker owes the running job progress, and since when."""

    deadline: ProgressDeadline
    at: float = 0.0  # its last message, or the last message it was sent
    serving: bool = False  # the coordinator is serving its `routes`/`fence`: the worker waits on us
    rows: int = 0  # rows of the last `routes` answered: what it computes now

    def overdue(self, now: float) -> str | None:
        """Why the worker is hung (silent past its allowance while not waiting on us), or None."""
        allowed = self.deadline.gpu_allowance(rows=self.rows)
        silent = now - self.at
        if self.serving or silent <= allowed:
            return None
        return f"no message for {silent:.1f} s while a job waits on it (allowed {allowed:.1f} s)"


def kill_hung(process: PidWatch | None, pid: int, what: str, reason: str) -> None:
    """SIGKILL a hung worker (through its watch, so a reused pid is never hit)."""
    logger.error("%s (pid %d) is hung: %s; killing it", what, pid, reason)
    if process is None or not process.kill():  # already gone: the pid watchdog handles it as a death
        logger.info("%s (pid %d) could not be killed: it had already exited", what, pid)


__all__ = [
    "DEFAULT_HANG_TIMEOUT_S",
    "GPU_ROW_ALLOWANCE_S",
    "MIN_DISK_BYTES_PER_S",
    "GpuProgress",
    "ProgressDeadline",
    "kill_hung",
]
