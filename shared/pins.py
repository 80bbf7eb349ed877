"""Startup pins from usage history: Colibri's AUTOPIN policy, made budget-safe.

The supervisor runs it over a profile read from disk (`UsageProfile`) to size
the slab before any process starts; the replay tool runs it over a ledger.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from shared.usage_profile import MAX_SAFE_INTEGER, ExpertUsageCount, bounded


class UsageHistory(Protocol):
    """What auto-pinning reads: `shared.usage_profile.UsageProfile` or `coordinator.usage.ExpertUsageLedger`."""

    @property
    def total_count(self) -> int: ...

    def ranked_counts(self) -> list[ExpertUsageCount]: ...


@dataclass(frozen=True, slots=True)
class ExpertAutoPinPlan:
    """Startup pins chosen from history, and the budget arithmetic behind them."""

    history_selections: int
    confidence: float
    requested_budget_bytes: int
    usable_budget_bytes: int
    planned_bytes: int
    pins: tuple[ExpertUsageCount, ...]


def _require_share(value: object) -> float:
    """pin_share as a finite float in (0, 1]."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"auto-pin pin_share must be a real number, got {value!r} ({type(value).__name__})")
    share = float(value)
    if not math.isfinite(share) or share <= 0 or share > 1:
        raise ValueError(f"auto-pin pin_share must be in (0, 1], got {value!r}")
    return share


def plan_expert_auto_pins(
    *,
    ledger: UsageHistory,
    resident_tier_budget_bytes: int,
    mandatory_resident_bytes: int,
    slot_bytes: Callable[[int], int],
    min_history_selections: int = 5000,
    full_confidence_selections: int = 200_000,
    pin_share: float = 0.5,
    min_pin_budget_bytes: int = 500_000_000,
) -> ExpertAutoPinPlan:
    """Colibri's startup AUTOPIN policy over `ledger`'s history, made budget-safe.

    History must reach `min_history_selections`; confidence ramps linearly to
    one at `full_confidence_selections`; pins get at most `pin_share` of the
    resident-tier budget (never the mandatory slots' share) and none at all
    below `min_pin_budget_bytes`. Greedy by count: an expert that does not fit
    is skipped and smaller ones may still fit after it.
    """
    if not callable(getattr(ledger, "ranked_counts", None)) or not hasattr(ledger, "total_count"):
        raise TypeError(f"ledger must be a usage history (ranked_counts, total_count), got {ledger!r}")
    if not callable(slot_bytes):
        raise TypeError(f"slot_bytes must be a function of the layer, got {slot_bytes!r}")

    def safe(value: object, name: str, minimum: int) -> int:
        return bounded(value, f"auto-pin {name}", minimum, MAX_SAFE_INTEGER)

    min_history = safe(min_history_selections, "min_history_selections", 1)
    full_confidence = safe(full_confidence_selections, "full_confidence_selections", 1)
    share = _require_share(pin_share)
    min_pin_budget = safe(min_pin_budget_bytes, "min_pin_budget_bytes", 0)
    tier_budget = safe(resident_tier_budget_bytes, "resident_tier_budget_bytes", 0)
    mandatory = safe(mandatory_resident_bytes, "mandatory_resident_bytes", 0)
    history = ledger.total_count
    confidence = min(history / full_confidence, 1.0)
    requested = math.floor(tier_budget * share * confidence)
    usable = min(requested, max(0, tier_budget - mandatory))
    pins: list[ExpertUsageCount] = []
    planned = 0
    if history >= min_history and requested >= min_pin_budget:
        for candidate in ledger.ranked_counts():
            size = safe(slot_bytes(candidate.layer), f"slot_bytes({candidate.layer})", 1)
            if planned + size > usable:
                continue
            pins.append(candidate)
            planned += size
    return ExpertAutoPinPlan(history, confidence, requested, usable, planned, tuple(pins))


__all__ = ["ExpertAutoPinPlan", "UsageHistory", "plan_expert_auto_pins"]
