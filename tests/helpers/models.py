"""Tiny deterministic random mlx-lm MoE models on disk, for tests.

Every model is built with mlx-lm's own classes, quantized with
`mlx_lm.utils.quantize_model` and saved with `mlx_lm.utils.save_model` /
`save_config`, so `mlx_lm.load` runs it unchanged and its generation is the
oracle for ours. `layout="per_expert"` rewrites the routed experts under their
one-tensor-per-expert Hugging Face names (what `sanitize` stacks on load).

The byte-level tokenizer (`EOS_TOKEN_ID`, `VOCAB_SIZE`, `write_tokenizer`) and
the seeded model construction (including random routers for families whose
router mlx-lm initialises to zeros) are shared with the demo model and live in
`shared/demo_model.py`; tests import those names from there.

- `FAMILIES`, `PER_EXPERT_FAMILIES`: the families built here, and those with a
  one-tensor-per-expert layout.
- `tiny_config(family, **overrides)`: a tiny model's config.json.
- `build_tiny_model(family, ...)`: the model in memory, cast and quantized.
- `write_tiny_model(path, family=..., ...)`: config, weights and tokenizer on disk.
- `unstack_experts(weights, family)`: stacked routed experts renamed one tensor per expert.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from shared.demo_model import EOS_TOKEN_ID, VOCAB_SIZE, build_model, write_tokenizer

FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss")
PER_EXPERT_FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3")

_COMMON = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "rms_norm_eps": 1e-6,
    # Long enough for the system tests' jobs that run until cancelled (max_tokens 100_000): the
    # front door refuses a prompt plus max_tokens beyond the context (coordinator/job_limits.py).
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "eos_token_id": EOS_TOKEN_ID,
    "bos_token_id": None,
    "torch_dtype": "float32",
}

# Expert intermediate sizes are 64 so mlx-lm's default group size (64)
# quantizes every expert projection, as in real checkpoints.
_CONFIGS = {
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "moe_intermediate_size": 64,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "rope_theta": 10000.0,
    },
    "mixtral": {
        "model_type": "mixtral",
        "architectures": ["MixtralForCausalLM"],
        "num_hidden_layers": 2,
        "intermediate_size": 64,
        "num_key_value_heads": 2,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "rope_theta": 1000000.0,
    },
    "deepseek_v3": {
        "model_type": "deepseek_v3",
        "architectures": ["DeepseekV3ForCausalLM"],
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "intermediate_size": 128,
        "moe_intermediate_size": 64,
        "num_key_value_heads": 4,
        "n_shared_experts": 1,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": 64,
        "q_lora_rank": 64,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "n_group": 1,
        "topk_group": 1,
        "rope_theta": 10000.0,
    },
    "gpt_oss": {
        "model_type": "gpt_oss",
        "architectures": ["GptOssForCausalLM"],
        "num_hidden_layers": 2,
        "intermediate_size": 64,
        "head_dim": 16,
        "num_key_value_heads": 2,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "experts_per_token": 2,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_theta": 150000,
        # transformers' GptOssConfig assumes YaRN x32 over 4096 positions and
        # warns when the tokenizer load reads a config that disagrees.
        "max_position_embeddings": 131072,
    },
}

# Hugging Face names of the stacked expert modules: (stacked module, per-expert
# module, mlx-lm projection -> HF projection).
_HF_NAMES = {
    "qwen3_moe": (
        "mlp.switch_mlp",
        "mlp.experts",
        {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"},
    ),
    "deepseek_v3": (
        "mlp.switch_mlp",
        "mlp.experts",
        {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"},
    ),
    "mixtral": (
        "block_sparse_moe.switch_mlp",
        "block_sparse_moe.experts",
        {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"},
    ),
}


def tiny_config(family: str, **overrides) -> dict:
    """The config.json of a tiny model of `family`, with `overrides` applied."""
    if family not in _CONFIGS:
        raise ValueError(f"unknown tiny model family {family!r}; choose from {FAMILIES}")
    config = {**copy.deepcopy(_COMMON), **copy.deepcopy(_CONFIGS[family]), **overrides}
    if family == "gpt_oss" and "layer_types" not in overrides:
        config["layer_types"] = ["sliding_attention", "full_attention"] * (config["num_hidden_layers"] // 2)
    return config


def build_tiny_model(
    family: str,
    *,
    quantized: bool = False,
    seed: int = 0,
    dtype: str = "float32",
    bits: int | None = None,
    group_size: int | None = None,
    mode: str = "affine",
    global_scale: bool = False,
    quant_predicate=None,
    **overrides,
):
    """(model, config) built, cast and quantized the way `mlx_lm.convert` does it.

    Seeds MLX's global random state with `seed` (the weights are its draws);
    routers mlx-lm initialises to zeros (deepseek_v3) get seeded random values
    so routing varies from token to token.

    bits/group_size default to the mode's (affine: 4 and 64); quant_predicate
    is `quantize_model`'s (path, module) -> bool | dict, for mixed precision;
    global_scale gives nvfp4 switch layers one tensor scale per expert.
    """
    from mlx_lm.utils import quantize_model

    config = tiny_config(family, torch_dtype=dtype, **overrides)
    model = build_model(config, seed=seed)
    if quantized:
        with contextlib.redirect_stdout(io.StringIO()):  # quantize_model prints bits per weight
            model, config = quantize_model(
                model,
                config,
                group_size,
                bits,
                mode=mode,
                global_scale=global_scale,
                quant_predicate=quant_predicate,
            )
    mx.eval(model.parameters())
    return model, config


def unstack_experts(weights: dict[str, mx.array], family: str) -> dict[str, mx.array]:
    """Rename stacked routed experts to one tensor per expert, Hugging Face style."""
    if family not in _HF_NAMES:
        raise ValueError(f"no one-tensor-per-expert layout for {family!r}; choose from {PER_EXPERT_FAMILIES}")
    stacked, per_expert, projections = _HF_NAMES[family]
    result = {}
    for name, value in weights.items():
        head, sep, tail = name.partition(f".{stacked}.")
        if not sep:
            result[name] = value
            continue
        projection, param = tail.split(".")
        if family == "qwen3_moe" and param != "weight":
            # mlx-lm's qwen3_moe sanitize stacks only `.weight`: such a checkpoint would not load.
            raise ValueError("mlx-lm cannot load a per-expert quantized qwen3_moe checkpoint")
        for expert in range(value.shape[0]):
            result[f"{head}.{per_expert}.{expert}.{projections[projection]}.{param}"] = value[expert]
    return result


def _write_shards(path: Path, weights: dict[str, mx.array], shards: int) -> None:
    """Write safetensors shards plus an index, tensors split in name order.

    numpy-convertible dtypes go through the `safetensors` package (the writer
    Hugging Face checkpoints come from); bfloat16 through MLX.
    """
    from safetensors.numpy import save_file

    names = sorted(weights)
    per_shard = math.ceil(len(names) / shards)
    weight_map = {}
    for index in range(shards):
        chunk = names[index * per_shard : (index + 1) * per_shard]
        file_name = "model.safetensors" if shards == 1 else f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: weights[name] for name in chunk}
        if any(value.dtype == mx.bfloat16 for value in part.values()):
            mx.save_safetensors(str(path / file_name), part, metadata={"format": "mlx"})
        else:
            save_file(
                {name: np.array(value) for name, value in part.items()},
                str(path / file_name),
                metadata={"format": "pt"},
            )
        weight_map.update(dict.fromkeys(chunk, file_name))
    total = sum(value.nbytes for value in weights.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=4)
    )


def write_tiny_model(
    path: str | Path,
    *,
    family: str,
    quantized: bool = False,
    layout: str = "stacked",
    seed: int = 0,
    dtype: str = "float32",
    shards: int = 1,
    index: bool = True,
    **overrides,
) -> Path:
    """Write a tiny random `family` model (config, weights, tokenizer) to `path`; returns it.

    layout: "stacked" (mlx-lm's own save) or "per_expert" (HF names, one tensor
    per expert). shards > 1 splits the weights over several files; index=False
    drops model.safetensors.index.json.
    """
    from mlx_lm.utils import save_config, save_model

    if layout not in ("stacked", "per_expert"):
        raise ValueError(f"layout must be 'stacked' or 'per_expert', got {layout!r}")
    if layout == "per_expert" and family not in PER_EXPERT_FAMILIES:
        raise ValueError(f"no one-tensor-per-expert layout for {family!r}; choose from {PER_EXPERT_FAMILIES}")
    shard_count = int(shards)
    if shard_count < 1:
        raise ValueError(f"shards must be >= 1, got {shards!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model, config = build_tiny_model(family, quantized=quantized, seed=seed, dtype=dtype, **overrides)
    if layout == "stacked" and shard_count == 1:
        save_model(path, model)
    else:
        weights = dict(tree_flatten(model.parameters()))
        if layout == "per_expert":
            weights = unstack_experts(weights, family)
        _write_shards(path, weights, shard_count)
    if not index:
        (path / "model.safetensors.index.json").unlink()
    save_config(config, config_path=path / "config.json")
    write_tokenizer(path)
    return path
