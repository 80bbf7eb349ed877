"""The I/O worker process: `python -m ioworker --index I --endpoint E ...`.

One entry function, `run_io_worker`: setup (DEALER connect, hello/welcome,
open the manifest, attach the slab, send ready), a poll loop over the socket,
the readers' completion pipe, the signal pipe and the parent's death pipe,
and a `finally` that releases everything. It reads only files of the manifest
fixed at startup; messages name files by index, never by path.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import zmq

from ioworker.engine import HintQueue, LoadEngine, LoadRefused, staging_for
from native import DEFAULT_BLOCK_SIZE, BypassFile, OpenMode, check_block_size
from native.staging import STAGING_REQUESTS, StagingRequest
from shared.io_messages import (
    WORKER_COMMANDS,
    Cancel,
    Hello,
    Hint,
    HintStatus,
    Load,
    Loaded,
    Ready,
    Shutdown,
    TelemetryRequest,
    Welcome,
    WorkerTelemetry,
)
from shared.protocol import (
    BAD_REQUEST,
    INTERNAL,
    MAX_MESSAGE_BYTES,
    ErrorReply,
    ProtocolError,
    decode,
    encode,
    error_frame,
    unpack_map,
)
from shared.slab import Slab

logger = logging.getLogger("ioworker")

SETUP_FAILED = "setup_failed"
EXIT_OK, EXIT_SETUP_FAILED = 0, 1


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    index: int
    endpoint: str
    manifest: str  # JSON file: an array of absolute paths
    slab_name: str
    total_slots: int
    slot_bytes: int
    block_size: int = DEFAULT_BLOCK_SIZE
    queue_depth: int = 8
    io_mode: OpenMode = "auto"
    staging: StagingRequest = "auto"
    hint_queue: int = 256
    death_fd: int | None = None
    handshake_timeout: float = 10.0
    log_level: str = "INFO"
    test_read_delay_ms: float = 0.0  # tests only: hold each load this long before reading


class SetupError(RuntimeError):
    """The worker cannot start; the message goes to the coordinator and stderr."""


def load_manifest(path: str | os.PathLike[str]) -> tuple[str, ...]:
    """The manifest's absolute file paths, or ValueError naming the bad entry."""
    entries = json.loads(Path(path).read_text())
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"manifest {path} must be a non-empty JSON array of absolute paths")
    for index, entry in enumerate(entries):
        if not isinstance(entry, str) or not os.path.isabs(entry):
            raise ValueError(f"manifest {path} entry {index} must be an absolute path, got {entry!r}")
    return tuple(entries)


def worker_arguments(config: WorkerConfig) -> list[str]:
    """Command-line arguments that `parse_args` turns back into `config`."""
    args = [
        "--index",
        str(config.index),
        "--endpoint",
        config.endpoint,
        "--manifest",
        config.manifest,
        "--slab-name",
        config.slab_name,
        "--total-slots",
        str(config.total_slots),
        "--slot-bytes",
        str(config.slot_bytes),
        "--block-size",
        str(config.block_size),
        "--queue-depth",
        str(config.queue_depth),
        "--io-mode",
        config.io_mode,
        "--staging",
        config.staging,
        "--hint-queue",
        str(config.hint_queue),
        "--handshake-timeout",
        str(config.handshake_timeout),
        "--log-level",
        config.log_level,
    ]
    if config.death_fd is not None:
        args += ["--death-fd", str(config.death_fd)]
    if config.test_read_delay_ms:
        args += ["--test-read-delay-ms", str(config.test_read_delay_ms)]
    return args


def parse_args(argv: Sequence[str] | None = None) -> WorkerConfig:
    parser = argparse.ArgumentParser(prog="python -m ioworker", description=__doc__.splitlines()[0])
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--endpoint", required=True, help="the coordinator's ROUTER endpoint")
    parser.add_argument("--manifest", required=True, help="JSON array of absolute file paths")
    parser.add_argument("--slab-name", required=True)
    parser.add_argument("--total-slots", type=int, required=True)
    parser.add_argument("--slot-bytes", type=int, required=True)
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    parser.add_argument("--queue-depth", type=int, default=8, help="concurrent reads")
    parser.add_argument("--io-mode", choices=["auto", "direct", "dontneed", "buffered"], default="auto")
    parser.add_argument(
        "--staging",
        choices=list(STAGING_REQUESTS),
        default="auto",
        help="direct reads through huge-page buffers (native/staging.py)",
    )
    parser.add_argument("--hint-queue", type=int, default=256, help="hint messages queued before drops")
    parser.add_argument("--death-fd", type=int, default=None, help="read end of the parent's death pipe")
    parser.add_argument("--handshake-timeout", type=float, default=10.0)
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--test-read-delay-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    for name in ("index", "total_slots", "slot_bytes", "queue_depth", "hint_queue"):
        minimum = 0 if name == "index" else 1
        if getattr(ns, name) < minimum:
            parser.error(f"--{name.replace('_', '-')} must be >= {minimum}, got {getattr(ns, name)}")
    try:
        check_block_size(ns.block_size)
    except ValueError as error:
        parser.error(str(error))
    return WorkerConfig(**vars(ns))


