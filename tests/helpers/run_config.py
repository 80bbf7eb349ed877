"""A small valid `RunConfig` for the tests that check configs (no system is started from it)."""

from __future__ import annotations

import os

from shared.config import RunConfig, SlabSpec, run_endpoints
from shared.plan import ExpertResidencyPlan, plan_expert_residency


def small_run_config(
    run_dir: str | os.PathLike[str], *, plan: ExpertResidencyPlan | None = None, **fields: object
) -> RunConfig:
    """Two sparse layers of 16 KiB slots in `run_dir`'s endpoints; `fields` override any field."""
    plan = plan or plan_expert_residency(
        budget_bytes=10**7, fixed_bytes=0, slot_bytes=16384, sparse_layers=2, working_slots=2, pinned_experts=0
    )
    defaults = dict(
        run_dir=str(run_dir),
        model_dir="/m",
        block_size=4096,
        manifest="/m.json",
        manifest_files=1,
        plan=plan,
        slab=SlabSpec("/moeslab-0123456789ab", plan.total_slots, plan.slot_bytes),
        endpoints=run_endpoints(run_dir),
        io_workers=1,
        io_mode="direct",
        kv_reserve_bytes=0,
        dense_bytes=10,
    )
    return RunConfig(**{**defaults, **fields})
