"""The expert locator against tiny mlx-lm checkpoints: bytes, layout rules, refusals."""

from __future__ import annotations

import importlib
import json
import os
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file

from shared.checkpoint import ExpertTensorSpec
from shared.checks import align_up
from shared.safetensors_index import StoreError, mlx_dtype, numpy_dtype
from shared.store import SLOT_ALIGNMENT, ExpertStore, SlotTensor, _plan_expert, slot_view
from tests.helpers.models import write_tiny_model

# (family, quantized, layout): every combination mlx-lm itself can load.
CASES = [
    ("qwen3_moe", False, "stacked"),
    ("qwen3_moe", True, "stacked"),
    ("qwen3_moe", False, "per_expert"),
    ("mixtral", False, "stacked"),
    ("mixtral", True, "stacked"),
    ("mixtral", False, "per_expert"),
    ("mixtral", True, "per_expert"),
    ("deepseek_v3", False, "stacked"),
    ("deepseek_v3", True, "stacked"),
    ("deepseek_v3", False, "per_expert"),
    ("deepseek_v3", True, "per_expert"),
    ("gpt_oss", False, "stacked"),
    ("gpt_oss", True, "stacked"),
]


def _case_id(case) -> str:
    family, quantized, layout = case
    return f"{family}-{'q4' if quantized else 'fp32'}-{layout}"


def _copy_model(source: Path, target: Path) -> Path:
    target.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        (target / item.name).write_bytes(item.read_bytes())
    return target


def _sanitized_weights(model_dir: Path) -> dict[str, mx.array]:
    """What mlx-lm's loader hands to the model: every file, through the family's sanitize."""
    config = json.loads((model_dir / "config.json").read_text())
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    weights = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        weights.update(mx.load(str(file)))
    return model.sanitize(weights)


def _raw(array: mx.array) -> bytes:
    """An MLX array's bytes (numpy has no bfloat16, so view those as uint16)."""
    if array.dtype == mx.bfloat16:
        array = array.view(mx.uint16)
    return np.array(array).tobytes()


