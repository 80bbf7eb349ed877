"""The GPU worker process: `python -m gpuworker --model DIR --endpoint E ...`.

One entry function, `run_gpu_worker`: setup (DEALER connect, `gpu_hello` /
`gpu_welcome`, attach the slab, open the expert store with the welcome's
block size, load the model's dense weights, check it against the store,
`gpu_ready`), then jobs one at a time (`gpuworker.serve.JobServer`), and a
`finally` that fences what is still leased, closes the socket before the
context and detaches the slab (never unlinks it: the supervisor owns it).
The slab is only read here.

It stops on SIGTERM/SIGINT (the current job ends at its next token or lease
request with `job_error` code `worker_stopping`), when the parent dies
(death pipe EOF, or re-parenting; `shared.process`), or when the handshake
fails or times out (exit code 1, with one clear log line).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import zmq
from mlx_lm.utils import load_tokenizer

from gpuworker.batch_serve import BatchJobServer
from gpuworker.channel import Channel, ParentGone
from gpuworker.lanes import jit_compiler_bytes, resolve_lanes
from gpuworker.lease_client import LeaseClient
from gpuworker.model import check_against_store, load_streamed_model
from gpuworker.serve import JobServer
from gpuworker.slots import ZERO_COPY
from shared.commands import GpuWorkerArgs, parse_gpu_worker_argv
from shared.gpu_messages import GPU_WORKER_ACCEPTS, GpuGoodbye, GpuHello, GpuReady, GpuWelcome
from shared.lease_words import LeaseWords, lease_words_bytes
from shared.process import HandshakeError, ProcessLife, handshake, report_setup_failure
from shared.protocol import ErrorReply, ProtocolError, decode, encode
from shared.slab import Slab
from shared.sockets import open_socket
from shared.store import ExpertStore

logger = logging.getLogger("gpuworker")

EXIT_OK, EXIT_SETUP_FAILED = 0, 1
# The largest frame the coordinator may legally send is a `job` at its schema limits
# (1 Mi prompt tokens at up to 9 msgpack bytes each, or 1 Mi characters of text); a frame
# over ZMQ_MAXMSGSIZE is not refused but drops the connection, so the bound is generous.
WORKER_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
ROUTING_ID_PREFIX = "gpuworker"


class SetupError(RuntimeError):
    """The worker cannot start; the message goes to stderr and the coordinator."""


def _welcome(frames: list[bytes]) -> GpuWelcome:
    """The handshake's answer: the coordinator's gpu_welcome, or HandshakeError saying what came instead."""
    try:
        if len(frames) != 1:
            raise ProtocolError("bad_frame", f"expected one frame, got {len(frames)}")
        reply = decode(frames[0], GPU_WORKER_ACCEPTS)
    except ProtocolError as error:
        raise HandshakeError(f"bad handshake reply: {error}") from None
    if isinstance(reply, GpuWelcome):
        return reply
    if isinstance(reply, ErrorReply):
        raise HandshakeError(f"the coordinator refused this worker: {reply.code}: {reply.message}")
    raise HandshakeError(f"expected gpu_welcome, got {reply.OP}")


def _lease_words_bytes(welcome: GpuWelcome) -> int:
    if not welcome.lease_layers:
        return 0
    return lease_words_bytes(slots=welcome.total_slots, layers=welcome.lease_layers, experts=welcome.lease_experts)


def _attach(welcome: GpuWelcome) -> Slab:
    try:
        return Slab.attach(
            welcome.slab_name,
            total_slots=welcome.total_slots,
            slot_bytes=welcome.slot_bytes,
            tail_bytes=_lease_words_bytes(welcome),
        )
    except Exception as error:
        raise SetupError(f"setup failed attaching slab {welcome.slab_name}: {type(error).__name__}: {error}") from error


def _load(config: GpuWorkerArgs, welcome: GpuWelcome, channel: Channel, slab: Slab) -> tuple[LeaseClient, JobServer]:
    """Open the store, load the tokenizer and the dense model over `slab`; SetupError naming the step."""
    try:
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
            parts_min_bytes=welcome.parts_min_bytes,
            batch_rows=config.max_sequences,
            copy_ahead=welcome.copy_ahead > 0,
            words=(
                LeaseWords(
                    slab.buffer,
                    offset=slab.tail_offset,
                    slots=welcome.total_slots,
                    layers=welcome.lease_layers,
                    experts=welcome.lease_experts,
                )
                if welcome.lease_layers
                else None
            ),
        )
        unused = "" if client.wrap_path != ZERO_COPY else "; unused on the zero-copy path"
        logger.info("compute lanes: %d (%s)%s", lanes, why, unused)
        if welcome.copy_ahead and not client.copies_ahead:
            logger.info("copy ahead: off (zero copy, no lease words, or decode waves copied in parts)")
        # The next layer's routers rank experts for prefetch (sent) and for copy ahead (local).
        predict = max(welcome.prefetch, welcome.copy_ahead if client.copies_ahead else 0)
        model, info = load_streamed_model(  # dense only
            config.model, provider=client, predict=predict, distance=config.prefetch_distance
        )
        if welcome.prefetch:
            logger.info("prefetch: %d experts of the sparse layer %d ahead", welcome.prefetch, config.prefetch_distance)
        step = "checking the model against the store"
        check_against_store(info, store)
    except Exception as error:
        raise SetupError(f"setup failed {step}: {type(error).__name__}: {error}") from error
    serving = BatchJobServer if config.max_sequences > 1 else JobServer
    return client, serving(channel, client, model, tokenizer, info, config)


def _announce_ready(channel: Channel, server: JobServer, welcome: GpuWelcome) -> None:
    """`gpu_ready`: from here on the coordinator sends jobs (so never after a stop request)."""
    info, wrap_path = server.info, server.client.wrap_path
    channel.send(
        GpuReady(
            pid=os.getpid(),
            dense_bytes=info.dense_bytes,
            sparse_layers=info.sparse_layers,
            wrap_path=wrap_path,
            compiler_bytes=jit_compiler_bytes(),
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


def run_gpu_worker(config: GpuWorkerArgs) -> int:
    """Serve until SIGTERM/SIGINT or the parent's death; the exit code."""
    with ProcessLife(death_fd=config.death_fd) as life:
        context = zmq.Context()
        sock: zmq.Socket | None = None
        slab: Slab | None = None
        client: LeaseClient | None = None
        linger = 0
        parent_gone = welcomed = False
        try:
            # The pid keeps a restarted worker from colliding with its predecessor's routing id.
            sock = open_socket(
                context,
                zmq.DEALER,
                connect=config.endpoint,
                max_message_bytes=WORKER_MAX_MESSAGE_BYTES,
                routing_id=f"{ROUTING_ID_PREFIX}-{os.getpid()}",
            )
            channel = Channel(sock, life=life, stop_grace_s=config.stop_grace)
            hello = encode(GpuHello(pid=os.getpid()))
            welcome = handshake(
                sock, hello, life=life, timeout=config.handshake_timeout, waiting_for="gpu_welcome", answer=_welcome
            )
            if welcome is None:
                logger.info("stopped during the handshake")
                return EXIT_OK
            welcomed = True
            slab = _attach(welcome)
            client, server = _load(config, welcome, channel, slab)
            if life.stop_requested:
                logger.info("stopped while loading")
                return EXIT_OK
            _announce_ready(channel, server, welcome)
            server.serve()
            logger.info("stopping on signal %d", life.stop_signal)
            linger = 500  # let the last job_error / fence reach the coordinator
            return EXIT_OK
        except ParentGone:
            parent_gone = True
            logger.warning("parent process is gone; exiting")
            return EXIT_OK
        except (SetupError, HandshakeError) as error:
            logger.error("%s", error)
            linger = report_setup_failure(sock, error)
            return EXIT_SETUP_FAILED
        finally:
            if client is not None and client.holding and not parent_gone:
                client.reply_timeout_s = min(client.reply_timeout_s, 2.0)
                try:
                    client.release()
                except Exception as error:
                    logger.warning("could not fence the held lease on exit: %s", error)
            if sock is not None and welcomed and life.stop_requested and not parent_gone:
                # After the fences: the coordinator reads them first, then hears this exit is not a loss.
                try:
                    sock.send(encode(GpuGoodbye(pid=os.getpid(), reason=f"signal {life.stop_signal}")), zmq.NOBLOCK)
                    linger = max(linger, 500)
                except zmq.ZMQError as error:
                    logger.info("could not say goodbye: %s", error)
            client = None
            if slab is not None:
                try:
                    slab.close()  # detach only: the supervisor owns (and unlinks) the segment
                except BufferError:
                    logger.warning("slab %s still has views; leaving the mapping to process exit", slab.name)
            if sock is not None:
                sock.close(linger=linger)
            context.term()


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_gpu_worker_argv(argv)
    logging.basicConfig(
        level=config.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s gpuworker[%(process)d] %(levelname)s %(name)s: %(message)s",
    )
    return run_gpu_worker(config)


__all__ = ["main", "run_gpu_worker"]
