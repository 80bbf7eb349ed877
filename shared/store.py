"""The expert locator: where each routed expert's bytes are and where they land in a slot.

`ExpertStore.open` reads an mlx-lm model directory (config.json and the
safetensors headers, never the tensors), finds every routed-expert tensor of
every sparse layer, stacked (as mlx-lm saves them) or one tensor per expert
(Hugging Face naming, for families whose `sanitize` only stacks them), and
refuses a checkpoint that does not match its config. For (layer, expert) it
gives the I/O segments to read and the in-slot layout the GPU worker wraps.

In-slot layout rule (from O_DIRECT): the reader rounds a segment's file range
out to `block_size` and writes the rounded window at
`slot_base + destination - offset % block_size`. Slots are 16 KiB aligned, so
each destination is congruent to its file offset modulo `block_size`, and the
windows are laid end to end so no window's slack lands on another segment's
requested bytes.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import numpy as np

from shared.checks import require_int
from shared.safetensors_index import (
    StoreError,
    TensorEntry,
    mlx_dtype,
    numpy_dtype,
    scan_checkpoint,
)
from shared.segments import ExpertIOSegment, ExpertResidencyLocation

__all__ = [
    "SLOT_ALIGNMENT",
    "ExpertStore",
    "ExpertTensorSpec",
    "QuantSpec",
    "SlotTensor",
    "SparseLayer",
    "StoreError",
    "TensorEntry",
    "mlx_dtype",
    "numpy_dtype",
    "slot_view",
]

logger = logging.getLogger(__name__)

# Slab base and slot stride alignment (Metal zero-copy needs page alignment);
# a block size above it could not keep destinations congruent to offsets.
SLOT_ALIGNMENT = 16 * 1024


@dataclass(frozen=True, slots=True)
class SlotTensor:
    """One tensor of an expert inside its slot; `shape` has no expert axis."""

    name: str  # parameter path in the SwitchGLU/SwitchMLP, e.g. "gate_proj.weight"
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]
    offset: int  # bytes from the slot's base
    nbytes: int


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


def slot_view(buffer, tensor: SlotTensor) -> np.ndarray:
    """A numpy view (no copy) of `tensor` in a slot's buffer, in its storage dtype.

    BF16/F8 come back as uint16/uint8; reinterpret with `mlx_dtype` on the MLX side.
    """
    count = math.prod(tensor.shape)
    array = np.frombuffer(buffer, numpy_dtype(tensor.dtype), count=count, offset=tensor.offset)
    return array.reshape(tensor.shape)


def _align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


# ---------------------------------------------------------------------------
# Which tensors are routed experts


@dataclass(frozen=True, slots=True)
class _PerExpertRule:
    """What a family's sanitize stacks: HF projection -> mlx-lm projection, params kept."""

    projections: Mapping[str, str]
    params: frozenset[str]
    target: str = "switch_mlp"  # the stacked module's name, next to `experts`


_GLU = ("gate_proj", "up_proj", "down_proj")
_MLP = ("fc1", "fc2")
_PARAMS = ("weight", "scales", "biases", "global_scale", "bias")
# A projection's input features are its partner's output features.
_PARTNER = {"gate_proj": "down_proj", "up_proj": "down_proj", "down_proj": "gate_proj"}
_PARTNER.update({"fc1": "fc2", "fc2": "fc1"})
_SAME = MappingProxyType({name: name for name in _GLU})
_W1W2W3 = MappingProxyType({"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"})
_WEIGHT = frozenset({"weight"})
_QUANTIZED = frozenset({"weight", "scales", "biases"})

# Families whose sanitize (mlx_lm 0.32, read line by line) does nothing to
# per-expert tensors but stack them. Per-expert naming of any other family is
# refused: serving bytes that sanitize would transform gives wrong answers.
_PER_EXPERT_RULES: Mapping[str, _PerExpertRule] = MappingProxyType(
    {
        "qwen3_moe": _PerExpertRule(_SAME, _WEIGHT),
        "qwen3_next": _PerExpertRule(_SAME, _WEIGHT),
        "qwen2_moe": _PerExpertRule(_SAME, _QUANTIZED),
        "olmoe": _PerExpertRule(_SAME, _QUANTIZED),
        "hunyuan": _PerExpertRule(_SAME, _QUANTIZED),
        "deepseek": _PerExpertRule(_SAME, _QUANTIZED),
        "deepseek_v2": _PerExpertRule(_SAME, _QUANTIZED),
        "deepseek_v3": _PerExpertRule(_SAME, _QUANTIZED),
        "glm4_moe": _PerExpertRule(_SAME, _QUANTIZED),
        "glm4_moe_lite": _PerExpertRule(_SAME, _QUANTIZED),
        "dots1": _PerExpertRule(_SAME, _QUANTIZED, target="experts"),
        "mixtral": _PerExpertRule(_W1W2W3, _QUANTIZED),
        "phimoe": _PerExpertRule(_W1W2W3, _QUANTIZED),
    }
)