def _read_like_o_direct(store: ExpertStore, layer: int, expert: int, *, reverse: bool = False) -> bytearray:
    """Fill a slot the way the I/O worker will: aligned windows, at destination - residue."""
    block = store.block_size
    slot = bytearray(b"\xa5" * store.slot_bytes)
    segments = store.locate(layer, expert).segments
    for segment in reversed(segments) if reverse else segments:
        residue = segment.offset % block
        start = segment.offset - residue
        end = -(-(segment.offset + segment.length) // block) * block
        base = segment.destination - residue
        assert base >= 0 and base % block == 0
        assert base + (end - start) <= store.slot_bytes
        with open(store.manifest[segment.file], "rb") as handle:
            handle.seek(start)
            data = handle.read(end - start)  # short at end of file, like O_DIRECT
        slot[base : base + len(data)] = data
    return slot


def _check_layout_rules(store: ExpertStore, layer: int, expert: int) -> None:
    block = store.block_size
    segments = store.locate(layer, expert).segments
    assert segments, (layer, expert)
    windows = []
    for segment in segments:
        assert segment.destination % block == segment.offset % block
        residue = segment.offset % block
        window_end = segment.destination - residue + -(-(residue + segment.length) // block) * block
        windows.append((segment.destination - residue, window_end))
        assert window_end <= store.slot_bytes
    for index, (start, end) in enumerate(windows):
        for other, segment in enumerate(segments):
            if other != index:
                requested = (segment.destination, segment.destination + segment.length)
                assert end <= requested[0] or start >= requested[1], (layer, expert, index, other)
    # Tensors tile their segments exactly, contiguous within each.
    covered = sorted((t.offset, t.offset + t.nbytes) for t in store.layout(layer, expert))
    spans = sorted((s.destination, s.destination + s.length) for s in segments)
    merged = []
    for begin, end in covered:
        if merged and merged[-1][1] == begin and any(a <= merged[-1][0] and end <= b for a, b in spans):
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((begin, end))
    assert merged == spans


def _check_every_expert(path: Path, *, block_size: int = 4096) -> ExpertStore:
    """Every expert's slot, filled like O_DIRECT would, holds mlx-lm's own sanitized slices."""
    store = ExpertStore.open(path, block_size=block_size)
    weights = _sanitized_weights(path)
    total = 0
    for layer in store.sparse_layers:
        module = store.layer(layer).module
        own = {name[len(module) + 1 :] for name in weights if name.startswith(module + ".")}
        for expert in range(store.experts_per_layer):
            _check_layout_rules(store, layer, expert)
            slot = _read_like_o_direct(store, layer, expert)
            again = _read_like_o_direct(store, layer, expert, reverse=True)
            assert slot == again  # no window clobbers another segment's bytes
            tensors = store.layout(layer, expert)
            assert {t.name for t in tensors} == own
            for tensor in tensors:
                expected = weights[f"{module}.{tensor.name}"][expert]
                view = slot_view(slot, tensor)
                assert tensor.shape == tuple(expected.shape)
                assert mlx_dtype(tensor.dtype) == expected.dtype
                assert view.tobytes() == _raw(expected), (layer, expert, tensor.name)
                total += tensor.nbytes
            assert store.slot_bytes >= sum(t.nbytes for t in tensors)
    assert store.slot_bytes % SLOT_ALIGNMENT == 0
    assert total == store.expert_bytes
    return store


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_slots_hold_the_models_own_expert_slices(models, case):
    _check_every_expert(models(*case))


def _down_proj_8bit(path, module):
    return {"bits": 8, "group_size": 32} if path.endswith("down_proj") and "switch_mlp" in path else True


@pytest.mark.parametrize(
    "options",
    [
        {"mode": "mxfp4"},
        {"mode": "nvfp4", "global_scale": True},
        {"quant_predicate": _down_proj_8bit},
        {"layout": "per_expert", "quant_predicate": _down_proj_8bit},
        {"dtype": "bfloat16"},
        {"dtype": "float16", "layout": "per_expert"},
    ],
    ids=[
        "mxfp4",
        "nvfp4-global-scale",
        "mixed-bits",
        "mixed-bits-per-expert",
        "bf16",
        "fp16-per-expert",
    ],
)
def test_other_quantizations_and_dtypes(tmp_path, options):
    quantized = "dtype" not in options
    path = write_tiny_model(tmp_path, family="mixtral", quantized=quantized, **options)
    store = _check_every_expert(path)
    layer = store.layer(1)
    if "mode" in options:
        spec = layer.quant("up_proj")
        assert spec.mode == options["mode"] and spec.global_scale == options.get("global_scale", False)
        assert "up_proj.biases" not in {t.name for t in layer.tensors}
    elif quantized:
        assert (layer.quant("down_proj").bits, layer.quant("down_proj").group_size) == (8, 32)
        assert (layer.quant("gate_proj").bits, layer.quant("gate_proj").group_size) == (4, 64)
    else:
        assert layer.quantization == ()
        assert {t.dtype for t in layer.tensors} == {"BF16" if options["dtype"] == "bfloat16" else "F16"}


@pytest.mark.parametrize("block_size", [1, 512, 4096, 16384])
@pytest.mark.parametrize("case", [CASES[1], CASES[6], CASES[12]], ids=_case_id)
def test_layout_rules_hold_for_every_block_size(models, case, block_size):
    store = ExpertStore.open(models(*case), block_size=block_size)
    for layer in store.sparse_layers:
        for expert in range(store.experts_per_layer):
            _check_layout_rules(store, layer, expert)
    layer = store.sparse_layers[-1]
    weights = _sanitized_weights(models(*case))
    slot = _read_like_o_direct(store, layer, 7)
    for tensor in store.layout(layer, 7):
        assert slot_view(slot, tensor).tobytes() == _raw(weights[f"{store.layer(layer).module}.{tensor.name}"][7])


def test_layouts_differ_per_expert_when_residues_differ(models):
    store = ExpertStore.open(models("qwen3_moe", True), block_size=4096)
    layouts = {store.layout(0, expert) for expert in range(store.experts_per_layer)}
    assert len(layouts) > 1  # stacked slices sit at base + e * stride
    assert store.layout(0, 3) is store.layout(0, 3)  # cached


def test_per_expert_layout_coalesces_contiguous_tensors(models):
    store = ExpertStore.open(models("mixtral", False, "per_expert"))
    for layer in store.sparse_layers:
        for expert in range(8):
            assert len(store.locate(layer, expert).segments) == 1
    quantized = ExpertStore.open(models("mixtral", True, "per_expert"))
    # safetensors groups U32 weights apart from F32 scales/biases: two runs.
    assert len(quantized.locate(1, 5).segments) == 2
    assert quantized.scale_offset(1, 5) == quantized.locate(1, 5).segments[1].destination


def test_metadata(models):
    path = models("deepseek_v3", True)
    store = ExpertStore.open(path)
    assert store.manifest == (os.path.abspath(path / "model.safetensors"),)
    assert store.sparse_layers == (1, 2)  # first_k_dense_replace=1
    assert (store.experts_per_layer, store.top_k) == (8, 2)
    assert store.config == json.loads((path / "config.json").read_text())
    names = store.expert_tensor_names
    assert "model.layers.1.mlp.switch_mlp.gate_proj.scales" in names
    assert not any("shared_experts" in name or "layers.0." in name for name in names)
    everything = {**load_file(str(path / "model.safetensors"))}
    assert store.expert_bytes == sum(everything[name].nbytes for name in names)
    assert store.dense_bytes + store.expert_bytes == sum(value.nbytes for value in everything.values())
    layer = store.layer(1)
    assert (layer.module, layer.kind, layer.layout) == (
        "model.layers.1.mlp.switch_mlp",
        "glu",
        "stacked",
    )
    assert layer.quant("down_proj").bits == 4 and layer.quant("down_proj").group_size == 64
    assert layer.quant("down_proj").mode == "affine"
    assert {t.name for t in layer.tensors} == {
        f"{p}.{k}" for p in ("gate_proj", "up_proj", "down_proj") for k in ("weight", "scales", "biases")
    }
    assert "slot_bytes" in repr(store)

    plain = ExpertStore.open(models("gpt_oss"))
    assert plain.layer(0).module == "model.layers.0.mlp.experts"
    assert plain.layer(0).quant("gate_proj") is None and plain.layer(0).quantization == ()
    assert {t.name for t in plain.layout(1, 0)} >= {
        "gate_proj.bias",
        "up_proj.bias",
        "down_proj.bias",
    }

    hf = ExpertStore.open(models("mixtral", False, "per_expert"))
    assert hf.layer(0).module == "model.layers.0.block_sparse_moe.switch_mlp"
    assert hf.layer(0).layout == "per_expert"
    assert "model.layers.0.block_sparse_moe.experts.7.w2.weight" in hf.expert_tensor_names


def test_dtype_helpers():
    assert numpy_dtype("F32") == np.float32 and numpy_dtype("BF16") == np.uint16
    assert mlx_dtype("BF16") == mx.bfloat16 and mlx_dtype("U32") == mx.uint32
    with pytest.raises(ValueError, match="Q4"):
        numpy_dtype("Q4")
    with pytest.raises(ValueError, match="F8_E4M3"):
        mlx_dtype("F8_E4M3")
    tensor = SlotTensor("up_proj.weight", "F16", (2, 3), 4, 12)
    buffer = bytearray(16)
    buffer[4:16] = np.arange(6, dtype=np.float16).tobytes()
    assert slot_view(buffer, tensor).tolist() == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.parametrize("options", [{"shards": 3}, {"shards": 2, "layout": "per_expert"}, {"index": False}])
def test_sharded_and_unindexed_checkpoints(models, options):
    path = models("qwen3_moe", **options)
    store = ExpertStore.open(path)
    assert len(store.manifest) == options.get("shards", 1)
    assert list(store.manifest) == sorted(store.manifest)
    weights = _sanitized_weights(path)
    for layer in store.sparse_layers:
        for expert in (0, 7):
            slot = _read_like_o_direct(store, layer, expert)
            for tensor in store.layout(layer, expert):
                expected = weights[f"model.layers.{layer}.mlp.switch_mlp.{tensor.name}"][expert]
                assert slot_view(slot, tensor).tobytes() == _raw(expected)


# ---------------------------------------------------------------------------
# Refusals


def _edit_tensors(model_dir: Path, edit) -> Path:
    """Rewrite model.safetensors through `edit(dict)`; drop the index (it would disagree)."""
    file = model_dir / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file))
    (model_dir / "model.safetensors.index.json").unlink(missing_ok=True)
    return file


