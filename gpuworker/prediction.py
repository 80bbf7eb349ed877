"""Next-layer prediction: layer L+1's own router applied to layer L's MoE input.

Colibri calls it PILOT: the residual stream changes little from one layer's
MoE input to the next, so the next sparse layer's router, run one layer early,
names most of the experts that layer will pick (on this project's benchmark
model with random weights: 89% of the top-8, 96% of them within the top 10;
Colibri measured 71.6% on a real model, GLM-5.2). The GPU worker sends the
prediction with a layer's `routes`, and the coordinator loads the predicted
experts that are not resident while this layer computes.

How far ahead (the run's `prefetch_distance`, d): one sparse layer by default,
which suffices where a layer computes for longer than a prefetch takes to land
(this host's CPU: ~50 ms a layer on the default benchmark). Where layers compute
faster than that (an Apple GPU: 0.2-0.5 ms), most of a prediction one layer
ahead lands after its layer asked. Layer L+d's router on layer L's input names
fewer of its experts (the deep bench shape, top-k + 2 predicted: 96% of the
picks one layer ahead, 93% two, 90% three) but gives the reads d layers of
compute to land in; the first d sparse layers are predicted from the token.
Copy ahead keeps the next layer's prediction whatever d is.

The router is the family's own module (`gate` or `router` of the MoE block:
a Linear, or a MoEGate's weight and score-correction bias), so every family
is predicted with its own weights; the ranking ignores group limits and
normalisation, which only matter for the exact pick, not for a prefetch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np

logger = logging.getLogger(__name__)

Scores = Callable[[mx.array], mx.array]

_ROUTER_NAMES = ("gate", "router")
_LINEARS = (nn.Linear, nn.QuantizedLinear)


@dataclass(slots=True)
class PredictionSwitch:
    """Whether decode steps predict now: one per model, set for each job (the coordinator's `predict`:
    off while its auto prefetch is paused, so that a pause costs no router call and no message bytes)."""

    on: bool = True


@dataclass(frozen=True, slots=True)
class NextLayerRouter:
    """The router of sparse layer `layer`, to be applied to the previous sparse layer's MoE input."""

    layer: int
    scores: Scores  # larger = more likely to be picked
    count: int  # experts to predict (top-k plus a margin)
    switch: PredictionSwitch = field(default_factory=PredictionSwitch)  # shared by the model's routers

    def rank(self, x: mx.array) -> mx.array | None:
        """This router's float32 scores for `x` (lazy, to be evaluated with the layer's routes);
        None when the router cannot take `x` (e.g. a family whose MoE input is narrower than
        the router's input): the caller then stops predicting this layer, and says so."""
        try:
            return self.scores(x).astype(mx.float32)
        except (ValueError, TypeError) as error:
            logger.warning("layer %d: its router cannot rank this input (%s); it is not prefetched", self.layer, error)
            return None

    def predict(self, scores: mx.array) -> tuple[int, ...]:
        """The `count` best experts of one row's evaluated float32 scores, best first."""
        flat = np.asarray(scores).reshape(-1)
        count = min(self.count, flat.size)
        best = np.argpartition(-flat, count - 1)[:count]
        return tuple(best[np.argsort(-flat[best], kind="stable")].tolist())


def _output_dims(linear: nn.Module) -> int:
    return int(linear.weight.shape[0])


