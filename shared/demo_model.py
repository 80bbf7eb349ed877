"""The demo model: a deterministic random qwen3_moe checkpoint whose experts outsize its budget.

Built with mlx-lm's own model classes and saved with `mlx_lm.utils.save_model`
/ `save_config`, so `mlx_lm.load` runs it unchanged and mlx-lm's generation is
the oracle for ours. fp32 on purpose: MLX's CPU kernels run bf16 several times
slower, and the demo must finish quickly on two cores.

Sizing (the default config): 8 sparse layers x 192 experts x (3 x 512 x 256)
fp32 = 2304 MiB of routed experts, exactly 4x `DEMO_MEMORY_BUDGET` (576 MiB).
The budget covers the whole system (coordinator/footprint.py): the processes
take ~250 MiB of it (Python and its libraries in five processes, MLX and the
~27 MiB dense part in the GPU worker), the KV reserve 64 MiB, room for MLX's
kernel compiler 128 MiB on the CPU backend (gpuworker/lanes.py), and the slab
the rest (~130 MiB: the top-k working bank, one slot per sparse layer, and
resident experts).

The byte-level tokenizer (one token per byte, then a few special tokens) is
built offline with `tokenizers`; `tests/helpers/models.py` shares it and
`build_model` from here.

`ensure_demo_model` caches: a directory holding a `moeslab-demo.json` whose
fingerprint (config, seed, builder version) matches is reused as it is.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map_with_path

from shared.checks import align_up

__all__ = [
    "DEMO_CONFIG",
    "DEMO_MEMORY_BUDGET",
    "EOS_TOKEN_ID",
    "FINGERPRINT_FILE",
    "SPECIAL_TOKENS",
    "VOCAB_SIZE",
    "DemoModel",
    "DemoSizes",
    "build_model",
    "default_demo_dir",
    "demo_config",
    "demo_sizes",
    "ensure_demo_model",
    "randomize_zero_routers",
    "suggested_budget",
    "write_tokenizer",
]

logger = logging.getLogger(__name__)

MiB = 1 << 20
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")
EOS_TOKEN_ID = 256  # bytes take ids 0..255, the special tokens follow
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

DEMO_MEMORY_BUDGET = 576 * MiB
"""The `--memory-budget` the demo runs with: a quarter of the demo model's routed experts."""

FINGERPRINT_FILE = "moeslab-demo.json"
# Bump when the builder's output changes for the same config and seed.
BUILDER_VERSION = 1

DEMO_CONFIG: dict[str, Any] = {
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "intermediate_size": 1024,  # dense MLP size; unused, every layer is sparse
    "moe_intermediate_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_experts": 192,
    "num_experts_per_tok": 4,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "eos_token_id": EOS_TOKEN_ID,
    "bos_token_id": None,
    "torch_dtype": "float32",
}

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_ROUTER_SUFFIXES = (".gate.weight", ".router.weight")  # never gate_proj / shared_expert_gate


# ------------------------------------------------------------ tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet of byte-level BPE."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


