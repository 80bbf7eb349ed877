"""The soak's RSS snapshots and leak check (its footprint sampling is `instruments.memory_watch`'s).

The processes are the supervisor and all its descendants (what is measured must include a
process the system started but does not list); every process the footprint watch sampled is
remembered (pid and start time) for the leak check.

After shutdown a run leaks when any process it ran is still alive, a `/dev/shm` segment
carrying this run's tag is left, or its run directory (with its socket files) remains; each
leftover is named in the report and then removed, so one failed soak does not poison the next.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable

import psutil

from instruments.memory_watch import process_tree
from shared.slab import SLAB_NAME_PREFIX
from shared.system_memory import processes_memory

logger = logging.getLogger("soak.memory")

SHM_DIR = "/dev/shm"


def rss_snapshot(supervisor_pid: int, name: Callable[[int], str]) -> dict[str, dict[str, int]]:
    """Each process of the system now: role -> pid, RSS and own PSS."""
    processes = process_tree(supervisor_pid)
    readings = processes_memory(process.pid for process in processes)
    snapshot = {}
    for process in processes:
        try:
            rss = process.memory_info().rss
        except psutil.NoSuchProcess:
            continue
        own = readings[process.pid].own if process.pid in readings else 0
        snapshot[name(process.pid)] = {"pid": process.pid, "rss": rss, "pss": own}
    return snapshot


def rss_growth(start: dict[str, dict[str, int]], end: dict[str, dict[str, int]]) -> dict[str, int | None]:
    """RSS growth per role, from whichever process held it at each end (a restarted worker is
    compared with the one it replaced: what the role costs after N jobs); None for a role absent
    at either end (a transient process such as MLX's kernel compiler)."""
    return {role: end[role]["rss"] - start[role]["rss"] if role in start and role in end else None for role in end}


def replaced_roles(start: dict[str, dict[str, int]], end: dict[str, dict[str, int]]) -> list[str]:
    """Roles held by a different process at the end than at the start."""
    return sorted(role for role in start if role in end and start[role]["pid"] != end[role]["pid"])


def _alive(pid: int, create_time: float) -> bool:
    try:
        process = psutil.Process(pid)
        return process.create_time() == create_time and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def find_leaks(processes: dict[int, float], shm_tag: str, run_dir: str, *, wait: float = 10.0) -> dict[str, list[str]]:
    """What the stopped run left behind (children get `wait` seconds to notice their death pipes);
    everything found is then removed."""
    deadline = time.monotonic() + wait
    while any(_alive(pid, ct) for pid, ct in processes.items()) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = [pid for pid, ct in processes.items() if _alive(pid, ct)]
    left: list[str] = []
    for pid in alive:
        try:
            process = psutil.Process(pid)
            left.append(f"{pid} {' '.join(process.cmdline())[:120]}")
            process.kill()
        except psutil.NoSuchProcess:
            continue
    prefix = f"{SLAB_NAME_PREFIX[1:]}{shm_tag}-"
    segments = sorted(name for name in _listdir(SHM_DIR) if name.startswith(prefix))
    for name in segments:
        _remove(os.path.join(SHM_DIR, name))
    run_files = sorted(_listdir(run_dir)) if os.path.isdir(run_dir) else []
    if os.path.isdir(run_dir):
        run_files = run_files or ["(empty directory)"]
        shutil.rmtree(run_dir, ignore_errors=True)
    return {"processes": left, "segments": segments, "run_dir": [f"{run_dir}/{f}" for f in run_files]}


def leak_count(leaks: dict[str, Iterable[str]]) -> int:
    return len(leaks["processes"]) + len(leaks["segments"]) + (1 if leaks["run_dir"] else 0)


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


__all__ = ["find_leaks", "leak_count", "replaced_roles", "rss_growth", "rss_snapshot"]
