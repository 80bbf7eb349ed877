"""The I/O worker process: `python -m ioworker --index I --endpoint E ...`.

One entry function, `run_io_worker`: setup (DEALER connect, hello/welcome,
open the manifest, attach the slab, send ready), a poll loop over the socket,
the wake pipe (stop signals and the readers' completions) and the parent's
death pipe (`shared.process`), and a `finally` that releases everything. It reads only files of the manifest
fixed at startup; messages name files by index, never by path.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import zmq

from ioworker.engine import HintQueue, LoadEngine, LoadRefused, load_failed, staging_for
from native import BypassFile
from shared.commands import IOWorkerArgs, parse_io_worker_argv
from shared.io_messages import (
    MAX_FRAMES,
    WORKER_COMMANDS,
    Cancel,
    Hello,
    Hint,
    HintStatus,
    Load,
    Ready,
    Shutdown,
    TelemetryRequest,
    Welcome,
    WorkerTelemetry,
)
from shared.process import HandshakeError, ProcessLife, handshake, report_setup_failure
from shared.protocol import (
    BAD_REQUEST,
    INTERNAL,
    ErrorReply,
    ProtocolError,
    decode,
    encode,
    error_frame,
    unpack_map,
)
from shared.scheduling import enter_helper_scheduling
from shared.slab import Slab
from shared.sockets import open_socket

_T, _R = TypeVar("_T"), TypeVar("_R")
logger = logging.getLogger("ioworker")

EXIT_OK, EXIT_SETUP_FAILED = 0, 1


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


def _welcome(config: IOWorkerArgs) -> Callable[[list[bytes]], bool | None]:
    """The handshake's answer: True for our welcome, None for a shutdown, else HandshakeError."""

    def answer(frames: list[bytes]) -> bool | None:
        try:
            if len(frames) != 1:
                raise ProtocolError("bad_frame", f"expected one frame, got {len(frames)}")
            fields = unpack_map(frames[0])
            if fields["op"] == ErrorReply.OP:
                raise HandshakeError(f"the coordinator refused this worker: {fields.get('message')!r}")
            reply = decode(frames[0], WORKER_COMMANDS)
        except ProtocolError as error:
            raise HandshakeError(f"bad handshake reply: {error}") from None
        if isinstance(reply, Welcome) and reply.index == config.index:
            return True
        if isinstance(reply, Shutdown):
            return None
        raise HandshakeError(f"expected welcome for index {config.index}, got {reply!r}")

    return answer


class _Server:
    """Socket-thread state of a running worker."""

    def __init__(
        self,
        sock: zmq.Socket,
        config: IOWorkerArgs,
        files: list[BypassFile],
        engine: LoadEngine,
        hints: HintQueue,
        *,
        scheduling: str,
    ) -> None:
        self.sock, self.config, self.files, self.engine, self.hints = sock, config, files, engine, hints
        self.scheduling = scheduling  # what shared.scheduling applied
        self.bad_commands = 0
        self.last_hint_status = HintStatus()
        self.stopping = False
        self.outgoing: list[bytes] = []  # replies of this loop iteration, sent by flush()

    def send(self, frame: bytes) -> None:
        """Queue a reply; `flush` sends what an iteration of the loop produced as one message."""
        self.outgoing.append(frame)

    def _send_outgoing(self) -> None:
        frames, self.outgoing = self.outgoing, []
        for start in range(0, len(frames), MAX_FRAMES):
            try:
                self.sock.send_multipart(frames[start : start + MAX_FRAMES], zmq.NOBLOCK)
            except zmq.Again:
                logger.warning("%d replies dropped: the coordinator's queue is full", len(frames) - start)
                return

    def bad(self, code: str, message: str) -> None:
        self.bad_commands += 1
        logger.warning("refused command: %s", message)
        self.send(error_frame(code, message))

    def handle_message(self, frames: list[bytes]) -> None:
        """Serve each frame of a message in order (one command each); the loads of a run of
        load frames are read together (`LoadEngine.submit_many`)."""
        if len(frames) > MAX_FRAMES:
            self.bad("bad_frame", f"expected at most {MAX_FRAMES} frames per message, got {len(frames)}")
            return
        loads: list[Load] = []
        for frame in frames:
            command = self._guarded(self._decoded, frame)
            if command is None:
                continue
            if isinstance(command, Load):
                loads.append(command)
                continue
            self._guarded(self._submit_queued, loads)  # before a cancel that may name one of them
            loads = []
            self._guarded(self._serve, command)
        self._guarded(self._submit, loads)

    def _decoded(self, frame: bytes) -> object | None:
        """The frame's command, or None once refused."""
        try:
            return decode(frame, WORKER_COMMANDS)
        except ProtocolError as error:
            self.bad(error.code, error.message)
            return None

    def _guarded(self, serve: Callable[[_T], _R], argument: _T) -> _R | None:
        """`serve(argument)`; None once an error it raised is answered (bad input never kills the worker)."""
        try:
            return serve(argument)
        except Exception as error:
            logger.exception("command failed")
            self.bad(INTERNAL, f"command failed: {error!r}")
            return None

    def _submit_queued(self, loads: list[Load]) -> None:
        """Loads a command follows: queued for a reader, never read here before that command runs."""
        self._submit(loads, inline=False)

    def _submit(self, loads: list[Load], *, inline: bool = True) -> None:
        if not loads:
            return
        for load, error in self.engine.submit_many(loads, inline=inline):
            self.bad_commands += 1
            message = f"load of slot {load.slot} generation {load.generation} refused: {error}"
            logger.warning("%s", message)
            self.send(encode(load_failed(load, message, BAD_REQUEST)))

    def _serve(self, command: object) -> None:
        if isinstance(command, Cancel):
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
        """Send this iteration's replies, the loads finished since the last one and hint progress."""
        for reply in self.engine.completions():
            self.send(encode(reply))
        status = self.hints.status()
        if status != self.last_hint_status:
            self.last_hint_status = status
            self.send(encode(status))
        if self.outgoing:
            self._send_outgoing()

    def telemetry(self) -> WorkerTelemetry:
        counters = self.engine.counters
        queued, in_flight = self.engine.depth()
        staging, buffer, aio = self.engine.staging_stats(), self.engine.staging_buffer, self.engine.aio_stats()
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
            scheduling=self.scheduling,
            aio=aio.enabled,
            aio_reason=aio.reason,
            aio_ranges=aio.ranges,
            aio_reread=aio.reread,
            aio_refused=aio.refused,
            aio_busy=aio.busy,
        )


