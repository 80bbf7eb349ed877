"""Which experts the replay pins: the top pairs of a usage file, of the trace itself, or auto-pin planning.

Pins are resident for the whole replay in every policy (the baselines get the same slots), so
which pairs are pinned decides what the comparison is: a usage file is history, the trace's own
frequencies are oracle knowledge of the future, and `plan_auto_pins` is what the launcher's
`--pinned auto` would choose. Usage files are read with the real `ExpertUsageLedger`.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from instruments.cache_policies import unique_rows
from shared.trace import Trace


def open_usage_ledger(path: str | Path, trace: Trace):
    """The usage file read with the real `ExpertUsageLedger`, over the trace's layers and experts.

    The ledger ignores a damaged profile with a warning (right for a server's
    derived state); here the file is the user's explicit input, so a warning
    is an error.
    """
    from coordinator.usage import ExpertUsageLedger

    warnings: list[str] = []
    ledger = ExpertUsageLedger.open(
        path,
        layers=trace.layer_ids,
        experts_per_layer=trace_experts(trace),
        on_warning=warnings.append,
    )
    if warnings:
        raise ValueError(warnings[0])
    return ledger


def read_usage_counts(path: str | Path, trace: Trace) -> Counter:
    """(layer, expert) -> count of the usage file (`open_usage_ledger`)."""
    ledger = open_usage_ledger(path, trace)
    return Counter({(c.layer, c.expert_id): c.count for c in ledger.ranked_counts()})


def trace_experts(trace: Trace) -> int:
    """Experts per layer as far as the trace shows: its largest id + 1."""
    return int(trace.experts.max()) + 1


def plan_auto_pins(
    trace: Trace, usage_file: str, *, slots_per_layer: int, slot_bytes: int, min_pin_budget: int
) -> tuple[tuple[tuple[int, int], ...], str]:
    """Pins from `plan_expert_auto_pins`, as the launcher plans them (`--pinned auto`).

    The resident tier (slots_per_layer × layers slots) is what pins and LRU
    slots share: pins take their planned share, the LRU tier keeps the rest.
    """
    from shared.pins import plan_expert_auto_pins

    ledger = open_usage_ledger(usage_file, trace)
    layers = len(trace.layer_ids)
    tier = slots_per_layer * layers * slot_bytes
    plan = plan_expert_auto_pins(
        ledger=ledger,
        resident_tier_budget_bytes=tier,
        mandatory_resident_bytes=layers * slot_bytes,
        slot_bytes=lambda layer: slot_bytes,
        min_pin_budget_bytes=min_pin_budget,
    )
    pins = tuple(sorted((pin.layer, pin.expert_id) for pin in plan.pins))
    source = (
        f"auto from {usage_file}: {len(pins)} pins, confidence {plan.confidence:.2f}, "
        f"{plan.planned_bytes} of {plan.usable_budget_bytes} usable bytes"
    )
    return pins, source


def choose_pins(trace: Trace, *, count: int, usage_file: str | None) -> tuple[tuple[tuple[int, int], ...], str]:
    """The top `count` (layer, expert) pairs by usage-file count, or by trace frequency (oracle)."""
    if count == 0:
        return (), "none"
    if usage_file is not None:
        layers = set(trace.layer_ids)
        counts = Counter(
            {key: n for key, n in read_usage_counts(usage_file, trace).items() if key[0] in layers and n > 0}
        )
        source = f"usage file {usage_file} (top {count} by count)"
    else:
        counts = Counter(
            (layer, expert)
            for layer, row in zip(trace.layers.tolist(), unique_rows(trace.experts.tolist()))
            for expert in row
        )
        source = f"trace itself (top {count} by frequency: oracle knowledge)"
    if len(counts) < count:
        raise ValueError(f"--pinned {count}: only {len(counts)} candidate (layer, expert) pairs in {source}")
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:count]
    return tuple(sorted(key for key, _ in ranked)), source
