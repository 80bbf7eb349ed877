"""Checkpoint discovery: the sparse layers of an mlx-lm model directory, checked against its config.

`find_sparse_layers` takes config.json and the safetensors headers (never the
tensors), finds every routed-expert tensor of every sparse layer (by name:
`shared.expert_names`) and refuses (StoreError) a checkpoint that does not
match its config: sparse layers, expert count, shapes, quantization as mlx-lm's
loader would decide it, top-k. What it returns says, for each sparse layer,
the module mlx-lm builds, the tensors of one expert and where each expert's
bytes are in the files; `shared.store.ExpertStore` places those bytes in slots.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from shared.expert_names import (
    CONVERT_HINT,
    GLU_PROJECTIONS,
    MLP_PROJECTIONS,
    canonical_order,
    first_entry,
    group_by_layer,
    tensor_error,
)
from shared.safetensors_index import StoreError, TensorEntry

__all__ = [
    "CheckpointExperts",
    "ExpertTensorSpec",
    "QuantSpec",
    "SparseLayer",
    "find_sparse_layers",
    "load_config",
]


@dataclass(frozen=True, slots=True)
class QuantSpec:
    """How one projection's experts are quantized, as mlx-lm's loader decides it."""

    bits: int
    group_size: int
    mode: str
    global_scale: bool = False  # nvfp4 with one tensor scale per expert


@dataclass(frozen=True, slots=True)
class ExpertTensorSpec:
    """One tensor of every expert of a layer; `shape` and `nbytes` are per expert."""

    name: str  # e.g. "down_proj.scales"
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True, slots=True)
class SparseLayer:
    """One sparse layer: the module mlx-lm builds and the tensors of each expert."""

    layer: int
    module: str  # module path after sanitize, e.g. "model.layers.1.mlp.switch_mlp"
    kind: str  # "glu" (SwitchGLU) or "mlp" (SwitchMLP)
    layout: str  # "stacked" or "per_expert"
    tensors: tuple[ExpertTensorSpec, ...]
    quantization: tuple[tuple[str, QuantSpec], ...]  # projection -> spec; absent: full precision
    checkpoint_names: tuple[str, ...]  # the tensor names in the files

    def quant(self, projection: str) -> QuantSpec | None:
        """The quantization of `projection` ("gate_proj", ...), None if full precision."""
        return dict(self.quantization).get(projection)


_EXPERT_KEYS = (
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "moe_num_experts",
    "num_routed_experts",
)
_TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "experts_per_token", "moe_top_k")
# A projection's input features are its partner's output features.
_PARTNER = {"gate_proj": "down_proj", "up_proj": "down_proj", "down_proj": "gate_proj"}
_PARTNER.update({"fc1": "fc2", "fc2": "fc1"})

# ---------------------------------------------------------------------------
# What config.json says


def _config_int(config: dict, keys: tuple[str, ...]) -> tuple[str, int] | None:
    """(key, value) of the first integer among `keys` in config or its text_config."""
    scopes = [config]
    if isinstance(config.get("text_config"), dict):
        scopes.append(config["text_config"])
    for scope in scopes:
        for key in keys:
            value = scope.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                return key, value
    return None


def _expected_sparse_layers(config: dict, family: str, layers: int | None) -> set[int] | None:
    """Which layers the family's mlx-lm model builds as MoE, where we know its rule."""
    if layers is None:
        return None
    if family == "qwen3_moe":
        step = config.get("decoder_sparse_step", 1) or 1
        dense = set(config.get("mlp_only_layers") or ())
        return {i for i in range(layers) if i not in dense and (i + 1) % step == 0}
    if family in ("deepseek_v2", "deepseek_v3"):
        first = config.get("first_k_dense_replace", 0)
        freq = config.get("moe_layer_freq", 1) or 1
        return {i for i in range(layers) if i >= first and i % freq == 0}
    if family == "glm4_moe":
        return set(range(config.get("first_k_dense_replace", 0), layers))
    if family in ("mixtral", "gpt_oss", "olmoe", "qwen2_moe", "phimoe"):
        return set(range(layers))
    return None


