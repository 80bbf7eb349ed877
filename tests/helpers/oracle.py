"""mlx-lm's own generation, the oracle every streamed or system result is compared with.

The oracle is mlx-lm's `generate_step` on the fully loaded model (`mlx_lm.utils.load_model`):
its tokens are what ours must emit and its log-probabilities what ours must match. Route
recording wraps every MoE block's switch module (`SwitchGLU` / `SwitchMLP`) so the router
selections mlx-lm made can be compared with the routes our model asked leases for.

- `generate_steps(model, prompt, max_tokens, **options)`: `generate_step` on any mlx-lm
  model (mlx-lm's own or our streamed one): tokens and log-probabilities as it yields them.
- `record_routes(model)`: wrap a loaded model's MoE blocks; returns the dict they fill.
- `oracle(model_dir, prompt, max_tokens, *, routes=False)`: the above on the fully loaded
  model at `model_dir`, log-probabilities as float32 numpy arrays.
- `relative_difference(want, got)`: max |want - got| / max |want| (numpy or mlx arrays).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np


class Steps(NamedTuple):
    """What `generate_step` yielded: one token and its log-probabilities (mlx arrays) per step.
    (A named tuple: tests unpack it as `tokens, logprobs = generate_steps(...)`.)"""

    tokens: list[int]
    logprobs: list[mx.array]


def generate_steps(model: nn.Module, prompt: Sequence[int], max_tokens: int, **options) -> Steps:
    """mlx-lm's `generate_step` (greedy unless `options` give a sampler) on `model`."""
    from mlx_lm.generate import generate_step

    tokens, logprobs = [], []
    for token, lp in generate_step(mx.array(list(prompt)), model, max_tokens=max_tokens, **options):
        tokens.append(int(token))
        logprobs.append(lp)
    return Steps(tokens, logprobs)


class _RouteRecorder(nn.Module):
    """Stands in for one switch module: records the expert indices it is called with, then runs it."""

    def __init__(self, inner: nn.Module, layer: int, record: Callable[[int, mx.array], None]) -> None:
        super().__init__()
        self.inner, self.layer = inner, layer
        self.record = record  # a function: a plain attribute, not a child module or parameter

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        self.record(self.layer, indices)
        return self.inner(x, indices)


def record_routes(model: nn.Module) -> dict[int, list[np.ndarray]]:
    """Wrap every MoE block's switch module of a fully loaded mlx-lm model so each call records
    its router selections; returns {layer: [one [tokens, top_k] array per call]}, filled as the
    model runs."""
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

    seen: dict[int, list[np.ndarray]] = {}

    def record(layer: int, indices: mx.array) -> None:
        seen.setdefault(layer, []).append(np.array(indices).reshape(-1, indices.shape[-1]))

    for name, module in model.named_modules():
        if isinstance(module, (SwitchGLU, SwitchMLP)):
            *parent, key = name.split(".")
            owner = model
            for part in parent:
                owner = owner[int(part)] if isinstance(owner, list) else owner[part]
            owner[key] = _RouteRecorder(module, int(re.findall(r"layers\.(\d+)", name)[-1]), record)
    return seen


class Oracle(NamedTuple):
    """mlx-lm's greedy generation: tokens, float32 log-probabilities per step and, when recorded,
    every router selection per sparse layer (prefill first, then one per decode step; empty when
    not recorded). A named tuple, like `Steps`."""

    tokens: list[int]
    logprobs: list[np.ndarray]
    routes: dict[int, list[np.ndarray]]


def oracle(
    model_dir: str | os.PathLike[str], prompt: Sequence[int], max_tokens: int, *, routes: bool = False
) -> Oracle:
    """Greedy tokens and per-step log-probabilities of mlx-lm on the fully loaded model; with
    `routes`, also every selection its routers made."""
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(model_dir))
    seen = record_routes(model) if routes else {}
    steps = generate_steps(model, prompt, max_tokens)
    return Oracle(steps.tokens, [np.array(lp.astype(mx.float32)) for lp in steps.logprobs], seen)


def relative_difference(want: np.ndarray | mx.array, got: np.ndarray | mx.array) -> float:
    """max |want - got| / max |want|: how the streamed and system tests measure log-probabilities."""
    want, got = (
        np.asarray(value.astype(mx.float32) if isinstance(value, mx.array) else value, dtype=np.float64)
        for value in (want, got)
    )
    return float(np.abs(want - got).max() / max(np.abs(want).max(), 1e-30))


__all__ = ["Oracle", "Steps", "generate_steps", "oracle", "record_routes", "relative_difference"]