def _pipe() -> tuple[int, int]:
    read_end, write_end = os.pipe()  # non-inheritable by default
    os.set_blocking(read_end, False)
    os.set_blocking(write_end, False)
    return read_end, write_end


def _drain(fd: int) -> bytes:
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def _poke(fd: int) -> None:
    try:
        os.write(fd, b"\0")
    except (BlockingIOError, OSError):
        pass  # a full pipe already wakes the loop


def _parent_gone(config: WorkerConfig, parent: int, events: dict) -> bool:
    if config.death_fd is not None and config.death_fd in events:
        try:
            if os.read(config.death_fd, 64) == b"":
                return True
        except BlockingIOError:
            pass
    return os.getppid() != parent


def _handshake(sock: zmq.Socket, config: WorkerConfig, wake_r: int, parent: int) -> bool:
    """Send hello and wait for welcome; False when told to stop meanwhile."""
    sock.send(encode(Hello(index=config.index, pid=os.getpid())))
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(wake_r, zmq.POLLIN)
    if config.death_fd is not None:
        poller.register(config.death_fd, zmq.POLLIN)
    deadline = time.monotonic() + config.handshake_timeout
    while (left := deadline - time.monotonic()) > 0:
        events = dict(poller.poll(min(left, 1.0) * 1000))
        if wake_r in events or _parent_gone(config, parent, events):
            return False
        if sock in events:
            frame = sock.recv()
            try:
                fields = unpack_map(frame)
                if fields["op"] == ErrorReply.OP:
                    raise SetupError(f"the coordinator refused this worker: {fields.get('message')!r}")
                reply = decode(frame, WORKER_COMMANDS)
            except ProtocolError as error:
                raise SetupError(f"bad handshake reply: {error}") from None
            if isinstance(reply, Welcome) and reply.index == config.index:
                return True
            if isinstance(reply, Shutdown):
                return False
            raise SetupError(f"expected welcome for index {config.index}, got {reply!r}")
    raise SetupError(f"no welcome from {config.endpoint} within {config.handshake_timeout} s")


class _Server:
    """Socket-thread state of a running worker."""

    def __init__(
        self, sock: zmq.Socket, config: WorkerConfig, files: list[BypassFile], engine: LoadEngine, hints: HintQueue
    ) -> None:
        self.sock, self.config, self.files, self.engine, self.hints = sock, config, files, engine, hints
        self.bad_commands = 0
        self.last_hint_status = HintStatus()
        self.stopping = False

    def send(self, frame: bytes) -> None:
        try:
            self.sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("reply dropped: the coordinator's queue is full")

    def bad(self, code: str, message: str) -> None:
        self.bad_commands += 1
        logger.warning("refused command: %s", message)
        self.send(error_frame(code, message))

    def handle(self, frames: list[bytes]) -> None:
        try:
            self._handle(frames)
        except Exception as error:  # bad input must never kill the worker
            logger.exception("command failed")
            self.bad(INTERNAL, f"command failed: {error!r}")

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) != 1:
            self.bad("bad_frame", f"expected one frame per message, got {len(frames)}")
            return
        try:
            command = decode(frames[0], WORKER_COMMANDS)
        except ProtocolError as error:
            self.bad(error.code, error.message)
            return
        if isinstance(command, Load):
            try:
                self.engine.submit(command)
            except LoadRefused as error:
                self.bad_commands += 1
                message = f"load of slot {command.slot} generation {command.generation} refused: {error}"
                logger.warning("%s", message)
                self.send(
                    encode(
                        Loaded(
                            slot=command.slot, generation=command.generation, ok=False, error=message, code=BAD_REQUEST
                        )
                    )
                )
        elif isinstance(command, Cancel):
            reply = self.engine.cancel(command.slot, command.generation)
            if reply is not None:
                self.send(encode(reply))
        elif isinstance(command, Hint):
            try:
                self.hints.offer(command.segments)
            except LoadRefused as error:
                self.bad(BAD_REQUEST, f"hint refused: {error}")
        elif isinstance(command, TelemetryRequest):
            self.send(encode(self.telemetry()))
        elif isinstance(command, Shutdown):
            logger.info("shutdown requested")
            self.stopping = True
        else:  # a second welcome: harmless, but say so
            self.bad(BAD_REQUEST, f"unexpected {command.OP} after the handshake")

    def flush(self) -> None:
        for reply in self.engine.completions():
            self.send(encode(reply))
        status = self.hints.status()
        if status != self.last_hint_status:
            self.last_hint_status = status
            self.send(encode(status))

    def telemetry(self) -> WorkerTelemetry:
        counters = self.engine.counters
        queued, in_flight = self.engine.depth()
        staging, buffer = self.engine.staging_stats(), self.engine.staging_buffer
        return WorkerTelemetry(
            index=self.config.index,
            pid=os.getpid(),
            loads=counters.loads,
            loads_failed=counters.loads_failed,
            cancelled=counters.cancelled,
            cancel_misses=counters.cancel_misses,
            bytes=counters.bytes,
            read_bytes=counters.read_bytes,
            read_ops=counters.read_ops,
            service_ms=counters.service_ms,
            queued=queued,
            in_flight=in_flight,
            bad_commands=self.bad_commands,
            files=len(self.files),
            bypass_files=sum(f.mode in ("direct", "nocache") for f in self.files),
            fallback_files=sum(f.fell_back for f in self.files),
            fallback_ops=counters.fallback_ops,
            hints=self.hints.status(),
            staging=staging.enabled,
            staging_reason=self.engine.staging.reason,
            staging_bytes=buffer.size if buffer else 0,
            staging_huge_bytes=buffer.huge_bytes if buffer else 0,
            staged_reads=staging.staged_reads,
            staged_bytes=staging.staged_bytes,
            staging_copy_ms=staging.copy_ms,
        )


