"""The streamed MoE module: mlx-lm's own SwitchGLU/SwitchMLP fed with leased experts.

`StreamedSwitch` replaces a `SwitchGLU`/`SwitchMLP` of
`mlx_lm.models.switch_layers` but keeps the original instance (its class,
activation, biases, quantization and `gather_mm`/`gather_qmm` calls) with its
expert parameters removed. A call receives `(x, indices)` exactly as the
switch module does, evaluates the routes (inherent: the experts to fetch are
data), asks an `ExpertProvider` for them, and for each leased wave:

1. stacks the wave's experts in ascending expert id into parameters of shape
   `[n_unique, ...]` and remaps the indices from expert ids to positions;
2. calls the original `__call__` and evaluates its output;
3. removes the parameters and drops every array that read the wave;
4. only then fences the wave (zero-copy arrays read the slab itself).

One wave (decode): the original call with the full, monotonically remapped
indices, so the sort, the kernels and the result are mlx-lm's bit for bit.
A decode wave may come in parts (consecutive ranks of its one route row, see
`LeasedWave.parts`): each part is one call of the original module on its
ranks, started (`mx.async_eval`) before the next part's tensors are taken, so
a provider that copies slots copies part j+1 while part j computes; a
decode row's (token, expert) products do not depend on the other ranks, so
the parts' outputs put side by side are the single call's, bit for bit.
Parts may run on different compute lanes (MLX streams, `gpuworker.lanes`):
the same kernels on the same bytes, on more cores where the backend has them.
Several waves (prefill larger than the working bank): each wave computes its
(row, rank) consumers only, and the outputs are put back in place, so the
family's `(y * scores).sum(-2)` runs unchanged on a `[..., k, hidden]` result.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from gpuworker.lanes import MAX_LANES, lane_stream

__all__ = [
    "ExpertParam",
    "ExpertProvider",
    "ExpertProviderError",
    "LeasedWave",
    "StreamedSwitch",
]

logger = logging.getLogger(__name__)


def _evaluate(*arrays: mx.array) -> None:
    """mx.eval, behind a name the tests can observe (ordering of eval and fence)."""
    mx.eval(*arrays)


def _evaluate_async(*arrays: mx.array) -> None:
    """mx.async_eval (a detached wave's output), behind a name the tests can observe."""
    mx.async_eval(*arrays)


class ExpertProviderError(ValueError):
    """A provider answered with waves that do not serve the routes asked for."""


@dataclass(frozen=True, slots=True)
class ExpertParam:
    """One tensor of one expert, as the switch module names it (no expert axis)."""

    name: str  # e.g. "gate_proj.weight", "down_proj.scales", "up_proj.bias"
    shape: tuple[int, ...]
    dtype: mx.Dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.size


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

    `detached=True`: the tensors are copies that never read the provider's
    slots (the copy path), so the wave may be fenced while its output is
    still being computed: the module starts the output's evaluation
    (`mx.async_eval`) instead of waiting for it, and hands it over in
    `outputs` with the fence. The provider must not overwrite the tensors'
    memory (a reused buffer) before those outputs are evaluated.

    `parts` with `take_part` (stacked, detached waves): the experts split into
    consecutive groups, in route rank order, whose stacked tensors
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
    ) -> None:
        self.expert_ids: tuple[int, ...] = tuple(int(e) for e in expert_ids)
        self.lease = lease
        self.stacked = bool(stacked)
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
    """Where a streamed module gets its experts (in memory for tests; the lease protocol later)."""

    def acquire(self, layer: int, routes: np.ndarray) -> Sequence[LeasedWave]:
        """Lease the experts of `routes` (rows x top_k, every selection, before dedup).

        Returns the waves in order; together they hold each routed expert once.
        A wave's tensors may load lazily (on `take`, after the previous fence).
        """
        ...

    def fence(self, wave: LeasedWave) -> None:
        """The module no longer reads `wave`: its outputs are evaluated and its arrays dropped."""
        ...


def _check_waves(waves: Sequence[LeasedWave], routes: np.ndarray, num_experts: int, layer: int) -> None:
    """Each routed expert in exactly one wave, and nothing else."""
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


def _check_array(array: object, shape: tuple[int, ...], dtype: mx.Dtype, where: str) -> None:
    if not isinstance(array, mx.array) or tuple(array.shape) != shape or array.dtype != dtype:
        what = f"{array.dtype} {list(array.shape)}" if isinstance(array, mx.array) else type(array).__name__
        raise ExpertProviderError(f"{where}: got {what}, the module needs {dtype} {list(shape)}")


