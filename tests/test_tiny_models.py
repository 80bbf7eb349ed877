"""The tiny test models load and generate under mlx-lm unchanged, deterministically."""

from __future__ import annotations

import json

import mlx_lm
import pytest
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_sampler

from shared.demo_model import EOS_TOKEN_ID, VOCAB_SIZE
from tests.helpers.models import FAMILIES, PER_EXPERT_FAMILIES, write_tiny_model


def _tokens(path, prompt: str = "hello, world", count: int = 12) -> list[int]:
    model, tokenizer = mlx_lm.load(str(path))
    greedy = make_sampler(temp=0.0)
    return [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=count, sampler=greedy)]


@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "q4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_mlx_lm_loads_and_generates(tmp_path, family, quantized):
    path = write_tiny_model(tmp_path, family=family, quantized=quantized)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == family and config["vocab_size"] == VOCAB_SIZE
    assert ("quantization" in config) == quantized
    if quantized:
        assert (config["quantization"]["bits"], config["quantization"]["group_size"]) == (4, 64)
    tokens = _tokens(path)
    assert tokens and all(0 <= token < VOCAB_SIZE for token in tokens)


@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "q4"])
@pytest.mark.parametrize("family", PER_EXPERT_FAMILIES)
def test_per_expert_layout_is_the_same_model(tmp_path, family, quantized):
    if family == "qwen3_moe" and quantized:
        with pytest.raises(ValueError, match="qwen3_moe"):
            write_tiny_model(tmp_path / "hf", family=family, quantized=True, layout="per_expert")
        return
    stacked = write_tiny_model(tmp_path / "stacked", family=family, quantized=quantized, seed=3)
    hf = write_tiny_model(tmp_path / "hf", family=family, quantized=quantized, seed=3, layout="per_expert", shards=2)
    assert any(
        ".experts.0." in name for name in json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"]
    )
    assert _tokens(stacked) == _tokens(hf)


def test_seeded_and_deterministic(tmp_path):
    first = write_tiny_model(tmp_path / "a", family="mixtral", seed=1)
    second = write_tiny_model(tmp_path / "b", family="mixtral", seed=1)
    other = write_tiny_model(tmp_path / "c", family="mixtral", seed=2)
    weights = (first / "model.safetensors").read_bytes()
    assert weights == (second / "model.safetensors").read_bytes()
    assert weights != (other / "model.safetensors").read_bytes()


def test_overrides_and_tokenizer(tmp_path):
    path = write_tiny_model(tmp_path, family="qwen3_moe", num_hidden_layers=4, num_experts=16, dtype="float16")
    config = json.loads((path / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_experts"], config["torch_dtype"]) == (
        4,
        16,
        "float16",
    )
    _, tokenizer = mlx_lm.load(str(path))
    text = "héllo ✓ <|im_end|>"
    ids = tokenizer.encode(text)
    assert ids[-1] == 258 and all(i < 256 for i in ids[:-1])
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token_id == EOS_TOKEN_ID
    assert EOS_TOKEN_ID in tokenizer.eos_token_ids


def test_bad_requests(tmp_path):
    with pytest.raises(ValueError, match="llama"):
        write_tiny_model(tmp_path, family="llama")
    with pytest.raises(ValueError, match="gpt_oss"):
        write_tiny_model(tmp_path, family="gpt_oss", layout="per_expert")
    with pytest.raises(ValueError, match="layout"):
        write_tiny_model(tmp_path, family="mixtral", layout="fused")
