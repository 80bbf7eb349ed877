"""The demo model builder: sizing arithmetic, caching, mlx-lm compatibility, random routers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_sampler

from shared import demo_model
from shared.demo_model import (
    DEMO_MEMORY_BUDGET,
    FINGERPRINT_FILE,
    VOCAB_SIZE,
    build_model,
    demo_config,
    demo_sizes,
    ensure_demo_model,
    randomize_zero_routers,
    suggested_budget,
)
from shared.store import ExpertStore
from tests.helpers.models import build_tiny_model

REPO = Path(__file__).resolve().parents[1]
SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    num_hidden_layers=2,
)


def test_default_sizing_is_four_times_the_budget():
    sizes = demo_sizes(demo_config())
    assert sizes.expert_bytes == 4 * DEMO_MEMORY_BUDGET  # 2304 MiB of experts, 576 MiB budget
    assert suggested_budget(sizes) == DEMO_MEMORY_BUDGET
    assert (sizes.sparse_layers, sizes.experts_per_layer, sizes.top_k) == (8, 192, 4)
    # Dense part plus the mandatory slots (top-k working bank + one per layer) fit with room to spare.
    assert sizes.floor_bytes < DEMO_MEMORY_BUDGET // 2
    assert sizes.floor_bytes == sizes.dense_bytes + (4 + 8) * sizes.slot_bytes


def test_sizing_arithmetic_matches_mlx_lm_classes():
    # The model is constructed lazily: shapes only, no weight is evaluated.
    config = demo_config()
    params = dict(tree_flatten(build_model(config).parameters()))
    expert = sum(v.nbytes for k, v in params.items() if ".switch_mlp." in k)
    dense = sum(v.nbytes for k, v in params.items() if ".switch_mlp." not in k)
    sizes = demo_sizes(config)
    assert (dense, expert) == (sizes.dense_bytes, sizes.expert_bytes)
    assert all(v.dtype == mx.float32 for v in params.values())


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return ensure_demo_model(tmp_path_factory.mktemp("demo") / "model", **SMALL)


def test_small_build_loads_and_generates(small):
    assert small.built and small.seconds > 0
    model, tokenizer = mlx_lm.load(str(small.path))
    greedy = make_sampler(temp=0.0)
    tokens = [r.token for r in stream_generate(model, tokenizer, "hello", max_tokens=6, sampler=greedy)]
    assert tokens and all(0 <= t < VOCAB_SIZE for t in tokens)
    again = [r.token for r in stream_generate(model, tokenizer, "hello", max_tokens=6, sampler=greedy)]
    assert again == tokens
    text = mlx_lm.generate(model, tokenizer, "hello", max_tokens=4, sampler=greedy)
    assert isinstance(text, str)


def test_small_build_sizes_match_the_store(small):
    store = ExpertStore.open(small.path)
    assert (store.dense_bytes, store.expert_bytes) == (small.sizes.dense_bytes, small.sizes.expert_bytes)
    assert store.slot_bytes <= small.sizes.slot_bytes
    config = json.loads((small.path / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["torch_dtype"] == "float32"
    record = json.loads((small.path / FINGERPRINT_FILE).read_text())
    assert record["suggested_memory_budget"] == small.budget_bytes


def test_cached_unless_forced_or_changed(tmp_path):
    path = tmp_path / "model"
    first = ensure_demo_model(path, **SMALL)
    weights = path / "model.safetensors"
    stamp, content = (weights.stat().st_ino, weights.stat().st_mtime_ns), weights.read_bytes()
    again = ensure_demo_model(path, **SMALL)
    assert not again.built and (weights.stat().st_ino, weights.stat().st_mtime_ns) == stamp
    forced = ensure_demo_model(path, force=True, **SMALL)
    assert forced.built and (weights.stat().st_ino, weights.stat().st_mtime_ns) != stamp
    assert weights.read_bytes() == content  # same seed, same bytes
    other_seed = ensure_demo_model(path, seed=1, **SMALL)  # a changed fingerprint rebuilds
    assert other_seed.built and first.built and weights.read_bytes() != content
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no staging or retired dirs left


def test_same_seed_same_bytes(tmp_path):
    a = ensure_demo_model(tmp_path / "a", **SMALL).path / "model.safetensors"
    b = ensure_demo_model(tmp_path / "b", **SMALL).path / "model.safetensors"
    assert a.read_bytes() == b.read_bytes()


def test_never_replaces_a_foreign_directory(tmp_path):
    (tmp_path / "precious.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=FINGERPRINT_FILE):
        ensure_demo_model(tmp_path, force=True, **SMALL)
    assert (tmp_path / "precious.txt").read_text() == "mine"
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_demo_model.py"), "--out", str(tmp_path), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "choose another directory" in result.stderr


def test_failed_build_leaves_nothing(tmp_path, monkeypatch):
    def broken(path):
        raise RuntimeError("disk full")

    monkeypatch.setattr(demo_model, "write_tokenizer", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        ensure_demo_model(tmp_path / "model", **SMALL)
    assert list(tmp_path.iterdir()) == []


def test_zero_routers_are_randomized_so_routing_varies():
    model, _ = build_tiny_model("deepseek_v3", seed=0)
    gate = model.model.layers[1].mlp.gate
    assert mx.any(gate.weight != 0).item()
    assert not mx.any(gate.e_score_correction_bias != 0).item()  # a bias, left as mlx-lm makes it
    inds, _ = gate(mx.random.normal((1, 32, gate.weight.shape[1]), key=mx.random.key(5)))
    assert len({tuple(sorted(row)) for row in inds[0].tolist()}) > 4
    again, _ = build_tiny_model("deepseek_v3", seed=0)
    other, _ = build_tiny_model("deepseek_v3", seed=1)
    assert mx.array_equal(again.model.layers[1].mlp.gate.weight, gate.weight).item()
    assert not mx.array_equal(other.model.layers[1].mlp.gate.weight, gate.weight).item()


def test_random_routers_are_left_alone():
    model, _ = build_tiny_model("qwen3_moe", seed=0)
    assert randomize_zero_routers(model, seed=0) == []
