"""The GPU worker as the coordinator knows it: one session per connected worker, and whether its process lives."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.pid_watch import PidWatch


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
    watch: PidWatch | None = field(default=None, compare=False)  # its process, from its hello on

    def alive(self) -> bool:
        """Its process has not exited (False for a session no hello opened)."""
        return self.watch is not None and self.watch.alive()

    def close(self) -> None:
        """The session is over: release its process watch."""
        if self.watch is not None:
            self.watch.close()


__all__ = ["GpuSession"]
