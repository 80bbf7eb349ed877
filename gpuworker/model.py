"""Load an mlx-lm model directory with its dense weights only; routed experts stream.

The loading is mlx-lm's own (`mlx_lm.utils.load_model`: config, model class,
`sanitize`, `nn.quantize` with its per-layer class predicate, `strict`
checks), run with `lazy=True`. `mx.load` of safetensors is lazy per tensor:
it reads the header and each tensor's bytes only when that tensor is
evaluated (measured: mapping a 200 MB file grows RSS ~1 MB; evaluating one
25 MB tensor grows it 25 MB). So before anything is evaluated, every
`SwitchGLU`/`SwitchMLP` loses its expert parameters, which are dropped
unread, and is wrapped in a `StreamedSwitch`; only then are the remaining
(dense) parameters evaluated, which reads exactly their byte ranges.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP
from mlx_lm.utils import load_model

from gpuworker.expert_provider import ExpertProvider
from gpuworker.prediction import (
    NextLayerRouter,
    PredictingEmbedding,
    PredictionSwitch,
    next_layer_routers,
    router_scores,
)
from gpuworker.slots import mlx_storage_dtype
from gpuworker.streamed import ExpertParam, StreamedSwitch

__all__ = [
    "SparseModule",
    "StreamedModelInfo",
    "check_against_store",
    "load_streamed_model",
    "set_provider",
    "streamed_switches",
]

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)(?:\.|$)")


@dataclass(frozen=True, slots=True)
class SparseModule:
    """One replaced switch module: where it is and what each of its experts holds."""

    layer: int  # decoder layer index, model.layers[layer]
    path: str  # module path after sanitize, e.g. "model.layers.1.mlp.switch_mlp"
    kind: str  # "glu" (SwitchGLU) or "mlp" (SwitchMLP)
    num_experts: int
    params: tuple[ExpertParam, ...]  # per expert, no expert axis

    @property
    def expert_bytes(self) -> int:
        return sum(param.nbytes for param in self.params)


@dataclass(frozen=True, slots=True)
class StreamedModelInfo:
    """What `load_streamed_model` loaded and what it left to the provider."""

    model_dir: str
    model_type: str
    config: Mapping[str, Any]
    dense_bytes: int  # bytes of the parameters the model holds (evaluated unless lazy)
    routed_bytes: int  # bytes of routed-expert tensors left on disk
    sparse_layers: tuple[int, ...]
    modules: tuple[SparseModule, ...]
    prediction: PredictionSwitch | None = None  # turns the model's next-layer prediction on and off (predict > 0)

    def module(self, layer: int) -> SparseModule:
        for module in self.modules:
            if module.layer == layer:
                return module
        raise KeyError(f"layer {layer} is not sparse; sparse layers are {list(self.sparse_layers)}")


def _layer_of(path: str) -> int:
    found = _LAYER.findall(path)
    if not found:
        raise ValueError(f"cannot tell the decoder layer of switch module {path!r}")
    return int(found[-1])


def _parent(model: nn.Module, path: str) -> tuple[Any, str]:
    *parts, last = path.split(".")
    parent: Any = model
    for part in parts:
        parent = parent[int(part)] if isinstance(parent, list) else parent[part]
    return parent, last


def _strip(path: str, switch: nn.Module) -> SparseModule:
    """Remove the expert parameters from `switch` (unevaluated: never read) and describe them."""
    flat = tree_flatten(switch.parameters())
    if not flat:
        raise ValueError(f"switch module {path} has no expert parameters")
    experts = {array.shape[0] if array.ndim else 0 for _, array in flat}
    if len(experts) != 1:
        raise ValueError(
            f"switch module {path}: parameters disagree on the expert count: "
            f"{ {name: list(array.shape) for name, array in flat} }"
        )
    params = tuple(ExpertParam(name, tuple(array.shape[1:]), array.dtype) for name, array in flat)
    for name, _ in flat:
        *owners, key = name.split(".")
        owner = switch
        for part in owners:
            owner = owner[part]
        del owner[key]
    kind = "glu" if isinstance(switch, SwitchGLU) else "mlp"
    return SparseModule(_layer_of(path), path, kind, experts.pop(), params)


def load_streamed_model(
    model_dir: str | os.PathLike[str],
    *,
    provider: ExpertProvider,
    strict: bool = True,
    lazy: bool = False,
    model_config: dict | None = None,
    trust_remote_code: bool = False,
    predict: int = 0,
    distance: int = 1,
) -> tuple[nn.Module, StreamedModelInfo]:
    """The mlx-lm model of `model_dir` with every SwitchGLU/SwitchMLP streamed from `provider`.

    Dense parameters are evaluated (read) unless `lazy`; routed-expert
    tensors are never read. `strict` is mlx-lm's: every checkpoint tensor
    must match a parameter of the model. `predict` > 0: every streamed module
    but the last ranks that many experts of the next sparse layer in decode
    steps, by that layer's own router (`gpuworker.prediction`), for prefetch;
    `distance` > 1: the prefetch predicts the sparse layer that many ahead instead.
    """
    path = Path(model_dir)
    # lazy=True: nothing is read yet, so dropping the experts below costs no I/O.
    model, config = load_model(
        path, lazy=True, strict=strict, model_config=model_config, trust_remote_code=trust_remote_code
    )
    found = [(name, module) for name, module in model.named_modules() if isinstance(module, (SwitchGLU, SwitchMLP))]
    if not found:
        raise ValueError(
            f"{path}: model_type {config.get('model_type')!r} has no SwitchGLU/SwitchMLP "
            "module (mlx_lm.models.switch_layers): nothing to stream"
        )
    modules = []
    wrappers: dict[int, StreamedSwitch] = {}
    blocks: dict[int, Any] = {}  # the MoE block holding each layer's switch (its router is a sibling)
    for name, switch in found:
        sparse = _strip(name, switch)
        parent, key = _parent(model, name)
        wrapper = StreamedSwitch(
            switch, layer=sparse.layer, num_experts=sparse.num_experts, params=sparse.params, provider=provider
        )
        if isinstance(parent, list):
            parent[int(key)] = wrapper
        else:
            parent[key] = wrapper
        modules.append(sparse)
        wrappers[sparse.layer], blocks[sparse.layer] = wrapper, parent
    modules.sort(key=lambda module: module.layer)
    layers = tuple(module.layer for module in modules)
    if len(set(layers)) != len(layers):
        raise ValueError(
            f"{path}: more than one switch module in a decoder layer: {[module.path for module in modules]}"
        )
    switch = PredictionSwitch() if predict > 0 else None
    if switch is not None:
        experts = {module.layer: module.num_experts for module in modules}
        for layer, router in next_layer_routers(blocks, experts, count=predict, switch=switch).items():
            wrappers[layer].predict = router
        if distance > 1:
            ahead = next_layer_routers(blocks, experts, count=predict, switch=switch, distance=distance)
            for wrapper in wrappers.values():
                wrapper.ahead, wrapper.predict_ahead = True, ahead.get(wrapper.layer)
        first = modules[: max(1, distance)]
        _predict_first_layers(model, blocks, experts, first, provider, count=predict, switch=switch)
    dense = tree_flatten(model.parameters())
    if not lazy:
        mx.eval([array for _, array in dense])
    info = StreamedModelInfo(
        model_dir=os.path.abspath(path),
        model_type=str(config.get("model_type", "")),
        config=MappingProxyType(config),
        dense_bytes=sum(array.nbytes for _, array in dense),
        routed_bytes=sum(module.expert_bytes * module.num_experts for module in modules),
        sparse_layers=layers,
        modules=tuple(modules),
        prediction=switch,
    )
    logger.info(
        "loaded %s (%s): %d dense bytes in memory, %d routed-expert bytes streamed, sparse layers %s",
        info.model_dir,
        info.model_type,
        info.dense_bytes,
        info.routed_bytes,
        list(layers),
    )
    return model, info


def _predict_first_layers(
    model: nn.Module, blocks, experts, firsts: list[SparseModule], provider, *, count: int, switch: PredictionSwitch
) -> None:
    """Wrap the token embedding so a decode step predicts the first sparse layers from the token
    (`PredictingEmbedding`); skipped, and said, where the model's embedding or first router is not
    found (a later one's router not found: that layer is not predicted so)."""
    found = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, (nn.Embedding, nn.QuantizedEmbedding))
    ]
    routers = []  # (router, its decoder layer's norm) of each first layer whose router is known
    for module in firsts:
        scores = router_scores(blocks[module.layer], experts[module.layer])
        if scores is not None:
            router = NextLayerRouter(module.layer, scores, max(1, min(count, experts[module.layer])), switch)
            routers.append((router, _moe_input_norm(model, module)))
    if len(found) != 1 or not routers or routers[0][0].layer != firsts[0].layer:
        logger.info("the first sparse layer is not predicted: %d embeddings, router %s", len(found), bool(routers))
        return
    name, embedding = found[0]
    parent, key = _parent(model, name)
    (router, norm), following = routers[0], tuple(routers[1:])
    wrapper = PredictingEmbedding(embedding, router, norm, provider, following=following)
    if isinstance(parent, list):
        parent[int(key)] = wrapper
    else:
        parent[key] = wrapper