def _stacked(wave: LeasedWave, params: Sequence[ExpertParam], layer: int) -> tuple[list[int], dict[str, mx.array]]:
    """The wave's experts in ascending id, stacked per tensor name: [n_unique, ...]."""
    if getattr(wave, "stacked", False):
        got = wave.take()
        wanted = {param.name for param in params}
        if set(got) != wanted:
            raise ExpertProviderError(
                f"layer {layer} wave {list(wave.expert_ids)}: stacked tensors "
                f"{sorted(got)} but the module needs {sorted(wanted)}"
            )
        n = len(wave.expert_ids)
        for param in params:
            _check_array(got[param.name], (n, *param.shape), param.dtype, f"layer {layer} stacked {param.name}")
        return sorted(wave.expert_ids), {param.name: got[param.name] for param in params}
    tensors = wave.take()
    order = sorted(range(len(wave.expert_ids)), key=wave.expert_ids.__getitem__)
    wanted = {param.name for param in params}
    for position, expert in enumerate(wave.expert_ids):
        got = tensors[position]
        if set(got) != wanted:
            raise ExpertProviderError(
                f"layer {layer} expert {expert}: tensors {sorted(got)} but the module needs {sorted(wanted)}"
            )
        for param in params:
            array = got[param.name]
            if not isinstance(array, mx.array) or tuple(array.shape) != param.shape or array.dtype != param.dtype:
                what = f"{array.dtype} {list(array.shape)}" if isinstance(array, mx.array) else type(array).__name__
                raise ExpertProviderError(
                    f"layer {layer} expert {expert} {param.name}: got {what}, "
                    f"the module needs {param.dtype} {list(param.shape)}"
                )
    stacked = {param.name: mx.stack([tensors[j][param.name] for j in order]) for param in params}
    return [wave.expert_ids[j] for j in order], stacked


