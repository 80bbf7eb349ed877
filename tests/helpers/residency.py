"""The residency manager's unit-test ground: async test bodies and plans of one-byte slots."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence

from shared.plan import ExpertResidencyPlan, plan_expert_residency


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
