"""Expert usage ledger: long-term routing counts plus session heat and recency.

A port of the reference engine's usage ledger (seeds/003, usage.ts). Counts
persist across runs in Colibri's `.coli_usage` format (`shared.usage_profile`)
and drive startup auto-pinning (`shared.pins`); heat and recency are
session-local and drive the LFRU live-repin policy. The profile is derived
state: a damaged file is reported and ignored, never fatal.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from shared.checks import require_int
from shared.usage_profile import (
    MAX_SAFE_INTEGER,
    UINT32_MAX,
    ExpertUsageCount,
    bounded,
    nonzero_rows,
    rank_counts,
    read_profile,
    remove_stale_temp_files,
    write_profile,
)

logger = logging.getLogger(__name__)

LFRU_RECENCY_WINDOW = 255
LFRU_HYSTERESIS = 4 * 256

_U64_MASK = np.uint64(UINT32_MAX)


@dataclass(frozen=True, slots=True)
class ExpertUsageEntry:
    """One expert's counters: persistent count, session heat, clock of last use."""

    count: int
    heat: int
    last_access: int


@dataclass(frozen=True, slots=True)
class ExpertUsageSnapshot:
    """Ledger totals; `total_count` is an exact (unsaturated) sum of all counts."""

    clock: int
    route_selections: int
    total_count: int
    nonzero_counts: int
    dirty: bool


@dataclass(frozen=True, slots=True)
class ExpertLfruCandidate:
    """A proposed live repin: replace pinned `cold_expert_id` by `hot_expert_id`."""

    layer: int
    cold_slot: int
    cold_expert_id: int
    hot_expert_id: int
    cold_score: int
    hot_score: int
    gain: int


def expert_lfru_score(heat: int, last_access: int, clock: int) -> int:
    """Heat in units of 256 plus a recency bonus that fades over 255 ticks.

    The age wraps at 2**32 like the ledger's clock, so a selection made just
    before the clock wrapped still counts as recent.
    """
    heat = require_int(heat, "heat")
    age = (require_int(clock, "clock") - require_int(last_access, "last_access")) & UINT32_MAX
    return heat * 256 + (LFRU_RECENCY_WINDOW - age if age < LFRU_RECENCY_WINDOW else 0)


def select_expert_lfru_candidates(
    candidates: Iterable[ExpertLfruCandidate], limit: int = 4
) -> list[ExpertLfruCandidate]:
    """The best `limit` repins: gain descending, then layer, then hot expert ascending."""
    limit = bounded(limit, "live-repin limit", 1, MAX_SAFE_INTEGER)
    ranked = sorted(candidates, key=lambda c: (-c.gain, c.layer, c.hot_expert_id))
    return ranked[:limit]


