"""The soak's faults: SIGKILL of an I/O worker or the GPU worker, and hangs (SIGSTOP, never SIGCONT).

Who to hit comes only from the coordinator's `health` reply (`HealthReply.processes`: the
supervisor's process table of current pids and restart counts). When that table is empty no
fault is injected and the skip is counted: there is deliberately no second way to find pids.

Faults fire every S seconds (`*_every`; with n kinds periodic, the i-th first fires (i + 1) S / n
seconds after the load starts, so they interleave) or when job number N is taken (`*_at_jobs`,
deterministic for tests). A hang stops a random worker (GPU or
I/O) with SIGSTOP and waits up to `hang_timeout` seconds for the table to show that role under a
new pid; if it does not, the soak sends SIGCONT itself and counts `hang_not_detected`.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from shared.client import Client, ClientError
from shared.job_messages import ProcessInfo

logger = logging.getLogger("soak.faults")

KINDS = ("kill_io", "kill_gpu", "hang")
HEALTH_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class FaultOptions:
    every: dict[str, float | None]  # kind -> seconds between faults (None: never)
    at_jobs: dict[str, tuple[int, ...]]  # kind -> job indices whose start triggers one
    hang_timeout: float = 30.0
    seed: int = 0
    hang_role: str = "any"  # which worker a hang stops: "gpu", "io" or "any"


class RoleBook:
    """pid -> role, from every process table seen (the memory figures name processes by it)."""

    def __init__(self, initial: dict[str, int]) -> None:
        self._lock = threading.Lock()
        self.roles = {pid: name for name, pid in initial.items()}

    def learn(self, processes: tuple[ProcessInfo, ...]) -> None:
        with self._lock:
            for info in processes:
                self.roles[info.pid] = info.name

    def name(self, pid: int) -> str:
        with self._lock:
            return self.roles.get(pid, f"pid_{pid}")


def process_table(client: Client, book: RoleBook) -> tuple[ProcessInfo, ...]:
    """The current process table from `health` (empty when unanswered or not populated)."""
    try:
        processes = client.health(timeout=HEALTH_TIMEOUT_S).processes
    except (ClientError, OSError) as error:
        logger.warning("health not answered: %s", error)
        return ()
    book.learn(processes)
    return processes


class Faults(threading.Thread):
    """Injects the faults until `stop()`; `report()` says what it did."""

    def __init__(self, endpoint: str, options: FaultOptions, book: RoleBook) -> None:
        super().__init__(name="soak-faults", daemon=True)
        self.endpoint, self.options, self.book = endpoint, options, book
        self._rng = random.Random(options.seed)
        self._halt = threading.Event()
        self._triggered: queue.Queue[str] = queue.Queue()
        self.done: Counter = Counter()  # kind -> faults injected
        self.skipped: Counter = Counter()  # kind -> faults not injected (no process table, victim gone)
        self.hangs: list[dict[str, Any]] = []  # each hang: role, pid, detected, seconds to a replacement

    def job_started(self, index: int) -> None:
        for kind, indices in self.options.at_jobs.items():
            if index in indices:
                self._triggered.put(kind)

    def stop(self) -> None:
        self._halt.set()
        self.join()

    def run(self) -> None:
        started = time.monotonic()
        periodic = [(kind, every) for kind, every in self.options.every.items() if every]
        # Staggered: the i-th of n periodic kinds first fires at (i + 1) / n of its period, so three
        # kinds every 60 s give a fault every 20 s rather than three at once every 60 s.
        due = {kind: started + every * (i + 1) / len(periodic) for i, (kind, every) in enumerate(periodic)}
        with Client(self.endpoint, timeout=HEALTH_TIMEOUT_S) as client:
            while not self._halt.is_set():
                kinds = []
                while not self._triggered.empty():
                    kinds.append(self._triggered.get_nowait())
                now = time.monotonic()
                for kind, at in due.items():
                    if now >= at:
                        kinds.append(kind)
                        due[kind] = now + self.options.every[kind]
                for kind in kinds:
                    self._inject(client, kind)
                self._halt.wait(0.1)

    def _inject(self, client: Client, kind: str) -> None:
        table = process_table(client, self.book)
        role = {"kill_gpu": "gpu", "kill_io": "io"}.get(kind, self.options.hang_role)
        candidates = [
            p
            for p in table
            if (role in ("gpu", "any") and p.name == "gpu_worker")
            or (role in ("io", "any") and p.name.startswith("io_worker_"))
        ]
        if not candidates:
            self.skipped[kind] += 1
            logger.warning("%s skipped: the health reply names no such process (%d in its table)", kind, len(table))
            return
        victim = self._rng.choice(candidates)
        try:
            os.kill(victim.pid, signal.SIGSTOP if kind == "hang" else signal.SIGKILL)
        except ProcessLookupError:
            self.skipped[kind] += 1
            return
        self.done[kind] += 1
        logger.info("%s: %s (pid %d)", kind, victim.name, victim.pid)
        if kind == "hang":
            self._await_replacement(client, victim)

    def _await_replacement(self, client: Client, victim: ProcessInfo) -> None:
        """A stopped process must be replaced by the system; otherwise resume it and say so."""
        started = time.monotonic()
        deadline = started + self.options.hang_timeout
        while time.monotonic() < deadline and not self._halt.is_set():
            now = {p.name: p.pid for p in process_table(client, self.book)}
            if victim.name in now and now[victim.name] != victim.pid:
                self.hangs.append(
                    {"role": victim.name, "pid": victim.pid, "detected": True, "seconds": time.monotonic() - started}
                )
                return
            time.sleep(0.5)
        logger.warning("hang of %s (pid %d) not detected; sending SIGCONT", victim.name, victim.pid)
        try:
            os.kill(victim.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        self.hangs.append({"role": victim.name, "pid": victim.pid, "detected": False, "seconds": None})

    def report(self) -> dict[str, Any]:
        return {
            "injected": {kind: self.done[kind] for kind in KINDS},
            "skipped": {kind: self.skipped[kind] for kind in KINDS if self.skipped[kind]},
            "hangs": self.hangs,
            "hang_not_detected": sum(not hang["detected"] for hang in self.hangs),
        }


__all__ = ["KINDS", "FaultOptions", "Faults", "RoleBook", "process_table"]
