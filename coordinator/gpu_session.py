"""The GPU worker as the coordinator knows it: one session per connected worker, and whether its pid lives."""

from __future__ import annotations

from dataclasses import dataclass

import psutil


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@dataclass(frozen=True, slots=True)
class GpuSession:
    epoch: int = 0
    identity: bytes | None = None
    pid: int = 0
    ready: bool = False
    dense_bytes: int = 0
    wrap_path: str = "copy"
    compiler_bytes: int = 0  # its backend's kernel-compiler reserve (GpuReady.compiler_bytes)
    leaving: str = ""  # the worker's goodbye: why it exits (its exit is then not a loss)


__all__ = ["GpuSession", "alive"]
