"""One started system (`supervisor.system.start_system`) and the jobs the bench runs against it.

`System` sizes the memory budget for `slots_per_layer` resident slots (plus room for the
processes themselves, which the budget covers), starts the processes,
runs generation jobs through the client and keeps each job's figures (tokens, tok/s, hits,
the GPU worker's lease telemetry); `summary` gives the medians of the measured jobs. The only
module of the instruments that starts a system.
"""

from __future__ import annotations

import time
from typing import Any

from instruments.figures import median
from instruments.lease_telemetry import TELEMETRY_KEYS, TelemetryLog, summarize_telemetry
from instruments.machine import (
    CPU_ROLES,
    compute_thread_ms_per_token,
    cpu_ms_per_token,
    process_cpu_s,
    process_rss,
    thread_schedstats,
)
from shared.client import Client
from shared.job_messages import TokenEvent
from shared.plan import DEFAULT_EXPERT_WORKING_SLOTS
from supervisor.budget import DEFAULT_KV_RESERVE_BYTES, PROCESS_ALLOWANCE_BYTES
from supervisor.system import start_system

# The coordinator's load timings a job reports (JobStats): over every demand load, and decode's own.
LOAD_TIMING_KEYS = tuple(
    f"{phase}{what}_p{p}_ms" for phase in ("", "decode_") for what in ("disk", "wait") for p in (50, 99)
)


