"""`GET /metrics`: the system's figures in the Prometheus text format (prometheus_client).

A custom collector reads one `stats` reply of the job front door (cumulative since the coordinator
started) and this front's own request counts; each scrape asks the door afresh, so a collector and a
registry are built per scrape from that one snapshot (two concurrent scrapes never mix their data).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shared.job_messages import StatsReply

CONTENT_TYPE = CONTENT_TYPE_LATEST  # the format generate_latest writes
PREFIX = "moeslab"


class DoorStatsCollector(Collector):
    """The door's cumulative statistics and the front's requests, as metric families."""

    def __init__(self, reply: StatsReply, requests: Counter[tuple[str, int]], open_jobs: int) -> None:
        self._reply, self._requests, self._open = reply, requests, open_jobs

    def collect(self) -> Iterator[Metric]:
        reply, stats = self._reply, self._reply.stats

        def counter(name: str, help_text: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(f"{PREFIX}_{name}", help_text, value=value)

        def gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"{PREFIX}_{name}", help_text, value=value)

        yield counter("generated_tokens", "Tokens generated since the coordinator started.", stats.generated_tokens)
        yield counter("prompt_tokens", "Prompt tokens prefilled since the coordinator started.", stats.prompt_tokens)
        yield gauge("decode_tokens_per_second", "Decode speed over the jobs so far (tokens/s).", stats.decode_tok_s)
        yield gauge("prefill_tokens_per_second", "Prefill speed over the jobs so far (tokens/s).", stats.prefill_tok_s)
        yield gauge("expert_hit_rate", "Share of expert visits served by resident experts.", stats.hit_rate)
        yield counter("expert_bytes_read", "Expert bytes read from the SSD on demand.", stats.bytes_read)
        yield gauge("footprint_bytes", "The whole system's memory: processes plus the slab.", stats.footprint_bytes)
        yield gauge("budget_bytes", "The memory budget the system stays within.", stats.budget_bytes)
        yield gauge("queue_depth", "Generation jobs waiting in the job front door's queue.", reply.queued)
        yield gauge("active_sequences", "Jobs decoding together now.", stats.active_sequences)
        yield counter("jobs_done", "Jobs answered with their tokens.", reply.jobs_done)
        yield counter("jobs_failed", "Jobs refused after queueing, failed or cancelled.", reply.jobs_failed)
        yield gauge("http_open_jobs", "Jobs this HTTP front has open at the door.", self._open)
        requests = CounterMetricFamily(
            f"{PREFIX}_http_requests", "HTTP requests answered, by route and status.", labels=["route", "status"]
        )
        for (route, status), count in sorted(self._requests.items()):
            requests.add_metric([route, str(status)], count)
        yield requests


def render(reply: StatsReply, requests: Counter[tuple[str, int]], open_jobs: int) -> bytes:
    """The metrics page for one stats snapshot."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DoorStatsCollector(reply, requests, open_jobs))
    return generate_latest(registry)


__all__ = ["CONTENT_TYPE", "DoorStatsCollector", "render"]
