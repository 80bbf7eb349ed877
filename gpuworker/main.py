"""The GPU worker process: `python -m gpuworker --model DIR --endpoint E ...`.

One entry function, `run_gpu_worker`: setup (DEALER connect, `gpu_hello` /
`gpu_welcome`, attach the slab, open the expert store with the welcome's
block size, load the model's dense weights, check it against the store,
`gpu_ready`), then jobs one at a time, and a `finally` that fences what is
still leased, closes the socket before the context and detaches the slab
(never unlinks it: the supervisor owns it). The slab is only read here.

It stops on SIGTERM/SIGINT (the current job ends at its next token or lease
request with `job_error` code `worker_stopping`), when the parent dies
(death pipe EOF, or re-parenting), or when the handshake fails or times out
(exit code 1, with one clear log line).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import zmq
from mlx_lm.utils import load_tokenizer

from gpuworker.channel import Channel, LeaseError, ParentGone, WorkerStopping
from gpuworker.generate import DEFAULT_PREFILL_STEP, JobRefused, job_done, run_job
from gpuworker.lanes import MAX_LANES, resolve_lanes
from gpuworker.lease_client import LeaseClient
from gpuworker.model import check_against_store, load_streamed_model
from gpuworker.slots import ZERO_COPY
from shared.config import check_compute_lanes
from shared.gpu_messages import (
    GPU_WORKER_ACCEPTS,
    MAX_ROUTE_ROWS,
    Fenced,
    GpuGoodbye,
    GpuHello,
    GpuReady,
    GpuWelcome,
    Job,
    JobDone,
    JobError,
    Lease,
)
from shared.protocol import BAD_REQUEST, ErrorReply, ProtocolError, decode, encode, error_frame
from shared.slab import Slab
from shared.store import ExpertStore

logger = logging.getLogger("gpuworker")

SETUP_FAILED = "setup_failed"
WORKER_FAILED = "worker_failed"
WORKER_STOPPING = "worker_stopping"
EXIT_OK, EXIT_SETUP_FAILED = 0, 1
# The largest frame the coordinator may legally send is a `job` at its schema limits
# (1 Mi prompt tokens at up to 9 msgpack bytes each, or 1 Mi characters of text); a frame
# over ZMQ_MAXMSGSIZE is not refused but drops the connection, so the bound is generous.
WORKER_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
ROUTING_ID_PREFIX = "gpuworker"
MAX_ERROR_CHARS = 4096


@dataclass(frozen=True, slots=True)
class GpuWorkerConfig:
    model: str
    endpoint: str
    death_fd: int | None = None
    log_level: str = "INFO"
    handshake_timeout: float = 10.0
    reply_timeout: float = 60.0  # longest wait for one lease/fenced reply
    stop_grace: float = 5.0  # after SIGTERM, how long a pending lease reply is still awaited
    prefill_step_size: int = DEFAULT_PREFILL_STEP
    compute_lanes: int | None = None  # MLX streams for a decode wave's parts; None: auto (gpuworker.lanes)


class SetupError(RuntimeError):
    """The worker cannot start; the message goes to stderr and (if `tell`) the coordinator."""

    def __init__(self, message: str, *, tell: bool = True) -> None:
        super().__init__(message)
        self.tell = tell


def worker_arguments(config: GpuWorkerConfig) -> list[str]:
    """Command-line arguments that `parse_args` turns back into `config`."""
    args = [
        "--model",
        config.model,
        "--endpoint",
        config.endpoint,
        "--log-level",
        config.log_level,
        "--handshake-timeout",
        str(config.handshake_timeout),
        "--reply-timeout",
        str(config.reply_timeout),
        "--stop-grace",
        str(config.stop_grace),
        "--prefill-step-size",
        str(config.prefill_step_size),
    ]
    if config.death_fd is not None:
        args += ["--death-fd", str(config.death_fd)]
    if config.compute_lanes is not None:
        args += ["--compute-lanes", str(config.compute_lanes)]
    return args


def gpu_worker_command(config: GpuWorkerConfig, *, python: str = sys.executable) -> list[str]:
    """The argv that starts the GPU worker (pass `config.death_fd` in `pass_fds`)."""
    return [python, "-m", "gpuworker", *worker_arguments(config)]


def parse_args(argv: Sequence[str] | None = None) -> GpuWorkerConfig:
    parser = argparse.ArgumentParser(prog="python -m gpuworker", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the mlx-lm model directory")
    parser.add_argument("--endpoint", required=True, help="the coordinator's ROUTER endpoint")
    parser.add_argument("--death-fd", type=int, default=None, help="read end of the parent's death pipe")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--handshake-timeout", type=float, default=10.0, help="seconds to wait for gpu_welcome")
    parser.add_argument("--reply-timeout", type=float, default=60.0, help="seconds to wait for one lease reply")
    parser.add_argument(
        "--stop-grace", type=float, default=5.0, help="seconds a pending lease reply is still awaited after SIGTERM"
    )
    parser.add_argument("--prefill-step-size", type=int, default=DEFAULT_PREFILL_STEP)
    parser.add_argument(
        "--compute-lanes",
        type=int,
        default=None,
        help=f"MLX streams a decode wave's experts compute on, 1..{MAX_LANES} "
        "(default: auto, 2 on a CPU with 2+ cores, else 1)",
    )
    ns = parser.parse_args(argv)
    if ns.compute_lanes is not None:
        try:
            check_compute_lanes(ns.compute_lanes, name="--compute-lanes")
        except ValueError as error:
            parser.error(str(error))
    for name in ("handshake_timeout", "reply_timeout", "prefill_step_size"):
        if getattr(ns, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(ns, name)}")
    if ns.prefill_step_size > MAX_ROUTE_ROWS:  # one chunk's routes travel in one `routes`
        parser.error(f"--prefill-step-size must be <= {MAX_ROUTE_ROWS}, got {ns.prefill_step_size}")
    if ns.stop_grace < 0:
        parser.error(f"--stop-grace must be >= 0, got {ns.stop_grace}")
    if not Path(ns.model).is_dir():
        parser.error(f"--model {ns.model!r} is not a directory")
    return GpuWorkerConfig(**vars(ns))


def _pipe() -> tuple[int, int]:
    read_end, write_end = os.pipe()  # non-inheritable by default
    os.set_blocking(read_end, False)
    os.set_blocking(write_end, False)
    return read_end, write_end


def _handshake(sock: zmq.Socket, config: GpuWorkerConfig, channel: Channel) -> GpuWelcome | None:
    """Send gpu_hello and wait for gpu_welcome; None when told to stop meanwhile."""
    sock.send(encode(GpuHello(pid=os.getpid())))
    poller = zmq.Poller()
    for item in (sock, channel.wake_fd, config.death_fd):
        if item is not None:
            poller.register(item, zmq.POLLIN)
    deadline = time.monotonic() + config.handshake_timeout
    while (left := deadline - time.monotonic()) > 0:
        events = dict(poller.poll(min(left, 0.5) * 1000))
        if channel.stop_requested() or channel.parent_gone(events):
            return None
        if sock not in events:
            continue
        frames = sock.recv_multipart()
        try:
            if len(frames) != 1:
                raise ProtocolError("bad_frame", f"expected one frame, got {len(frames)}")
            reply = decode(frames[0], GPU_WORKER_ACCEPTS)
        except ProtocolError as error:
            raise SetupError(f"bad handshake reply: {error}") from None
        if isinstance(reply, GpuWelcome):
            return reply
        if isinstance(reply, ErrorReply):
            raise SetupError(f"the coordinator refused this worker: {reply.code}: {reply.message}")
        raise SetupError(f"expected gpu_welcome, got {reply.OP}")
    raise SetupError(
        f"no gpu_welcome from {config.endpoint} within {config.handshake_timeout:g} s", tell=False
    )  # nobody answered: nobody to tell


class _Worker:
    """The loaded worker: serves jobs one at a time on its channel."""

    def __init__(self, channel: Channel, client: LeaseClient, model, tokenizer, info, config: GpuWorkerConfig) -> None:
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
        channel.current_job = job.job_id
        client.reset_stats()
        try:
            if channel.cancel_requested(job.job_id):
                channel.send(JobDone(job_id=job.job_id, tokens=(), finish_reason="cancelled"))
                return
            logger.info("job %d: up to %d tokens", job.job_id, job.max_tokens)
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
            logger.info("job %d lease telemetry: %s", job.job_id, _telemetry_json(generation, stats))
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


def _telemetry_json(generation, stats) -> str:
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
                ]
                for s in stats.layers
            ],
        },
        separators=(",", ":"),
    )


def run_gpu_worker(config: GpuWorkerConfig) -> int:
    """Serve until SIGTERM/SIGINT or the parent's death; the exit code."""
    parent = os.getppid()
    wake_r, wake_w = _pipe()
    stop_signal: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        stop_signal.append(signum)
        try:
            os.write(wake_w, b"\0")
        except OSError:
            pass

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    if config.death_fd is not None:
        os.set_blocking(config.death_fd, False)
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    channel = Channel(
        sock,
        wake_fd=wake_r,
        death_fd=config.death_fd,
        parent_pid=parent,
        stop_requested=lambda: bool(stop_signal),
        stop_grace_s=config.stop_grace,
    )
    slab: Slab | None = None
    client: LeaseClient | None = None
    worker: _Worker | None = None
    linger = 0
    parent_gone = False
    welcomed = False
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, WORKER_MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        # The pid keeps a restarted worker from colliding with its predecessor's routing id.
        sock.setsockopt(zmq.ROUTING_ID, f"{ROUTING_ID_PREFIX}-{os.getpid()}".encode())
        sock.connect(config.endpoint)
        welcome = _handshake(sock, config, channel)
        if welcome is None:
            logger.info("stopped during the handshake")
            return EXIT_OK
        welcomed = True
        step = f"attaching slab {welcome.slab_name}"
        try:
            slab = Slab.attach(welcome.slab_name, total_slots=welcome.total_slots, slot_bytes=welcome.slot_bytes)
            step = f"opening the expert store of {config.model}"
            store = ExpertStore.open(config.model, block_size=welcome.block_size)
            if store.slot_bytes > welcome.slot_bytes:
                raise ValueError(
                    f"the store's experts need {store.slot_bytes}-byte slots; the slab has {welcome.slot_bytes}"
                )
            step = f"loading the tokenizer and model of {config.model}"
            tokenizer = load_tokenizer(Path(config.model), eos_token_ids=store.config.get("eos_token_id"))
            lanes, why = resolve_lanes(config.compute_lanes)
            client = LeaseClient(
                channel,
                store=store,
                buffer=slab.buffer,
                total_slots=welcome.total_slots,
                slot_bytes=welcome.slot_bytes,
                working_slots=welcome.working_slots,
                reply_timeout_s=config.reply_timeout,
                compute_lanes=lanes,
            )
            logger.info(
                "compute lanes: %d (%s)%s",
                lanes,
                why,
                "" if client.wrap_path != ZERO_COPY else "; unused on the zero-copy path",
            )
            model, info = load_streamed_model(config.model, provider=client)  # dense weights only
            step = "checking the model against the store"
            check_against_store(info, store)
        except Exception as error:
            raise SetupError(f"setup failed {step}: {type(error).__name__}: {error}") from error
        if stop_signal:
            logger.info("stopped while loading")
            return EXIT_OK
        worker = _Worker(channel, client, model, tokenizer, info, config)
        channel.send(
            GpuReady(
                pid=os.getpid(),
                dense_bytes=info.dense_bytes,
                sparse_layers=info.sparse_layers,
                wrap_path=client.wrap_path,
            )
        )
        logger.info(
            "ready: %s, %d dense bytes, sparse layers %s, slab %s (%d slots, %d working)",
            info.model_type,
            info.dense_bytes,
            list(info.sparse_layers),
            welcome.slab_name,
            welcome.total_slots,
            welcome.working_slots,
        )
        worker.serve()
        logger.info("stopping on signal %d", stop_signal[0])
        linger = 500  # let the last job_error / fence reach the coordinator
        return EXIT_OK
    except ParentGone:
        parent_gone = True
        logger.warning("parent process is gone; exiting")
        return EXIT_OK
    except SetupError as error:
        logger.error("%s", error)
        try:
            if not error.tell:
                return EXIT_SETUP_FAILED
            sock.send(error_frame(SETUP_FAILED, str(error)), zmq.NOBLOCK)
            linger = 1000  # give the error a moment to reach the coordinator
        except zmq.ZMQError:
            pass
        return EXIT_SETUP_FAILED
    finally:
        if client is not None and client.holding and not parent_gone:
            client.reply_timeout_s = min(client.reply_timeout_s, 2.0)
            try:
                client.release()
            except Exception as error:
                logger.warning("could not fence the held lease on exit: %s", error)
        if welcomed and stop_signal and not parent_gone:
            # After the fences: the coordinator reads them first, then hears this exit is not a loss.
            try:
                sock.send(encode(GpuGoodbye(pid=os.getpid(), reason=f"signal {stop_signal[0]}")), zmq.NOBLOCK)
                linger = max(linger, 500)
            except zmq.ZMQError as error:
                logger.info("could not say goodbye: %s", error)
        worker = client = None
        if slab is not None:
            try:
                slab.close()  # detach only: the supervisor owns (and unlinks) the segment
            except BufferError:
                logger.warning("slab %s still has views; leaving the mapping to process exit", slab.name)
        sock.close(linger=linger)
        context.term()
        for fd in (wake_r, wake_w):
            os.close(fd)


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    logging.basicConfig(
        level=config.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s gpuworker[%(process)d] %(levelname)s %(name)s: %(message)s",
    )
    return run_gpu_worker(config)


__all__ = ["GpuWorkerConfig", "gpu_worker_command", "main", "parse_args", "run_gpu_worker", "worker_arguments"]