def write_tokenizer(path: str | Path) -> None:
    """A byte-level tokenizer (one token per byte, then the special tokens), built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    path = Path(path)
    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.save(str(path / "tokenizer.json"))
    template = (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
        "{{ message['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": SPECIAL_TOKENS[0],
                "pad_token": SPECIAL_TOKENS[3],
                "bos_token": None,
                "add_bos_token": False,
                "model_max_length": 2048,
                "clean_up_tokenization_spaces": False,
                "chat_template": template,
            },
            indent=2,
        )
    )


# ---------------------------------------------------------------- model


def randomize_zero_routers(model: Any, *, seed: int) -> list[str]:
    """Give every all-zero router weight seeded uniform values; returns their paths.

    Some mlx-lm families (deepseek_v3, glm4_moe, dots1, ...) initialise the
    router to zeros, so an untrained model routes every token to the same
    experts and residency has nothing to do. Draws use their own key derived
    from `seed` (not the global state), so models whose routers are already
    random come out bit-identical.
    """
    zero = [
        (name, value)
        for name, value in tree_flatten(model.parameters())
        if name.endswith(_ROUTER_SUFFIXES) and value.ndim == 2 and not mx.any(value != 0).item()
    ]
    if not zero:
        return []
    # Branch 1 of key(seed): branch 0 would repeat the first draws of model init.
    keys = mx.random.split(mx.random.split(mx.random.key(seed))[1], len(zero))
    updates = {}
    for key, (name, value) in zip(keys, zero, strict=True):
        scale = value.shape[1] ** -0.5  # nn.Linear's init range
        updates[name] = mx.random.uniform(-scale, scale, value.shape, mx.float32, key=key).astype(value.dtype)
    model.update(tree_map_with_path(lambda path, value: updates.get(path, value), model.parameters()))
    logger.debug("randomized %d zero-initialised router weights", len(updates))
    return sorted(updates)


def build_model(config: dict, *, seed: int = 0) -> Any:
    """An mlx-lm model of `config` with seeded random weights, cast to its torch_dtype.

    Seeds MLX's global random state with `seed` (the weights are its draws),
    randomizes zero-initialised routers, and casts the way `mlx_lm.convert`
    does (its `cast_predicate` skips e.g. deepseek's e_score_correction_bias).
    Nothing is evaluated here.
    """
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    randomize_zero_routers(model, seed=seed)
    cast = getattr(model, "cast_predicate", lambda _: True)
    target = getattr(mx, config.get("torch_dtype", "float32"))
    model.update(
        tree_map_with_path(
            lambda key, value: value.astype(target) if cast(key) and mx.issubdtype(value.dtype, mx.floating) else value,
            model.parameters(),
        )
    )
    return model


# --------------------------------------------------------------- sizing


@dataclass(frozen=True, slots=True)
class DemoSizes:
    """Byte figures of a qwen3_moe config, from arithmetic alone (nothing is built)."""

    dense_bytes: int  # every tensor that is not a routed expert (embeddings, attention, routers, norms)
    expert_bytes: int  # all routed experts of all sparse layers
    one_expert_bytes: int  # gate + up + down of one expert
    slot_bytes: int  # upper bound of the store's slot: each read window may grow by one block, 16 KiB aligned
    sparse_layers: int
    experts_per_layer: int
    top_k: int
    floor_bytes: int  # dense + (top_k working slots + one slot per sparse layer): the least budget that starts


def demo_sizes(config: dict, *, block_size: int = 4096) -> DemoSizes:
    """Dense and expert bytes of a qwen3_moe `config` (the demo's family)."""
    if config.get("model_type") != "qwen3_moe":
        raise ValueError(f"demo_sizes knows qwen3_moe only, got {config.get('model_type')!r}")
    width = _DTYPE_BYTES[config.get("torch_dtype", "float32")]
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    experts, moe_inter = config["num_experts"], config["moe_intermediate_size"]
    layers = config["num_hidden_layers"]
    step, dense_only = config["decoder_sparse_step"], set(config["mlp_only_layers"])
    sparse = [i for i in range(layers) if i not in dense_only and experts > 0 and (i + 1) % step == 0]

    attention = hidden * head_dim * (2 * heads + 2 * kv_heads) + 2 * head_dim  # q, k, v, o; q/k norms
    per_layer = attention + 2 * hidden  # input and post-attention norms
    dense = vocab * hidden * (1 if config["tie_word_embeddings"] else 2) + hidden  # embed, lm_head, norm
    dense += layers * per_layer + len(sparse) * experts * hidden  # routers
    dense += (layers - len(sparse)) * 3 * hidden * config["intermediate_size"]  # dense MLP layers
    one_tensor = moe_inter * hidden * width
    one_expert = 3 * one_tensor
    slot = align_up(3 * align_up(one_tensor + block_size - 1, block_size), 16 * 1024)
    top_k = config["num_experts_per_tok"]
    return DemoSizes(
        dense_bytes=dense * width,
        expert_bytes=len(sparse) * experts * one_expert,
        one_expert_bytes=one_expert,
        slot_bytes=slot,
        sparse_layers=len(sparse),
        experts_per_layer=experts,
        top_k=top_k,
        floor_bytes=dense * width + (top_k + len(sparse)) * slot,
    )


def suggested_budget(sizes: DemoSizes) -> int:
    """A quarter of the experts, rounded up to a MiB, never below what the slab needs to start."""
    quarter = align_up(sizes.expert_bytes // 4, MiB)
    return max(quarter, align_up(sizes.floor_bytes, MiB))


def demo_config(**overrides: Any) -> dict:
    """The demo config.json with `overrides` (e.g. a small variant for tests) applied."""
    return json.loads(json.dumps({**DEMO_CONFIG, **overrides}))  # a deep copy


# -------------------------------------------------------------- on disk


def default_demo_dir() -> Path:
    """`<repo>/.cache/demo-model` (the repo's .gitignore ignores /.cache/)."""
    return Path(__file__).resolve().parents[1] / ".cache" / "demo-model"


@dataclass(frozen=True, slots=True)
class DemoModel:
    path: Path
    built: bool  # False: a cached directory with a matching fingerprint was reused
    seconds: float  # build time (0 when reused)
    config: dict
    sizes: DemoSizes
    budget_bytes: int  # the suggested --memory-budget


def _fingerprint(config: dict, seed: int) -> str:
    blob = json.dumps({"builder": BUILDER_VERSION, "seed": seed, "config": config}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _read_fingerprint(path: Path) -> str | None:
    try:
        record = json.loads((path / FINGERPRINT_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record.get("fingerprint") if isinstance(record, dict) else None


def _check_replaceable(path: Path) -> None:
    """Only an absent or empty directory, or one this builder wrote, may be replaced."""
    if not path.exists():
        return
    if not path.is_dir():
        raise FileExistsError(f"{path} exists and is not a directory")
    if any(path.iterdir()) and not (path / FINGERPRINT_FILE).is_file():
        # Never delete a directory we did not write, even with force.
        raise FileExistsError(f"{path} is not empty and holds no {FINGERPRINT_FILE}; choose another directory")


def _write(path: Path, config: dict, seed: int) -> None:
    from mlx_lm.utils import save_config, save_model

    model = build_model(config, seed=seed)
    mx.eval(model.parameters())
    save_model(path, model)
    del model
    save_config(config, config_path=path / "config.json")
    write_tokenizer(path)


def ensure_demo_model(
    out: str | os.PathLike[str] | None = None,
    *,
    force: bool = False,
    seed: int = 0,
    **overrides: Any,
) -> DemoModel:
    """Write the demo model to `out` (default `default_demo_dir()`) unless it is already there.

    `overrides` change the config (tests build a small variant). The model is
    written to a sibling temporary directory and renamed into place, so an
    interrupted build never leaves a directory that looks cached.
    """
    path = Path(out) if out is not None else default_demo_dir()
    config = demo_config(**overrides)
    sizes = demo_sizes(config)
    budget = suggested_budget(sizes)
    fingerprint = _fingerprint(config, seed)
    if not force and _read_fingerprint(path) == fingerprint:
        logger.info("demo model %s is cached (fingerprint %s)", path, fingerprint[:12])
        return DemoModel(path, False, 0.0, config, sizes, budget)
    _check_replaceable(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.building-", dir=path.parent))
    try:
        staging.chmod(0o755)  # mkdtemp's 0700 would hide the model from other users
        _write(staging, config, seed)
        record = {
            "fingerprint": fingerprint,
            "builder": BUILDER_VERSION,
            "seed": seed,
            "sizes": asdict(sizes),
            "suggested_memory_budget": budget,
        }
        # Written last: its presence marks a complete build.
        (staging / FINGERPRINT_FILE).write_text(json.dumps(record, indent=2) + "\n")
        if path.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
            path.rename(retired / "model")
            staging.rename(path)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            staging.rename(path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    seconds = time.perf_counter() - started
    logger.info("demo model written to %s in %.1f s", path, seconds)
    return DemoModel(path, True, seconds, config, sizes, budget)
