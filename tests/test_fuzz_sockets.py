"""Generated bad input on three real processes' sockets: the job front door, the coordinator's GPU
socket (as a second, rogue GPU worker) and an I/O worker (from a test ROUTER playing coordinator).

Each example sends a few multipart messages (tests/helpers/fuzz.py: random msgpack values, maps
with a valid op and wrongly typed or out-of-range fields, invalid UTF-8, deep nesting, truncated
frames, zero-length and extra frames), then a sentinel whose answer must come back: every reply
before it must decode as a message the peer accepts, and an `error` must carry a refusal's code
(never `internal`); the process must stay alive and log no handler failure. After the batch a
valid request gets the right answer: the front door's greedy job gives the tokens it gave before
the fuzzing, the I/O worker's load lands the file's bytes.

Hypothesis runs derandomized (the same examples every run, so CI is reproducible) with no
example database; one system and one I/O worker serve a whole module.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import msgpack
import numpy as np
import psutil
import pytest
import zmq
from hypothesis import HealthCheck, assume, example, given, settings

from coordinator.service import GPU_MAX_MESSAGE_BYTES
from shared.children import CHILD_LOGGER, spawn_child, stop_children
from shared.commands import IO_WORKER_MODULE, IOWorkerArgs, child_command, io_worker_argv
from shared.gpu_messages import (
    COORDINATOR_ACCEPTS_FROM_GPU,
    GPU_WORKER_ACCEPTS,
    Fence,
    GpuGoodbye,
    GpuHello,
    GpuReady,
    JobDone,
    JobError,
    Prefetch,
    RouteMatrix,
    Routes,
    Token,
)
from shared.io_messages import (
    WORKER_COMMANDS,
    WORKER_REPLIES,
    Cancel,
    ErrorReply,
    Hello,
    Hint,
    Load,
    Loaded,
    Ready,
    Shutdown,
    TelemetryRequest,
    Welcome,
    WorkerTelemetry,
)
from shared.job_messages import (
    CLIENT_ACCEPTS,
    COORDINATOR_ACCEPTS_FROM_CLIENTS,
    CancelJob,
    Generate,
    HealthReply,
    HealthRequest,
    JobFailed,
    StatsRequest,
)
from shared.protocol import decode, encode
from shared.segments import ExpertIOHintSegment, ExpertIOSegment
from shared.slab import SLOT_ALIGNMENT, Slab
from shared.sockets import open_socket
from tests.helpers.fuzz import messages, pack
from tests.helpers.models import write_tiny_model
from tests.helpers.system import run_job, start_test_system

EXAMPLES = 200
# Each stage the tests check was reached, whatever the generated examples (derandomized, they
# change whenever a message type gains a field): an unknown op, and a frame that is not msgpack.
STAGES = ([pack({"op": "no_such_op", "id": "x"})], [b"\xc1"])
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
REPLY_TIMEOUT_S = 30.0  # a process that does not answer the sentinel within this hangs
MAX_TOKENS = 16  # --max-tokens: a valid generate the fuzzer happens to make runs briefly
# Valid messages the fuzzer mutates one field of (or sends as they are).
CLIENT_BASES = (
    Generate(id="v", prompt_tokens=(1, 2, 3), max_tokens=4),
    Generate(id="w", prompt="hi", max_tokens=2, temperature=0.5, top_p=0.9, seed=3),
    CancelJob(id="v"),
    StatsRequest(id="s"),
    HealthRequest(id="h"),
)
GPU_BASES = (
    GpuHello(pid=1),
    GpuReady(pid=1, dense_bytes=1, sparse_layers=(0, 1)),
    GpuGoodbye(pid=1, reason="bye"),
    Routes(layer=0, routes=RouteMatrix(np.array([[0, 1]])), fence=1, prefetch_layer=1, prefetch=(2,)),
    Fence(lease_id=1, next=True),
    Prefetch(layer=0, experts=(1, 2)),
    Token(job_id=1, index=0, token=5),
    JobDone(job_id=1, tokens=(5,)),
    JobError(job_id=1, code="x", message="y"),
    ErrorReply(code="x", message="y"),
)
IO_BASES = (
    Welcome(index=0),
    Load(slot=1, generation=1, segments=(ExpertIOSegment(0, 4096, 1000, 0),)),
    Cancel(slot=1, generation=1),
    Hint(segments=(ExpertIOHintSegment(0, 0, 4096),)),
    TelemetryRequest(),
)
# Refusals a client may see; `internal` (and anything else) would be a handler failing.
CLIENT_REFUSALS = {
    "bad_message",
    "unknown_op",
    "bad_field",
    "bad_request",
    "prompt_too_long",
    "max_tokens_too_large",
    "context_exceeded",
    "client_queue_full",
    "cancelled",
    "unknown_job",
    "duplicate_id",
    "message_too_large",
}
PEER_REFUSALS = {"bad_frame", "bad_message", "unknown_op", "bad_field", "bad_request"}
# What a handler logs when an exception escaped it (the process survived, but the input was not refused).
HANDLER_FAILURES = ("failed to handle", "command failed", "Traceback")


class ChildLog(logging.Handler):
    """The children's forwarded stderr lines that say a handler failed."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.failures: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if any(word in message for word in HANDLER_FAILURES):
            self.failures.append(message)