class System:
    """One started system (`supervisor.system.start_system`) with `slots_per_layer` resident slots."""

    def __init__(
        self,
        store,
        *,
        name: str,
        slots_per_layer: int,
        io_workers: int,
        io_mode: str,
        working_slots: int | None,
        telemetry: TelemetryLog,
        expert_bytes: int,
        compute_lanes: int | None = None,
        prefetch: str = "auto",
        io_staging: str = "auto",
        lease_path: str = "shared",
        max_sequences: int | None = None,
        copy_ahead: str = "on",
        prefetch_margin: int | None = None,
        prefetch_distance: int = 1,
        helper_scheduling: str = "auto",
    ) -> None:
        self.store, self.name, self.telemetry, self.expert_bytes = store, name, telemetry, expert_bytes
        working = DEFAULT_EXPERT_WORKING_SLOTS if working_slots is None else working_slots
        kv = DEFAULT_KV_RESERVE_BYTES
        slots = working + len(store.sparse_layers) * slots_per_layer
        budget = store.dense_bytes + kv + slots * store.slot_bytes + PROCESS_ALLOWANCE_BYTES
        started = time.perf_counter()
        self.system = start_system(
            model_dir=store.model_dir,
            memory_budget=budget,
            io_workers=io_workers,
            working_slots=working,
            slots_per_layer=slots_per_layer,
            io_mode=io_mode,
            kv_reserve_bytes=kv,
            compute_lanes=compute_lanes,
            prefetch=prefetch,
            io_staging=io_staging,
            lease_path=lease_path,
            run_config={
                "copy_ahead": copy_ahead,
                "helper_scheduling": helper_scheduling,
                "prefetch_distance": prefetch_distance,
            }
            | ({} if max_sequences is None else {"max_sequences": max_sequences})
            | ({} if prefetch_margin is None else {"prefetch_margin": prefetch_margin}),
        )
        self.prefetch, self.prefetch_distance = prefetch, prefetch_distance
        self.startup_s = time.perf_counter() - started
        self.jobs: list[dict[str, Any]] = []
        self.rss = 0
        self.pinning: dict[str, list[int]] | None = None  # each process's CPUs, when the bench pinned them

    def stop(self) -> None:
        self.system.stop()

    def job(
        self,
        prompt: list[int],
        tokens: int,
        *,
        expected: list[int] | None,
        temperature: float,
        seed: int,
        warmup: bool = False,
    ) -> dict[str, Any]:
        before = self.telemetry.count()
        cpu_before = process_cpu_s(self.system.pids)
        cpu_first: dict[str, float] | None = None  # at the first token: what follows is decode alone
        sched_first: dict[int, tuple[int, int, int]] = {}
        gpu_worker = self.system.pids["GPU worker"]
        got, done = [], None
        with Client(self.system.endpoint, timeout=600) as client:
            for event in client.generate(prompt_tokens=prompt, max_tokens=tokens, temperature=temperature, seed=seed):
                if isinstance(event, TokenEvent):
                    if cpu_first is None:
                        cpu_first = process_cpu_s(self.system.pids)
                        sched_first = thread_schedstats(gpu_worker)
                    got.append(event.token)
                else:
                    done = event
        cpu_after = process_cpu_s(self.system.pids)
        compute_thread = compute_thread_ms_per_token(sched_first, thread_schedstats(gpu_worker), len(got) - 1)
        cpu = cpu_ms_per_token(cpu_before, cpu_after, len(got))
        decode_cpu = cpu_ms_per_token(cpu_first or cpu_after, cpu_after, len(got) - 1)
        record = self.telemetry.wait_for(before + 1)
        self.rss = max(self.rss, process_rss(list(self.system.pids.values())))
        stats = done.stats
        # The coordinator's decode_tok_s is tokens / (time from the first token to the last): recover that
        # time and count the intervals it holds (tokens - 1), as for mlx-lm.
        decode_s = stats.generated_tokens / stats.decode_tok_s if stats.decode_tok_s else 0.0
        job = {
            "warmup": warmup,
            "tokens": list(done.tokens),
            "tokens_match": expected is None or (got == expected and list(done.tokens) == expected),
            "generated": stats.generated_tokens,
            "decode_tok_s": (stats.generated_tokens - 1) / decode_s if decode_s else 0.0,
            "coordinator_decode_tok_s": stats.decode_tok_s,
            "prefill_tok_s": stats.prefill_tok_s,
            "hits": stats.hits,
            "misses": stats.misses,
            "hit_rate": stats.hit_rate,
            "bytes_read": stats.bytes_read,
            **{key: getattr(stats, key) for key in LOAD_TIMING_KEYS},
            "bytes_copied": stats.bytes_copied,
            "wrap_path": stats.wrap_path,
            "evictions": stats.evictions,
            "footprint_bytes": stats.footprint_bytes,
            "prefetch": {
                name.removeprefix("prefetch_"): getattr(stats, name)
                for name in stats.__slots__
                if name.startswith("prefetch_")
            },
            "telemetry": summarize_telemetry(record, expert_bytes=self.expert_bytes),
            "cpu_ms_per_token": cpu,  # the whole job (prefill too), per generated token
            "decode_cpu_ms_per_token": decode_cpu,  # from the first token to the last, per token after the first
            "compute_thread": compute_thread,  # the GPU worker's compute thread in decode; None without schedstats
        }
        self.jobs.append(job)
        return job

    def summary(self) -> dict[str, Any]:
        plan = self.system.plan
        measured = [job for job in self.jobs if not job["warmup"]]
        tele = [job["telemetry"] for job in measured if job["telemetry"] and job["telemetry"].get("decode_passes")]
        result = {
            "slots_per_layer": plan.slots_per_layer,
            "working_slots": plan.working_slots,
            "io_workers": self.system.io_workers,
            "resident_fraction": plan.slots_per_layer / self.store.experts_per_layer,
            "budget_bytes": plan.budget_bytes,
            "slab_bytes": plan.slab_bytes,
            "startup_s": self.startup_s,
            "warmup_jobs": len(self.jobs) - len(measured),
            "pinning": self.pinning,
            "children_peak_rss_bytes": self.rss,
            "tokens_match": all(job["tokens_match"] for job in self.jobs),
            "decode_tok_s": median([job["decode_tok_s"] for job in measured]),
            "decode_tok_s_runs": [job["decode_tok_s"] for job in measured],
            "misses_per_job": [job["misses"] for job in measured],
            "hit_rate": median([job["hit_rate"] for job in measured]),
            **{key: median([job[key] for job in measured]) for key in LOAD_TIMING_KEYS},
            **{
                key: {role: median([job[key][role] for job in measured]) for role in CPU_ROLES}
                for key in ("cpu_ms_per_token", "decode_cpu_ms_per_token")
            },
            "compute_thread": _compute_thread_summary(measured),
            "bytes_read_per_token": median([job["bytes_read"] / max(job["generated"], 1) for job in measured]),
            "prefetch": {**_prefetch_summary(self.prefetch, measured), "distance": self.prefetch_distance},
            "jobs": [{k: v for k, v in job.items() if k != "tokens"} for job in self.jobs],
        }
        for key in TELEMETRY_KEYS:
            if tele:
                result[key] = median([t[key] for t in tele])
        if tele:
            result["per_layer"] = tele[len(tele) // 2]["per_layer"]
            result["compute_lanes"] = tele[-1]["compute_lanes"]
        return result


def _compute_thread_summary(jobs: list[dict[str, Any]]) -> dict[str, float] | None:
    """Medians over the measured jobs of the compute thread's figures (None where a job has none)."""
    figures = [job["compute_thread"] for job in jobs]
    if not figures or None in figures:
        return None
    return {key: median([figure[key] for figure in figures]) for key in figures[0]}


def _prefetch_summary(mode: str, jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the measured jobs of what prefetch did, per generated token where it is a count."""
    if not jobs:
        return {"mode": mode}

    def per_token(key: str) -> float:
        return median([job["prefetch"][key] / max(job["generated"], 1) for job in jobs])

    return {
        "mode": mode,
        "recall": median([job["prefetch"]["recall"] for job in jobs]),
        "precision": median([job["prefetch"]["precision"] for job in jobs]),
        "prediction_recall": median([job["prefetch"]["prediction_recall"] for job in jobs]),
        "predicted_per_token": per_token("predicted"),
        "issued_per_token": per_token("issued"),
        "useful_per_token": per_token("useful"),
        "wasted_per_token": per_token("wasted"),
        "bytes_per_token": per_token("bytes"),
        "wasted_bytes_per_token": per_token("wasted_bytes"),
        "waits_per_token": per_token("waits"),
        "wait_ms_per_token": per_token("wait_ms"),
        "disabled_layers": max(job["prefetch"]["disabled_layers"] for job in jobs),
        "steps_without": sum(job["prefetch"]["steps_without"] for job in jobs),
        "paused_jobs": sum(bool(job["prefetch"]["paused"]) for job in jobs),
        "trialling_jobs": sum(bool(job["prefetch"]["trialling"]) for job in jobs),  # auto had no verdict yet
    }
