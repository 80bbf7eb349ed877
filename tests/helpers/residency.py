"""The residency manager's unit-test ground: async test bodies, plans of one-byte slots, and small
managers over the in-memory backend driven one wave at a time."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence

from coordinator.memory_backend import InMemoryBackend
from coordinator.residency import ExpertResidencyManager
from coordinator.slot_table import SlotRecord
from shared.plan import ExpertResidencyPlan, plan_expert_residency
from shared.segments import ExpertIOSegment, ExpertResidencyLocation


def run_async(fn):
    """Run an `async def` test body in a fresh event loop."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))

    return wrapper


def one_byte_plan(*, layers: Sequence[int], working: int, per_layer: int, pins: int = 0) -> ExpertResidencyPlan:
    """A plan of one-byte slots whose budget holds exactly `working` + `pins` + `per_layer` per layer."""
    plan = plan_expert_residency(
        budget_bytes=working + pins + len(layers) * per_layer,
        fixed_bytes=0,
        slot_bytes=1,
        sparse_layers=len(layers),
        working_slots=working,
        pinned_experts=pins,
    )
    assert plan.slots_per_layer == per_layer
    return plan


def locate_one_byte(layer: int, expert: int) -> ExpertResidencyLocation:
    """Expert (layer, e) is byte e of file `layer`."""
    segment = ExpertIOSegment(file=layer, offset=expert, length=1, destination=0)
    return ExpertResidencyLocation(layer, expert, (segment,))


def make_manager(*, replacement, layers=(0,), working=2, per_layer=2, pins=(), usage=None) -> ExpertResidencyManager:
    """A manager of one-byte slots over the in-memory backend under `replacement`."""
    plan = one_byte_plan(layers=layers, working=working, per_layer=per_layer, pins=len(pins))
    return ExpertResidencyManager(
        plan=plan,
        sparse_layer_ids=list(layers),
        backend=InMemoryBackend(plan.total_slots),
        locate=locate_one_byte,
        pinned=list(pins),
        usage=usage,
        replacement=replacement,
    )


def visit(manager: ExpertResidencyManager, layer: int, ids) -> list[bool]:
    """One demand wave, released at once; the hit flag of each expert."""

    async def go():
        lease = await manager.acquire_block(layer, ids)
        lease.release_fenced()
        return [entry.hit for entry in lease.entries]

    return asyncio.run(go())


def resident(manager) -> dict[tuple[int, int], str]:
    """(layer, expert) -> tier of every resident expert."""
    return {(e.layer, e.expert_id): e.tier for e in manager.residency_map()}


def record(*, slot=0, layer=0, expert=None, last_use=0, phase="ready") -> SlotRecord:
    """A layer slot's record, for ranking by hand."""
    return SlotRecord(id=slot, role="layer", layer=layer, phase=phase, expert_id=expert, last_use=last_use)