def router_scores(block: nn.Module, num_experts: int) -> Scores | None:
    """The scores by which an MoE block's router ranks its experts, as a function of its input; None when
    the block's router is not one this knows (its layer is then not predicted)."""
    router = next((block[name] for name in _ROUTER_NAMES if isinstance(block, nn.Module) and name in block), None)
    if router is None:
        return None
    if isinstance(router, _LINEARS) and _output_dims(router) == num_experts:
        return router  # logits: softmax and top-k keep their order
    weight = router.get("weight") if isinstance(router, nn.Module) else None
    if isinstance(weight, mx.array) and weight.ndim == 2 and weight.shape[0] == num_experts:
        # DeepSeek-V3 / GLM-4 MoEGate: sigmoid scores plus the score-correction bias pick the experts.
        # The parameters are read at each call, so a later update of the module (load_weights) counts.
        def gate_scores(x: mx.array) -> mx.array:
            scores = mx.sigmoid((x @ router["weight"].T).astype(mx.float32))
            bias = router.get("e_score_correction_bias")
            return scores + bias if isinstance(bias, mx.array) else scores

        return gate_scores
    for _, child in router.named_modules():  # a gating module around a Linear (e.g. granitemoe)
        if isinstance(child, _LINEARS) and _output_dims(child) == num_experts:
            return child
    return None


def next_layer_routers(
    blocks: dict[int, nn.Module],
    num_experts: dict[int, int],
    *,
    count: int,
    switch: PredictionSwitch | None = None,
    distance: int = 1,
) -> dict[int, NextLayerRouter]:
    """For each sparse layer with another `distance` sparse layers after it, the router of that one
    (`count` experts): by default the next one's."""
    layers = sorted(blocks)
    routers: dict[int, NextLayerRouter] = {}
    for layer, following in zip(layers, layers[distance:]):
        scores = router_scores(blocks[following], num_experts[following])
        if scores is None:
            logger.info("layer %d: its router is not one prediction knows; it is not prefetched", following)
            continue
        routers[layer] = NextLayerRouter(
            following, scores, max(1, min(count, num_experts[following])), switch or PredictionSwitch()
        )
    return routers


class PredictingEmbedding(nn.Module):
    """The model's token embedding; in a decode step it also predicts the first sparse layer.

    Nothing precedes the first sparse layer in a forward pass to carry its prediction, so it
    is made from the token itself: that layer's router on its pre-MoE norm of the embedding
    (the residual stream before the first attention adds to it). It is sent at once, as a
    `prefetch` of its own, while the first layers' attention computes. A run that prefetches
    d layers ahead predicts the first d sparse layers so (`following`: the 2nd to the d-th),
    since no layer before them is d layers ahead of them."""

    def __init__(
        self,
        embedding: nn.Module,
        router: NextLayerRouter,
        norm: nn.Module | None,
        provider,
        *,
        following: tuple[tuple[NextLayerRouter, nn.Module | None], ...] = (),
    ) -> None:
        super().__init__()
        self.embedding = embedding
        self._predict = _FirstLayer(router, norm)
        self._following = tuple(_FirstLayer(r, n) for r, n in following)
        self.provider = provider

    def __call__(self, ids: mx.array) -> mx.array:
        h = self.embedding(ids)
        first = self._predict
        if ids.size == 1 and first is not None and first.router.switch.on:
            predicted: list[tuple[NextLayerRouter, mx.array]] = []
            for layer in (first, *self._following):
                scores = layer.router.rank(h if layer.norm is None else layer.norm(h))
                if scores is not None:
                    predicted.append((layer.router, scores))
                elif layer is first:
                    self._predict = None  # rank() said why; the first layer is simply not prefetched
                    return h
                else:
                    self._following = tuple(f for f in self._following if f is not layer)
            mx.eval(h, *(scores for _, scores in predicted))
            for router, scores in predicted:  # the first sparse layer's first: it is needed first
                self.provider.prefetch(router.layer, router.predict(scores))
        return h

    def as_linear(self, x: mx.array) -> mx.array:
        """Tied output heads read the embedding's weights through this."""
        return self.embedding.as_linear(x)


@dataclass(frozen=True, slots=True)
class _FirstLayer:
    """A plain holder (not module state: the router and norm belong to their own layer)."""

    router: NextLayerRouter
    norm: nn.Module | None


__all__ = [
    "NextLayerRouter",
    "PredictingEmbedding",
    "PredictionSwitch",
    "Scores",
    "next_layer_routers",
    "router_scores",
]
