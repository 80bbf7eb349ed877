"""The benchmark model: a qwen3_moe config, built once with mlx-lm's own classes and cached by fingerprint.

The decode benchmark needs a model of real expert shapes (Qwen3-30B-A3B's by default) without
downloading one: `ensure_bench_model` builds it from seeded random weights (`shared.demo_model`),
scales its residual branches so routing follows the token as in a trained model, quantizes and
saves it with mlx-lm's functions, and keeps it under `<repo>/.cache/bench-model-<fingerprint>`
so later runs reuse it.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import io
import json
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from shared.demo_model import EOS_TOKEN_ID, VOCAB_SIZE, build_model, write_tokenizer

REPO = Path(__file__).resolve().parents[1]
FINGERPRINT_FILE = "moeslab-bench.json"
BUILDER_VERSION = 2


def bench_config(
    *,
    layers: int,
    experts: int,
    hidden: int,
    moe_intermediate: int,
    top_k: int,
    scale_dtype: str,
    heads: int | None = None,
    kv_heads: int | None = None,
) -> dict:
    """A qwen3_moe config.json (Qwen3-30B-A3B's shapes at the defaults: hidden 2048, 32 heads of
    128, 4 KV heads, 128 experts of 768, top-8). The byte tokenizer keeps the vocabulary at 260."""
    head_dim = 128 if hidden >= 1024 else 16
    heads = heads or max(1, 2 * hidden // head_dim if hidden >= 1024 else hidden // head_dim)
    kv_heads = kv_heads or max(1, min(4, heads))
    return {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": VOCAB_SIZE,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": 3 * hidden,  # dense MLP size; unused, every layer is sparse
        "moe_intermediate_size": moe_intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "eos_token_id": EOS_TOKEN_ID,
        "bos_token_id": None,
        "torch_dtype": scale_dtype,
    }


def _fingerprint(config: dict, bits: int, group_size: int, seed: int, residual_scale: float) -> str:
    blob = json.dumps(
        {
            "builder": BUILDER_VERSION,
            "config": config,
            "bits": bits,
            "group_size": group_size,
            "seed": seed,
            "residual_scale": residual_scale,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def _cached(path: Path, fingerprint: str) -> bool:
    try:
        return json.loads((path / FINGERPRINT_FILE).read_text()).get("fingerprint") == fingerprint
    except (OSError, ValueError, AttributeError):
        return False


RESIDUAL_BRANCHES = (".self_attn.o_proj.weight", ".switch_mlp.down_proj.weight", ".mlp.down_proj.weight")


def default_residual_scale(hidden: int) -> float:
    return 1.0 / math.sqrt(hidden)


def scale_residual_branches(model: Any, scale: float) -> int:
    """Multiply the weights that write into the residual stream (attention out, expert down) by `scale`.

    With mlx-lm's uniform init every attention and MoE output is ~15x the norm of a token's
    embedding at hidden 2048; the residual stream then carries mostly a context average that
    changes little from token to token, and every layer past the first routes 32 tokens to 15-36
    of 128 experts (a quarter of the experts hits 85-95%). Scaled like GPT-2's residual init, the
    token still drives the routing, as in a trained model (~100 of 128 experts over 32 tokens; an
    LRU of a quarter of them hits ~25-30%). Lazy; returns how many tensors were scaled.
    """
    from mlx.utils import tree_flatten, tree_map_with_path

    names = {name for name, _ in tree_flatten(model.parameters()) if name.endswith(RESIDUAL_BRANCHES)}
    model.update(tree_map_with_path(lambda path, value: value * scale if path in names else value, model.parameters()))
    return len(names)


def ensure_bench_model(
    config: dict,
    *,
    bits: int,
    group_size: int = 64,
    seed: int = 0,
    residual_scale: float | None = None,
    cache_dir: Path | None = None,
) -> tuple[Path, bool, float]:
    """The model directory for `config` quantized to `bits` (built unless cached); (path, built, seconds).

    mlx-lm's classes (`shared.demo_model.build_model`: seeded weights, random routers, cast to
    torch_dtype), residual branches scaled (`scale_residual_branches`; default 1/sqrt(hidden)),
    `mlx_lm.utils.quantize_model` (affine, `group_size`) and `save_model`. Built in a sibling
    temporary directory, evaluated one decoder layer at a time (the fp32 draws of one layer's
    experts are the peak), then renamed into place.
    """
    from mlx_lm.utils import quantize_model, save_config, save_model

    if residual_scale is None:
        residual_scale = default_residual_scale(config["hidden_size"])
    fingerprint = _fingerprint(config, bits, group_size, seed, residual_scale)
    root = cache_dir or REPO / ".cache"
    path = root / f"bench-model-{fingerprint[:12]}"
    if _cached(path, fingerprint):
        return path, False, 0.0
    root.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.building-", dir=root))
    try:
        staging.chmod(0o755)
        model = build_model(config, seed=seed)
        scale_residual_branches(model, residual_scale)
        with contextlib.redirect_stdout(io.StringIO()):  # quantize_model prints bits per weight
            model, quantized = quantize_model(model, config, group_size, bits)
        for layer in model.layers:  # one layer's draws at a time
            mx.eval(layer.parameters())
        mx.eval(model.parameters())
        save_model(staging, model)
        del model
        gc.collect()
        mx.clear_cache()
        save_config(quantized, config_path=staging / "config.json")
        write_tokenizer(staging)
        record = {
            "fingerprint": fingerprint,
            "builder": BUILDER_VERSION,
            "bits": bits,
            "group_size": group_size,
            "seed": seed,
            "residual_scale": residual_scale,
            "config": config,
        }
        (staging / FINGERPRINT_FILE).write_text(json.dumps(record, indent=2) + "\n")  # last: marks it complete
        if path.exists():
            shutil.rmtree(path)
        staging.rename(path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return path, True, time.perf_counter() - started


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark model's flags (scripts/bench_generate.py and scripts/bench_serve.py share them)."""
    shape = parser.add_argument_group("benchmark model (built once and cached)")
    shape.add_argument("--layers", type=int, default=8)
    shape.add_argument("--experts", type=int, default=128)
    shape.add_argument("--hidden", type=int, default=2048)
    shape.add_argument("--moe-intermediate", type=int, default=768)
    shape.add_argument("--top-k", type=int, default=8)
    shape.add_argument("--bits", type=int, default=4)
    shape.add_argument("--group-size", type=int, default=64)
    shape.add_argument(
        "--scale-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype of the quantization scales/biases and every unquantized float",
    )
    shape.add_argument("--seed", type=int, default=0, help="weights seed")
    shape.add_argument(
        "--residual-scale",
        type=float,
        default=None,
        help="factor on attention-out and expert-down weights (default 1/sqrt(hidden)); see scale_residual_branches",
    )
    shape.add_argument(
        "--cache-dir", type=Path, default=None, help="where built models are cached (default <repo>/.cache)"
    )
    shape.add_argument("--model", type=Path, default=None, help="use this model directory instead")


def model_from_arguments(args: argparse.Namespace) -> tuple[Path, bool, float]:
    """(directory, built now, seconds) of the model `add_model_arguments`' flags name."""
    if args.model is not None:
        return args.model.resolve(), False, 0.0
    config = bench_config(
        layers=args.layers,
        experts=args.experts,
        hidden=args.hidden,
        moe_intermediate=args.moe_intermediate,
        top_k=args.top_k,
        scale_dtype=args.scale_dtype,
    )
    return ensure_bench_model(
        config,
        bits=args.bits,
        group_size=args.group_size,
        seed=args.seed,
        residual_scale=args.residual_scale,
        cache_dir=args.cache_dir,
    )
