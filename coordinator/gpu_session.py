"""The GPU worker as the coordinator knows it: one session per connected worker, and whether its process lives."""

from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.prefetch import welcome_copy_ahead, welcome_prefetch
from shared.config import RunConfig
from shared.gpu_messages import GpuWelcome
from shared.pid_watch import PidWatch
from shared.store import ExpertStore


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


def gpu_welcome(config: RunConfig, store: ExpertStore, slab_name: str, *, shared_path: bool) -> GpuWelcome:
    """What a worker that said hello is told: the slab's geometry, what to predict, and (on the
    shared lease path) the lease words' shape and how far to copy ahead."""
    plan = config.plan
    return GpuWelcome(
        slab_name=slab_name,
        total_slots=plan.total_slots,
        slot_bytes=plan.slot_bytes,
        working_slots=plan.working_slots,
        block_size=store.block_size,
        prefetch=welcome_prefetch(config, store),
        lease_layers=config.slab.lease_layers if shared_path else 0,
        lease_experts=config.slab.lease_experts if shared_path else 0,
        parts_min_bytes=config.decode_parts_min_bytes,
        copy_ahead=welcome_copy_ahead(config, store) if shared_path else 0,
    )


__all__ = ["GpuSession", "gpu_welcome"]
