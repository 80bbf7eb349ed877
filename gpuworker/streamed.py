"""The streamed MoE module: mlx-lm's own SwitchGLU/SwitchMLP fed with leased experts.

`StreamedSwitch` replaces a `SwitchGLU`/`SwitchMLP` of
`mlx_lm.models.switch_layers` but keeps the original instance (its class,
activation, biases, quantization and `gather_mm`/`gather_qmm` calls) with its
expert parameters removed. A call receives `(x, indices)` exactly as the
switch module does, evaluates the routes (inherent: the experts to fetch are
data), asks an `ExpertProvider` (`gpuworker.expert_provider`) for them, and
for each leased wave:

1. stacks the wave's experts in ascending expert id into parameters of shape
   `[n_unique, ...]` and remaps the indices from expert ids to positions;
2. calls the original `__call__` and evaluates its output;
3. removes the parameters and drops every array that read the wave;
4. only then fences the wave (zero-copy arrays read the slab itself).

One wave (decode): the original call with the full, monotonically remapped
indices, so the sort, the kernels and the result are mlx-lm's bit for bit. A
wave copied ahead (`LeasedWave.stack_rows`, `gpuworker.copy_ahead`) names its
rows in any order: a decode row has fewer routes than mlx-lm sorts (64), so
its kernels compute each (token, expert) product from the same bytes alike.
A decode wave may come in parts (its one route row's ranks, see
`LeasedWave.parts`; consecutive, or resident experts first for a split visit,
`gpuworker.split_visit`): each part is one call of the original module on its
ranks, started (`mx.async_eval`) before the next part's tensors are taken, so
a provider that copies slots copies part j+1 while part j computes; a
decode row's (token, expert) products do not depend on the other ranks, so
the parts' outputs put side by side, in rank order, are the single call's,
bit for bit.
Parts may run on different compute lanes (MLX streams, `gpuworker.lanes`):
the same kernels on the same bytes, on more cores where the backend has them.
Several waves (prefill larger than the working bank): each wave computes its
(row, rank) consumers only, and the outputs are put back in place, so the
family's `(y * scores).sum(-2)` runs unchanged on a `[..., k, hidden]` result.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from gpuworker.expert_provider import ExpertProvider, ExpertProviderError, LeasedWave, check_waves
from gpuworker.lanes import lane_stream
from gpuworker.prediction import NextLayerRouter

__all__ = ["ExpertParam", "StreamedSwitch"]

logger = logging.getLogger(__name__)


_SMALL_ROUTES = 64  # route entries up to which positions are mapped in Python (decode rows)


def _evaluate(*arrays: mx.array) -> None:
    """mx.eval, behind a name the tests can observe (ordering of eval and fence)."""
    mx.eval(*arrays)


def _evaluate_async(*arrays: mx.array) -> None:
    """mx.async_eval (a detached wave's output), behind a name the tests can observe."""
    mx.async_eval(*arrays)


@dataclass(frozen=True, slots=True)
class ExpertParam:
    """One tensor of one expert, as the switch module names it (no expert axis)."""

    name: str  # e.g. "gate_proj.weight", "down_proj.scales", "up_proj.bias"
    shape: tuple[int, ...]
    dtype: mx.Dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.size


def _check_array(array: object, shape: tuple[int, ...], dtype: mx.Dtype, where: str, *where_args: object) -> None:
    """Refuse a tensor of the wrong type, shape or dtype; `where % where_args` says which (formatted
    only on refusal: a decode layer checks every tensor of every wave)."""
    if not isinstance(array, mx.array) or array.shape != shape or array.dtype != dtype:
        what = f"{array.dtype} {list(array.shape)}" if isinstance(array, mx.array) else type(array).__name__
        raise ExpertProviderError(f"{where % where_args}: got {what}, the module needs {dtype} {list(shape)}")


def _stacked(wave: LeasedWave, params: Sequence[ExpertParam], layer: int) -> tuple[dict[int, int], dict[str, mx.array]]:
    """The wave's experts stacked per tensor name, and each expert's row in the stack: in
    ascending id ([n_unique, ...]), or where the wave's `stack_rows` put them."""
    if getattr(wave, "stacked", False):
        got = wave.take()
        wanted = {param.name for param in params}
        if got.keys() != wanted:
            raise ExpertProviderError(
                f"layer {layer} wave {list(wave.expert_ids)}: stacked tensors "
                f"{sorted(got)} but the module needs {sorted(wanted)}"
            )
        rows = getattr(wave, "stack_rows", ())
        if rows:
            position_of = dict(zip(wave.expert_ids, rows))
            n = got[params[0].name].shape[0] if params else 0
            if max(rows) >= n:
                raise ExpertProviderError(f"layer {layer}: stack rows {list(rows)} past a stack of {n}")
        else:
            position_of = {expert: row for row, expert in enumerate(sorted(wave.expert_ids))}
            n = len(wave.expert_ids)
        for param in params:
            _check_array(got[param.name], (n, *param.shape), param.dtype, "layer %d stacked %s", layer, param.name)
        return position_of, {param.name: got[param.name] for param in params}
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
    return {wave.expert_ids[j]: row for row, j in enumerate(order)}, stacked


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
        # The next sparse layer's router (gpuworker.prediction); plain attributes, not module state.
        # It predicts for prefetch and for copy ahead; a run that prefetches further ahead sends
        # the prediction of `predict_ahead` (None: no sparse layer that far after this one).
        self.predict: NextLayerRouter | None = None
        self.predict_ahead: NextLayerRouter | None = None
        self.ahead = False  # the run's prefetch distance is more than one layer

    @property
    def expert_params(self) -> tuple[ExpertParam, ...]:
        return self._expert_params.params

    # -- parameters of the current wave ----------------------------------------------------------

    def _owner(self, name: str) -> tuple[nn.Module, str]:
        """The submodule holding expert tensor `name`, and its key there (looked up once: the
        module's structure does not change, and a decode layer installs every tensor per token)."""
        found = self._expert_params.owners.get(name)
        if found is None:
            *path, key = name.split(".")
            owner = self.switch
            for part in path:
                owner = owner[part]
            found = self._expert_params.owners[name] = (owner, key)
        return found

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
        position_of, stacked = _stacked(wave, self.expert_params, self.layer)
        # Rows in ascending id keep mlx-lm's sort by index (routes of >= 64 entries) in the same
        # order; `stack_rows` (any order) come only with decode rows, which mlx-lm does not sort.
        if ids.size <= _SMALL_ROUTES:  # a decode row: a dict beats numpy's per-call overhead
            positions = mx.array([position_of[e] for e in ids.reshape(-1).tolist()], dtype=dtype).reshape(ids.shape)
        else:
            lookup = np.full(self.num_experts, -1, dtype=np.int64)
            lookup[list(position_of)] = list(position_of.values())
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
        order = [e for part in wave.parts for e in part]
        if sorted(order) != sorted(ranks):
            raise ExpertProviderError(
                f"layer {self.layer}: wave parts {list(wave.parts)} are not the route's ranks {ranks}"
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
                        "layer %d part %d %s",
                        self.layer,
                        index,
                        param.name,
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
        y = mx.concatenate(outputs, axis=-2)
        if order != ranks:  # a split visit's parts: resident experts first (gpuworker.split_visit)
            where = {expert: position for position, expert in enumerate(order)}
            y = mx.take(y, mx.array([where[e] for e in ranks], dtype=mx.int32), axis=-2)
        return y

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
        # A decode step also ranks the next sparse layer's experts by that layer's router on x,
        # in the same evaluation: its prediction rides with this layer's routes (prefetch), and
        # the provider copies those experts while this layer computes (copy ahead). A run that
        # prefetches further ahead ranks the experts of that layer for the prefetch.
        decode = indices.size == indices.shape[-1]
        far = (self.predict_ahead if self.ahead else self.predict) if decode else None
        if far is not None and not far.switch.on:  # off: this job does not prefetch (paused)
            far = None
        due = getattr(self.provider, "copy_ahead_due", None)
        near = self.predict if decode and self.predict is not None and due is not None and due() else None
        far_scores = far.rank(x) if far is not None else None
        scores = far_scores if near is far else near.rank(x) if near is not None else None
        for router, ranked in ((far, far_scores), (near, scores)):
            if router is not None and ranked is None:  # rank() said why; this layer stops using it
                self.predict = None if self.predict is router else self.predict
                self.predict_ahead = None if self.predict_ahead is router else self.predict_ahead
        sends, stages = far_scores is not None, scores is not None
        _evaluate(x, indices, *(s for s in (far_scores, None if near is far else scores) if s is not None))
        routes = np.array(indices, copy=True).astype(np.int32).reshape(-1, indices.shape[-1])
        if routes.size and (routes.min() < 0 or routes.max() >= self.num_experts):
            raise ValueError(f"layer {self.layer}: route out of range [0, {self.num_experts})")
        routes.setflags(write=False)
        if routes.size == 0:
            return mx.zeros((*indices.shape, x.shape[-1]), dtype=x.dtype)
        if sends:  # the prediction rides with the lease request
            sent = far.predict(far_scores)
            waves = list(self.provider.acquire(self.layer, routes, prefetch=(far.layer, sent)))
        else:
            waves = list(self.provider.acquire(self.layer, routes))
        fenced: list[LeasedWave] = []
        try:
            check_waves(waves, routes, self.num_experts, self.layer)
            y = self._waves(x, indices, routes, waves, fenced)
        except BaseException as error:
            self._release_after_error(waves, fenced, error)
            raise
        if stages:  # this layer's experts are computing: rank and copy the next one's now
            predicted = sent if near is far else near.predict(scores)
            if predicted:
                self.provider.stage(near.layer, predicted)
        return y

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

    __slots__ = ("owners", "params")

    def __init__(self, params: tuple[ExpertParam, ...]) -> None:
        self.params = params
        self.owners: dict[str, tuple[nn.Module, str]] = {}  # see StreamedSwitch._owner
