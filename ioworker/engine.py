"""The I/O worker's readers: validated loads on reader threads, and the hint queue.

The socket thread validates a `load` against the manifest and the slot, then
queues it; `queue_depth` reader threads each run one queued read at a time
through the shared native pool (GIL released), so `cancel` and `telemetry` are
served while reads are in flight. Finished loads become `Loaded` replies that
the socket thread collects after `notify()` wakes it.

The loads a message brings together (`submit_many`: a wave's misses, a layer's
prefetches) are one read: one reader, one native call whose direct ranges go to
the kernel at once, replies ready together. Per load that saves the wake-ups of
a reader, of its completions and of a reply of its own, which on a machine
whose cores compute is CPU taken from the computation; what it costs is that a
load's reply waits for the others of its read, which the disk serves at the same
time anyway.

A read of at most `INLINE_READ_BYTES` that finds no other load queued or running,
and that no other command follows in its message (a cancel must find its load
queued), is read on the socket thread itself: the hand-off to a reader and the wake-up
back cost about 0.5 ms of a demand miss's round trip (measured on a model of
small experts, whose whole read takes 0.8 ms), more than the socket thread's
pause for the read, during which a cancel or another load waits.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from native import STATUS_SHORT_READ, AioStats, BypassFile, ReadPool, ReadResult, StagingStats, advise_willneed
from native.staging import StagingBuffer, StagingChoice, StagingRequest, choose_staging
from shared.io_messages import HintStatus, Load, Loaded
from shared.protocol import BAD_REQUEST, INTERNAL
from shared.segments import ExpertIOHintSegment, ExpertIOSegment, SegmentError, check_segments
from shared.slab import Slab

logger = logging.getLogger(__name__)

CANCELLED = "cancelled"
READ_FAILED = "read_failed"
SHORT_READ = "short_read"
INLINE_READ_BYTES = 1 << 20  # the largest read the socket thread does itself when no reader is busy


class LoadRefused(ValueError):
    """A load or hint whose values this worker will not act on."""


def load_failed(load: Load, error: str, code: str) -> Loaded:
    """The reply to `load` when nothing of it was read (refused, cancelled, crashed)."""
    return Loaded(slot=load.slot, generation=load.generation, ok=False, error=error, code=code)


def _refuse_bad(
    segments: Sequence[ExpertIOSegment | ExpertIOHintSegment], files: Sequence[BypassFile], *, slot_bytes: int | None
) -> None:
    """LoadRefused naming the first segment value the manifest (its files' sizes too) or the slot refuses."""
    try:
        check_segments(segments, slot_bytes=slot_bytes, manifest=files)
    except (SegmentError, TypeError) as error:
        raise LoadRefused(str(error)) from None


def staging_for(files: Sequence[BypassFile], *, largest_read: int, requested: StagingRequest) -> StagingChoice:
    """Staging for the files this worker reads with O_DIRECT (none: nothing to stage)."""
    direct = [file.path for file in files if file.mode == "direct"]
    if not direct:
        return StagingChoice(False, "no file is read with O_DIRECT")
    return choose_staging(direct, largest_read=largest_read, requested=requested)


@dataclass(slots=True)
class _Job:
    load: Load
    received: float
    state: str = "queued"  # queued -> running -> done, or queued -> cancelled


@dataclass(slots=True)
class LoadCounters:
    reads: int = 0  # reads: the loads of a message, or one load
    inline_reads: int = 0  # of them, read on the socket thread (INLINE_READ_BYTES)
    loads: int = 0
    loads_failed: int = 0
    cancelled: int = 0
    cancel_misses: int = 0
    bytes: int = 0
    read_bytes: int = 0
    read_ops: int = 0
    service_ms: float = 0.0
    fallback_ops: int = 0


class LoadEngine:
    """Loads into the slab on `queue_depth` reader threads over one native pool."""

    def __init__(
        self,
        *,
        files: Sequence[BypassFile],
        slab: Slab,
        block_size: int,
        queue_depth: int,
        notify: Callable[[], None],
        staging: StagingChoice | None = None,
        delay_s: float = 0.0,
    ) -> None:
        self._files = tuple(files)
        self._slab = slab
        self._delay_s = delay_s  # fault injection for tests: a load that stays in flight
        self._block_size = block_size
        # Reading several slots as one region is safe only if no rounded range can leave its slot:
        # the native layer bounds a range by the region, which is then more than the slot.
        self.reads_together = slab.slot_bytes % block_size == 0
        if not self.reads_together:
            logger.warning(
                "loads read one at a time: slots of %d bytes are no multiple of the block size %d",
                slab.slot_bytes,
                block_size,
            )
        self._notify = notify
        self._lock = threading.Lock()
        self._jobs: dict[int, _Job] = {}  # slot -> its one queued or running job
        self._queue: queue.SimpleQueue[list[_Job] | None] = queue.SimpleQueue()  # a read: its loads
        self._done: deque[Loaded] = deque()
        self.counters = LoadCounters()
        self._last_staging = StagingStats(False, 0, 0, 0, 0, 0.0)
        self.staging = staging or StagingChoice(False, "not configured")
        self.staging_buffer = (
            StagingBuffer(threads=queue_depth, stride=self.staging.stride) if self.staging.enabled else None
        )
        self._pool: ReadPool | None = ReadPool(
            threads=queue_depth, staging=self.staging_buffer, stage_above=self.staging.stage_above
        )
        aio = self._pool.aio_stats()
        if aio.enabled:
            logger.info("direct reads: kernel AIO, a load's ranges submitted together from its reader thread")
        else:
            logger.warning("direct reads: on the pool's threads, one blocking read per range (%s)", aio.reason)
        self._last_aio = aio
        buffer = self.staging_buffer
        if buffer is None:
            logger.info("staging off: %s", self.staging.reason)
        else:
            logger.info(
                "staging on: %s; %d x %d bytes, %d on huge pages",
                self.staging.reason,
                buffer.threads,
                buffer.stride,
                buffer.huge_bytes,
            )
            if buffer.huge_bytes < buffer.size:  # e.g. no free huge page: staged reads may still split
                logger.warning("staging buffers got %d of %d bytes on huge pages", buffer.huge_bytes, buffer.size)
        self._threads = [
            threading.Thread(target=self._reader, name=f"reader-{i}", daemon=True) for i in range(queue_depth)
        ]
        for thread in self._threads:
            thread.start()

    def submit_many(self, loads: Sequence[Load], *, inline: bool = True) -> list[tuple[Load, LoadRefused]]:
        """Queue `loads` as one read (module docstring); the ones refused, each with its reason
        naming the offending value (the others are queued). `inline` False: never read them on the
        calling thread (a command after them, a cancel perhaps, must still find them queued)."""
        refused: list[tuple[Load, LoadRefused]] = []
        jobs: list[_Job] = []
        for load in loads:
            try:
                self._check(load)
            except LoadRefused as error:
                refused.append((load, error))
                continue
            with self._lock:
                busy = self._jobs.get(load.slot)
                if busy is not None:
                    message = f"slot {load.slot} already has load generation {busy.load.generation} {busy.state}"
                    refused.append((load, LoadRefused(message)))
                    continue
                job = _Job(load, time.monotonic())
                self._jobs[load.slot] = job
            jobs.append(job)
        for read in [jobs] if self.reads_together else [[job] for job in jobs]:
            if not read:
                continue
            with self._lock:
                here = (
                    inline
                    and not self._delay_s  # a test's load that must stay in flight
                    and len(self._jobs) == len(read)  # nothing else queued or running
                    and sum(s.length for job in read for s in job.load.segments) <= INLINE_READ_BYTES
                )
                self.counters.inline_reads += here
            if here:
                self._read(read)  # the caller collects the replies (`completions`): no wake-up
            else:
                self._queue.put(read)
        return refused

    def _check(self, load: Load) -> None:
        if not 0 <= load.slot < self._slab.total_slots:
            raise LoadRefused(f"slot {load.slot} is outside the slab's {self._slab.total_slots} slots")
        _refuse_bad(load.segments, self._files, slot_bytes=self._slab.slot_bytes)

    def cancel(self, slot: int, generation: int) -> Loaded | None:
        """Drop a queued load and return its `cancelled` reply; None if it is running or unknown."""
        with self._lock:
            job = self._jobs.get(slot)
            if job is None or job.load.generation != generation or job.state != "queued":
                if job is None or job.load.generation != generation:
                    self.counters.cancel_misses += 1
                return None
            job.state = CANCELLED
            del self._jobs[slot]
            self.counters.cancelled += 1
        return load_failed(job.load, CANCELLED, CANCELLED)

    def completions(self) -> list[Loaded]:
        """Replies of loads finished since the last call."""
        with self._lock:
            done = list(self._done)
            self._done.clear()
        return done

    def staging_stats(self) -> StagingStats:
        pool = self._pool
        return pool.staging_stats() if pool is not None else self._last_staging

    def aio_stats(self) -> AioStats:
        pool = self._pool
        return pool.aio_stats() if pool is not None else self._last_aio

    def depth(self) -> tuple[int, int]:
        """(queued, in flight) loads."""
        with self._lock:
            running = sum(1 for job in self._jobs.values() if job.state == "running")
            return len(self._jobs) - running, running

    def close(self) -> list[Loaded]:
        """Cancel queued loads, let running ones finish, join the readers.

        Returns the replies nobody has collected (cancellations included)."""
        cancelled = []
        with self._lock:
            for slot, job in list(self._jobs.items()):
                if job.state == "queued":
                    job.state = CANCELLED
                    del self._jobs[slot]
                    cancelled.append(job.load)
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join()
        if self._pool is not None:
            self._pool.close()
            self._last_staging, self._last_aio = self._pool.staging_stats(), self._pool.aio_stats()
            self._pool = None  # the native pool holds the staging buffer until it is freed
        if self.staging_buffer is not None:
            self.staging_buffer.close()
        replies = [load_failed(load, CANCELLED, CANCELLED) for load in cancelled]
        return replies + self.completions()

    def _reader(self) -> None:
        while True:
            queued = self._queue.get()
            if queued is None:
                return
            if self._read(queued):
                self._notify()

    def _read(self, queued: list[_Job]) -> bool:
        """Read the jobs of `queued` not cancelled meanwhile; their replies join `completions`.
        Whether there were any."""
        with self._lock:
            jobs = [job for job in queued if job.state == "queued"]  # not cancelled while queued
            for job in jobs:
                job.state = "running"
            self.counters.reads += bool(jobs)
        if not jobs:
            return False
        try:
            replies = self._run(jobs)
        except Exception as error:  # never lose a reply: the coordinator waits on it
            logger.exception("read of slots %s crashed", [job.load.slot for job in jobs])
            replies = [load_failed(job.load, f"internal error: {error!r}", INTERNAL) for job in jobs]
        with self._lock:
            for job, reply in zip(jobs, replies):
                del self._jobs[job.load.slot]
                self._done.append(reply)
                self._count(reply)
        return True

    def _count(self, reply: Loaded) -> None:
        self.counters.loads += 1
        self.counters.loads_failed += not reply.ok
        self.counters.bytes += reply.bytes
        self.counters.service_ms += reply.service_ms

    def _run(self, jobs: list[_Job]) -> list[Loaded]:
        """Read every job's segments in one native call; each job's reply."""
        if self._delay_s:
            time.sleep(self._delay_s)
        started = time.monotonic()
        slot_bytes = self._slab.slot_bytes
        first = min(job.load.slot for job in jobs)
        ops = [
            self._files[s.file].op(s.offset, s.length, (job.load.slot - first) * slot_bytes + s.destination)
            for job in jobs
            for s in job.load.segments
        ]
        view = self._slab.slots_view(first, max(job.load.slot for job in jobs) - first + 1)
        pool = self._pool
        assert pool is not None, "reader threads stop before the pool closes"
        try:
            results = pool.read(view, ops, block_size=self._block_size)
        except ValueError as error:  # alignment or overlap refused before any read
            if len(jobs) > 1:  # read each on its own, so that a refusal is the refused load's alone
                return [reply for job in jobs for reply in self._run([job])]
            return [load_failed(jobs[0].load, f"segment layout refused (op i is segment i): {error}", BAD_REQUEST)]
        finally:
            view.release()
        finished = time.monotonic()
        with self._lock:
            self.counters.read_ops += len(results)
            self.counters.read_bytes += sum(r.transferred for r in results)
            self.counters.fallback_ops += sum(self._files[s.file].fell_back for job in jobs for s in job.load.segments)
        replies, at = [], 0
        for job in jobs:
            count = len(job.load.segments)
            replies.append(self._loaded(job, results[at : at + count], started, finished))
            at += count
        return replies

    def _loaded(self, job: _Job, results: Sequence[ReadResult], started: float, finished: float) -> Loaded:
        """The reply for one load of a read: its first failed segment, or success."""
        load = job.load
        common = dict(
            slot=load.slot,
            generation=load.generation,
            bytes=sum(r.delivered for r in results),
            service_ms=(finished - started) * 1e3,
            queued_ms=(started - job.received) * 1e3,
        )
        for segment, result in zip(load.segments, results):
            if result.ok:
                continue
            file = self._files[segment.file]
            return Loaded(
                ok=False,
                error=(
                    f"read of file {segment.file} ({file.path}) at offset {segment.offset} length "
                    f"{segment.length} failed: {result.describe()}"
                ),
                code=SHORT_READ if result.status == STATUS_SHORT_READ else READ_FAILED,
                file=segment.file,
                offset=segment.offset,
                **common,
            )
        return Loaded(ok=True, **common)


class HintQueue:
    """A bounded queue of advisory readahead messages on one thread.

    A message that finds the queue full is dropped and counted, never waited on."""

    def __init__(self, *, files: Sequence[BypassFile], capacity: int, notify: Callable[[], None]) -> None:
        self._files = tuple(files)
        self._capacity = capacity
        self._notify = notify
        self._cond = threading.Condition()
        self._pending: deque[tuple[ExpertIOHintSegment, ...]] = deque()
        self._closing = False
        self._counts = dict.fromkeys(("submitted", "completed", "dropped", "operations", "bytes", "errors"), 0)
        self._in_flight = 0
        self._thread = threading.Thread(target=self._run, name="hints", daemon=True)
        self._thread.start()

    def offer(self, segments: Sequence[ExpertIOHintSegment]) -> bool:
        """Queue one hint message (validated, or LoadRefused); False when dropped."""
        _refuse_bad(segments, self._files, slot_bytes=None)
        with self._cond:
            self._counts["submitted"] += 1
            if len(self._pending) >= self._capacity:
                self._counts["dropped"] += 1
                return False
            self._pending.append(tuple(segments))
            self._cond.notify()
            return True

    def status(self) -> HintStatus:
        with self._cond:
            return HintStatus(queue_depth=len(self._pending), in_flight=self._in_flight, **self._counts)

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._pending.clear()
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                if self._closing:
                    return
                batch = self._pending.popleft()
                self._in_flight = 1
            operations = advised = errors = 0
            for segment in batch:
                try:
                    advise_willneed(self._files[segment.file].fd, segment.offset, segment.length)
                    advised += segment.length
                except OSError as error:
                    errors += 1
                    logger.debug("hint on file %d at %d failed: %s", segment.file, segment.offset, error)
                operations += 1
            with self._cond:
                self._in_flight = 0
                self._counts["completed"] += 1
                self._counts["operations"] += operations
                self._counts["bytes"] += advised
                self._counts["errors"] += errors
            self._notify()


__all__ = [
    "CANCELLED",
    "READ_FAILED",
    "SHORT_READ",
    "HintQueue",
    "LoadCounters",
    "LoadEngine",
    "LoadRefused",
    "load_failed",
]
