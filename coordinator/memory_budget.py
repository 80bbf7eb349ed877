"""The budget over the whole system: which processes count, and the slab sized once they are measured.

The supervisor's plan bounds the slab by the dense weights alone (nothing else
is known before the processes run). Once the I/O workers and the GPU worker
are ready, `SlabSizing.size` measures every process (coordinator.footprint),
keeps that as the baseline, and limits each sparse layer's resident slots to
what the budget leaves after the baseline, the KV reserve and the room the
GPU worker asks for its backend's kernel compiler (MLX's CPU backend runs g++
as a child process for each new fused kernel; gpuworker/lanes.py)
(`shared.plan.plan_after_baseline`): the slots beyond are disabled, never
loaded, so their pages are never allocated. A budget that cannot hold the
startup floor after the baseline is refused with every part named, and the
coordinator exits (`hold` is one of its tasks): the launch fails with that line.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from dataclasses import replace

from coordinator.footprint import FootprintMeter
from coordinator.residency import ExpertResidencyManager
from shared.config import RunConfig
from shared.job_messages import ProcessInfo
from shared.plan import ExpertResidencyPlan, plan_after_baseline
from shared.process_table import read_process_table

logger = logging.getLogger("coordinator")
HTTP_FRONT_ROLE = "http_front"  # its process table key (supervisor/http_child.py: role_key("HTTP front"))


class BudgetRefused(ValueError):
    """The started processes leave the memory budget no room for the slab's startup floor."""


def system_roles(config: RunConfig, io_pids: Mapping[int, int], gpu_pid: int | None) -> dict[str, int]:
    """The processes whose memory counts, by role: the supervisor (when counted), the coordinator
    (this process), the I/O workers, the ready GPU worker, and the HTTP front when the supervisor's
    process table names one (it is the supervisor's child, but counts in its own right, also when
    a program embeds the system and the supervisor itself is not counted)."""
    roles = {"supervisor": config.supervisor_pid} if config.supervisor_pid else {}
    roles["coordinator"] = os.getpid()
    roles |= {f"io_worker_{index}": pid for index, pid in sorted(io_pids.items())}
    if gpu_pid is not None:
        roles["gpu_worker"] = gpu_pid
    http = next((info.pid for info in read_process_table(config.run_dir) if info.name == HTTP_FRONT_ROLE), None)
    if http:
        roles[HTTP_FRONT_ROLE] = http
    return roles


def measured_processes(meter: FootprintMeter, run_dir: str) -> tuple[ProcessInfo, ...]:
    """The supervisor's process table, each process with its memory at the meter's last sample."""
    readings = meter.readings()
    return tuple(
        replace(info, memory_bytes=readings[info.name][1]) if readings.get(info.name, (0,))[0] == info.pid else info
        for info in read_process_table(run_dir)
    )


class SlabSizing:
    """The plan once the processes were measured (`sized`), or the refusal `hold` raises."""

    def __init__(self, config: RunConfig, meter: FootprintMeter, manager: ExpertResidencyManager) -> None:
        self._config, self._meter, self._manager = config, meter, manager
        self.sized: ExpertResidencyPlan | None = None
        self.compiler_bytes = 0
        self._refusal: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def size(self, *, compiler_bytes: int = 0) -> bool:
        """Measure the processes and size the slab after them (and `compiler_bytes` kept free for the
        GPU worker's kernel compiler), the first time only; False if refused."""
        if self.sized is not None:
            return True
        if self._refusal.done():
            return False
        config, plan = self._config, self._config.plan
        baseline = self._meter.mark_baseline()
        parts = ", ".join(f"{role} {own}" for role, own in self._meter.parts().items())
        try:
            self.sized = plan_after_baseline(
                plan,
                baseline_bytes=baseline,
                kv_reserve_bytes=config.kv_reserve_bytes,
                compiler_bytes=compiler_bytes,
                parts=parts,
            )
        except ValueError as error:
            logger.error("%s", error)
            self._refusal.set_exception(BudgetRefused(str(error)))
            return False
        self.compiler_bytes = compiler_bytes
        disabled = self._manager.limit_layer_slots(self.sized.slots_per_layer)
        logger.info(
            "slab sized after the processes' %d bytes (%s), the KV reserve %d and the kernel compiler's %d: "
            "%d slots per layer of %d planned (%d slots disabled; budget %d)",
            baseline,
            parts,
            config.kv_reserve_bytes,
            compiler_bytes,
            self.sized.slots_per_layer,
            plan.slots_per_layer,
            disabled,
            plan.budget_bytes,
        )
        return True

    async def hold(self) -> None:
        """A task of the coordinator: raises BudgetRefused (so the coordinator exits) on a refusal."""
        await self._refusal


__all__ = ["BudgetRefused", "SlabSizing", "measured_processes", "system_roles"]
