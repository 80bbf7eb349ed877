"""Helpers for tests that run the whole system (coordinator, I/O workers, GPU worker).

- `io_mode_for(path)`: "buffered" where the files live on tmpfs (no O_DIRECT), else "direct".
- `tight_budget(store, kv_reserve)`: the smallest budget the plan accepts with a working bank
  of top_k and one resident slot per sparse layer, so every token misses and evicts.
- `oracle(model_dir, prompt, n)`: mlx-lm's greedy `generate_step` on the fully loaded model.
- `run_job(system, ...)`: one job through the real client; its token events and `Done`.
- `relative_difference(a, b)`: max |a - b| / max |a| (the streamed-model tests' measure).
- `hook_counts(records)`: the coordinator's "test hooks after job" log line, parsed.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.client import Client, token_logprobs
from shared.job_messages import Done, TokenEvent
from shared.store import ExpertStore
from supervisor.system import RunningSystem

PROMPT = tuple(b"The quick brown fox jumps over the lazy dog, again and again.")
TEST_KV_RESERVE = 1 << 20


def _mount_type(path: str | os.PathLike[str]) -> str:
    """The filesystem type of the mount holding `path` (longest matching mount point)."""
    target = os.path.realpath(path)
    best, kind = "", "unknown"
    try:
        with open("/proc/self/mounts", encoding="utf-8") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                if (target == point or target.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
                    best, kind = point, fields[2]
    except OSError:
        pass
    return kind


def io_mode_for(path: str | os.PathLike[str]) -> str:
    """tmpfs refuses O_DIRECT: read buffered there, cache-bypassing everywhere else."""
    return "buffered" if _mount_type(path) in ("tmpfs", "ramfs") else "direct"


def tight_budget(store: ExpertStore, kv_reserve: int = TEST_KV_RESERVE) -> int:
    """dense + KV reserve + (top_k working + one per sparse layer) slots: the plan's floor."""
    return store.dense_bytes + kv_reserve + (store.top_k + len(store.sparse_layers)) * store.slot_bytes


@dataclass(frozen=True, slots=True)
class Oracle:
    tokens: list[int]
    logprobs: list[np.ndarray]


def oracle(model_dir: str | os.PathLike[str], prompt: Sequence[int], max_tokens: int) -> Oracle:
    """Greedy tokens and per-step log-probabilities of mlx-lm on the fully loaded model."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(model_dir))
    tokens, logprobs = [], []
    for token, lp in generate_step(mx.array(list(prompt)), model, max_tokens=max_tokens):
        tokens.append(int(token))
        logprobs.append(np.array(lp.astype(mx.float32)))
    return Oracle(tokens, logprobs)


@dataclass(frozen=True, slots=True)
class JobResult:
    events: list[TokenEvent]
    done: Done

    @property
    def tokens(self) -> list[int]:
        return [event.token for event in self.events]

    @property
    def logprobs(self) -> list[np.ndarray]:
        return [token_logprobs(event) for event in self.events]


def run_job(
    system: RunningSystem,
    *,
    prompt_tokens: Sequence[int] = PROMPT,
    max_tokens: int = 32,
    return_logprobs: bool = True,
    timeout: float = 120.0,
) -> JobResult:
    with Client(system.endpoint, timeout=timeout) as client:
        events: list[TokenEvent] = []
        done: Done | None = None
        for event in client.generate(
            prompt_tokens=list(prompt_tokens), max_tokens=max_tokens, return_logprobs=return_logprobs
        ):
            if isinstance(event, TokenEvent):
                events.append(event)
            else:
                done = event
    assert done is not None
    return JobResult(events, done)


def relative_difference(want: np.ndarray, got: np.ndarray) -> float:
    want, got = np.asarray(want, dtype=np.float64), np.asarray(got, dtype=np.float64)
    return float(np.abs(want - got).max() / max(np.abs(want).max(), 1e-30))


_HOOKS = re.compile(r"test hooks after job (\d+): (\d+) scribbled, (\d+) restored, (\d+) verified, (\d+) violations")


def hook_counts(records: Iterable[logging.LogRecord]) -> dict[str, int] | None:
    """The last 'test hooks after job' line the coordinator logged (its stderr is forwarded)."""
    found = None
    for record in records:
        match = _HOOKS.search(record.getMessage())
        if match:
            job, scribbled, restored, verified, violations = (int(group) for group in match.groups())
            found = dict(job=job, scribbled=scribbled, restored=restored, verified=verified, violations=violations)
    return found


def wait_for(predicate, *, timeout: float = 5.0, interval: float = 0.05):
    """Poll `predicate` until it returns something truthy (returned) or `timeout` passes (None)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


__all__ = [
    "PROMPT",
    "TEST_KV_RESERVE",
    "JobResult",
    "Oracle",
    "hook_counts",
    "io_mode_for",
    "oracle",
    "relative_difference",
    "run_job",
    "tight_budget",
    "wait_for",
]
