"""The whole system (coordinator, I/O workers, GPU worker) started in process, and its jobs.

Every test that runs a system starts it here, with the tests' defaults, so the budgets and
modes they reason about are the same everywhere.

- `PROMPT`, `TEST_KV_RESERVE`: the jobs' prompt (byte tokens) and the KV reserve of every plan.
- `io_mode_for(path)`: "buffered" where the files live on tmpfs (no O_DIRECT), else "direct".
- `tight_budget(store, kv_reserve)`: the smallest budget the plan accepts with a working bank
  of top_k and one resident slot per sparse layer, so every token misses and evicts.
- `all_resident_budget(store, kv_reserve)`: a working bank of top_k and every expert resident.
- `PROCESS_ALLOWANCE`, `with_processes(store, budget)`: the budget covers the whole system
  (coordinator/footprint.py), so a test that reasons about a plan (dense + KV reserve + slots)
  gives the processes this much more, with the plan's slots per layer as a cap so the plan stays
  the one it reasons about.
- `start_test_system(model_dir, *, budget="all_resident", **options)`: `supervisor.system.start_system`
  with those defaults (a named budget gets the process allowance); any option (`run_config` for the
  coordinator's knobs) overrides them; an explicit `memory_budget` is taken as it is.
- `run_job(system, ...)`: one job through the real client; its token events and `Done`.
- `hook_counts(records)`: the coordinator's "test hooks after job" log line, parsed.
- `wait_for(predicate)`: poll until something is true, or time runs out.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from instruments.disk import resolve_io_mode
from shared.client import Client, token_logprobs
from shared.job_messages import Done, TokenEvent
from shared.store import ExpertStore
from supervisor.budget import PROCESS_ALLOWANCE_BYTES, plan_budget
from supervisor.system import RunningSystem, start_system

PROMPT = tuple(b"The quick brown fox jumps over the lazy dog, again and again.")
TEST_KV_RESERVE = 1 << 20


def io_mode_for(path: str | os.PathLike[str]) -> str:
    """tmpfs refuses O_DIRECT: read buffered there, cache-bypassing everywhere else."""
    return resolve_io_mode("auto", path)


def tight_budget(store: ExpertStore, kv_reserve: int = TEST_KV_RESERVE) -> int:
    """dense + KV reserve + (top_k working + one per sparse layer) slots: the plan's floor."""
    return store.dense_bytes + kv_reserve + (store.top_k + len(store.sparse_layers)) * store.slot_bytes


def all_resident_budget(store: ExpertStore, kv_reserve: int = TEST_KV_RESERVE) -> int:
    """dense + KV reserve + (top_k working + every expert of every sparse layer) slots."""
    slots = store.top_k + len(store.sparse_layers) * store.experts_per_layer
    return store.dense_bytes + kv_reserve + slots * store.slot_bytes


BUDGETS = {"all_resident": all_resident_budget, "tight": tight_budget}
# What the system's processes may use beyond a plan's dense + KV + slab bytes (in-process systems:
# coordinator, I/O workers, GPU worker ~200 MiB; launched ones add the supervisor ~30 MiB).
PROCESS_ALLOWANCE = PROCESS_ALLOWANCE_BYTES


def with_processes(
    store: ExpertStore,
    budget: int,
    *,
    working_slots: int | None = None,
    pinned: int = 0,
    kv_reserve: int = TEST_KV_RESERVE,
) -> dict[str, int]:
    """`start_system` options for the plan `budget` would give on its own, with room for the processes."""
    plan = plan_budget(
        store,
        memory_budget=budget,
        kv_reserve_bytes=kv_reserve,
        working_slots=store.top_k if working_slots is None else working_slots,
        pinned=pinned,
    )
    return dict(memory_budget=budget + PROCESS_ALLOWANCE, slots_per_layer=plan.slots_per_layer)


def start_test_system(model_dir: str | os.PathLike[str], *, budget: str = "all_resident", **options) -> RunningSystem:
    """A started system over the model at `model_dir`: a working bank of top_k, the 1 MiB test KV
    reserve, the I/O mode its filesystem allows and the `budget` named in `BUDGETS`; `options`
    (any `start_system` argument: `memory_budget`, `test_hooks`, `run_config`, ...) override them."""
    store = ExpertStore.open(model_dir)
    defaults = dict(
        model_dir=model_dir,
        **with_processes(store, BUDGETS[budget](store)),
        working_slots=store.top_k,
        kv_reserve_bytes=TEST_KV_RESERVE,
        io_mode=io_mode_for(model_dir),
    )
    return start_system(**{**defaults, **options})


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
    "BUDGETS",
    "PROMPT",
    "TEST_KV_RESERVE",
    "JobResult",
    "all_resident_budget",
    "hook_counts",
    "io_mode_for",
    "run_job",
    "start_test_system",
    "tight_budget",
    "wait_for",
]
