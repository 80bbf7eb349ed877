"""Read and validate safetensors headers without loading any tensor.

The expert store needs each tensor's file, absolute byte offset, dtype and
shape; it must never trust a header it has not checked, because the I/O
workers will read exactly the ranges derived from it.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

# Item sizes of the safetensors dtype strings that whole-byte tensors use.
# Sub-byte formats (F4, F6_*) are not listed: nothing in mlx-lm writes them and
# their byte count is not dtype x shape, so they are refused as unknown.
DTYPE_SIZES: Mapping[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "C64": 8,
}

# numpy has no bfloat16 or fp8: those are viewed as same-width unsigned ints
# and reinterpreted on the MLX side (`mlx_dtype`).
_NUMPY_STORAGE: Mapping[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "F8_E4M3": "uint8",
    "F8_E5M2": "uint8",
    "F8_E8M0": "uint8",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "uint16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "I64": "int64",
    "U64": "uint64",
    "F64": "float64",
    "C64": "complex64",
}

_MLX_NAMES: Mapping[str, str] = {
    "BOOL": "bool_",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "I64": "int64",
    "U64": "uint64",
    "F64": "float64",
    "C64": "complex64",
}

# The reference implementation refuses headers above 100 MB; so do we, so a
# corrupt length field cannot make us allocate gigabytes.
MAX_HEADER_BYTES = 100_000_000


class StoreError(ValueError):
    """A checkpoint that cannot be served as it is; the message names tensor and file."""


def numpy_dtype(dtype: str) -> np.dtype:
    """The numpy dtype to view a tensor's bytes with (BF16 -> uint16, F8 -> uint8)."""
    try:
        return np.dtype(_NUMPY_STORAGE[dtype])
    except KeyError:
        raise ValueError(f"unknown safetensors dtype {dtype!r}") from None


def mlx_dtype(dtype: str):
    """The mlx.core dtype of a safetensors dtype string (imports MLX lazily)."""
    import mlx.core as mx

    name = _MLX_NAMES.get(dtype)
    if name is None:
        raise ValueError(f"safetensors dtype {dtype!r} has no MLX dtype")
    return getattr(mx, name)


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a checkpoint: where its bytes are and what they hold."""

    name: str
    file: int  # index into the manifest
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


def _reject_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    result: dict[str, object] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_header(path: str | os.PathLike[str], file_index: int = 0) -> list[TensorEntry]:
    """Parse and validate one safetensors header; tensors sorted by offset.

    Checks: sane header length, a JSON object, known dtypes, shapes of
    non-negative ints, data_offsets inside the file, equal to dtype x shape and
    not overlapping each other.
    """
    path = os.fspath(path)
    size = os.path.getsize(path)
    if size < 8:
        raise StoreError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
    with open(path, "rb") as handle:
        (header_len,) = struct.unpack("<Q", handle.read(8))
        if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
            raise StoreError(f"{path}: corrupt safetensors header length {header_len} (file has {size} bytes)")
        raw = handle.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_reject_duplicates)
    except (UnicodeDecodeError, ValueError) as error:
        raise StoreError(f"{path}: corrupt safetensors header: {error}") from None
    if not isinstance(header, dict):
        raise StoreError(f"{path}: corrupt safetensors header: not a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not isinstance(metadata, dict):
        raise StoreError(f"{path}: corrupt safetensors header: __metadata__ is not an object")

    data_start = 8 + header_len
    entries = []
    for name, info in header.items():
        where = f"{path}: tensor {name!r}"
        if not isinstance(info, dict):
            raise StoreError(f"{where}: header entry is not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in DTYPE_SIZES:
            raise StoreError(f"{where}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_is_count(dim) for dim in shape):
            raise StoreError(f"{where}: shape {shape!r} is not a list of non-negative integers")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_is_count(value) for value in offsets)
            or offsets[0] > offsets[1]
        ):
            raise StoreError(f"{where}: bad data_offsets {offsets!r}")
        begin, end = offsets
        expected = DTYPE_SIZES[dtype] * math.prod(shape)
        if end - begin != expected:
            raise StoreError(
                f"{where}: data_offsets {offsets} hold {end - begin} bytes but {dtype} x {shape} needs {expected}"
            )
        if data_start + end > size:
            raise StoreError(
                f"{where}: data ends at byte {data_start + end} but the file has only {size} bytes (truncated file?)"
            )
        entries.append(TensorEntry(name, file_index, dtype, tuple(shape), data_start + begin, expected))

    entries.sort(key=lambda entry: (entry.offset, entry.nbytes))
    for before, after in itertools.pairwise(entries):
        if after.offset < before.offset + before.nbytes:
            raise StoreError(f"{path}: tensor {after.name!r} overlaps tensor {before.name!r} in the data section")
    return entries


def _indexed_files(model_dir: Path) -> dict[str, str] | None:
    """The index's weight_map (tensor -> file name), or None without an index."""
    index_path = model_dir / "model.safetensors.index.json"
    if not index_path.exists():
        return None
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise StoreError(f"{index_path}: corrupt index: {error}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(key, str) and isinstance(value, str) for key, value in weight_map.items()
    ):
        raise StoreError(f"{index_path}: corrupt index: no weight_map of tensor -> file name")
    for name, file_name in weight_map.items():
        # A file name from the index must stay inside the model directory.
        if Path(file_name).name != file_name or file_name in ("", ".", ".."):
            raise StoreError(f"{index_path}: tensor {name!r} names file {file_name!r} outside the model")
    return weight_map


def scan_checkpoint(
    model_dir: str | os.PathLike[str],
) -> tuple[tuple[str, ...], dict[str, TensorEntry]]:
    """The manifest (sorted absolute paths) and every tensor of a model directory.

    With `model.safetensors.index.json` the manifest is the files it names and
    every indexed tensor must be in its file; without, it is every
    `*.safetensors` file. A tensor name in two files is refused.
    """
    root = Path(model_dir)
    weight_map = _indexed_files(root)
    if weight_map is not None:
        names = sorted(set(weight_map.values()))
    else:
        names = sorted(path.name for path in root.glob("*.safetensors"))
    if not names:
        raise StoreError(f"{os.path.abspath(root)}: no *.safetensors files")
    manifest = tuple(os.path.abspath(root / name) for name in names)
    tensors: dict[str, TensorEntry] = {}
    for index, path in enumerate(manifest):
        if not os.path.isfile(path):
            raise StoreError(f"{path}: listed in model.safetensors.index.json but missing")
        for entry in read_header(path, index):
            if entry.name in tensors:
                other = manifest[tensors[entry.name].file]
                raise StoreError(f"tensor {entry.name!r} is in both {other} and {path}")
            tensors[entry.name] = entry
    if weight_map is not None:
        for name, file_name in weight_map.items():
            entry = tensors.get(name)
            if entry is None:
                raise StoreError(
                    f"tensor {name!r} is indexed in {os.path.abspath(root / file_name)} but that file does not hold it"
                )
            if os.path.basename(manifest[entry.file]) != file_name:
                raise StoreError(f"tensor {name!r} is indexed in {file_name} but lives in {manifest[entry.file]}")
        unindexed = sorted(set(tensors) - set(weight_map))
        if unindexed:
            logger.warning("%d tensors are missing from the index, e.g. %r", len(unindexed), unindexed[0])
    return manifest, tensors
