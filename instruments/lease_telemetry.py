"""The GPU worker's lease telemetry: its end-of-job log line collected and summarized per decode token.

The GPU worker logs `job N lease telemetry: {...}` at the end of each job (per layer and phase:
visits, lease round trips, IPC wait, slot copy, experts and hits); its stderr is forwarded into
this process's logging, where `TelemetryLog` catches the line. `summarize_telemetry` turns it
into the decode figures the bench reports (IPC wait and copy per layer visit, misses per token).
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from typing import Any

from instruments.figures import MB

TELEMETRY = re.compile(r"job (\d+) lease telemetry: (\{.*\})")


class TelemetryLog(logging.Handler):
    """Collects the GPU worker's `job N lease telemetry: {...}` lines (its stderr is forwarded)."""

    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.records: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        match = TELEMETRY.search(record.getMessage())
        if match:
            with self._lock:
                self.records.append({"job": int(match.group(1)), "logger": record.name, **json.loads(match.group(2))})

    def count(self) -> int:
        with self._lock:
            return len(self.records)

    def wait_for(self, count: int, timeout: float = 10.0) -> dict[str, Any] | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if len(self.records) >= count:
                    return self.records[count - 1]
            time.sleep(0.02)
        return None


def summarize_telemetry(record: dict[str, Any] | None, *, expert_bytes: int) -> dict[str, Any] | None:
    """Per-layer decode figures of one job's telemetry (means per layer visit / per token)."""
    if record is None:
        return None
    rows = [
        dict(
            zip(
                (
                    "layer",
                    "phase",
                    "visits",
                    "round_trips",
                    "wait_ms",
                    "copy_ms",
                    "experts",
                    "hits",
                    "bytes_copied",
                    "exposed_copy_ms",
                    "shared_visits",
                ),
                row,
            )
        )
        for row in record["layers"]
    ]
    decode = [r for r in rows if r["phase"] == "decode" and r["layer"] >= 0]
    end = [r for r in rows if r["phase"] == "decode" and r["layer"] < 0]
    visits = sum(r["visits"] for r in decode)
    passes = max((r["visits"] for r in decode), default=0)  # decode forward passes
    if not visits or not passes:
        return {"decode_passes": 0}
    misses = sum(r["experts"] - r["hits"] for r in decode)
    end_wait = sum(r["wait_ms"] for r in end)
    return {
        "decode_passes": passes,
        "compute_lanes": record.get("compute_lanes", 1),
        "ipc_wait_ms_per_layer": sum(r["wait_ms"] for r in decode) / visits,
        # per decode visit: the lease wait's quantiles, and the share leased without a round trip
        "lease_wait_p50_ms": record.get("visit_wait_p50_ms", 0.0),
        "lease_wait_p99_ms": record.get("visit_wait_p99_ms", 0.0),
        "shared_visit_fraction": sum(r.get("shared_visits", 0) for r in decode) / visits,
        "copy_ms_per_layer": sum(r["copy_ms"] for r in decode) / visits,
        "round_trips_per_layer": sum(r["round_trips"] for r in decode) / visits,
        "end_step_fence_ms_per_token": end_wait / passes,
        "ipc_wait_ms_per_token": (sum(r["wait_ms"] for r in decode) + end_wait) / passes,
        "copy_ms_per_token": sum(r["copy_ms"] for r in decode) / passes,
        "exposed_copy_ms_per_token": sum(r.get("exposed_copy_ms", r["copy_ms"]) for r in decode) / passes,
        "copied_MB_per_token": sum(r["bytes_copied"] for r in decode) / passes / MB,
        "misses_per_token": misses / passes,
        "misses_per_visit": misses / visits,
        # copy ahead (gpuworker.copy_ahead): the share of routed experts found copied ahead, and of
        # the experts copied ahead the share a visit used
        "copy_ahead_found_fraction": record.get("found_ahead", 0) / max(1, record.get("routed_ahead", 0)),
        "copy_ahead_precision": record.get("found_ahead", 0) / max(1, record.get("copied_ahead", 0)),
        "copy_ahead_visit_fraction": record.get("routed_ahead", 0) / max(1, sum(r["experts"] for r in decode)),
        "miss_bytes_per_token": misses * expert_bytes / passes,
        # split visits (gpuworker.split_visit): the share of decode visits that computed resident
        # experts while their lease was on its way, and how many each computed so
        "split_visit_fraction": record.get("split_visits", 0) / visits,
        "split_early_experts_per_split": record.get("split_early_experts", 0) / max(1, record.get("split_visits", 0)),
        "per_layer": {
            str(r["layer"]): {
                "ipc_wait_ms": r["wait_ms"] / r["visits"],
                "copy_ms": r["copy_ms"] / r["visits"],
                "misses": (r["experts"] - r["hits"]) / r["visits"],
            }
            for r in decode
            if r["visits"]
        },
    }


TELEMETRY_KEYS = (
    "ipc_wait_ms_per_layer",
    "lease_wait_p50_ms",
    "lease_wait_p99_ms",
    "shared_visit_fraction",
    "copy_ms_per_layer",
    "round_trips_per_layer",
    "end_step_fence_ms_per_token",
    "ipc_wait_ms_per_token",
    "copy_ms_per_token",
    "exposed_copy_ms_per_token",
    "copied_MB_per_token",
    "misses_per_token",
    "misses_per_visit",
    "miss_bytes_per_token",
    "copy_ahead_found_fraction",
    "copy_ahead_precision",
    "copy_ahead_visit_fraction",
    "split_visit_fraction",
    "split_early_experts_per_split",
)
