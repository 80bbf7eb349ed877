"""Budget planning for a launch: sizes, the residency plan, the pinned experts.

Pure functions of the expert store and the options; nothing here creates a
file, a segment or a process, so a budget that cannot start is refused before
anything exists.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence

from shared.pins import plan_expert_auto_pins
from shared.plan import DEFAULT_EXPERT_WORKING_SLOTS, ExpertResidencyPlan, plan_expert_residency
from shared.store import ExpertStore
from shared.usage_profile import UsageProfile

logger = logging.getLogger("moeslab.launch")

DEFAULT_KV_RESERVE_BYTES = 256 * 2**20
# Room for the processes themselves (Python, libraries, MLX, staging buffers; ~150-250 MiB measured on
# the test and demo models) in budgets that tools derive from a slot count: the budget covers the
# whole system, so a budget of dense + KV + slots alone is refused once the processes are measured.
PROCESS_ALLOWANCE_BYTES = 512 * 2**20

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")


class BudgetError(ValueError):
    """The memory budget cannot hold the model's fixed parts and the minimum slots."""


def parse_size(text: str) -> int:
    """`8GiB`, `512MiB`, `1.5GB`, `4096` (bytes) as a positive number of bytes; ValueError otherwise.

    KB/MB/GB/TB are decimal, KiB/MiB/GiB/TiB binary (case does not matter); fractions round down."""
    match = _SIZE.fullmatch(text) if isinstance(text, str) else None
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"{text!r} is not a size: use bytes or a number with B, KB, MB, GB, TB, KiB, MiB, GiB "
            "or TiB, e.g. 8GiB, 512MiB, 1.5GB"
        )
    number = match.group(1)
    whole, _, fraction = number.partition(".")
    # Exact decimal arithmetic: 1.1GB is 1100000000 bytes, not a float's neighbour of it.
    scale = _UNITS[unit]
    value = int(whole or 0) * scale + (int(fraction) * scale // 10 ** len(fraction) if fraction else 0)
    if value <= 0:
        raise ValueError(f"size {text!r} must be at least one byte")
    return value


def plan_budget(
    store: ExpertStore,
    *,
    memory_budget: int,
    kv_reserve_bytes: int = DEFAULT_KV_RESERVE_BYTES,
    working_slots: int | None = None,
    slots_per_layer: int | None = None,
    pinned: int = 0,
) -> ExpertResidencyPlan:
    """The residency plan for `store` in `memory_budget`, or BudgetError naming every part."""
    fixed = store.dense_bytes + kv_reserve_bytes
    working = DEFAULT_EXPERT_WORKING_SLOTS if working_slots is None else working_slots
    layers, slot = len(store.sparse_layers), store.slot_bytes
    if all(isinstance(n, int) and not isinstance(n, bool) for n in (memory_budget, working, pinned, kv_reserve_bytes)):
        needed = fixed + (working + pinned + layers) * slot
        if memory_budget < needed:
            raise BudgetError(
                f"memory budget {memory_budget} bytes cannot start {store.model_dir}: it needs the dense weights "
                f"({store.dense_bytes} bytes) + the KV reserve ({kv_reserve_bytes} bytes) + {working} working "
                f"slots + {pinned} pinned slots + one slot for each of {layers} sparse layers, at {slot} bytes "
                f"per slot: {needed} bytes"
            )
    # Anything else wrong (a negative count, a non-integer) is the planner's to name.
    return plan_expert_residency(
        budget_bytes=memory_budget,
        fixed_bytes=fixed,
        slot_bytes=slot,
        sparse_layers=layers,
        working_slots=working,
        pinned_experts=pinned,
        max_slots_per_layer=slots_per_layer,
    )


def check_pins(store: ExpertStore, pins: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Explicit (layer, expert) pins, checked against the store; ValueError names a bad one."""
    checked = tuple((int(layer), int(expert)) for layer, expert in pins)
    for layer, expert in checked:
        if layer not in store.sparse_layers or not 0 <= expert < store.experts_per_layer:
            raise ValueError(
                f"pinned expert {layer}:{expert} is not an expert of the sparse layers "
                f"{list(store.sparse_layers)} x {store.experts_per_layer} experts"
            )
    if len(set(checked)) != len(checked):
        raise ValueError(f"pinned experts repeat: {list(checked)}")
    return checked


def _read_profile(store: ExpertStore, usage_file: str) -> UsageProfile:
    return UsageProfile.open(usage_file, layers=store.sparse_layers, experts_per_layer=store.experts_per_layer)


def choose_pins(store: ExpertStore, count: int, usage_file: str | None) -> tuple[tuple[int, int], ...]:
    """`count` (layer, expert) pins: the usage profile's most counted first, then round robin."""
    pins: list[tuple[int, int]] = []
    if count and usage_file and os.path.exists(usage_file):
        pins = [(c.layer, c.expert_id) for c in _read_profile(store, usage_file).ranked_counts()[:count]]
    for expert in range(store.experts_per_layer):
        for layer in store.sparse_layers:
            if len(pins) >= count:
                return tuple(pins)
            if (layer, expert) not in pins:
                pins.append((layer, expert))
    if len(pins) < count:
        raise BudgetError(f"{count} pinned experts asked for; the model has {len(pins)}")
    return tuple(pins)


def auto_pins(
    store: ExpertStore, *, memory_budget: int, kv_reserve_bytes: int, working_slots: int | None, usage_file: str | None
) -> tuple[tuple[int, int], ...]:
    """`--pinned-experts auto`: the usage ledger's auto-pin policy over the resident tier.

    The resident tier is what the budget leaves after the dense weights, the KV reserve and the
    working bank; its mandatory part is one slot per sparse layer. No profile: no pins."""
    if not usage_file or not os.path.exists(usage_file):
        logger.info("auto pins: no usage profile at %s; pinning nothing", usage_file)
        return ()
    working = DEFAULT_EXPERT_WORKING_SLOTS if working_slots is None else working_slots
    tier = memory_budget - store.dense_bytes - kv_reserve_bytes - working * store.slot_bytes
    plan = plan_expert_auto_pins(
        ledger=_read_profile(store, usage_file),
        resident_tier_budget_bytes=max(0, tier),
        mandatory_resident_bytes=len(store.sparse_layers) * store.slot_bytes,
        slot_bytes=lambda layer: store.slot_bytes,
    )
    logger.info(
        "auto pins from %d selections of history (confidence %.2f): %d experts, %d bytes",
        plan.history_selections,
        plan.confidence,
        len(plan.pins),
        plan.planned_bytes,
    )
    return tuple((pin.layer, pin.expert_id) for pin in plan.pins)


__all__ = [
    "DEFAULT_KV_RESERVE_BYTES",
    "BudgetError",
    "auto_pins",
    "check_pins",
    "choose_pins",
    "parse_size",
    "plan_budget",
]