_LAYER = r"(?:.+\.)?(?:layers|h)\.(?P<layer>\d+)\.(?:.+\.)?"
_PER_EXPERT = re.compile(rf"^(?P<parent>{_LAYER})experts\.(?P<expert>\d+)\.(?P<proj>\w+)\.(?P<param>\w+)$")
_STACKED = re.compile(rf"^(?P<module>{_LAYER}(?:switch_mlp|switch_glu|experts))\.(?P<proj>\w+)\.(?P<param>\w+)$")
# A tensor under such a module that fits neither pattern is an expert layout
# we do not understand (e.g. gpt_oss's fused `experts.gate_up_proj`).
_EXPERTISH = re.compile(r"(?:^|\.)(?:experts|switch_mlp|switch_glu)(?:\.|$)")

_EXPERT_KEYS = (
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "moe_num_experts",
    "num_routed_experts",
)
_TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "experts_per_token", "moe_top_k")
_CONVERT = "convert the model with mlx_lm.convert first"


def _canonical(key: tuple[str, str]) -> tuple[int, int]:
    """(projection, param) in module order: gate, up, down, fc1, fc2 x weight, scales, ..."""
    return (_GLU + _MLP).index(key[0]), _PARAMS.index(key[1])


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


def _refuse(entry: TensorEntry, manifest: tuple[str, ...], why: str) -> StoreError:
    return StoreError(f"tensor {entry.name!r} in {manifest[entry.file]}: {why}")


def _classify(name: str, entry: TensorEntry, manifest: tuple[str, ...], family: str):
    """(layer, layout, module, projection, param, expert) of a routed-expert tensor, else None."""
    match = _PER_EXPERT.match(name)
    if match is not None:
        rule = _PER_EXPERT_RULES.get(family)
        proj, param = match["proj"], match["param"]
        if rule is None:
            raise _refuse(
                entry,
                manifest,
                f"one-tensor-per-expert layout of family {family!r} is not supported (its "
                f"mlx-lm sanitize is not known to only stack experts); {_CONVERT}",
            )
        if proj not in rule.projections:
            raise _refuse(
                entry,
                manifest,
                f"{family}'s sanitize does not stack projection {proj!r} as it is (it stacks "
                f"{sorted(rule.projections)}); {_CONVERT}",
            )
        if param not in rule.params:
            raise _refuse(
                entry,
                manifest,
                f"{family}'s sanitize stacks per-expert {sorted(rule.params)} tensors "
                f"unchanged, not {param!r} ones (it transforms them or cannot load them); "
                f"{_CONVERT} if mlx-lm can load it",
            )
        module = match["parent"] + rule.target
        return (
            int(match["layer"]),
            "per_expert",
            module,
            rule.projections[proj],
            param,
            int(match["expert"]),
        )
    match = _STACKED.match(name)
    if match is not None and match["proj"] in _GLU + _MLP and match["param"] in _PARAMS:
        return int(match["layer"]), "stacked", match["module"], match["proj"], match["param"], None
    if _EXPERTISH.search(name):
        raise _refuse(
            entry,
            manifest,
            "unrecognized routed-expert tensor (a layout mlx-lm's sanitize transforms, such as "
            f"a fused gate_up_proj?); {_CONVERT}",
        )
    return None


