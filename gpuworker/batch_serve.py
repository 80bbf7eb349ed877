"""Serving jobs decoded together: mlx-lm's `BatchGenerator` over the streamed model.

With `--max-sequences N` > 1 the coordinator keeps up to N jobs here at once.
Each job becomes a row of mlx-lm's continuous batching (`BatchGenerator`:
per-row KV caches merged into `BatchKVCache`, per-row samplers and token
limits, EOS as its stop tokens): a job joins at a step boundary (its prompt
is prefilled in the same `next()` call, batched with other new prompts), and
a finished or cancelled row leaves (`remove`) without disturbing the others.
One forward pass per step serves every row, so each sparse layer leases the
union of the rows' experts once (waves when it exceeds the working bank),
exactly as a prefill chunk's rows do.

What a row emits follows `gpuworker.generate.generate` (and so mlx-lm's
`stream_generate`): EOS stops it and is not emitted, the last token of a
`max_tokens` run carries the detokenizer's final flush, timings are per row.
A job's lease figures in its `job_done` are the lease client's over the
job's life (shared with the rows it ran beside); its telemetry line is the
client's since the batch last went idle, which for a job that ran alone is
that job's own. `seed` reseeds MLX's one global generator when the job joins:
a seeded job reproduces its tokens only when it decodes alone.

A job that arrives while nothing decodes runs alone through mlx-lm's
`generate_step` (the single-sequence path, ~9% faster per token than a
batch of one here: no batch mask or per-row bookkeeping per layer). When
another job arrives it hands over at a token boundary: its KV cache, less
the last token's entry, joins the batch with that last token as its prompt,
so the batch recomputes the step `generate_step` had already run ahead and
the row continues exactly. Only for models whose caches are plain
`KVCache`s (trimmable at any length); others go to the batch at once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import KVCache, make_prompt_cache, trim_prompt_cache
from mlx_lm.sample_utils import make_sampler

from gpuworker.channel import ParentGone, WorkerStopping
from gpuworker.generate import (
    CANCELLED,
    LENGTH,
    STOP,
    ForwardHook,
    Generation,
    JobRefused,
    check_sampling,
    job_done,
    job_prompt,
)
from gpuworker.serve import MAX_ERROR_CHARS, WORKER_FAILED, WORKER_STOPPING, JobServer, telemetry_json
from shared.gpu_messages import Job, JobDone, JobError, Token

__all__ = ["BatchJobServer"]

logger = logging.getLogger("gpuworker")


@dataclass(slots=True)
class _Row:
    """One job decoding in the batch."""

    job: Job
    uid: int
    prompt_tokens: int
    detokenizer: object
    eos: frozenset[int]
    previous: float  # when its last token (or its admission) was
    lease_start: tuple[int, float, float]  # the client's (bytes copied, copy ms, lease wait ms) when it joined
    ids: list[int]
    sampler: object
    tokens: list[int] = field(default_factory=list)
    prefill_ms: float = 0.0
    decode_ms: float = 0.0


class BatchJobServer(JobServer):
    """The loaded worker: up to `config.max_sequences` jobs decode together on its channel."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rows: dict[int, _Row] = {}  # by BatchGenerator uid
        self._greedy = make_sampler(0.0)  # one object: rows sharing it are sampled in one call
        self._generator: BatchGenerator | None = None
        # A job alone runs single-sequence when its cache can hand over to the batch (see above).
        self._solo = all(type(cache) is KVCache for cache in make_prompt_cache(self.model))

    def _new_generator(self) -> BatchGenerator:
        size = max(1, self.config.max_sequences)
        eos = sorted(self.tokenizer.eos_token_ids)
        return BatchGenerator(
            ForwardHook(self.model, lambda: self.client.end_step(wait=False)),
            stop_tokens=[[token] for token in eos],
            completion_batch_size=size,
            prefill_batch_size=size,
            prefill_step_size=self.config.prefill_step_size,
        )

    def serve(self) -> None:
        try:
            while not self.channel.stop_requested():
                if self._solo and not self.rows and self.channel.backlog:
                    row = self.prepare(self.channel.backlog.popleft())
                    if row is not None:
                        self.run_alone(row)
                    continue
                while self.channel.backlog and len(self.rows) < self.config.max_sequences:
                    row = self.prepare(self.channel.backlog.popleft())
                    if row is not None:
                        self.join(row, row.ids)
                if not self.rows:
                    for stray in self.channel.idle_messages(1.0):
                        self.stray(stray)
                    continue
                self.drop_cancelled()
                if self.rows:
                    self.step()
            if self.rows:
                self.fail_all(WORKER_STOPPING, "the GPU worker is stopping: stop requested", None)
        finally:
            if self._generator is not None:
                self._generator.close()

    # -- rows joining and leaving -------------------------------------------------------------

    def prepare(self, job: Job) -> _Row | None:
        """The job's row, or None when it was cancelled or refused (and answered)."""
        channel, client = self.channel, self.client
        if channel.cancel_requested(job.job_id):
            channel.send(JobDone(job_id=job.job_id, tokens=(), finish_reason=CANCELLED))
            channel.job_finished(job.job_id)
            return None
        try:
            check_sampling(job.temperature, job.top_p)
            ids = job_prompt(job, self.tokenizer, self.info.config)
        except JobRefused as error:
            logger.warning("job %d refused: %s", job.job_id, error.message)
            channel.send(JobError(job_id=job.job_id, code=error.code, message=error.message))
            channel.job_finished(job.job_id)
            return None
        if not self.rows:
            client.reset_stats()  # nothing decoded: the telemetry starts over
        if self.info.prediction is not None:  # next-layer prediction runs only for single-row decode
            self.info.prediction.on = job.predict
        if job.seed is not None:
            mx.random.seed(job.seed)
        stats, now = client.stats(), time.perf_counter()
        channel.running.add(job.job_id)
        return _Row(
            job=job,
            uid=-1,
            prompt_tokens=len(ids),
            detokenizer=self.tokenizer.detokenizer,  # a fresh one per call
            eos=frozenset(self.tokenizer.eos_token_ids),
            previous=now,
            lease_start=(stats.bytes_copied, stats.copy_ms, stats.lease_wait_ms),
            ids=ids,
            sampler=self._greedy if job.temperature == 0 else make_sampler(job.temperature, top_p=job.top_p),
        )

    def join(self, row: _Row, prompt: list[int], cache: list | None = None) -> None:
        """The row becomes one of the batch's (its prompt prefilled at the next step)."""
        if self._generator is None:
            self._generator = self._new_generator()
        (row.uid,) = self._generator.insert(
            [prompt],
            max_tokens=[row.job.max_tokens - len(row.tokens)],
            caches=[cache if cache is not None else make_prompt_cache(self.model)],
            samplers=[row.sampler],
        )
        self.rows[row.uid] = row
        logger.info(
            "job %d joins the batch (%d rows) after %d tokens alone: up to %d more",
            row.job.job_id,
            len(self.rows),
            len(row.tokens),
            row.job.max_tokens - len(row.tokens),
        )

    def run_alone(self, row: _Row) -> None:
        """`generate_step` for a job alone, until it ends or another job arrives (then it joins the batch)."""
        job, cache = row.job, make_prompt_cache(self.model)
        self.rows[row.uid] = row
        steps = generate_step(
            mx.array(row.ids),
            ForwardHook(self.model, lambda: self.client.end_step(wait=False)),
            max_tokens=job.max_tokens,
            sampler=row.sampler,
            prompt_cache=cache,
            prefill_step_size=self.config.prefill_step_size,
        )
        handover: int | None = None
        try:
            for token, logprobs in steps:
                self.on_token(
                    row, SimpleNamespace(token=token, finish_reason=None, logprobs=logprobs), time.perf_counter()
                )
                if row.uid not in self.rows:
                    return  # it ended (EOS or max_tokens)
                if self.channel.stop_requested():
                    raise WorkerStopping("stop requested")
                if self.channel.cancel_requested(job.job_id):
                    self.finish(row, CANCELLED)
                    return
                if self.channel.backlog:
                    handover = token
                    break
        except (ParentGone, KeyboardInterrupt):
            raise
        except WorkerStopping as error:
            self.fail_all(WORKER_STOPPING, f"the GPU worker is stopping: {error}", error)
            return
        except Exception as error:
            logger.exception("job %d failed", job.job_id)
            self.fail_all(WORKER_FAILED, f"{type(error).__name__}: {error}", error)
            return
        finally:
            steps.close()  # no step runs after this
        del self.rows[row.uid]
        # generate_step ran the step after `handover` ahead: its cache holds that token's entry.
        trim_prompt_cache(cache, 1)
        self.join(row, [handover], cache)

    def drop_cancelled(self) -> None:
        for row in list(self.rows.values()):
            if self.channel.cancel_requested(row.job.job_id):
                self.finish(row, CANCELLED)

    def step(self) -> None:
        """One `next()` of the batch: every row's next token (and new rows' prefill)."""
        try:
            _, generated = self._generator.next()
        except ParentGone:
            raise
        except WorkerStopping as error:
            self.fail_all(WORKER_STOPPING, f"the GPU worker is stopping: {error}", error)
            return
        except Exception as error:  # the batch's state is unknown: every row fails, the next starts anew
            logger.exception("a batched step failed")
            self.fail_all(WORKER_FAILED, f"{type(error).__name__}: {error}", error)
            return
        now = time.perf_counter()
        for response in generated:
            row = self.rows.get(response.uid)
            if row is not None:
                self.on_token(row, response, now)
        if not self.rows:
            self.client.end_step()  # idle: nothing is held (and every fence is acknowledged)

    def on_token(self, row: _Row, response, now: float) -> None:
        elapsed, row.previous = (now - row.previous) * 1e3, now
        if row.tokens:
            row.decode_ms += elapsed
        else:
            row.prefill_ms = elapsed
        token = int(response.token)
        if token in row.eos:  # EOS ends the row and is not emitted (stream_generate's rule)
            self.finish(row, STOP)
            return
        row.detokenizer.add_token(token)
        row.tokens.append(token)
        last = response.finish_reason is not None or len(row.tokens) == row.job.max_tokens
        if last:
            row.detokenizer.finalize()
        logprobs = None
        if row.job.return_logprobs:
            logprobs = memoryview(response.logprobs.astype(mx.float32)).tobytes()
        self.channel.send(
            Token(
                job_id=row.job.job_id,
                index=len(row.tokens) - 1,
                token=token,
                text=row.detokenizer.last_segment,
                elapsed_ms=elapsed,
                logprobs=logprobs,
                prompt_tokens=row.prompt_tokens,
            )
        )
        if last:
            self.finish(row, LENGTH, finalized=True)

    def finish(self, row: _Row, reason: str, *, finalized: bool = False) -> None:
        """The row leaves the batch (the generator already dropped it, or drops it now)."""
        del self.rows[row.uid]
        if reason != LENGTH and not finalized:
            row.detokenizer.finalize()
        if self._generator is not None:
            self._generator.remove([row.uid])  # a no-op for a row the generator dropped itself
        generation = Generation(
            tuple(row.tokens), row.detokenizer.text, row.prompt_tokens, row.prefill_ms, row.decode_ms, reason
        )
        if not self.rows:
            self.client.end_step()  # the last row: fence and drain before its job_done
        stats = self.client.stats()
        copied, copy_ms, wait_ms = row.lease_start
        self.channel.send(
            job_done(
                row.job,
                generation,
                wrap_path=stats.wrap_path,
                bytes_copied=stats.bytes_copied - copied,
                copy_ms=stats.copy_ms - copy_ms,
                lease_wait_ms=stats.lease_wait_ms - wait_ms,
            )
        )
        self.channel.job_finished(row.job.job_id)
        logger.info("job %d: %d tokens (%s), %d rows left", row.job.job_id, len(row.tokens), reason, len(self.rows))
        logger.info("job %d lease telemetry: %s", row.job.job_id, telemetry_json(generation, stats))

    def fail_all(self, code: str, message: str, error: BaseException | None) -> None:
        """Every row fails (a step raised, or the worker stops): fence what is held, answer each job."""
        rows, self.rows = list(self.rows.values()), {}
        if self._generator is not None:
            self._generator.close()
            self._generator = None  # its caches may hold a half-done step
        self.release(error)
        for row in rows:
            self.channel.send(JobError(job_id=row.job.job_id, code=code, message=message[:MAX_ERROR_CHARS]))
            self.channel.job_finished(row.job.job_id)