def load_config(model_dir: Path) -> dict:
    """config.json of `model_dir` as a dict; StoreError if it is missing, corrupt or not an object."""
    path = os.path.abspath(model_dir / "config.json")
    if not os.path.isfile(path):
        raise StoreError(f"{path}: missing config.json")
    try:
        config = json.loads(Path(path).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise StoreError(f"{path}: corrupt config.json: {error}") from None
    if not isinstance(config, dict):
        raise StoreError(f"{path}: config.json is not a JSON object")
    return config


# ---------------------------------------------------------------------------
# Checking the expert tensors against the config and each other


def _quant_spec(
    config: dict,
    path: str,
    weight: ExpertTensorSpec,
    scales: ExpertTensorSpec,
    in_dims: int,
    where: str,
) -> QuantSpec:
    """The (bits, group_size, mode) mlx-lm's loader would use for `path`, checked on shapes."""
    quantization = config.get("quantization")
    override = quantization.get(path) if isinstance(quantization, dict) else None
    if override is False:
        raise StoreError(f"{where}: has scales but config quantization[{path!r}] is false")
    if isinstance(override, dict):  # passed to to_quantized, whose defaults fill the gaps
        spec = QuantSpec(override.get("bits", 4), override.get("group_size", 64), override.get("mode", "affine"))
    elif override is True:  # the top-level defaults
        bits, group_size = quantization.get("bits"), quantization.get("group_size")
        spec = QuantSpec(bits, group_size, quantization.get("mode", "affine"))
    else:  # what mlx_lm.utils.infer_quant_config derives from the shapes
        groups = scales.shape[-1] if scales.shape else 0
        group_size = in_dims // groups if groups else 0
        bits = weight.shape[-1] * 32 // in_dims if in_dims else 0
        mode = "affine"
        if scales.dtype == "U8":
            modes = {(4, 16): "nvfp4", (4, 32): "mxfp4", (8, 32): "mxfp8"}
            mode = modes.get((bits, group_size), "unknown")
        spec = QuantSpec(bits, group_size, mode)
    counts = (spec.bits, spec.group_size)
    if (
        weight.dtype != "U32"
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in counts)
        or spec.mode == "unknown"
        or weight.shape[-1] * 32 != in_dims * spec.bits
        or scales.shape[-1] * spec.group_size != in_dims
    ):
        raise StoreError(
            f"{where}: quantized weight {weight.dtype} {list(weight.shape)} with scales "
            f"{list(scales.shape)} does not fit {spec} for {in_dims} input features"
        )
    return spec