class ExpertUsageLedger:
    """Colibri-compatible expert frequency plus session-local heat and recency.

    Per tracked layer it keeps three uint32 arrays (count, heat, last access).
    Every router selection advances a uint32 clock that wraps at 2**32.
    Construct with `open`, which also loads an existing profile.
    """

    def __init__(self, path: str | os.PathLike[str], *, layers: Iterable[int], experts_per_layer: int) -> None:
        """An empty ledger (no profile is read); validates everything before keeping anything."""
        text = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
        if not isinstance(text, str):
            raise TypeError(f"expert usage path must be str or os.PathLike[str], got {path!r}")
        if not text:
            raise ValueError(f"expert usage path must not be empty, got {text!r}")
        experts = bounded(experts_per_layer, "experts_per_layer", 1, UINT32_MAX)
        if isinstance(layers, (str, bytes)):
            raise TypeError(f"layers must be an iterable of integers, got {layers!r}")
        tracked = tuple(bounded(layer, "expert usage layer", 0, MAX_SAFE_INTEGER) for layer in layers)
        if not tracked or len(set(tracked)) != len(tracked):
            raise ValueError(f"expert usage layers must be non-empty and unique, got {list(tracked)}")
        self._path, self._layers, self._experts = text, tracked, experts
        self._counts = {layer: np.zeros(experts, np.uint32) for layer in tracked}
        self._heat = {layer: np.zeros(experts, np.uint32) for layer in tracked}
        self._last = {layer: np.zeros(experts, np.uint32) for layer in tracked}
        self._clock = 0  # uint32, wraps
        self._route_selections = 0  # this session, unbounded
        self._dirty = False

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        layers: Iterable[int],
        experts_per_layer: int,
        on_warning: Callable[[str], None] | None = None,
    ) -> ExpertUsageLedger:
        """A ledger seeded from the profile at `path` if it exists.

        A damaged or unreadable profile is reported through `on_warning` (or the
        log when no callback is given) and ignored: all counts start at zero.
        Temp files of flushes killed before their rename are removed (the ledger
        is the profile's writer).
        """
        if on_warning is not None and not callable(on_warning):
            raise TypeError(f"on_warning must be callable or None, got {on_warning!r}")
        ledger = cls(path, layers=layers, experts_per_layer=experts_per_layer)
        read_profile(ledger._path, ledger._counts, on_warning=on_warning)
        removed = remove_stale_temp_files(ledger._path)
        if removed:
            logger.info("removed %d temp file(s) of killed usage flushes: %s", len(removed), removed)
        return ledger

    @property
    def path(self) -> str:
        """The profile file loaded from and flushed to."""
        return self._path

    @property
    def layers(self) -> tuple[int, ...]:
        """Tracked layers as given (also the file's row order)."""
        return self._layers

    @property
    def experts_per_layer(self) -> int:
        """Routed experts in every tracked layer."""
        return self._experts

    def record_routes(self, layer: int, routes: Iterable[Iterable[int]] | np.ndarray) -> None:
        """Count every selected route before the execution plan deduplicates it.

        `routes` is rows of expert ids, or a 2-D integer array (rows x top-k).
        The clock advances once per selection in row-major, rank-major order and
        each expert's last access is the clock at its last selection. Every id is
        validated first: an invalid batch changes nothing.
        """
        layer = self._require_layer(layer)
        self._apply(layer, self._route_ids(routes))

    def entry(self, layer: int, expert_id: int) -> ExpertUsageEntry:
        """One expert's count, heat and last access."""
        layer = self._require_layer(layer)
        expert_id = self._require_expert(expert_id, "expert_id")
        return ExpertUsageEntry(
            int(self._counts[layer][expert_id]), int(self._heat[layer][expert_id]), int(self._last[layer][expert_id])
        )

    def snapshot(self) -> ExpertUsageSnapshot:
        """Clock, selections recorded this session, and count totals."""
        total = self.total_count
        nonzero = sum(int(np.count_nonzero(counts)) for counts in self._counts.values())
        return ExpertUsageSnapshot(self._clock, self._route_selections, total, nonzero, self._dirty)

    @property
    def total_count(self) -> int:
        """The exact (unsaturated) sum of all counts: the selections of history."""
        return sum(int(counts.sum(dtype=np.uint64)) for counts in self._counts.values())

    def ranked_counts(self) -> list[ExpertUsageCount]:
        """Nonzero counts, most frequent first; ties by layer, then expert id."""
        return rank_counts(self._nonzero_rows())

    def lfru_candidate(self, layer: int, pinned_expert_ids: Sequence[int] | np.ndarray) -> ExpertLfruCandidate | None:
        """Propose swapping the coldest pinned expert for the hottest unpinned one.

        As in the reference, an empty pin list yields None before any validation.
        The coldest pin is the first minimum score, the hottest unpinned expert
        the first (lowest id) maximum; None unless the hot score beats the cold
        one by the hysteresis margin (a quarter of it plus four heat units).
        """
        ids = pinned_expert_ids
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
            raise TypeError(f"pinned_expert_ids must be a sequence of ints, got {ids!r}")
        pinned = ids.tolist() if isinstance(ids, np.ndarray) else list(ids)
        if not pinned:
            return None
        layer = self._require_layer(layer)
        pinned = [self._require_expert(expert_id, "pinned expert id") for expert_id in pinned]
        scores = self._scores(layer)
        pinned_scores = scores[pinned]
        cold_slot = int(np.argmin(pinned_scores))  # argmin: first minimum wins
        cold_score = int(pinned_scores[cold_slot])
        unpinned = scores.copy()
        unpinned[pinned] = -1  # real scores are >= 0
        hot_expert_id = int(np.argmax(unpinned))  # argmax: first maximum wins
        hot_score = int(unpinned[hot_expert_id])
        if hot_score < 0 or hot_score <= cold_score + cold_score // 4 + LFRU_HYSTERESIS:
            return None
        return ExpertLfruCandidate(
            layer,
            cold_slot,
            pinned[cold_slot],
            hot_expert_id,
            cold_score,
            hot_score,
            gain=(hot_score - cold_score) // 256,
        )

    def decay_heat(self) -> None:
        """Halve every expert's heat so old bursts fade (counts are untouched)."""
        for heat in self._heat.values():
            np.right_shift(heat, 1, out=heat)

    def flush(self) -> None:
        """Persist the counts atomically; a no-op when nothing changed.

        Same-directory temp file (0600, created exclusively), written fully, fsynced,
        renamed over the profile, directory fsynced. On any failure the temp file is
        removed, the old profile is intact, the ledger stays dirty, the error propagates.
        """
        if not self._dirty:
            return
        written = write_profile(self._path, self._nonzero_rows())
        self._dirty = False
        logger.debug("flushed %d expert usage bytes to %s", written, self._path)

    def _force_clock(self, clock: int) -> None:
        """Test hook only: set the clock (reaching 2**32 for real takes hours)."""
        self._clock = bounded(clock, "clock", 0, UINT32_MAX)

    def _force_entry(self, layer: int, expert_id: int, *, heat: int, last_access: int) -> None:
        """Test hook only: set one expert's heat and last access directly."""
        layer = self._require_layer(layer)
        expert_id = self._require_expert(expert_id, "expert_id")
        self._heat[layer][expert_id] = bounded(heat, "heat", 0, UINT32_MAX)
        self._last[layer][expert_id] = bounded(last_access, "last_access", 0, UINT32_MAX)

    def _require_layer(self, layer: object) -> int:
        number = require_int(layer, "layer")
        if number not in self._counts:
            raise ValueError(f"layer {number} is not tracked by expert usage (tracked: {list(self._layers)})")
        return number

    def _require_expert(self, expert_id: object, name: str) -> int:
        return bounded(expert_id, name, 0, self._experts - 1)

    def _route_ids(self, routes: object) -> np.ndarray:
        """Validated expert ids of a batch, flattened row-major, as intp."""
        if isinstance(routes, np.ndarray) and routes.dtype.kind != "O":
            if routes.ndim != 2:
                raise ValueError(f"routes array must be 2-D (rows x top-k), got shape {routes.shape}")
            if routes.dtype.kind not in "iu":
                raise TypeError(f"routes array must have an integer dtype, got {routes.dtype}")
            wide = routes.astype(np.int64 if routes.dtype.kind == "i" else np.uint64).ravel()
            bad = wide >= self._experts
            if wide.dtype.kind == "i":
                bad |= wide < 0
            if bad.any():
                first = int(np.flatnonzero(bad)[0])
                row, rank = divmod(first, routes.shape[1])
                self._require_expert(int(wide[first]), f"route {row} rank {rank} expert")
            return wide.astype(np.intp)
        if isinstance(routes, np.ndarray):
            routes = routes.tolist()
        if isinstance(routes, (str, bytes)) or not isinstance(routes, Iterable):
            raise TypeError(f"routes must be rows of expert ids, got {routes!r}")
        ids: list[int] = []
        for row, indices in enumerate(routes):
            if isinstance(indices, np.ndarray):
                if indices.ndim != 1:
                    raise ValueError(f"route {row} must be 1-D, got shape {indices.shape}")
                indices = indices.tolist()
            elif isinstance(indices, (str, bytes)) or not isinstance(indices, Iterable):
                raise TypeError(f"route {row} must be a sequence of expert ids, got {indices!r}")
            for rank, expert_id in enumerate(indices):
                ids.append(self._require_expert(expert_id, f"route {row} rank {rank} expert"))
        return np.asarray(ids, dtype=np.intp)

    def _apply(self, layer: int, ids: np.ndarray) -> None:
        """Apply validated selections; equivalent to the reference's one-by-one loop."""
        n = int(ids.size)
        if n == 0:
            return
        # Unique over the reversed batch: the first index there is the last selection.
        experts, reversed_first, hits = np.unique(ids[::-1], return_index=True, return_counts=True)
        hits = hits.astype(np.uint64)
        for counters in (self._counts[layer], self._heat[layer]):
            counters[experts] = np.minimum(counters[experts].astype(np.uint64) + hits, _U64_MASK)
        last_position = (n - 1 - reversed_first).astype(np.uint64)
        self._last[layer][experts] = (last_position + np.uint64(self._clock + 1)) & _U64_MASK
        self._clock = (self._clock + n) & UINT32_MAX
        self._route_selections += n
        self._dirty = True

    def _scores(self, layer: int) -> np.ndarray:
        """`expert_lfru_score` of every expert in `layer`, vectorised (int64)."""
        age = (np.int64(self._clock) - self._last[layer].astype(np.int64)) & np.int64(UINT32_MAX)
        recency = np.where(age < LFRU_RECENCY_WINDOW, LFRU_RECENCY_WINDOW - age, 0)
        return self._heat[layer].astype(np.int64) * 256 + recency

    def _nonzero_rows(self) -> Iterator[tuple[int, int, int]]:
        """(layer, expert, count) for nonzero counts: layers as given, experts ascending."""
        return nonzero_rows(self._counts, self._layers)


__all__ = [
    "ExpertLfruCandidate",
    "ExpertUsageEntry",
    "ExpertUsageLedger",
    "ExpertUsageSnapshot",
    "expert_lfru_score",
    "select_expert_lfru_candidates",
]