def _edit_header(file: Path, edit) -> None:
    raw = file.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    edit(header)
    encoded = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(encoded)) + encoded + raw[8 + length :])


def _edit_config(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def _refused(model_dir: Path, *fragments: str) -> str:
    with pytest.raises(ValueError) as caught:
        ExpertStore.open(model_dir)
    assert isinstance(caught.value, StoreError)
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_refuses_missing_expert_tensor(models, tmp_path):
    hf = _copy_model(models("mixtral", False, "per_expert"), tmp_path / "hf")
    file = _edit_tensors(hf, lambda t: t.pop("model.layers.1.block_sparse_moe.experts.5.w3.weight"))
    _refused(hf, "model.layers.1.block_sparse_moe.experts.5.w3.weight", str(file))

    stacked = _copy_model(models("qwen3_moe"), tmp_path / "stacked")
    file = _edit_tensors(stacked, lambda t: t.pop("model.layers.1.mlp.switch_mlp.up_proj.weight"))
    _refused(stacked, "model.layers.1.mlp.switch_mlp.up_proj.weight", str(file))

    layerless = _copy_model(models("qwen3_moe"), tmp_path / "layerless")

    def drop_layer(tensors):
        for name in [n for n in tensors if n.startswith("model.layers.0.mlp.switch_mlp.")]:
            del tensors[name]

    file = _edit_tensors(layerless, drop_layer)
    _refused(layerless, "layer 0", "model.layers.0.mlp.switch_mlp.gate_proj.weight", str(file))

    indexed = _copy_model(models("qwen3_moe"), tmp_path / "indexed")
    file = indexed / "model.safetensors"
    tensors = load_file(str(file))
    del tensors["model.layers.0.mlp.switch_mlp.gate_proj.weight"]
    save_file(tensors, str(file))  # the index still lists it
    _refused(indexed, "model.layers.0.mlp.switch_mlp.gate_proj.weight", str(file))


def test_refuses_truncated_file(models, tmp_path):
    path = _copy_model(models("mixtral", True), tmp_path / "m")
    file = path / "model.safetensors"
    os.truncate(file, file.stat().st_size - 100)
    _refused(path, str(file), "truncated", "tensor '")
    os.truncate(file, 5)
    _refused(path, str(file), "truncated")


def test_refuses_shape_mismatches(models, tmp_path):
    hf = _copy_model(models("mixtral", False, "per_expert"), tmp_path / "hf")
    name = "model.layers.0.block_sparse_moe.experts.3.w1.weight"
    file = _edit_tensors(hf, lambda t: t.__setitem__(name, t[name][:32]))
    _refused(hf, name, str(file), "differs")

    stacked = _copy_model(models("mixtral"), tmp_path / "count")
    _edit_config(stacked, num_local_experts=16)
    _refused(
        stacked,
        "model.layers.0.block_sparse_moe.switch_mlp.",
        str(stacked / "model.safetensors"),
        "num_local_experts=16",
    )

    hidden = _copy_model(models("gpt_oss"), tmp_path / "hidden")
    _edit_config(hidden, hidden_size=128)
    _refused(hidden, "down_proj.weight", str(hidden / "model.safetensors"), "hidden_size")

    uneven = _copy_model(models("qwen3_moe"), tmp_path / "uneven")
    name = "model.layers.1.mlp.switch_mlp.up_proj.weight"
    file = _edit_tensors(uneven, lambda t: t.__setitem__(name, t[name][:, :32]))
    _refused(uneven, name, str(file), "gate_proj")

    quant = _copy_model(models("qwen3_moe", True), tmp_path / "quant")
    name = "model.layers.0.mlp.switch_mlp.down_proj.scales"
    file = _edit_tensors(quant, lambda t: t.__setitem__(name, np.concatenate([t[name]] * 3, axis=-1)))
    _refused(quant, "model.layers.0.mlp.switch_mlp.down_proj.weight", str(file), "does not fit")


def test_refuses_corrupt_headers(models, tmp_path):
    path = _copy_model(models("qwen3_moe"), tmp_path / "m")
    file = path / "model.safetensors"
    pristine = file.read_bytes()

    file.write_bytes(pristine[:8] + b"{not json" + pristine[17:])
    _refused(path, str(file), "corrupt safetensors header")
    file.write_bytes(struct.pack("<Q", 1 << 40) + pristine[8:])
    _refused(path, str(file), "header length")
    file.write_bytes(pristine)
    _edit_header(file, lambda h: (h.clear(), h.update({"a": 1})))
    _refused(path, str(file), "'a'", "not an object")

    def bad(field, value, name="model.layers.0.mlp.switch_mlp.down_proj.weight"):
        file.write_bytes(pristine)
        _edit_header(file, lambda h: h[name].__setitem__(field, value))
        return name

    name = bad("dtype", "Q4")
    _refused(path, name, str(file), "unknown dtype 'Q4'")
    name = bad("shape", [8, 64, -64])
    _refused(path, name, str(file), "shape")
    name = bad("shape", [8, 64, 63])
    _refused(path, name, str(file), "needs")
    name = bad("data_offsets", [0, 1 << 40])
    _refused(path, name, str(file))
    name = bad("data_offsets", "nope")
    _refused(path, name, str(file), "data_offsets")

    file.write_bytes(pristine)
    gate, up = (f"model.layers.0.mlp.switch_mlp.{p}_proj.weight" for p in ("gate", "up"))
    _edit_header(file, lambda h: h[up].__setitem__("data_offsets", h[gate]["data_offsets"]))
    _refused(path, str(file), "overlaps", "up_proj.weight", "gate_proj.weight")


def test_refuses_layouts_sanitize_would_transform(models, tmp_path):
    fused = _copy_model(models("gpt_oss"), tmp_path / "fused")

    def fuse(tensors):
        for layer in (0, 1):
            prefix = f"model.layers.{layer}.mlp.experts."
            gate, up = (
                tensors.pop(prefix + "gate_proj.weight"),
                tensors.pop(prefix + "up_proj.weight"),
            )
            tensors[prefix + "gate_up_proj"] = np.stack([gate, up], axis=-2).reshape(8, 128, 64)
            tensors[prefix + "gate_up_proj_bias"] = np.concatenate(
                [tensors.pop(prefix + "gate_proj.bias"), tensors.pop(prefix + "up_proj.bias")],
                axis=-1,
            )

    file = _edit_tensors(fused, fuse)
    _refused(fused, "model.layers.0.mlp.experts.gate_up_proj", str(file), "mlx_lm.convert")

    # qwen3_moe's sanitize stacks only `.weight`: per-expert scales would not load.
    qwen = _copy_model(models("qwen3_moe", True), tmp_path / "qwen")

    def unstack(tensors):
        for name in [n for n in tensors if ".switch_mlp." in n]:
            value = tensors.pop(name)
            for expert in range(8):
                tensors[name.replace(".switch_mlp.", f".experts.{expert}.")] = value[expert]

    file = _edit_tensors(qwen, unstack)
    _refused(qwen, ".experts.", str(file), "stacks per-expert ['weight'] tensors unchanged")

    fp8 = _copy_model(models("deepseek_v3", False, "per_expert"), tmp_path / "fp8")
    name = "model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv"
    file = _edit_tensors(fp8, lambda t: t.__setitem__(name, np.ones((1, 1), np.float32)))
    _refused(fp8, name, str(file), "weight_scale_inv")

    family = _copy_model(models("mixtral", False, "per_expert"), tmp_path / "family")
    _edit_config(family, model_type="minimax")
    _refused(family, "block_sparse_moe.experts.", str(family / "model.safetensors"), "minimax")

    extra = _copy_model(models("mixtral", False, "per_expert"), tmp_path / "extra")
    name = "model.layers.0.block_sparse_moe.experts.8.w1.weight"
    file = _edit_tensors(
        extra,
        lambda t: t.__setitem__(name, t["model.layers.0.block_sparse_moe.experts.0.w1.weight"].copy()),
    )
    _refused(extra, name, str(file), "out of range")


def test_refuses_other_checkpoint_problems(models, tmp_path):
    dense = _copy_model(models("qwen3_moe"), tmp_path / "dense")
    _edit_tensors(dense, lambda t: [t.pop(n) for n in list(t) if ".switch_mlp." in n])
    _edit_config(dense, model_type="llama")
    _refused(dense, "no routed-expert tensors", str(dense / "model.safetensors"))

    no_config = _copy_model(models("qwen3_moe"), tmp_path / "no_config")
    (no_config / "config.json").unlink()
    _refused(no_config, "config.json")

    no_weights = tmp_path / "empty"
    no_weights.mkdir()
    (no_weights / "config.json").write_text("{}")
    _refused(no_weights, "no *.safetensors")

    missing_shard = _copy_model(models("qwen3_moe", shards=3), tmp_path / "shards")
    (missing_shard / "model-00002-of-00003.safetensors").unlink()
    _refused(missing_shard, "model-00002-of-00003.safetensors", "missing")

    twice = _copy_model(models("qwen3_moe", index=False), tmp_path / "twice")
    (twice / "extra.safetensors").write_bytes((twice / "model.safetensors").read_bytes())
    _refused(twice, "extra.safetensors", "model.safetensors", "in both")

    no_top_k = _copy_model(models("mixtral"), tmp_path / "top_k")
    _edit_config(no_top_k, num_experts_per_tok=None)
    _refused(no_top_k, "top-k")

    mismatch = _copy_model(models("mixtral", True), tmp_path / "mismatch")
    config = json.loads((mismatch / "config.json").read_text())
    config["quantization"]["model.layers.1.block_sparse_moe.switch_mlp.down_proj"] = {"bits": 8}
    (mismatch / "config.json").write_text(json.dumps(config))
    _refused(mismatch, "model.layers.1.block_sparse_moe.switch_mlp.down_proj.weight", "bits=8")

    unquantized = _copy_model(models("mixtral", True), tmp_path / "unquantized")
    config = json.loads((unquantized / "config.json").read_text())
    config["quantization"]["model.layers.0.block_sparse_moe.switch_mlp.up_proj"] = False
    (unquantized / "config.json").write_text(json.dumps(config))
    _refused(unquantized, "model.layers.0.block_sparse_moe.switch_mlp.up_proj.weight", "is false")


@pytest.mark.parametrize(
    ("layer", "expert", "error", "fragment"),
    [
        (0, 0, ValueError, "layer 0"),  # deepseek's dense first layer
        (3, 0, ValueError, "layer 3"),
        (-1, 0, ValueError, "-1"),
        (1, 8, ValueError, "expert_id 8"),
        (1, -1, ValueError, "-1"),
        ("1", 0, TypeError, "'1'"),
        (1, True, TypeError, "True"),
        (1, 2.0, TypeError, "2.0"),
        (None, 0, TypeError, "None"),
    ],
)
def test_bad_arguments(models, layer, expert, error, fragment):
    store = ExpertStore.open(models("deepseek_v3"))
    for call in (store.locate, store.layout, store.scale_offset):
        with pytest.raises(error, match=fragment):
            call(layer, expert)
    if expert == 0:
        with pytest.raises(error, match=fragment):
            store.layer(layer)
    assert store.locate(np.int64(1), np.int32(7)).expert_id == 7


@pytest.mark.parametrize(
    ("block_size", "error"),
    [
        (3000, ValueError),
        (32768, ValueError),
        (0, ValueError),
        ("4096", TypeError),
        (4096.0, TypeError),
    ],
)
def test_bad_block_size(models, block_size, error):
    with pytest.raises(error, match=str(block_size)):
        ExpertStore.open(models("qwen3_moe"), block_size=block_size)


def test_not_a_directory(tmp_path):
    with pytest.raises(StoreError, match="not a model directory"):
        ExpertStore.open(tmp_path / "nope")


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 20_000), min_size=1, max_size=12),
    gaps=st.lists(st.sampled_from([0, 0, 1, 7, 4096, 5000]), min_size=12, max_size=12),
    files=st.lists(st.integers(0, 2), min_size=12, max_size=12),
    start=st.integers(0, 1 << 20),
    block_shift=st.integers(0, 14),
)
def test_plan_rules_hold_for_arbitrary_offsets(sizes, gaps, files, start, block_shift):
    """The placement rule on made-up tensors: congruence, no clobbering, exact tiling."""
    block = 1 << block_shift
    specs, sources, cursor = [], [], start
    for index, size in enumerate(sizes):
        specs.append(ExpertTensorSpec(f"t{index}.{'weight' if index % 3 else 'scales'}", "U8", (size,), size))
        sources.append(((files[index], cursor),))
        cursor += size + gaps[index]
    plan = _plan_expert(0, 0, tuple(specs), tuple(sources), block)
    segments = plan.location.segments
    assert sum(s.length for s in segments) == sum(sizes)
    windows = []
    for segment in segments:
        assert segment.destination % block == segment.offset % block
        residue = segment.offset % block
        windows.append((segment.destination - residue, align_up(segment.destination + segment.length, block)))
    assert plan.extent == max(end for _, end in windows)
    for index, (begin, end) in enumerate(windows):
        for other, segment in enumerate(segments):
            if other != index:
                assert end <= segment.destination or begin >= segment.destination + segment.length
    # Each tensor sits in its segment exactly where its file bytes are.
    for tensor, source in zip(plan.layout, (sources[int(t.name[1:].split(".")[0])] for t in plan.layout), strict=True):
        ((file, offset),) = source
        segment = next(s for s in segments if s.file == file and s.offset <= offset < s.offset + s.length)
        assert tensor.offset == segment.destination + offset - segment.offset
    # Contiguous tensors of one file are one read.
    assert len(segments) == len({(f, s) for f, s in _runs(sizes, gaps, files, start)})


def _runs(sizes, gaps, files, start):
    """(file, start offset) of each run of file-contiguous tensors."""
    runs, cursor, previous = [], start, None
    for index, size in enumerate(sizes):
        if previous is None or files[index] != previous[0] or cursor != previous[1]:
            runs.append((files[index], cursor))
        previous = (files[index], cursor + size)
        cursor += size + gaps[index]
    return runs