def run_io_worker(config: IOWorkerArgs) -> int:
    """Serve until shutdown, SIGTERM/SIGINT or the parent's death; the exit code."""
    scheduling = enter_helper_scheduling(config.scheduling)  # every thread, and the ones started from here on
    with ProcessLife(death_fd=config.death_fd) as life:
        context = zmq.Context()
        files: list[BypassFile] = []
        sock = slab = engine = hints = None
        linger = 0
        try:
            sock = open_socket(context, zmq.DEALER, connect=config.endpoint, routing_id=f"ioworker-{config.index}")
            hello = encode(Hello(index=config.index, pid=os.getpid()))
            welcomed = handshake(
                sock, hello, life=life, timeout=config.handshake_timeout, waiting_for="welcome", answer=_welcome(config)
            )
            if not welcomed:
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
            # Reader threads wake the socket loop through the same pipe as the signals do.
            engine = LoadEngine(
                files=files,
                slab=slab,
                block_size=config.block_size,
                queue_depth=config.queue_depth,
                notify=life.wake,
                staging=staging,
                delay_s=config.test_read_delay_ms / 1e3,
            )
            hints = HintQueue(files=files, capacity=config.hint_queue, notify=life.wake)
            server = _Server(sock, config, files, engine, hints, scheduling=scheduling)
            modes = tuple(f.mode for f in files)
            sock.send(encode(Ready(index=config.index, pid=os.getpid(), block_size=config.block_size, modes=modes)))
            logger.info(
                "ready: %d files (%s), slab %s, scheduling %s",
                len(files),
                ",".join(sorted(set(modes))),
                config.slab_name,
                scheduling,
            )
            poller = zmq.Poller()
            poller.register(sock, zmq.POLLIN)
            life.register(poller)
            while not server.stopping and not life.stop_requested:
                events = dict(poller.poll(1000))
                if life.parent_gone(events):
                    logger.warning("parent process is gone; exiting")
                    break
                life.drain(events)
                if sock in events:
                    for _ in range(256):  # bounded so completions are not starved
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        server.handle_message(frames)
                server.flush()
            if life.stop_requested:
                logger.info("stopping on signal %d", life.stop_signal)
            return EXIT_OK
        except (SetupError, HandshakeError) as error:
            logger.error("%s", error)
            linger = report_setup_failure(sock, error)
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
            if sock is not None:
                sock.close(linger=linger)
            context.term()


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_io_worker_argv(argv)
    logging.basicConfig(
        level=config.log_level.upper(),
        stream=sys.stderr,
        format=f"%(asctime)s ioworker-{config.index}[%(process)d] %(levelname)s %(name)s: %(message)s",
    )
    return run_io_worker(config)


__all__ = ["load_manifest", "main", "run_io_worker"]
