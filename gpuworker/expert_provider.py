"""The contract between a streamed MoE module and where its experts come from.

`gpuworker.streamed.StreamedSwitch` asks an `ExpertProvider` for the experts a
layer's routes select and gets them back as `LeasedWave`s: the experts leased
together, their tensors (loaded lazily, stacked, detached, or in parts for a
decode row) and the provider's own lease handle; the module fences each wave
once nothing reads it. `check_waves` holds a provider's answer to the protocol
(each routed expert in exactly one wave). Providers: `gpuworker.lease_client`
(the coordinator's lease protocol) and the tests' in-memory ones.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import mlx.core as mx
import numpy as np

from gpuworker.lanes import MAX_LANES

__all__ = ["ExpertProvider", "ExpertProviderError", "LeasedWave", "check_waves"]


def check_waves(waves: Sequence[LeasedWave], routes: np.ndarray, num_experts: int, layer: int) -> None:
    """Each routed expert in exactly one wave, and nothing else."""
    if len(waves) == 1 and _one_wave_serves(waves[0], routes, num_experts):
        return  # a decode visit's usual answer, checked without building the error's parts
    seen: set[int] = set()
    for wave in waves:
        ids = getattr(wave, "expert_ids", None)
        if ids is None or not all(callable(getattr(wave, name, None)) for name in ("take", "discard")):
            raise ExpertProviderError(f"layer {layer}: provider returned {type(wave).__name__}, not a LeasedWave")
        for expert in ids:
            if not 0 <= expert < num_experts:
                raise ExpertProviderError(f"layer {layer}: wave expert {expert} out of range [0, {num_experts})")
            if expert in seen:
                raise ExpertProviderError(f"layer {layer}: expert {expert} leased twice in one call")
            seen.add(expert)
    routed = set(np.unique(routes).tolist())
    if seen != routed:
        missing, extra = sorted(routed - seen), sorted(seen - routed)
        raise ExpertProviderError(
            f"layer {layer}: waves lease experts {sorted(seen)} but the routes need {sorted(routed)} "
            f"(missing {missing}, not routed {extra})"
        )


def _one_wave_serves(wave: object, routes: np.ndarray, num_experts: int) -> bool:
    ids = getattr(wave, "expert_ids", None)
    if ids is None or not (callable(getattr(wave, "take", None)) and callable(getattr(wave, "discard", None))):
        return False
    unique = set(ids)
    return (
        len(unique) == len(ids)
        and all(0 <= expert < num_experts for expert in unique)
        and unique == set(routes.reshape(-1).tolist())
    )


class ExpertProviderError(ValueError):
    """A provider answered with waves that do not serve the routes asked for."""


class LeasedWave:
    """Experts leased together: ids (unique, wave order) and each one's tensors.

    `tensors` is the per-expert `{name: mx.array}` in `expert_ids` order, or a
    zero-argument callable that produces them when the module reaches this
    wave: with a working bank smaller than a prefill's experts, wave i+1 can
    only be read into the slots wave i frees, i.e. after wave i's fence.
    The module `take()`s the tensors so that, once it has dropped them,
    nothing else holds them when it fences. `lease` is the provider's own
    handle (e.g. the lease id of the wire protocol).

    `stacked=True`: the tensors come already stacked, one `{name: [n, ...]}`
    mapping with the experts in ascending id (a provider that copies each
    slot straight into a stacked array saves the module's `mx.stack` copy).
    With `stack_rows` (one row per expert id, in `expert_ids` order) the
    stack is `[m, ...]`, m > every row, and expert_ids[i] is row
    stack_rows[i]; rows no expert names are never read (a set the provider
    filled ahead with predicted experts, `gpuworker.copy_ahead`).

    `detached=True`: the tensors are copies that never read the provider's
    slots (the copy path), so the wave may be fenced while its output is
    still being computed: the module starts the output's evaluation
    (`mx.async_eval`) instead of waiting for it, and hands it over in
    `outputs` with the fence. The provider must not overwrite the tensors'
    memory (a reused buffer) before those outputs are evaluated.

    `parts` with `take_part` (stacked, detached waves): the experts split into
    groups (consecutive in route rank order, or any order: the module puts the
    outputs back in rank order), whose stacked tensors
    `take_part(j)` produces one group at a time (in the group's order), so
    the module can compute a group while the next one is produced. A module
    uses either `take()` or every part, in order. `part_lanes[j]` is the
    compute lane (`gpuworker.lanes`) part j runs on (default: all lane 0).
    """

    __slots__ = (
        "_next_part",
        "_take_part",
        "_tensors",
        "detached",
        "expert_ids",
        "lease",
        "outputs",
        "part_lanes",
        "parts",
        "stack_rows",
        "stacked",
    )

    def __init__(
        self,
        expert_ids: Sequence[int],
        tensors: Sequence[Mapping[str, mx.array]] | Mapping[str, mx.array] | Callable[[], Any],
        *,
        lease: object = None,
        stacked: bool = False,
        detached: bool = False,
        parts: Sequence[Sequence[int]] = (),
        take_part: Callable[[int], Mapping[str, mx.array]] | None = None,
        part_lanes: Sequence[int] = (),
        stack_rows: Sequence[int] = (),
    ) -> None:
        self.expert_ids: tuple[int, ...] = tuple(int(e) for e in expert_ids)
        self.lease = lease
        self.stacked = bool(stacked)
        self.stack_rows: tuple[int, ...] = tuple(stack_rows)
        if self.stack_rows and (
            not self.stacked
            or len(self.stack_rows) != len(self.expert_ids)
            or len(set(self.stack_rows)) != len(self.stack_rows)
            or min(self.stack_rows) < 0
        ):
            raise ValueError(
                f"stack_rows {self.stack_rows} must be one distinct row per expert of "
                f"{self.expert_ids} in a stacked wave"
            )
        self.detached = bool(detached)
        self.outputs: tuple[mx.array, ...] = ()  # a detached wave's outputs, possibly still computing
        self.parts: tuple[tuple[int, ...], ...] = tuple(tuple(int(e) for e in part) for part in parts)
        if self.parts:
            if take_part is None or not (self.stacked and self.detached):
                raise ValueError("parts need take_part and a stacked, detached wave")
            if sorted(e for part in self.parts for e in part) != sorted(self.expert_ids):
                raise ValueError(f"parts {self.parts} do not hold the wave's experts {self.expert_ids} once each")
        self.part_lanes: tuple[int, ...] = tuple(part_lanes) or (0,) * len(self.parts)
        if len(self.part_lanes) != len(self.parts) or not all(
            isinstance(lane, int) and not isinstance(lane, bool) and 0 <= lane < MAX_LANES for lane in self.part_lanes
        ):
            raise ValueError(
                f"part_lanes {self.part_lanes} must be one lane in [0, {MAX_LANES}) per part ({len(self.parts)} parts)"
            )
        self._take_part = take_part
        self._next_part = 0
        if not callable(tensors):
            if self.stacked:
                tensors = dict(tensors)  # type: ignore[arg-type]
            else:
                tensors = tuple(tensors)
                if len(tensors) != len(self.expert_ids):
                    raise ValueError(f"{len(self.expert_ids)} expert ids but {len(tensors)} tensor sets")
        self._tensors = tensors

    @property
    def taken(self) -> bool:
        return self._tensors is None

    def take(self) -> Any:
        """Hand the tensors over (once, loading them if lazy) and forget them: a tuple of
        per-expert mappings, or (stacked) one mapping of stacked arrays."""
        if self._tensors is None or self._next_part:
            raise ExpertProviderError(f"wave {list(self.expert_ids)} was already taken")
        source, self._tensors = self._tensors, None
        loaded = source() if callable(source) else source
        if self.stacked:
            if not isinstance(loaded, Mapping):
                raise ExpertProviderError(
                    f"wave {list(self.expert_ids)}: stacked tensors are {type(loaded).__name__}, not a mapping"
                )
            return loaded
        tensors = tuple(loaded)
        if len(tensors) != len(self.expert_ids):
            raise ExpertProviderError(f"wave {list(self.expert_ids)}: {len(tensors)} tensor sets")
        return tensors

    def take_part(self, index: int) -> Mapping[str, mx.array]:
        """Part `index`'s stacked tensors ({name: [len(part), ...]}, in the part's order); parts
        are taken in order, and once they all are the wave counts as taken."""
        if self._tensors is None or self._take_part is None or index != self._next_part:
            raise ExpertProviderError(
                f"wave {list(self.expert_ids)}: part {index} taken out of order "
                f"(next is {self._next_part}, taken={self.taken})"
            )
        self._next_part += 1
        if self._next_part == len(self.parts):
            self._tensors = None
        got = self._take_part(index)
        if not isinstance(got, Mapping):
            raise ExpertProviderError(
                f"wave {list(self.expert_ids)} part {index}: tensors are {type(got).__name__}, not a mapping"
            )
        return got

    def discard(self) -> None:
        """Forget the tensors without loading them (error paths, empty waves)."""
        self._tensors = None
        self._take_part = None

    def __repr__(self) -> str:
        return f"LeasedWave(experts={list(self.expert_ids)}, lease={self.lease!r}, taken={self.taken})"


@runtime_checkable
class ExpertProvider(Protocol):
    """Where a streamed module gets its experts (in memory for tests; the lease protocol: `gpuworker.lease_client`)."""

    def acquire(
        self, layer: int, routes: np.ndarray, *, prefetch: tuple[int, tuple[int, ...]] | None = None
    ) -> Sequence[LeasedWave]:
        """Lease the experts of `routes` (rows x top_k, every selection, before dedup).

        Returns the waves in order; together they hold each routed expert once.
        A wave's tensors may load lazily (on `take`, after the previous fence).
        `prefetch` (only for modules given a predictor): (the next sparse layer, the
        experts predicted for it, best first), advisory; a provider may ignore it.
        """
        ...

    def fence(self, wave: LeasedWave) -> None:
        """The module no longer reads `wave`: its outputs are evaluated and its arrays dropped."""
        ...
