"""Serving jobs on a loaded GPU worker: one at a time, each ending in `job_done` or `job_error`.

`JobServer` takes jobs from the channel's backlog, runs each through mlx-lm's
generation (`gpuworker.generate.run_job`) with the streamed model, fences
what a failed job still holds before saying why it failed, and logs one line
of lease telemetry JSON per job (what `scripts/bench_generate.py` reads).
"""

from __future__ import annotations

import json
import logging
import traceback

from gpuworker.channel import Channel, LeaseError, ParentGone, WorkerStopping
from gpuworker.generate import JobRefused, job_done, run_job
from gpuworker.lease_client import LeaseClient
from shared.commands import GpuWorkerArgs
from shared.gpu_messages import Fenced, Job, JobDone, JobError, Lease
from shared.protocol import BAD_REQUEST, ErrorReply

logger = logging.getLogger("gpuworker")

WORKER_FAILED = "worker_failed"
WORKER_STOPPING = "worker_stopping"
MAX_ERROR_CHARS = 4096


class JobServer:
    """The loaded worker: serves jobs one at a time on its channel."""

    def __init__(self, channel: Channel, client: LeaseClient, model, tokenizer, info, config: GpuWorkerArgs) -> None:
        self.channel, self.client, self.model, self.tokenizer = channel, client, model, tokenizer
        self.info, self.config = info, config

    def serve(self) -> None:
        while not self.channel.stop_requested():
            if self.channel.backlog:
                self.run(self.channel.backlog.popleft())
                continue
            for stray in self.channel.idle_messages(1.0):
                self.stray(stray)

    def stray(self, message: object) -> None:
        if isinstance(message, ErrorReply):  # never answer an error with an error
            logger.warning("the coordinator reported an error: %s: %s", message.code, message.message)
        elif isinstance(message, (Lease, Fenced)):
            self.channel.refuse(
                BAD_REQUEST,
                f"unexpected {message.OP} {message.lease_id}: no routes or fence of this worker is outstanding",
            )
        else:
            self.channel.refuse(BAD_REQUEST, f"unexpected {getattr(message, 'OP', type(message).__name__)}")

    def should_stop(self, job_id: int) -> bool:
        if self.channel.stop_requested():
            raise WorkerStopping("stop requested")
        return self.channel.cancel_requested(job_id)

    def run(self, job: Job) -> None:
        channel, client = self.channel, self.client
        channel.running.add(job.job_id)
        client.reset_stats()
        try:
            if channel.cancel_requested(job.job_id):
                channel.send(JobDone(job_id=job.job_id, tokens=(), finish_reason="cancelled"))
                return
            logger.info("job %d: up to %d tokens", job.job_id, job.max_tokens)
            if self.info.prediction is not None:  # the coordinator's auto prefetch may have paused
                self.info.prediction.on = job.predict
                if not job.predict:
                    logger.info("job %d: no next-layer prediction (the coordinator paused prefetch)", job.job_id)
            generation = run_job(
                job,
                model=self.model,
                tokenizer=self.tokenizer,
                config=self.info.config,
                send=channel.send,
                should_stop=lambda: self.should_stop(job.job_id),
                after_forward=lambda: client.end_step(wait=False),
                prefill_step_size=self.config.prefill_step_size,
            )
            client.end_step()  # nothing is held after the last forward (and every fence is acknowledged)
            stats = client.stats()
            channel.send(
                job_done(
                    job,
                    generation,
                    wrap_path=stats.wrap_path,
                    bytes_copied=stats.bytes_copied,
                    copy_ms=stats.copy_ms,
                    lease_wait_ms=stats.lease_wait_ms,
                )
            )
            logger.info(
                "job %d: %d tokens (%s), %d lease round trips, %.1f ms waiting for leases",
                job.job_id,
                len(generation.tokens),
                generation.finish_reason,
                stats.round_trips,
                stats.lease_wait_ms,
            )
            logger.info("job %d lease telemetry: %s", job.job_id, telemetry_json(generation, stats))
        except JobRefused as error:
            logger.warning("job %d refused: %s", job.job_id, error.message)
            channel.send(JobError(job_id=job.job_id, code=error.code, message=error.message))
        except ParentGone:
            raise
        except WorkerStopping as error:
            logger.info("job %d abandoned: %s", job.job_id, error)
            self.fail(job, WORKER_STOPPING, f"the GPU worker is stopping: {error}", error)
        except LeaseError as error:  # the coordinator's answer did not fit: the message says why
            logger.error("job %d failed: %s", job.job_id, error)
            self.fail(job, WORKER_FAILED, f"{type(error).__name__}: {error}", error)
        except Exception as error:
            logger.exception("job %d failed", job.job_id)
            self.fail(job, WORKER_FAILED, f"{type(error).__name__}: {error}", error)
        finally:
            channel.job_finished(job.job_id)

    def fail(self, job: Job, code: str, message: str, error: BaseException) -> None:
        """Fence what the failed job still holds, then say why it failed."""
        self.release(error)
        if len(message) > MAX_ERROR_CHARS:  # the wire refuses long strings; keep the start
            message = message[: MAX_ERROR_CHARS - 15] + " ... (truncated)"
        self.channel.send(JobError(job_id=job.job_id, code=code, message=message))

    def release(self, error: BaseException | None = None) -> None:
        """Fence whatever the failed job still holds (its arrays die with the traceback)."""
        if error is not None:
            traceback.clear_frames(error.__traceback__)
        try:
            self.client.release()
        except (ParentGone, KeyboardInterrupt):
            raise
        except Exception:
            logger.exception("could not fence the leases of the failed job")


def telemetry_json(generation, stats) -> str:
    """One line of JSON: the job's lease figures per (layer, phase); what benchmarks read."""
    return json.dumps(
        {
            "tokens": len(generation.tokens),
            "prompt_tokens": generation.prompt_tokens,
            "prefill_ms": round(generation.prefill_ms, 3),
            "decode_ms": round(generation.decode_ms, 3),
            "round_trips": stats.round_trips,
            "lease_wait_ms": round(stats.lease_wait_ms, 3),
            "copy_ms": round(stats.copy_ms, 3),
            "bytes_copied": stats.bytes_copied,
            "wrap_path": stats.wrap_path,
            "compute_lanes": stats.compute_lanes,
            "lane_parts": list(stats.lane_parts),
            "visit_wait_p50_ms": round(stats.visit_wait_p50_ms, 4),
            "visit_wait_p99_ms": round(stats.visit_wait_p99_ms, 4),
            "shared_visits": stats.shared_visits,
            "shared_misses": stats.shared_misses,
            "shared_behind": stats.shared_behind,
            "copy_ahead": stats.copy_ahead,
            "copied_ahead": stats.copied_ahead,
            "found_ahead": stats.found_ahead,
            "routed_ahead": stats.routed_ahead,
            "split_visits": stats.split_visits,
            "split_early_experts": stats.split_early_experts,
            "layers": [
                [
                    s.layer,
                    s.phase,
                    s.visits,
                    s.round_trips,
                    round(s.wait_ms, 3),
                    round(s.copy_ms, 3),
                    s.experts,
                    s.hits,
                    s.bytes_copied,
                    round(s.exposed_copy_ms, 3),
                    s.shared_visits,
                ]
                for s in stats.layers
            ],
        },
        separators=(",", ":"),
    )


__all__ = ["MAX_ERROR_CHARS", "WORKER_FAILED", "WORKER_STOPPING", "JobServer", "telemetry_json"]