def _moe_input_norm(model: nn.Module, module: SparseModule) -> nn.Module | None:
    """The norm a sparse module's decoder layer applies to its MoE block's input
    (post_attention_layernorm in mlx-lm); None where there is none by that name."""
    prefix = re.match(r"^(.*?(?:layers|h)\.\d+)(?:\.|$)", module.path)
    parent, key = _parent(model, prefix.group(1)) if prefix else (None, "")
    decoder = parent[int(key)] if isinstance(parent, list) else parent[key] if parent is not None else None
    norm = decoder.get("post_attention_layernorm") if isinstance(decoder, nn.Module) else None
    return norm if isinstance(norm, nn.Module) else None


def streamed_switches(model: nn.Module) -> list[StreamedSwitch]:
    """The streamed modules of `model`, by layer."""
    found = [module for _, module in model.named_modules() if isinstance(module, StreamedSwitch)]
    return sorted(found, key=lambda module: module.layer)


def set_provider(model: nn.Module, provider: ExpertProvider) -> None:
    """Point every streamed module of `model` at `provider` (e.g. a new lease client)."""
    for module in streamed_switches(model):
        module.provider = provider
    for _, module in model.named_modules():
        if isinstance(module, PredictingEmbedding):
            module.provider = provider


def check_against_store(info: StreamedModelInfo, store: Any) -> None:
    """Raise ValueError unless `store` (shared.store.ExpertStore) serves what the model expects.

    Same sparse layers, module paths, expert counts, and per-expert tensor
    names, shapes and dtypes, so slot layouts wrap into the arrays the
    switch modules take.
    """
    if tuple(store.sparse_layers) != info.sparse_layers:
        raise ValueError(f"store sparse layers {list(store.sparse_layers)} != model's {list(info.sparse_layers)}")
    if store.experts_per_layer != info.modules[0].num_experts:
        raise ValueError(f"store has {store.experts_per_layer} experts per layer, model {info.modules[0].num_experts}")
    for module in info.modules:
        layer = store.layer(module.layer)
        if layer.module != module.path:
            raise ValueError(f"layer {module.layer}: store module {layer.module!r} != model's {module.path!r}")
        want = {param.name: (param.shape, param.dtype) for param in module.params}
        have = {spec.name: (tuple(spec.shape), mlx_storage_dtype(spec.dtype)) for spec in layer.tensors}
        if want != have:
            raise ValueError(f"layer {module.layer}: store tensors {have} != model's {want}")