def _check_layer(
    config: dict, module: str, specs: dict, entries: dict, manifest: tuple[str, ...]
) -> tuple[str, tuple[tuple[str, QuantSpec], ...]]:
    """Structural checks of one layer's expert tensors; (kind, quantization per projection)."""
    kind = "glu" if any(proj in GLU_PROJECTIONS for proj, _ in specs) else "mlp"
    projections = GLU_PROJECTIONS if kind == "glu" else MLP_PROJECTIONS
    for proj in projections:
        if (proj, "weight") not in specs:
            where = manifest[next(iter(entries.values())).file]
            raise StoreError(
                f"missing tensor for {module}.{proj}.weight (the layer's other expert tensors are in {where})"
            )
    for (proj, param), entry in entries.items():
        shape, weight = specs[proj, param].shape, specs[proj, "weight"].shape
        if proj not in projections:
            raise tensor_error(entry, manifest, f"{proj!r} does not belong in a {kind} expert")
        if param == "weight" and len(shape) != 2:
            raise tensor_error(entry, manifest, f"expert weight shape {list(shape)} is not 2-D")
        if param == "biases" and (proj, "scales") not in specs:
            raise tensor_error(entry, manifest, "quantization biases without scales")
        if param in ("scales", "biases") and (len(shape) != 2 or shape[0] != weight[0]):
            raise tensor_error(entry, manifest, f"{param} {list(shape)} do not fit weight {list(weight)}")
        if param == "bias" and shape != weight[:1]:
            raise tensor_error(entry, manifest, f"bias {list(shape)} does not fit weight {list(weight)}")
    if kind == "glu":
        gate, up = specs["gate_proj", "weight"], specs["up_proj", "weight"]
        if (gate.shape, gate.dtype) != (up.shape, up.dtype):
            raise tensor_error(
                entries["up_proj", "weight"],
                manifest,
                f"{up.dtype} {list(up.shape)} differs from gate_proj {gate.dtype} {list(gate.shape)}",
            )
    hidden = _config_int(config, ("hidden_size",))
    out_features = specs[projections[-1], "weight"].shape[0]
    if hidden is not None and out_features != hidden[1]:
        raise tensor_error(
            entries[projections[-1], "weight"],
            manifest,
            f"{out_features} output features but config hidden_size is {hidden[1]}",
        )
    quantization = []
    for proj in projections:
        if (proj, "scales") in specs:
            entry = entries[proj, "weight"]
            spec = _quant_spec(
                config,
                f"{module}.{proj}",
                specs[proj, "weight"],
                specs[proj, "scales"],
                specs[_PARTNER[proj], "weight"].shape[0],
                f"tensor {entry.name!r} in {manifest[entry.file]}",
            )
            if (proj, "global_scale") in specs:
                spec = QuantSpec(spec.bits, spec.group_size, spec.mode, global_scale=True)
            quantization.append((proj, spec))
    return kind, tuple(quantization)


def _per_expert_slices(
    key: tuple[str, str],
    value: dict[int, TensorEntry],
    experts: int,
    manifest: tuple[str, ...],
    count_from: str,
):
    """(spec, first entry, per-expert (file, offset), names) of one per-expert tensor."""
    first = value[min(value)]
    for index, entry in value.items():
        if index >= experts:
            raise tensor_error(entry, manifest, f"expert {index} out of range ({count_from})")
        if (entry.dtype, entry.shape) != (first.dtype, first.shape):
            raise tensor_error(
                entry,
                manifest,
                f"{entry.dtype} {list(entry.shape)} differs from {first.name!r} {first.dtype} {list(first.shape)}",
            )
    for index in range(experts):
        if index not in value:
            missing = first.name.replace(f"experts.{min(value)}.", f"experts.{index}.", 1)
            raise StoreError(
                f"missing tensor {missing!r} (expert {index} of {experts}; its siblings are in {manifest[first.file]})"
            )
    spec = ExpertTensorSpec(".".join(key), first.dtype, first.shape, first.nbytes)
    spans = tuple((value[e].file, value[e].offset) for e in range(experts))
    return spec, first, spans, [value[e].name for e in range(experts)]


def _stacked_slices(
    key: tuple[str, str],
    entry: TensorEntry,
    experts: int,
    manifest: tuple[str, ...],
    count_from: str,
):
    """(spec, entry, per-expert (file, offset), names) of one stacked [E, ...] tensor."""
    if not entry.shape or entry.shape[0] != experts:
        why = f"shape {list(entry.shape)} does not stack {count_from}"
        raise tensor_error(entry, manifest, why)
    nbytes = entry.nbytes // experts
    spec = ExpertTensorSpec(".".join(key), entry.dtype, entry.shape[1:], nbytes)
    spans = tuple((entry.file, entry.offset + e * nbytes) for e in range(experts))
    return spec, entry, spans, [entry.name]


@dataclass(frozen=True, slots=True)
class CheckpointExperts:
    """What `find_sparse_layers` found: each sparse layer, where its experts' bytes are, E and top-k."""

    layers: dict[int, SparseLayer]
    # sources[layer][tensor index][expert] = (file, offset) of that expert's bytes
    sources: dict[int, tuple[tuple[tuple[int, int], ...], ...]]
    experts_per_layer: int
    top_k: int


