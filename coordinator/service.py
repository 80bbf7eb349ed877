"""The running coordinator: its state, the GPU worker's session, and the job front door's host.

`Coordinator` ties the parts together: the I/O backend (metered, optionally
fence-checked), the residency manager, the lease service, the usage ledger,
safe points and job statistics. Its tasks serve the GPU worker's ROUTER
(the lease protocol and job messages), the clients' ROUTER (through
`coordinator.jobs.JobFrontDoor`, for which it is the `JobHost`), and watch
the GPU worker's pid. `coordinator.main` builds it and runs its tasks.

Safe points (`coordinator.safepoint`): after each `fenced` sent to the GPU
worker and each `token` relayed, the footprint is checked (rate-limited);
between jobs, the footprint, live repin, heat decay and a ledger flush.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from dataclasses import replace

import zmq
import zmq.asyncio

from coordinator.backend import IOWorkerBackend
from coordinator.fence_checks import FenceCheckedBackend, hook_report, with_fence_checks
from coordinator.footprint import FootprintMeter
from coordinator.gpu_session import GpuSession, gpu_welcome
from coordinator.jobs import FrontDoorLimits, JobFrontDoor
from coordinator.lease_publisher import LeasePublisher, PublishingBackend, lease_words_for
from coordinator.leases import LeaseService
from coordinator.liveness import GpuProgress, ProgressDeadline, kill_hung
from coordinator.memory_budget import SlabSizing, measured_processes, system_roles
from coordinator.metered_backend import LoadTimer, MeteredBackend
from coordinator.prefetch import PrefetchBook, welcome_prefetch
from coordinator.residency import ExpertResidencyManager
from coordinator.safepoint import SafePoints
from coordinator.stats import JobBook
from coordinator.usage import ExpertUsageLedger
from shared.config import RunConfig
from shared.gpu_messages import (
    COORDINATOR_ACCEPTS_FROM_GPU,
    Fence,
    Fenced,
    GpuGoodbye,
    GpuHello,
    GpuReady,
    JobDone,
    JobError,
    Lease,
    Prefetch,
    Routes,
    Token,
    Visited,
)
from shared.job_messages import (
    MAX_REQUEST_BYTES,
    PRESSURE,
    SHUTTING_DOWN,
    WORKER_FAILED,
    WORKER_HUNG,
    HealthReply,
    JobStats,
    ProcessInfo,
)
from shared.loop_socket import LoopSocket
from shared.pid_watch import PidWatch, platform_liveness
from shared.protocol import BAD_REQUEST, ErrorReply, ProtocolError, decode
from shared.slab import Slab
from shared.sockets import send_routed
from shared.store import ExpertStore

logger = logging.getLogger("coordinator")

NOT_READY = "not_ready"


WATCH_INTERVAL_S = 0.5
# A frame over ZMQ_MAXMSGSIZE drops the peer's connection (it is not refused). The jobs and GPU sockets
# take the largest legal `generate` (1 Mi prompt tokens, up to 9 msgpack bytes each) and `job_done`; the jobs
# socket well beyond it, so an oversized request is answered (`message_too_large`). The I/O socket: default.
GPU_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
JOBS_MAX_MESSAGE_BYTES = 2 * MAX_REQUEST_BYTES + 8 * 1024 * 1024


class Coordinator:
    """The running coordinator's state; the job front door's `JobHost`."""

    def __init__(
        self,
        *,
        config: RunConfig,
        store: ExpertStore,
        slab: Slab,
        io: IOWorkerBackend,
        gpu_sock: LoopSocket,
        jobs_sock: zmq.asyncio.Socket,
        ledger: ExpertUsageLedger | None,
    ) -> None:
        self.config, self.store, self.slab, self.ledger = config, store, slab, ledger
        self.io, self.gpu_sock, self.jobs_sock = io, gpu_sock, jobs_sock
        self.gpu = GpuSession()
        self.progress = GpuProgress(ProgressDeadline(timeout_s=config.hang_timeout_s))
        words = lease_words_for(config, slab)
        self.fence_checked = with_fence_checks(io, config.test_hooks, slab=slab, shared_path=words is not None)
        self.timer = LoadTimer()
        if config.test_footprint_offset_bytes:
            logger.warning(
                "TEST KNOB: %d bytes are added to every measured footprint", config.test_footprint_offset_bytes
            )
        self.meter = FootprintMeter(
            slab=slab,
            pids=self._roles,
            interval_s=config.footprint_interval_ms / 1e3,
            offset=config.test_footprint_offset_bytes,
            background_reads=True,  # a page-table walk must not stall a lease request (coordinator.footprint)
        )
        self.publisher = LeasePublisher(words, claim_timeout_s=config.hang_timeout_s)
        metered = MeteredBackend(self.fence_checked, slab=slab, timer=self.timer, footprint=self.meter.footprint)
        self.backend = PublishingBackend(metered, self.publisher)
        self.manager = ExpertResidencyManager(
            plan=config.plan,
            sparse_layer_ids=store.sparse_layers,
            backend=self.backend,
            locate=store.locate,
            pinned=[tuple(pair) for pair in config.pinned],
            usage=ledger,
            prefetch=PrefetchBook(mode=config.prefetch),  # type: ignore[arg-type]
            replacement=config.replacement,
        )
        self.publisher.attach(self.manager)
        self.leases = LeaseService(manager=self.manager, experts_per_layer=store.experts_per_layer, timer=self.timer)
        self.sizing = SlabSizing(config, self.meter, self.manager)
        self.safepoints = SafePoints(
            manager=self.manager,
            backend=self.backend,
            meter=self.meter,
            ledger=ledger,
            tolerance=config.pressure_tolerance_bytes,
            flush_interval_s=config.usage_flush_s,
        )
        self.book = JobBook(leases=self.leases, manager=self.manager, meter=self.meter, timer=self.timer)
        self.front = JobFrontDoor(
            host=self, limits=FrontDoorLimits.for_run(store.config, config), max_running=config.max_sequences
        )
        self.io_ready = False
        self.stopping = False
        self._violations = self._fallback_ops = 0

    # ------------------------------------------------------------ tasks

    async def start_io(self) -> None:
        await self.io.start(timeout=self.config.start_timeout_s)
        self.meter.sample(force=True)  # the coordinator's and the I/O workers' baselines
        if self.config.pinned:
            await self.manager.preload_pinned()
            preload = self.manager.drain_policy_telemetry()  # not the first live repin's
            logger.info(
                "preloaded %d pinned experts: %d loads, %d bytes read",
                len(self.config.pinned),
                preload.loads,
                preload.read_bytes,
            )
        self.io_ready = True
        self.publisher.sync()  # the pinned preload
        logger.info("%d I/O workers ready", self.config.io_workers)
        self._size_slab()
        self.front.poke()

    async def serve_gpu(self) -> None:
        while True:
            frames = await self.gpu_sock.recv_multipart()
            try:
                await self._gpu_message(frames)
            except Exception:  # a bad message must never stop the coordinator
                logger.exception("failed to handle a GPU worker message")

    async def serve_jobs(self) -> None:
        while True:
            frames = await self.jobs_sock.recv_multipart()
            try:
                await self.front.handle_client(frames)
            except Exception:
                logger.exception("failed to handle a client message")

    async def watch_gpu(self) -> None:
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            if self.gpu.identity is not None and not self.gpu.alive():
                await self._gpu_lost(f"GPU worker pid {self.gpu.pid} exited", expected=bool(self.gpu.leaving))
            elif self.gpu.ready and self.front.active:
                reason = self.progress.overdue(time.monotonic())
                if reason is not None:  # killed, then handled as lost: the job fails `worker_hung`
                    kill_hung(self.gpu.watch, self.gpu.pid, "GPU worker", reason)
                    await self._gpu_lost(f"hung: {reason}", code=WORKER_HUNG)

    # ------------------------------------------------------ the GPU worker

    async def _gpu_message(self, frames: list[bytes]) -> None:
        counted = False
        try:
            counted = await self._gpu_dispatch(frames)
        finally:
            if counted:  # refused or served: the worker counted it as sent
                self.publisher.processed()

    async def _gpu_dispatch(self, frames: list[bytes]) -> bool:
        """Handle one frame set; whether it was the worker's message that may change residency."""
        if len(frames) != 2:
            if len(frames) > 2:
                send_routed(
                    self.gpu_sock, frames[0], ErrorReply(BAD_REQUEST, f"expected one frame, got {len(frames) - 1}")
                )
            return False
        identity, payload = frames
        try:
            message = decode(payload, COORDINATOR_ACCEPTS_FROM_GPU)
        except ProtocolError as error:
            logger.warning("refused a GPU worker frame: %s", error.message)
            send_routed(self.gpu_sock, identity, ErrorReply(error.code, error.message))
            return False
        if isinstance(message, GpuHello):
            await self._gpu_hello(identity, message)
            return False
        if identity != self.gpu.identity:
            send_routed(
                self.gpu_sock,
                identity,
                ErrorReply(BAD_REQUEST, f"{message.OP} before gpu_hello (or from a GPU worker that was replaced)"),
            )
            return False
        counted = isinstance(message, (Routes, Fence, Prefetch)) or (
            isinstance(message, Visited) and (message.fence is not None or bool(message.predictions))
        )
        if isinstance(message, GpuReady):
            self._gpu_ready(identity, message)
        elif isinstance(message, GpuGoodbye):
            logger.info("GPU worker pid %d is exiting (%s)", message.pid, message.reason)
            self.gpu = replace(self.gpu, ready=False, leaving=message.reason or "goodbye")
        elif isinstance(message, (Routes, Fence)):
            if not self.io_ready:
                send_routed(self.gpu_sock, identity, ErrorReply(NOT_READY, "the I/O workers are not ready yet"))
                return counted
            epoch = self.gpu.epoch
            self.progress.serving = True  # until answered, the worker waits on us, not we on it
            try:
                reply = await self.leases.handle(message)
            finally:
                self.progress.serving, self.progress.at = False, time.monotonic()
            if isinstance(message, Routes):
                self.progress.rows = message.routes.array.shape[0]
            if self.gpu.epoch != epoch:  # the worker was lost while its wave was being loaded
                self.leases.release_for_lost_worker("lost while its wave was being loaded")
                return counted
            send_routed(self.gpu_sock, identity, reply)
            if isinstance(message, Routes) and isinstance(reply, Lease):  # demand first, then the prediction
                self.leases.prefetch(message)
            if isinstance(reply, Fenced):  # the end of a forward step: nothing is leased
                self._safe_point()
        elif isinstance(message, Prefetch):  # no reply, ever: the worker waits for none (a refusal is logged)
            if self.io_ready:
                self.leases.prefetch(message)
        elif isinstance(message, Visited):  # answered only when it fences (or is refused)
            self.progress.at = time.monotonic()
            reply = await self.leases.handle(message)
            if reply is not None:
                send_routed(self.gpu_sock, identity, reply)
            if message.end_step:  # the end of a forward step: nothing is leased
                self._safe_point()
        elif isinstance(message, (Token, JobDone, JobError)):
            await self.front.on_gpu(message)
            if isinstance(message, Token):
                self._safe_point()
        elif isinstance(message, ErrorReply):
            logger.warning("the GPU worker reported %s: %s", message.code, message.message)
        return counted

    async def _gpu_hello(self, identity: bytes, hello: GpuHello) -> None:
        current = self.gpu
        if current.identity is not None:
            if current.identity == identity and current.pid == hello.pid:
                logger.info("GPU worker pid %d said hello again", hello.pid)
                self._welcome(identity)
                return
            if current.pid != hello.pid and current.alive():
                # Releasing a live worker's lease could let a slot be rewritten under its reads.
                message = f"GPU worker pid {current.pid} is connected and alive; refusing pid {hello.pid}"
                logger.warning("%s", message)
                send_routed(self.gpu_sock, identity, ErrorReply(BAD_REQUEST, message))
                return
            await self._gpu_lost(f"a new GPU worker (pid {hello.pid}) said hello")
        self.gpu = GpuSession(epoch=self.gpu.epoch + 1, identity=identity, pid=hello.pid, watch=PidWatch(hello.pid))
        self.publisher.reader_lost()  # a new reader: its message count starts at zero
        logger.info("GPU worker pid %d connected", hello.pid)
        self._welcome(identity)

    def _welcome(self, identity: bytes) -> None:
        shared = self.publisher.enabled
        send_routed(self.gpu_sock, identity, gpu_welcome(self.config, self.store, self.slab.name, shared_path=shared))

    def _gpu_ready(self, identity: bytes, ready: GpuReady) -> None:
        if tuple(ready.sparse_layers) != tuple(self.store.sparse_layers):
            message = (
                f"GPU worker's sparse layers {list(ready.sparse_layers)} are not the store's "
                f"{list(self.store.sparse_layers)}"
            )
            logger.error("%s", message)
            send_routed(self.gpu_sock, identity, ErrorReply(BAD_REQUEST, message))
            return
        self.gpu = GpuSession(
            epoch=self.gpu.epoch,
            identity=identity,
            pid=self.gpu.pid,
            ready=True,
            dense_bytes=ready.dense_bytes,
            wrap_path=ready.wrap_path,
            compiler_bytes=ready.compiler_bytes,
            watch=self.gpu.watch,
        )
        logger.info(
            "GPU worker pid %d ready: %d dense bytes, wrap path %s, kernel compiler reserve %d",
            ready.pid,
            ready.dense_bytes,
            ready.wrap_path,
            ready.compiler_bytes,
        )
        self.meter.sample(force=True)
        self._size_slab()
        self.front.poke()

    async def _gpu_lost(self, reason: str, *, expected: bool = False, code: str = WORKER_FAILED) -> None:
        if expected:  # it said goodbye first: a stop, not a failure (any job was already answered)
            logger.info("GPU worker gone: %s after its goodbye", reason)
        else:
            logger.error("GPU worker lost: %s", reason)
        self.gpu.close()
        self.gpu = GpuSession(epoch=self.gpu.epoch + 1)
        self.leases.release_for_lost_worker(reason)
        self.publisher.reader_lost()  # it was the only reader: nothing reads its slots now
        await self.front.gpu_lost(reason, code=code)

    # ------------------------------------------------------ JobHost

    def send_client(self, identity: bytes, message: object) -> bool:
        return send_routed(self.jobs_sock, identity, message)

    def send_gpu(self, message: object) -> bool:
        self.progress.at = time.monotonic()  # a job (or a cancel) gives it work: its clock starts
        sent = self.gpu.identity is not None and send_routed(self.gpu_sock, self.gpu.identity, message)
        if not sent:  # gone (ROUTER_MANDATORY): no job starts until its loss is handled and one is ready
            self.gpu.ready = False
        return sent

    def ready(self) -> bool:
        return self.io_ready and self.gpu.ready and self.sizing.sized is not None and not self.stopping

    def health(self, request_id: str) -> HealthReply:
        return HealthReply(
            id=request_id,
            ready=self.ready(),
            pid=os.getpid(),
            io_workers=len(self.io.worker_modes()),
            gpu_worker=self.gpu.ready,
            accepting=not self.stopping,
            processes=self.processes(),
            baseline_bytes=self.meter.baseline,
            compiler_bytes=self.sizing.compiler_bytes,
            slots_per_layer=self.sizing.sized.slots_per_layer if self.sizing.sized is not None else 0,
            liveness=platform_liveness(),
        )

    def processes(self) -> tuple[ProcessInfo, ...]:
        return measured_processes(self.meter, self.config.run_dir)

    @functools.cached_property
    def _prefetch_count(self) -> int:  # predicted for prefetch (0: none, though copy ahead may predict)
        return welcome_prefetch(self.config, self.store)

    def job_predicts(self) -> bool:
        return self._prefetch_count > 0 and self.manager.prefetch_book.job_starts()

    def begin_job(self, job_id: int) -> None:
        # The front door counts the job as running already: the first of a busy period opens the
        # book's window; a job joining others shares theirs.
        if len(self.front.active) == 1:
            self.book.begin()
            self._violations = self._hook_violations()

    async def end_job(self, job_id: int, done: JobDone | None, relayed: int) -> tuple[JobStats, str | None]:
        try:
            fallback = sum(t.fallback_ops for t in await self.io.request_telemetry(timeout=2.0))
        except Exception as error:  # telemetry is a nicety; the job's answer must not wait on it
            logger.warning("I/O worker telemetry unavailable: %s", error)
            fallback = self._fallback_ops
        fallback_delta, self._fallback_ops = max(0, fallback - self._fallback_ops), fallback
        # A job's residency figures are the book's window since the last job ended (or the busy
        # period began): a job that ran alone gets exactly its own; overlapping jobs split the
        # period between them, so the run's totals still add up.
        stats = self.book.end(done, relayed=relayed, wrap_path=self.gpu.wrap_path, io_fallback_ops=fallback_delta)
        if self.front.active:  # the door no longer counts this job
            self.book.begin()  # the next window, of the jobs still running (a step boundary: the job's fence came)
        return stats, hook_report(self.fence_checked, job_id, since=self._violations)

    async def between_jobs(self) -> None:
        if self.leases.held is None and not self.manager.active and not self.stopping:
            await self.safepoints.between_jobs()
            self.publisher.sync()

    def cumulative_stats(self) -> JobStats:
        return self.book.cumulative()

    # ------------------------------------------------------ helpers

    def _hook_violations(self) -> int:
        return self.fence_checked.violations if isinstance(self.fence_checked, FenceCheckedBackend) else 0

    def _safe_point(self) -> None:
        """Inside a job, between two forward steps: the footprint check, and a failure if it cannot be met."""
        if not self.front.active or self.leases.held is not None or self.manager.active:
            return
        report = self.safepoints.step()
        if report is not None and report.failed:
            self.front.fail_running(PRESSURE, report.message())

    def _roles(self) -> dict[str, int]:
        return system_roles(self.config, self.io.worker_pids(), self.gpu.pid if self.gpu.ready else None)

    def _size_slab(self) -> None:
        """The first time every process is ready: the slab gets what the budget leaves after them."""
        if self.io_ready and self.gpu.ready and self.sizing.size(compiler_bytes=self.gpu.compiler_bytes):
            self.front.poke()

    def shutdown(self) -> None:
        """Answer queued and running jobs, ask the I/O workers to exit; the caller closes the sockets."""
        self.stopping = True
        self.front.shutdown(SHUTTING_DOWN, "the coordinator is shutting down")
        self.io.shutdown_workers()
        self.gpu.close()


__all__ = ["GPU_MAX_MESSAGE_BYTES", "JOBS_MAX_MESSAGE_BYTES", "NOT_READY", "Coordinator"]
