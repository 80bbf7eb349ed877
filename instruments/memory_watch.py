"""Watch a running system's whole memory from outside: every process's PSS, the slab once, every 50 ms.

An instrument, independent of the coordinator's own accounting (it reads the
same kernel figures through `shared.system_memory`, but for the supervisor's
whole process tree, whatever the coordinator believes its pids are): the
demo, the soak and the tests use it to check that the sum never exceeds the
budget.

    with FootprintWatch(supervisor_pid, slab_path) as watch:   # or FootprintWatch(None, path, pids=[...])
        ...run jobs...
    watch.peak, watch.peak_parts  # the largest sum seen, and what it was made of
    watch.seen                    # pid -> start time of every process sampled (for leak checks)
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

import psutil

from shared.system_memory import processes_memory, system_footprint

SAMPLE_INTERVAL_S = 0.05


def process_tree(root: int) -> list[psutil.Process]:
    """`root` and every descendant still there."""
    try:
        parent = psutil.Process(root)
        return [parent, *parent.children(recursive=True)]
    except psutil.Error:
        return []


def _role(process: psutil.Process) -> str:
    """A short name for a process of the system: its module (`-m coordinator`), its script, or
    (not Python: MLX's kernel compiler, g++ and cc1plus) its executable."""
    try:
        argv = process.cmdline()
    except psutil.Error:
        return "gone"
    if "-m" in argv and argv.index("-m") + 1 < len(argv):
        name = argv[argv.index("-m") + 1]
        if name == "ioworker" and "--index" in argv:
            return f"ioworker{argv[argv.index('--index') + 1]}"
        return name
    if len(argv) > 1 and os.path.basename(argv[0]).startswith("python"):
        return os.path.basename(argv[1])
    return process.name()


def slab_resident(path: str) -> int:
    try:
        return os.stat(path).st_blocks * 512
    except OSError:
        return 0


@dataclass
class FootprintWatch:
    """Samples the tree under `root` (or the trees under `pids`, for a system started inside another
    program) and the slab file at `slab_path`, in a thread until stopped."""

    root: int | None
    slab_path: str
    pids: tuple[int, ...] = ()
    interval_s: float = SAMPLE_INTERVAL_S
    peak: int = 0
    peak_parts: dict[str, int] = field(default_factory=dict)
    samples: int = 0
    seen: dict[int, float] = field(default_factory=dict)  # pid -> create_time, every process sampled
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _roles: dict[int, str] = field(default_factory=dict)

    def _processes(self) -> list[psutil.Process]:
        if self.root is not None:
            return process_tree(self.root)
        found: list[psutil.Process] = []
        for pid in self.pids:  # each with the processes it started (MLX's kernel compiler)
            found += process_tree(pid)
        return found

    def sample(self) -> int:
        tree = self._processes()
        for process in tree:
            if process.pid not in self._roles:
                self._roles[process.pid] = _role(process)
                try:
                    self.seen[process.pid] = process.create_time()
                except psutil.Error:
                    pass
        readings = processes_memory(p.pid for p in tree)
        slab = slab_resident(self.slab_path)
        total = system_footprint(readings, slab)
        self.samples += 1
        if total > self.peak:
            self.peak = total
            parts: dict[str, int] = {"slab": slab}
            for pid, reading in readings.items():
                role = self._roles.get(pid, str(pid))
                parts[role] = parts.get(role, 0) + reading.own
            self.peak_parts = parts
        return total

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> FootprintWatch:
        self.sample()
        self._thread = threading.Thread(target=self._run, name="memory-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def describe(self) -> str:
        parts = ", ".join(f"{name} {value / 2**20:.0f}" for name, value in sorted(self.peak_parts.items()))
        return f"peak {self.peak / 2**20:.0f} MiB over {self.samples} samples ({parts} MiB)"


__all__ = ["SAMPLE_INTERVAL_S", "FootprintWatch", "process_tree", "slab_resident"]