def _group_by_layer(
    tensors: Mapping[str, TensorEntry], manifest: tuple[str, ...], family: str, layers: int | None
) -> dict[int, tuple[str, str, dict]]:
    """{layer: (layout, module, {(proj, param): entry, or {expert: entry} per expert})}."""
    found: dict[int, tuple[str, str, dict]] = {}
    for name, entry in tensors.items():
        parsed = _classify(name, entry, manifest, family)
        if parsed is None:
            continue
        layer, layout, module, proj, param, expert = parsed
        if layers is not None and layer >= layers:
            # Multi-token-prediction layers past num_hidden_layers: sanitize drops them.
            logger.warning("ignoring %s: layer %d is past num_hidden_layers=%d", name, layer, layers)
            continue
        have = found.setdefault(layer, (layout, module, {}))
        if have[:2] != (layout, module):
            raise _refuse(
                entry,
                manifest,
                f"layer {layer} mixes expert modules: {have[1]} ({have[0]}) and {module} ({layout})",
            )
        if expert is None:
            have[2][proj, param] = entry
        else:
            have[2].setdefault((proj, param), {})[expert] = entry
    return found


def _first_entry(groups: dict) -> TensorEntry:
    value = groups[min(groups, key=_canonical)]
    return value[min(value)] if isinstance(value, dict) else value


