"""The expert locator: where each routed expert's bytes are and where they land in a slot.

`ExpertStore.open` indexes an mlx-lm model directory with `shared.checkpoint`
(config.json and the safetensors headers, never the tensors; a checkpoint that
does not match its config is refused there). For (layer, expert) it gives the
I/O segments to read and the in-slot layout the GPU worker wraps. This module
is that layout, apart from discovery: the I/O workers' O_DIRECT reads and the
GPU worker's views both depend on it, and on nothing about checkpoint names.

In-slot layout rule (from O_DIRECT): the reader rounds a segment's file range
out to `block_size` and writes the rounded window at
`slot_base + destination - offset % block_size`. Slots are 16 KiB aligned, so
each destination is congruent to its file offset modulo `block_size`, and the
windows are laid end to end so no window's slack lands on another segment's
requested bytes.
"""

from __future__ import annotations

import copy
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import numpy as np

from shared.checkpoint import CheckpointExperts, ExpertTensorSpec, SparseLayer, find_sparse_layers, load_config
from shared.checks import align_up, require_int
from shared.safetensors_index import StoreError, TensorEntry, numpy_dtype, scan_checkpoint
from shared.segments import ExpertIOSegment, ExpertResidencyLocation

__all__ = [
    "SLOT_ALIGNMENT",
    "ExpertStore",
    "SlotTensor",
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


def slot_view(buffer, tensor: SlotTensor) -> np.ndarray:
    """A numpy view (no copy) of `tensor` in a slot's buffer, in its storage dtype.

    BF16/F8 come back as uint16/uint8; reinterpret with `shared.safetensors_index.mlx_dtype` on the MLX side.
    """
    count = math.prod(tensor.shape)
    array = np.frombuffer(buffer, numpy_dtype(tensor.dtype), count=count, offset=tensor.offset)
    return array.reshape(tensor.shape)


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
        cursor = align_up(destination + length, block)  # end of this read's window
    return _ExpertPlan(
        location=ExpertResidencyLocation(layer, expert, tuple(segments)),
        layout=tuple(layout),
        scale_offset=cursor if scale_offset is None else scale_offset,
        extent=cursor,
    )


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
        found: CheckpointExperts,
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
        self.slot_bytes = align_up(widest, SLOT_ALIGNMENT)

    @classmethod
    def open(cls, model_dir: str | os.PathLike[str], *, block_size: int = 4096) -> ExpertStore:
        """Index `model_dir`; refuse (StoreError) a checkpoint that does not match its config."""
        block = require_int(block_size, "block_size", minimum=1)
        if block & (block - 1) or block > SLOT_ALIGNMENT:
            raise ValueError(f"block_size must be a power of two no larger than {SLOT_ALIGNMENT}, got {block}")
        root = Path(model_dir)
        if not root.is_dir():
            raise StoreError(f"{os.path.abspath(root)}: not a model directory")
        config = load_config(root)
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
