"""Which tensors of a checkpoint are routed experts, told by their names alone.

`group_by_layer` sorts a checkpoint's tensor names into the routed-expert
tensors of each sparse layer: stacked `[E, ...]` tensors (as mlx-lm saves them)
or one tensor per expert (Hugging Face naming), the latter only for families
whose mlx-lm `sanitize` does nothing to them but stack them. A name that looks
like an expert tensor but fits no layout we can serve byte for byte is refused
here, before any shape is checked: serving bytes that sanitize would transform
gives wrong answers. `shared.checkpoint` checks what is found against config.json.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from shared.safetensors_index import StoreError, TensorEntry

__all__ = [
    "CONVERT_HINT",
    "GLU_PROJECTIONS",
    "MLP_PROJECTIONS",
    "canonical_order",
    "first_entry",
    "group_by_layer",
    "tensor_error",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _PerExpertRule:
    """What a family's sanitize stacks: HF projection -> mlx-lm projection, params kept."""

    projections: Mapping[str, str]
    params: frozenset[str]
    target: str = "switch_mlp"  # the stacked module's name, next to `experts`


GLU_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
MLP_PROJECTIONS = ("fc1", "fc2")
_PARAMS = ("weight", "scales", "biases", "global_scale", "bias")
_SAME = MappingProxyType({name: name for name in GLU_PROJECTIONS})
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

# The advice every refusal ends with: mlx_lm.convert writes the stacked layout we serve.
CONVERT_HINT = "convert the model with mlx_lm.convert first"


def canonical_order(key: tuple[str, str]) -> tuple[int, int]:
    """(projection, param) in module order: gate, up, down, fc1, fc2 x weight, scales, ..."""
    return (GLU_PROJECTIONS + MLP_PROJECTIONS).index(key[0]), _PARAMS.index(key[1])


def tensor_error(entry: TensorEntry, manifest: tuple[str, ...], why: str) -> StoreError:
    """The refusal of one tensor, naming it and the file that holds it."""
    return StoreError(f"tensor {entry.name!r} in {manifest[entry.file]}: {why}")


def _classify(name: str, entry: TensorEntry, manifest: tuple[str, ...], family: str):
    """(layer, layout, module, projection, param, expert) of a routed-expert tensor, else None."""
    match = _PER_EXPERT.match(name)
    if match is not None:
        rule = _PER_EXPERT_RULES.get(family)
        proj, param = match["proj"], match["param"]
        if rule is None:
            raise tensor_error(
                entry,
                manifest,
                f"one-tensor-per-expert layout of family {family!r} is not supported (its "
                f"mlx-lm sanitize is not known to only stack experts); {CONVERT_HINT}",
            )
        if proj not in rule.projections:
            raise tensor_error(
                entry,
                manifest,
                f"{family}'s sanitize does not stack projection {proj!r} as it is (it stacks "
                f"{sorted(rule.projections)}); {CONVERT_HINT}",
            )
        if param not in rule.params:
            raise tensor_error(
                entry,
                manifest,
                f"{family}'s sanitize stacks per-expert {sorted(rule.params)} tensors "
                f"unchanged, not {param!r} ones (it transforms them or cannot load them); "
                f"{CONVERT_HINT} if mlx-lm can load it",
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
    if match is not None and match["proj"] in GLU_PROJECTIONS + MLP_PROJECTIONS and match["param"] in _PARAMS:
        return int(match["layer"]), "stacked", match["module"], match["proj"], match["param"], None
    if _EXPERTISH.search(name):
        raise tensor_error(
            entry,
            manifest,
            "unrecognized routed-expert tensor (a layout mlx-lm's sanitize transforms, such as "
            f"a fused gate_up_proj?); {CONVERT_HINT}",
        )
    return None


def group_by_layer(
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
            raise tensor_error(
                entry,
                manifest,
                f"layer {layer} mixes expert modules: {have[1]} ({have[0]}) and {module} ({layout})",
            )
        if expert is None:
            have[2][proj, param] = entry
        else:
            have[2].setdefault((proj, param), {})[expert] = entry
    return found


def first_entry(groups: dict) -> TensorEntry:
    """The first tensor (module order, lowest expert) of one layer's `group_by_layer` groups."""
    value = groups[min(groups, key=canonical_order)]
    return value[min(value)] if isinstance(value, dict) else value