@pytest.fixture(scope="module")
def module_child_log():
    handler, logger = ChildLog(), logging.getLogger(CHILD_LOGGER)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture()
def child_log(module_child_log):
    """The children's handler failures during this test (a failure before it is another test's)."""
    module_child_log.failures.clear()
    return module_child_log


@pytest.fixture(scope="module")
def system(tmp_path_factory, module_child_log):
    path = write_tiny_model(tmp_path_factory.mktemp("fuzz"), family="qwen3_moe")
    with start_test_system(path, run_config=dict(max_tokens=MAX_TOKENS)) as running:
        yield running
    # Leaks after the module's system stopped: its processes, its slab, its run directory.
    assert not [pid for pid in running.pids.values() if _alive(pid)], running.pids
    assert running.slab_name and not Path("/dev/shm", running.slab_name.lstrip("/")).exists()
    assert not os.path.exists(running.run_dir)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _dealer(context: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def _exchange(sock: zmq.Socket, message: list[bytes], sentinel: bytes, registry, is_sentinel) -> list:
    """Send `message` and then `sentinel`; every reply before the sentinel's, decoded."""
    sock.send_multipart(message)
    sock.send(sentinel)
    replies = []
    while True:
        assert sock.poll(REPLY_TIMEOUT_S * 1000), f"no answer to the sentinel after {message!r:.300}: a hang"
        frames = sock.recv_multipart()
        assert len(frames) == 1, frames
        reply = decode(frames[0], registry)  # a malformed reply fails the test here
        if is_sentinel(reply):
            return replies
        replies.append(reply)


def _op(frame: bytes) -> dict | None:
    try:
        value = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception:
        return None
    return value if isinstance(value, dict) else None


def _first_op(message: list[bytes]) -> object:
    return _op(message[0])


def _assert_serves_on(system, pids: dict[str, int], before: list[int], child_log) -> None:
    """After the fuzzing: the same processes, alive, the same answer, and no failure logged."""
    assert system.pids == pids and all(_alive(pid) for pid in pids.values()), system.dead_children()
    assert run_job(system, max_tokens=8, return_logprobs=False).tokens == before
    assert not child_log.failures, child_log.failures[:5]


# ------------------------------------------------------------------------ the job front door


def test_fuzzed_client_frames_get_errors_and_the_door_serves_on(system, child_log):
    before = run_job(system, max_tokens=8, return_logprobs=False).tokens
    pids = system.pids
    context = zmq.Context()
    sock = _dealer(context, system.endpoint)
    counter = iter(range(1 << 30))

    @FUZZ
    @given(message=messages(list(COORDINATOR_ACCEPTS_FROM_CLIENTS.values()), CLIENT_BASES))
    @example(message=STAGES[0])
    @example(message=STAGES[1])
    def fuzz(message: list[bytes]) -> None:
        sentinel_id = f"sentinel-{next(counter)}"
        replies = _exchange(
            sock,
            message,
            pack({"op": "health", "id": sentinel_id}),
            CLIENT_ACCEPTS,
            lambda reply: isinstance(reply, HealthReply) and reply.id == sentinel_id,
        )
        for reply in replies:
            seen.append(reply.code if isinstance(reply, JobFailed) else reply.OP)
            if isinstance(reply, JobFailed):
                assert reply.code in CLIENT_REFUSALS and reply.message, reply
        assert not child_log.failures, child_log.failures[:5]

    seen: list[str] = []
    try:
        fuzz()
    finally:
        sock.close(linger=0)
        context.term()
    _assert_serves_on(system, pids, before, child_log)
    # The examples reached every stage of the door: decoding, validation, and the queue.
    assert {"bad_message", "unknown_op", "bad_field", "bad_request", "token"} <= set(seen), sorted(set(seen))


# --------------------------------------------------------- the coordinator's GPU socket, as a rogue


def test_a_rogue_gpu_peer_gets_errors_and_the_real_worker_serves_on(system, child_log):
    before = run_job(system, max_tokens=8, return_logprobs=False).tokens
    pids = system.pids
    gpu_pid = pids["GPU worker"]
    context = zmq.Context()
    sock = _dealer(context, system.config.endpoints.gpu)
    counter = iter(range(1 << 30))

    @FUZZ
    @given(message=messages(list(COORDINATOR_ACCEPTS_FROM_GPU.values()), GPU_BASES))
    @example(message=STAGES[0])
    @example(message=STAGES[1])
    def fuzz(message: list[bytes]) -> None:
        first = _first_op(message)
        # A hello claiming the real worker's own pid is that worker reconnecting, by design.
        assume(not (first and first.get("op") == "gpu_hello" and first.get("pid") == gpu_pid))
        sentinel = f"sentinel-{next(counter)}"
        replies = _exchange(
            sock,
            message,
            pack({"op": sentinel}),
            GPU_WORKER_ACCEPTS,
            lambda reply: isinstance(reply, ErrorReply) and f"'{sentinel}'" in reply.message,
        )
        for reply in replies:  # the rogue is never welcomed, leased or given a job
            assert isinstance(reply, ErrorReply) and reply.code in PEER_REFUSALS and reply.message, reply
            seen.append(reply.code)
        assert not child_log.failures, child_log.failures[:5]

    seen: list[str] = []
    try:
        fuzz()
        # Over the GPU socket's ZMQ_MAXMSGSIZE a frame is not read at all: ZeroMQ drops that peer's
        # connection (an internal socket: no `message_too_large` answer), and nobody else's.
        giant = _dealer(context, system.config.endpoints.gpu)
        giant.send(b"\x00" * (GPU_MAX_MESSAGE_BYTES + 1))
        assert not giant.poll(1000)
        giant.close(linger=0)
    finally:
        sock.close(linger=0)
        context.term()
    _assert_serves_on(system, pids, before, child_log)
    # bad_request: a well-formed message from a peer that never said hello (or a hello refused).
    assert {"bad_frame", "bad_message", "unknown_op", "bad_field", "bad_request"} <= set(seen), sorted(set(seen))


# ------------------------------------------------------------------------------ an I/O worker

SLOT = 4 * SLOT_ALIGNMENT
FILE_SIZE = 128 * 1024


class IOWorkerUnderTest:
    """A real I/O worker connected to a ROUTER this test binds (it plays the coordinator)."""

    def __init__(self, root: Path, slab: Slab) -> None:
        self.blobs = [os.urandom(FILE_SIZE) for _ in range(2)]
        paths = [root / f"f{index}.bin" for index in range(2)]
        for path, blob in zip(paths, self.blobs):
            path.write_bytes(blob)
        (root / "manifest.json").write_text(json.dumps([str(path) for path in paths]))
        self.context = zmq.Context()
        self.endpoint = f"ipc://{root}/io.sock"
        self.sock = open_socket(self.context, zmq.ROUTER, bind=self.endpoint)
        args = IOWorkerArgs(
            index=0,
            endpoint=self.endpoint,
            manifest=str(root / "manifest.json"),
            slab_name=slab.name,
            total_slots=slab.total_slots,
            slot_bytes=slab.slot_bytes,
            handshake_timeout=10.0,
            io_mode="buffered",
        )
        self.worker = spawn_child("I/O worker 0", child_command(IO_WORKER_MODULE, io_worker_argv(args)))
        self.identity = b""
        self.pending: list[bytes] = []

    def recv(self):
        """The next reply; a message of several frames (replies ready at once) is several replies."""
        if not self.pending:
            assert self.sock.poll(REPLY_TIMEOUT_S * 1000), f"no reply: {self.worker.describe()}"
            frames = self.sock.recv_multipart()
            assert len(frames) >= 2, frames
            self.identity, self.pending = frames[0], frames[1:]
        return decode(self.pending.pop(0), WORKER_REPLIES)

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart([self.identity, *frames])

    def handshake(self) -> None:
        assert isinstance(self.recv(), Hello)
        self.send([encode(Welcome(index=0))])
        assert isinstance(self.recv(), Ready)

    def close(self) -> None:
        try:
            if self.worker.exit_code is None and self.identity:
                self.send([encode(Shutdown())])
                self.worker.process.wait(timeout=10)
        finally:
            stop_children([self.worker], timeout=5.0)
            self.sock.close()
            self.context.term()
            Path(self.endpoint.removeprefix("ipc://")).unlink(missing_ok=True)


@pytest.fixture(scope="module")
def io_worker(tmp_path_factory):
    with Slab.create(total_slots=4, slot_bytes=SLOT) as slab:
        under_test = IOWorkerUnderTest(tmp_path_factory.mktemp("io-fuzz"), slab)
        try:
            under_test.handshake()
            yield under_test, slab
        finally:
            under_test.close()
        assert under_test.worker.exit_code == 0, under_test.worker.describe()


def test_fuzzed_commands_get_errors_and_the_io_worker_serves_on(io_worker, child_log):
    worker, slab = io_worker
    counter = iter(range(1 << 30))
    commands = [cls for cls in WORKER_COMMANDS.values() if cls is not Shutdown]  # a shutdown is obeyed

    def exchange(message: list[bytes], sentinel: str) -> list:
        worker.send(message)
        worker.send([pack({"op": sentinel})])
        replies = []
        while True:
            reply = worker.recv()
            if isinstance(reply, ErrorReply) and f"'{sentinel}'" in reply.message:
                return replies
            replies.append(reply)

    @FUZZ
    @given(message=messages(commands, IO_BASES))
    @example(message=STAGES[0])
    @example(message=STAGES[1])
    def fuzz(message: list[bytes]) -> None:
        # Every frame is a command of its own: a shutdown in any of them is obeyed.
        assume(not any(op and op.get("op") == Shutdown.OP for op in map(_op, message)))
        for reply in exchange(message, f"sentinel-{next(counter)}"):
            seen.append(reply.code if isinstance(reply, ErrorReply) else reply.OP)
            if isinstance(reply, ErrorReply):
                assert reply.code in PEER_REFUSALS and reply.message, reply
            elif isinstance(reply, Loaded) and not reply.ok:
                assert reply.code != "internal" and reply.error, reply
        assert worker.worker.exit_code is None, worker.worker.describe()
        assert not child_log.failures, child_log.failures[:5]

    seen: list[str] = []
    fuzz()
    assert {"bad_frame", "bad_message", "unknown_op", "bad_field", "bad_request", "loaded"} <= set(seen), sorted(
        set(seen)
    )
    # Loads the fuzzer got accepted finish first; then a valid load lands the file's bytes.
    while True:
        worker.send([encode(TelemetryRequest())])
        reply = worker.recv()
        while not isinstance(reply, WorkerTelemetry):
            reply = worker.recv()
        if reply.queued == 0 and reply.in_flight == 0:
            break
    segment = ExpertIOSegment(1, 4096 + 7, 1000, 7)
    worker.send([encode(Load(slot=3, generation=1 << 40, segments=(segment,)))])
    reply = worker.recv()
    while not (isinstance(reply, Loaded) and reply.generation == 1 << 40):
        reply = worker.recv()
    assert reply.ok and reply.bytes == segment.length, reply
    base, want = slab.slot_offset(3) + segment.destination, worker.blobs[1][segment.offset :][: segment.length]
    assert slab.buffer[base : base + segment.length] == want
    assert _alive(worker.worker.pid) and not child_log.failures, child_log.failures[:5]
