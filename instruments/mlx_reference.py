"""mlx-lm's own generation, the reference the system is compared with, and the benchmark's prompt.

`MlxLm` loads the whole model with `mlx_lm.utils.load_model` (every parameter in memory) and
generates with mlx-lm's `generate_step`, sampling as the GPU worker does, so equal logits give
equal tokens: its tokens are what every system job must emit (`until_eos`), its decode tok/s
the figure the system is measured against.
"""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx

from instruments.figures import median
from shared.demo_model import EOS_TOKEN_ID

PROMPT_TEXT = b"The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun. "


def prompt_tokens(count: int) -> list[int]:
    """`count` byte tokens of an English sentence (repeated as needed)."""
    text = PROMPT_TEXT * (count // len(PROMPT_TEXT) + 1)
    return list(text[:count])


def until_eos(tokens: Sequence[int]) -> list[int]:
    """What the system emits of mlx-lm's tokens: it stops at EOS and does not emit it."""
    out = []
    for token in tokens:
        if token == EOS_TOKEN_ID:
            break
        out.append(int(token))
    return out


class MlxLm:
    """mlx-lm's own model (`mlx_lm.utils.load_model`, every parameter evaluated) and generation."""

    def __init__(self, model_dir: Path) -> None:
        from mlx_lm.utils import load_model

        started = time.perf_counter()
        self.model, _ = load_model(model_dir)
        self.load_s = time.perf_counter() - started

    def run(self, prompt: list[int], tokens: int, *, temperature: float, seed: int) -> dict[str, Any]:
        """One `generate_step` generation, sampled as the GPU worker samples (`mx.random.seed(seed)`,
        `make_sampler(temperature)`; greedy at 0), so equal logits give equal tokens."""
        from mlx_lm.generate import generate_step
        from mlx_lm.sample_utils import make_sampler

        out, stamps = [], []
        mx.random.seed(seed)
        sampler = make_sampler(temperature)
        begin = time.perf_counter()
        for token, _lp in generate_step(mx.array(prompt), self.model, max_tokens=tokens, sampler=sampler):
            stamps.append(time.perf_counter())
            out.append(int(token))
        decode_s = stamps[-1] - stamps[0]
        return {
            "tokens": out,
            "prefill_s": stamps[0] - begin,
            "decode_s": decode_s,
            "decode_tok_s": (len(out) - 1) / decode_s if decode_s > 0 else 0.0,
        }

    def moe_layer_ms(self, samples: int = 10) -> float:
        """One layer's MoE block (SwitchGLU) alone on one token with random top-k experts."""
        from mlx.utils import tree_flatten
        from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

        switch = next(m for _, m in self.model.named_modules() if isinstance(m, (SwitchGLU, SwitchMLP)))
        experts = tree_flatten(switch.parameters())[0][1].shape[0]
        args = self.model.args
        rng = random.Random(1)
        x = mx.random.normal((1, 1, args.hidden_size), key=mx.random.key(1))
        times = []
        for i in range(samples + 2):
            idx = mx.array([[rng.sample(range(experts), args.num_experts_per_tok)]], dtype=mx.uint32)
            mx.eval(x, idx)
            started = time.perf_counter()
            mx.eval(switch(x, idx))
            if i >= 2:
                times.append(time.perf_counter() - started)
        return median(times) * 1e3

    def close(self) -> None:
        self.model = None
        gc.collect()
        mx.clear_cache()