# ---------------------------------------------------------------------------
# Checking them against the config and each other


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
    kind = "glu" if any(proj in _GLU for proj, _ in specs) else "mlp"
    projections = _GLU if kind == "glu" else _MLP
    for proj in projections:
        if (proj, "weight") not in specs:
            where = manifest[next(iter(entries.values())).file]
            raise StoreError(
                f"missing tensor for {module}.{proj}.weight (the layer's other expert tensors are in {where})"
            )
    for (proj, param), entry in entries.items():
        shape, weight = specs[proj, param].shape, specs[proj, "weight"].shape
        if proj not in projections:
            raise _refuse(entry, manifest, f"{proj!r} does not belong in a {kind} expert")
        if param == "weight" and len(shape) != 2:
            raise _refuse(entry, manifest, f"expert weight shape {list(shape)} is not 2-D")
        if param == "biases" and (proj, "scales") not in specs:
            raise _refuse(entry, manifest, "quantization biases without scales")
        if param in ("scales", "biases") and (len(shape) != 2 or shape[0] != weight[0]):
            raise _refuse(entry, manifest, f"{param} {list(shape)} do not fit weight {list(weight)}")
        if param == "bias" and shape != weight[:1]:
            raise _refuse(entry, manifest, f"bias {list(shape)} does not fit weight {list(weight)}")
    if kind == "glu":
        gate, up = specs["gate_proj", "weight"], specs["up_proj", "weight"]
        if (gate.shape, gate.dtype) != (up.shape, up.dtype):
            raise _refuse(
                entries["up_proj", "weight"],
                manifest,
                f"{up.dtype} {list(up.shape)} differs from gate_proj {gate.dtype} {list(gate.shape)}",
            )
    hidden = _config_int(config, ("hidden_size",))
    out_features = specs[projections[-1], "weight"].shape[0]
    if hidden is not None and out_features != hidden[1]:
        raise _refuse(
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
            raise _refuse(entry, manifest, f"expert {index} out of range ({count_from})")
        if (entry.dtype, entry.shape) != (first.dtype, first.shape):
            raise _refuse(
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
        raise _refuse(entry, manifest, why)
    nbytes = entry.nbytes // experts
    spec = ExpertTensorSpec(".".join(key), entry.dtype, entry.shape[1:], nbytes)
    spans = tuple((entry.file, entry.offset + e * nbytes) for e in range(experts))
    return spec, entry, spans, [entry.name]


@dataclass(frozen=True, slots=True)
class _Found:
    layers: dict[int, SparseLayer]
    # sources[layer][tensor index][expert] = (file, offset) of that expert's bytes
    sources: dict[int, tuple[tuple[tuple[int, int], ...], ...]]
    experts_per_layer: int
    top_k: int


def find_sparse_layers(config: dict, tensors: Mapping[str, TensorEntry], manifest: tuple[str, ...]) -> _Found:
    """Every sparse layer's routed-expert tensors, checked against config and each other."""
    family = str(config.get("model_type", ""))
    quant_config = config.get("quantization_config")
    if "quantization" not in config and isinstance(quant_config, dict):
        method = quant_config.get("quant_method")
        if method in ("awq", "gptq", "bitnet"):
            raise StoreError(f"{manifest[0]}: mlx-lm's loader repacks {method} weights; {_CONVERT}")
    layer_count = _config_int(config, ("num_hidden_layers",))
    layer_count = None if layer_count is None else layer_count[1]
    declared = _config_int(config, _EXPERT_KEYS)
    found = _group_by_layer(tensors, manifest, family, layer_count)
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
            example = f"{module}.{'.'.join(min(groups, key=_canonical))}"
            example = example.replace(f"layers.{like}.", f"layers.{missing[0]}.", 1)
            raise StoreError(
                f"config makes layer {missing[0]} sparse but no routed-expert tensor of it "
                f"(e.g. {example!r}, like layer {like}'s) is in {', '.join(manifest)}"
            )
        extra = min(set(found) - expected)
        why = f"config makes layer {extra} dense but it has routed-expert tensors"
        raise _refuse(_first_entry(found[extra][2]), manifest, why)

    experts = None if declared is None else declared[1]
    layers, sources = {}, {}
    for layer, (layout, module, groups) in sorted(found.items()):
        if experts is None:
            if layout == "per_expert":
                why = f"per-expert layout needs an expert count ({'/'.join(_EXPERT_KEYS)})"
                raise _refuse(_first_entry(groups), manifest, why)
            shape = _first_entry(groups).shape
            experts = shape[0] if shape else 0
        if experts < 1:
            raise _refuse(_first_entry(groups), manifest, f"{experts} experts per layer")
        count_from = f"{experts} experts" if declared is None else f"config {declared[0]}={experts}"
        specs, entries, spans, names = {}, {}, [], []
        for key in sorted(groups, key=_canonical):
            if layout == "stacked":
                sliced = _stacked_slices(key, groups[key], experts, manifest, count_from)
            else:
                sliced = _per_expert_slices(key, groups[key], experts, manifest, count_from)
            spec, entry, span, checkpoint_names = sliced
            if spec.nbytes == 0:
                raise _refuse(entry, manifest, f"empty expert tensor (shape {list(entry.shape)})")
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
    return _Found(layers, sources, experts, top_k[1])


# ---------------------------------------------------------------------------
# The store


@dataclass(frozen=True, slots=True)
class _ExpertPlan:
    location: ExpertResidencyLocation
    layout: tuple[SlotTensor, ...]
    scale_offset: int
    extent: int  # end of the last aligned window


def _plan_expert(
    layer: int,
    expert: int,
    specs: tuple[ExpertTensorSpec, ...],
    sources: tuple[tuple[tuple[int, int], ...], ...],
    block: int,
) -> _ExpertPlan:
    """Coalesce an expert's tensors into reads and place each aligned window after the last."""
    pieces = sorted((*sources[index][expert], index) for index in range(len(specs)))
    groups: list[list[tuple[int, int, int]]] = []
    for piece in pieces:
        if groups:
            file, offset, index = groups[-1][-1]
            if piece[0] == file and piece[1] == offset + specs[index].nbytes:
                groups[-1].append(piece)  # contiguous in the file: one read
                continue
        groups.append([piece])

    def holds_weights(group: list[tuple[int, int, int]]) -> bool:
        return any(specs[index].name.endswith(".weight") for _, _, index in group)

    # Weights first, scales and biases last: that tail is what readahead hints warm.
    groups.sort(key=lambda group: not holds_weights(group))
    cursor, scale_offset = 0, None
    segments, layout = [], []
    for group in groups:
        file, start, _ = group[0]
        length = sum(specs[index].nbytes for _, _, index in group)
        destination = cursor + start % block  # congruent to the file offset
        if scale_offset is None and not holds_weights(group):
            scale_offset = destination
        segments.append(ExpertIOSegment(file, start, length, destination))
        for _, offset, index in group:
            spec = specs[index]
            at = destination + offset - start
            layout.append(SlotTensor(spec.name, spec.dtype, spec.shape, at, spec.nbytes))
        cursor = _align_up(destination + length, block)  # end of this read's window
    return _ExpertPlan(
        location=ExpertResidencyLocation(layer, expert, tuple(segments)),
        layout=tuple(layout),
        scale_offset=cursor if scale_offset is None else scale_offset,
        extent=cursor,
    )


def _load_config(model_dir: Path) -> dict:
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


class ExpertStore:
    """Read-only locator of a checkpoint's routed experts; build it with `open`."""

    def __init__(
        self,
        *,
        model_dir: str,
        block_size: int,
        config: dict,
        manifest: tuple[str, ...],
        tensors: Mapping[str, TensorEntry],
        found: _Found,
    ) -> None:
        self.model_dir = model_dir
        self.block_size = block_size
        self._config = config
        self.manifest = manifest
        self.tensors: Mapping[str, TensorEntry] = MappingProxyType(dict(tensors))
        self.layers: Mapping[int, SparseLayer] = MappingProxyType(found.layers)
        self._sources = found.sources
        self.sparse_layers: tuple[int, ...] = tuple(sorted(found.layers))
        self.experts_per_layer = found.experts_per_layer
        self.top_k = found.top_k
        self.expert_tensor_names: frozenset[str] = frozenset(
            name for layer in found.layers.values() for name in layer.checkpoint_names
        )
        self.expert_bytes = sum(self.tensors[name].nbytes for name in self.expert_tensor_names)
        self.dense_bytes = sum(entry.nbytes for name, entry in tensors.items() if name not in self.expert_tensor_names)
        self._plans: dict[tuple[int, int], _ExpertPlan] = {}
        widest = max(
            _plan_expert(layer, expert, self.layers[layer].tensors, self._sources[layer], block_size).extent
            for layer in self.sparse_layers
            for expert in range(self.experts_per_layer)
        )
        self.slot_bytes = _align_up(widest, SLOT_ALIGNMENT)

    @classmethod
    def open(cls, model_dir: str | os.PathLike[str], *, block_size: int = 4096) -> ExpertStore:
        """Index `model_dir`; refuse (StoreError) a checkpoint that does not match its config."""
        block = require_int(block_size, "block_size", minimum=1)
        if block & (block - 1) or block > SLOT_ALIGNMENT:
            raise ValueError(f"block_size must be a power of two no larger than {SLOT_ALIGNMENT}, got {block}")
        root = Path(model_dir)
        if not root.is_dir():
            raise StoreError(f"{os.path.abspath(root)}: not a model directory")
        config = _load_config(root)
        manifest, tensors = scan_checkpoint(root)
        found = find_sparse_layers(config, tensors, manifest)
        store = cls(
            model_dir=os.path.abspath(root),
            block_size=block,
            config=config,
            manifest=manifest,
            tensors=tensors,
            found=found,
        )
        logger.info(
            "expert store %s: %d sparse layers x %d experts (top-%d), %d-byte slots, "
            "%d expert bytes, %d dense bytes, %d files",
            store.model_dir,
            len(store.sparse_layers),
            store.experts_per_layer,
            store.top_k,
            store.slot_bytes,
            store.expert_bytes,
            store.dense_bytes,
            len(manifest),
        )
        return store

    @property
    def config(self) -> dict:
        """A copy of config.json (the store never changes)."""
        return copy.deepcopy(self._config)

    def layer(self, layer: int) -> SparseLayer:
        """What one sparse layer holds: module path, tensor specs, quantization."""
        number = require_int(layer, "layer")
        if number not in self.layers:
            sparse = list(self.sparse_layers)
            raise ValueError(f"layer {number} is not a sparse layer; sparse layers are {sparse}")
        return self.layers[number]

    def _plan(self, layer: int, expert_id: int) -> _ExpertPlan:
        number = self.layer(layer).layer
        expert = require_int(expert_id, "expert_id")
        if expert >= self.experts_per_layer:
            raise ValueError(f"expert_id {expert} out of range: layer {number} has {self.experts_per_layer} experts")
        plan = self._plans.get((number, expert))
        if plan is None:
            specs, sources = self.layers[number].tensors, self._sources[number]
            plan = _plan_expert(number, expert, specs, sources, self.block_size)
            self._plans[number, expert] = plan
        return plan

    def locate(self, layer: int, expert_id: int) -> ExpertResidencyLocation:
        """The segments (file index, offset, length, destination) of one expert."""
        return self._plan(layer, expert_id).location

    def layout(self, layer: int, expert_id: int) -> tuple[SlotTensor, ...]:
        """Where each tensor of one expert sits in its slot once `locate`'s segments are read."""
        return self._plan(layer, expert_id).layout

    def scale_offset(self, layer: int, expert_id: int) -> int:
        """First in-slot destination past the weights (for `build_expert_hint_segments`)."""
        return self._plan(layer, expert_id).scale_offset

    def __repr__(self) -> str:
        return (
            f"ExpertStore({self.model_dir!r}, layers={len(self.sparse_layers)}, "
            f"experts={self.experts_per_layer}, top_k={self.top_k}, slot_bytes={self.slot_bytes})"
        )