class StreamedSwitch(nn.Module):
    """A SwitchGLU/SwitchMLP whose experts come from an `ExpertProvider`, one wave at a time."""

    def __init__(
        self,
        switch: nn.Module,
        *,
        layer: int,
        num_experts: int,
        params: Sequence[ExpertParam],
        provider: ExpertProvider,
    ) -> None:
        super().__init__()
        self.switch = switch  # the original instance, expert parameters removed
        self.layer = int(layer)
        self.num_experts = int(num_experts)
        self.provider = provider
        self._expert_params = _ParamSpecs(tuple(params))

    @property
    def expert_params(self) -> tuple[ExpertParam, ...]:
        return self._expert_params.params

    # -- parameters of the current wave ----------------------------------------------------------

    def _owner(self, name: str) -> tuple[nn.Module, str]:
        *path, key = name.split(".")
        owner = self.switch
        for part in path:
            owner = owner[part]
        return owner, key

    def _install(self, stacked: Mapping[str, mx.array]) -> None:
        for name, array in stacked.items():
            owner, key = self._owner(name)
            owner[key] = array

    def _clear(self) -> None:
        for param in self.expert_params:
            owner, key = self._owner(param.name)
            owner.pop(key, None)

    # -- computing --------------------------------------------------------------------------------

    def _run_wave(self, x: mx.array, ids: np.ndarray, wave: LeasedWave, dtype: mx.Dtype) -> mx.array:
        """The switch output for `x` routed to `ids` (expert ids, all in `wave`), evaluated.

        On return no array of this frame reads the wave: the output is
        evaluated (MLX detaches evaluated arrays from their inputs) and the
        stacked parameters are removed from the module. A detached wave's
        output is only being evaluated (its tensors are copies, not slots):
        the wave carries it in `outputs` for the provider, and the next
        layer's graph is built while it computes.
        """
        if getattr(wave, "parts", ()) and ids.size == ids.shape[-1]:  # one route row (decode)
            return self._run_parts(x, ids, wave, dtype)
        order, stacked = _stacked(wave, self.expert_params, self.layer)
        lookup = np.full(self.num_experts, -1, dtype=np.int64)
        lookup[order] = np.arange(len(order))
        # Ascending ids -> ascending positions: mlx-lm's sort by index sees the same order.
        positions = mx.array(lookup[ids].astype(np.int32)).astype(dtype)
        self._install(stacked)
        del stacked
        try:
            y = self.switch(x, positions)
            if getattr(wave, "detached", False):
                _evaluate_async(y)
                wave.outputs = (y,)
            else:
                _evaluate(y)
        finally:
            self._clear()
        return y

    def _run_parts(self, x: mx.array, ids: np.ndarray, wave: LeasedWave, dtype: mx.Dtype) -> mx.array:
        """One decode row, part by part: each part's output starts computing before the next
        part is taken; the outputs side by side are the whole call's (module docstring)."""
        ranks = ids.reshape(-1).tolist()
        if [e for part in wave.parts for e in part] != ranks:
            raise ExpertProviderError(
                f"layer {self.layer}: wave parts {list(wave.parts)} are not the route's ranks {ranks} in order"
            )
        outputs = []
        try:
            for index, part in enumerate(wave.parts):
                got = wave.take_part(index)
                if set(got) != {param.name for param in self.expert_params}:
                    raise ExpertProviderError(f"layer {self.layer} part {index}: tensors {sorted(got)}")
                for param in self.expert_params:
                    _check_array(
                        got[param.name],
                        (len(part), *param.shape),
                        param.dtype,
                        f"layer {self.layer} part {index} {param.name}",
                    )
                positions = mx.array(np.arange(len(part), dtype=np.int32).reshape(*ids.shape[:-1], len(part)))
                self._install(got)
                del got
                try:
                    with mx.stream(lane_stream(wave.part_lanes[index])):
                        y = self.switch(x, positions.astype(dtype))
                finally:
                    self._clear()
                _evaluate_async(y)
                outputs.append(y)
        finally:
            wave.outputs = tuple(outputs)  # the provider waits for these before reusing their buffers
        return mx.concatenate(outputs, axis=-2)

    def _finish(self, wave: LeasedWave, fenced: list[LeasedWave]) -> None:
        fenced.append(wave)
        self.provider.fence(wave)

    def _waves(
        self, x: mx.array, indices: mx.array, routes: np.ndarray, waves: Sequence[LeasedWave], fenced: list[LeasedWave]
    ) -> mx.array:
        shape, k = indices.shape, indices.shape[-1]
        if len(waves) == 1:
            y = self._run_wave(x, routes.reshape(shape), waves[0], indices.dtype)
            self._finish(waves[0], fenced)
            return y
        rows = x.reshape(-1, x.shape[-1])
        flat = routes.reshape(-1)
        outputs, places = [], []
        for wave in waves:
            consumers = np.flatnonzero(np.isin(flat, np.asarray(wave.expert_ids, dtype=flat.dtype)))
            if consumers.size == 0:  # an empty wave: nothing reads it
                wave.discard()
                self._finish(wave, fenced)
                continue
            wave_x = rows[mx.array((consumers // k).astype(np.int32))]
            y = self._run_wave(wave_x, flat[consumers].reshape(-1, 1), wave, indices.dtype)
            self._finish(wave, fenced)
            outputs.append(y.reshape(consumers.size, -1))
            places.append(consumers)
        # Every (row, rank) belongs to exactly one wave: undo the wave order with one gather.
        inverse = np.argsort(np.concatenate(places), kind="stable").astype(np.int32)
        y = mx.concatenate(outputs, axis=0)[mx.array(inverse)]
        return y.reshape(*shape, -1)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        if tuple(x.shape[:-1]) != tuple(indices.shape[:-1]):
            raise ValueError(
                f"layer {self.layer}: x {list(x.shape)} and indices {list(indices.shape)} "
                "do not share leading dimensions"
            )
        # The routes are data: evaluate them (and x, so no dense compute runs under the lease).
        _evaluate(x, indices)
        routes = np.array(indices, copy=True).astype(np.int32).reshape(-1, indices.shape[-1])
        if routes.size and (routes.min() < 0 or routes.max() >= self.num_experts):
            raise ValueError(f"layer {self.layer}: route out of range [0, {self.num_experts})")
        routes.setflags(write=False)
        if routes.size == 0:
            return mx.zeros((*indices.shape, x.shape[-1]), dtype=x.dtype)
        waves = list(self.provider.acquire(self.layer, routes))
        fenced: list[LeasedWave] = []
        try:
            _check_waves(waves, routes, self.num_experts, self.layer)
            return self._waves(x, indices, routes, waves, fenced)
        except BaseException as error:
            self._release_after_error(waves, fenced, error)
            raise

    def _release_after_error(self, waves: Sequence[LeasedWave], fenced: list[LeasedWave], error: BaseException) -> None:
        """Drop everything that may read the waves, then fence the ones not fenced yet.

        Lazy arrays built from a wave can survive in the frames of the
        traceback (a failed `_run_wave`); clearing those frames drops them
        before the fence, so the ordering holds on the error path too.
        """
        self._clear()
        traceback.clear_frames(error.__traceback__)
        for wave in waves:
            if any(wave is done for done in fenced):
                continue
            try:
                discard = getattr(wave, "discard", None)
                if callable(discard):
                    discard()
                self.provider.fence(wave)
            except Exception:  # keep the original error; the provider reports its own
                logger.exception("layer %d: fence after error failed for %r", self.layer, wave)


class _ParamSpecs:
    """Holds the expert tensor specs as a plain attribute (nn.Module would treat a tuple as state)."""

    __slots__ = ("params",)

    def __init__(self, params: tuple[ExpertParam, ...]) -> None:
        self.params = params