def find_sparse_layers(
    config: dict, tensors: Mapping[str, TensorEntry], manifest: tuple[str, ...]
) -> CheckpointExperts:
    """Every sparse layer's routed-expert tensors, checked against config and each other."""
    family = str(config.get("model_type", ""))
    quant_config = config.get("quantization_config")
    if "quantization" not in config and isinstance(quant_config, dict):
        method = quant_config.get("quant_method")
        if method in ("awq", "gptq", "bitnet"):
            raise StoreError(f"{manifest[0]}: mlx-lm's loader repacks {method} weights; {CONVERT_HINT}")
    layer_count = _config_int(config, ("num_hidden_layers",))
    layer_count = None if layer_count is None else layer_count[1]
    declared = _config_int(config, _EXPERT_KEYS)
    found = group_by_layer(tensors, manifest, family, layer_count)
    if not found:
        count = "no expert count" if declared is None else f"{declared[0]}={declared[1]}"
        raise StoreError(
            f"no routed-expert tensors in {', '.join(manifest)} (model_type {family!r}, "
            f"{count}): not a MoE checkpoint moeslab can serve"
        )
    expected = _expected_sparse_layers(config, family, layer_count)
    if expected is not None and expected != set(found):
        missing = sorted(expected - set(found))
        if missing:
            # Name what the missing layer should hold, by analogy with a present one.
            like, (_, module, groups) = min(found.items())
            example = f"{module}.{'.'.join(min(groups, key=canonical_order))}"
            example = example.replace(f"layers.{like}.", f"layers.{missing[0]}.", 1)
            raise StoreError(
                f"config makes layer {missing[0]} sparse but no routed-expert tensor of it "
                f"(e.g. {example!r}, like layer {like}'s) is in {', '.join(manifest)}"
            )
        extra = min(set(found) - expected)
        why = f"config makes layer {extra} dense but it has routed-expert tensors"
        raise tensor_error(first_entry(found[extra][2]), manifest, why)

    experts = None if declared is None else declared[1]
    layers, sources = {}, {}
    for layer, (layout, module, groups) in sorted(found.items()):
        if experts is None:
            if layout == "per_expert":
                why = f"per-expert layout needs an expert count ({'/'.join(_EXPERT_KEYS)})"
                raise tensor_error(first_entry(groups), manifest, why)
            shape = first_entry(groups).shape
            experts = shape[0] if shape else 0
        if experts < 1:
            raise tensor_error(first_entry(groups), manifest, f"{experts} experts per layer")
        count_from = f"{experts} experts" if declared is None else f"config {declared[0]}={experts}"
        specs, entries, spans, names = {}, {}, [], []
        for key in sorted(groups, key=canonical_order):
            if layout == "stacked":
                sliced = _stacked_slices(key, groups[key], experts, manifest, count_from)
            else:
                sliced = _per_expert_slices(key, groups[key], experts, manifest, count_from)
            spec, entry, span, checkpoint_names = sliced
            if spec.nbytes == 0:
                raise tensor_error(entry, manifest, f"empty expert tensor (shape {list(entry.shape)})")
            specs[key], entries[key] = spec, entry
            spans.append(span)
            names.extend(checkpoint_names)
        kind, quantization = _check_layer(config, module, specs, entries, manifest)
        specs_tuple = tuple(specs.values())
        layers[layer] = SparseLayer(layer, module, kind, layout, specs_tuple, quantization, tuple(names))
        sources[layer] = tuple(spans)

    top_k = _config_int(config, _TOP_K_KEYS)
    if top_k is None or not 1 <= top_k[1] <= experts:
        raise StoreError(f"config needs a top-k ({'/'.join(_TOP_K_KEYS)}) between 1 and {experts}, got {top_k}")
    return CheckpointExperts(layers, sources, experts, top_k[1])