def run_io_worker(config: WorkerConfig) -> int:
    """Serve until shutdown, SIGTERM/SIGINT or the parent's death; the exit code."""
    parent = os.getppid()
    wake_r, wake_w = _pipe()
    notify_r, notify_w = _pipe()
    stop_signal: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        stop_signal.append(signum)
        _poke(wake_w)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    files: list[BypassFile] = []
    slab = engine = hints = None
    linger = 0
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.ROUTING_ID, f"ioworker-{config.index}".encode())
        sock.connect(config.endpoint)
        if not _handshake(sock, config, wake_r, parent):
            logger.info("stopped during the handshake")
            return EXIT_OK
        try:
            for path in load_manifest(config.manifest):
                files.append(BypassFile.open(path, mode=config.io_mode, block_size=config.block_size))
            slab = Slab.attach(config.slab_name, total_slots=config.total_slots, slot_bytes=config.slot_bytes)
        except (OSError, ValueError) as error:
            raise SetupError(f"setup failed: {error}") from error
        for file in files:
            if file.fell_back:
                logger.warning("%s: the filesystem refused O_DIRECT; reading %s", file.path, file.mode)
        staging = staging_for(files, largest_read=config.slot_bytes, requested=config.staging)
        engine = LoadEngine(
            files=files,
            slab=slab,
            block_size=config.block_size,
            queue_depth=config.queue_depth,
            notify=lambda: _poke(notify_w),
            staging=staging,
            delay_s=config.test_read_delay_ms / 1e3,
        )
        hints = HintQueue(files=files, capacity=config.hint_queue, notify=lambda: _poke(notify_w))
        server = _Server(sock, config, files, engine, hints)
        sock.send(
            encode(
                Ready(
                    index=config.index,
                    pid=os.getpid(),
                    block_size=config.block_size,
                    modes=tuple(f.mode for f in files),
                )
            )
        )
        logger.info(
            "ready: %d files (%s), slab %s", len(files), ",".join(sorted({f.mode for f in files})), config.slab_name
        )
        poller = zmq.Poller()
        for item in (sock, wake_r, notify_r, config.death_fd):
            if item is not None:
                poller.register(item, zmq.POLLIN)
        while not server.stopping and not stop_signal:
            events = dict(poller.poll(1000))
            if _parent_gone(config, parent, events):
                logger.warning("parent process is gone; exiting")
                break
            if wake_r in events:
                _drain(wake_r)
            if notify_r in events:
                _drain(notify_r)
            if sock in events:
                for _ in range(256):  # bounded so completions are not starved
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    server.handle(frames)
            server.flush()
        if stop_signal:
            logger.info("stopping on signal %d", stop_signal[0])
        return EXIT_OK
    except SetupError as error:
        logger.error("%s", error)
        try:
            sock.send(error_frame(SETUP_FAILED, str(error)), zmq.NOBLOCK)
            linger = 1000  # give the error a moment to reach the coordinator
        except zmq.ZMQError:
            pass
        return EXIT_SETUP_FAILED
    finally:
        if hints is not None:
            hints.close()
        if engine is not None:
            for reply in engine.close():  # running reads finish before the slab goes away
                try:
                    sock.send(encode(reply), zmq.NOBLOCK)
                except zmq.ZMQError:
                    break
        for file in files:
            file.close()
        if slab is not None:
            slab.close()
        sock.close(linger=linger)
        context.term()
        for fd in (wake_r, wake_w, notify_r, notify_w):
            os.close(fd)


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    logging.basicConfig(
        level=config.log_level.upper(),
        stream=sys.stderr,
        format=f"%(asctime)s ioworker-{config.index}[%(process)d] %(levelname)s %(name)s: %(message)s",
    )
    return run_io_worker(config)


__all__ = ["WorkerConfig", "load_manifest", "main", "parse_args", "run_io_worker", "worker_arguments"]
