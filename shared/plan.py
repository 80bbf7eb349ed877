"""The residency plan: how a memory budget splits into working, pinned and per-layer slots.

The supervisor sizes the slab with it, the coordinator's residency manager
lays out its slots by it, and the replay tool simulates it.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.checks import require_int

DEFAULT_EXPERT_WORKING_SLOTS = 64


@dataclass(frozen=True, slots=True)
class ExpertResidencyPlan:
    """The only admissible fixed-capacity slab layout for a budget."""

    budget_bytes: int
    fixed_bytes: int
    slot_bytes: int
    sparse_layers: int
    working_slots: int
    pinned_slots: int
    slots_per_layer: int
    resident_slots: int
    total_slots: int
    slab_bytes: int
    planned_bytes: int


def plan_expert_residency(
    *,
    budget_bytes: int,
    fixed_bytes: int,
    slot_bytes: int,
    sparse_layers: int,
    working_slots: int | None = None,
    pinned_experts: int | None = None,
    max_slots_per_layer: int | None = None,
) -> ExpertResidencyPlan:
    """Split a memory budget into working, pinned and per-layer resident slots.

    One persistent slot per sparse layer plus the whole working bank is the
    startup floor; a budget below it is refused with every part named.
    """
    budget = require_int(budget_bytes, "budget_bytes", minimum=1)
    fixed = require_int(fixed_bytes, "fixed_bytes", minimum=0)
    slot = require_int(slot_bytes, "slot_bytes", minimum=1)
    layers = require_int(sparse_layers, "sparse_layers", minimum=1)
    working = require_int(
        DEFAULT_EXPERT_WORKING_SLOTS if working_slots is None else working_slots,
        "working_slots",
        minimum=1,
    )
    pinned = require_int(0 if pinned_experts is None else pinned_experts, "pinned_experts")
    cap = None if max_slots_per_layer is None else require_int(max_slots_per_layer, "max_slots_per_layer", minimum=1)

    mandatory_bytes = (working + pinned + layers) * slot
    if fixed + mandatory_bytes > budget:
        raise ValueError(
            f"expert residency budget cannot start: {budget} bytes does not fit "
            f"{fixed} fixed + {working} working + {pinned} pinned + one slot for "
            f"each of {layers} sparse layers, at {slot} bytes per slot "
            f"(needs {fixed + mandatory_bytes} bytes)"
        )
    variable_bytes = budget - fixed - (working + pinned) * slot
    slots_per_layer = variable_bytes // (layers * slot)
    if cap is not None:
        slots_per_layer = min(slots_per_layer, cap)
    resident = slots_per_layer * layers
    total = working + pinned + resident
    slab = total * slot
    return ExpertResidencyPlan(
        budget_bytes=budget,
        fixed_bytes=fixed,
        slot_bytes=slot,
        sparse_layers=layers,
        working_slots=working,
        pinned_slots=pinned,
        slots_per_layer=slots_per_layer,
        resident_slots=resident,
        total_slots=total,
        slab_bytes=slab,
        planned_bytes=fixed + slab,
    )


def plan_after_baseline(
    plan: ExpertResidencyPlan,
    *,
    baseline_bytes: int,
    kv_reserve_bytes: int,
    compiler_bytes: int = 0,
    parts: str = "",
) -> ExpertResidencyPlan:
    """`plan` once the started processes' memory is known: the slab gets what the budget leaves
    after the processes (`baseline_bytes`, dense weights included), the KV reserve and the room
    kept for a kernel compiler process (`compiler_bytes`), never more slots per layer than `plan`
    had; ValueError naming every part when the startup floor does not fit."""
    try:
        return plan_expert_residency(
            budget_bytes=plan.budget_bytes,
            fixed_bytes=baseline_bytes + kv_reserve_bytes + compiler_bytes,
            slot_bytes=plan.slot_bytes,
            sparse_layers=plan.sparse_layers,
            working_slots=plan.working_slots,
            pinned_experts=plan.pinned_slots,
            max_slots_per_layer=plan.slots_per_layer,
        )
    except ValueError:
        floor = (plan.working_slots + plan.pinned_slots + plan.sparse_layers) * plan.slot_bytes
        needed = baseline_bytes + kv_reserve_bytes + compiler_bytes + floor
        compiler = f"the kernel compiler's {compiler_bytes} bytes + " if compiler_bytes else ""
        raise ValueError(
            f"memory budget {plan.budget_bytes} bytes cannot serve: the started processes use {baseline_bytes} "
            f"bytes{f' ({parts})' if parts else ''} + the KV reserve {kv_reserve_bytes} bytes + {compiler}"
            f"{plan.working_slots} working + {plan.pinned_slots} pinned + one slot for each of "
            f"{plan.sparse_layers} sparse layers at {plan.slot_bytes} bytes: {needed} bytes "
            f"(raise --memory-budget to at least {needed})"
        ) from None


__all__ = ["DEFAULT_EXPERT_WORKING_SLOTS", "ExpertResidencyPlan", "plan_after_baseline", "plan_expert_residency"]
