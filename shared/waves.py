"""The wave partition: which experts of a routes matrix are leased together.

A layer's routes (rows x top-k expert ids) are leased as waves: the unique
experts in first-seen order, row-major then rank-major, at most the working
bank at a time. The coordinator leases by `build_expert_batch_union` and the
GPU worker predicts the same waves with `wave_partition`; both run the one
rule in `wave_partition`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from shared.checks import require_int
from shared.plan import DEFAULT_EXPERT_WORKING_SLOTS


def wave_partition(routes: np.ndarray | Sequence[int], working_slots: int) -> list[tuple[int, ...]]:
    """The unique experts of `routes` (flattened row-major) in first-seen order, `working_slots` at a time."""
    # dict keeps first-seen order; for a decode step's few ids it is faster than numpy's unique.
    flat = routes.reshape(-1).tolist() if isinstance(routes, np.ndarray) else list(routes)
    order = list(dict.fromkeys(flat))
    return [tuple(order[start : start + working_slots]) for start in range(0, len(order), working_slots)]


@dataclass(frozen=True, slots=True)
class ExpertUnionEntry:
    """One unique expert of a wave and every (row, rank) that selected it."""

    expert_id: int
    consumers: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class ExpertUnionWave:
    """At most `max_unique_per_wave` unique experts, leased together."""

    entries: tuple[ExpertUnionEntry, ...]

    @property
    def expert_ids(self) -> tuple[int, ...]:
        return tuple(entry.expert_id for entry in self.entries)


def _route_rows(routes: Sequence[Sequence[int]] | np.ndarray) -> Iterable[Sequence[int]]:
    if isinstance(routes, np.ndarray):
        if routes.ndim != 2:
            raise ValueError(f"routes array must be 2-D (rows x top-k), got shape {routes.shape}")
        if not np.issubdtype(routes.dtype, np.integer):
            raise TypeError(f"routes array must hold integers, got dtype {routes.dtype}")
        return routes.tolist()
    if isinstance(routes, (str, bytes)) or not isinstance(routes, Sequence):
        raise TypeError(f"routes must be a sequence of rows or a 2-D array, got {type(routes).__name__}")
    return routes


def build_expert_batch_union(
    routes: Sequence[Sequence[int]] | np.ndarray,
    max_unique_per_wave: int = DEFAULT_EXPERT_WORKING_SLOTS,
) -> list[ExpertUnionWave]:
    """Deduplicate router output into waves (`wave_partition`), each expert with every consumer.

    Every id is validated first, naming the bad (row, rank); no wave holds more
    unique experts than `max_unique_per_wave`.
    """
    limit = require_int(max_unique_per_wave, "max_unique_per_wave", minimum=1)
    consumers: dict[int, list[tuple[int, int]]] = {}
    for row, route in enumerate(_route_rows(routes)):
        if isinstance(route, (str, bytes)) or not isinstance(route, (Sequence, np.ndarray)):
            raise TypeError(f"route {row} must be a sequence of expert ids, got {route!r}")
        for rank, expert in enumerate(route):
            try:
                expert_id = require_int(expert, f"route {row} rank {rank} expert")
            except (TypeError, ValueError) as error:
                raise type(error)(f"route {row} rank {rank} has invalid expert {expert!r}") from None
            consumers.setdefault(expert_id, []).append((row, rank))
    return [
        ExpertUnionWave(tuple(ExpertUnionEntry(expert, tuple(consumers[expert])) for expert in wave))
        for wave in wave_partition(list(consumers), limit)  # already first-seen, once each
    ]


__all__ = ["ExpertUnionEntry", "ExpertUnionWave", "build_expert_batch_union", "wave_partition"]
