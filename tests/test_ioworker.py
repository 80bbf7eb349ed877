"""A real I/O worker process driven by a test ROUTER speaking the raw protocol."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from ioworker.engine import HintQueue, LoadEngine
from ioworker.main import load_manifest
from native import HAVE_AIO, BypassFile
from native.staging import choose_staging
from shared.children import spawn_child, stop_children
from shared.commands import IO_WORKER_MODULE, IOWorkerArgs, child_command, io_worker_argv, parse_io_worker_argv
from shared.io_messages import (
    MAX_FRAMES,
    WORKER_REPLIES,
    Cancel,
    ErrorReply,
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
from shared.protocol import decode, encode
from shared.segments import ExpertIOHintSegment, ExpertIOSegment
from shared.slab import SLOT_ALIGNMENT, Slab
from shared.sockets import open_socket

SLOT = 4 * SLOT_ALIGNMENT  # 64 KiB
FILE_SIZE = 256 * 1024


class Coordinator:
    """The coordinator's side, by hand: a ROUTER and one spawned worker."""

    def __init__(self, tmp_path: Path, files: list[Path], slab: Slab, **options) -> None:
        self.context = zmq.Context()
        self.endpoint = f"ipc://{tmp_path}/io.sock"
        self.sock = open_socket(self.context, zmq.ROUTER, bind=self.endpoint)
        manifest = tmp_path / "manifest.json"
        manifest.write_text(json.dumps([str(p) for p in files]))
        config = IOWorkerArgs(
            index=0,
            endpoint=self.endpoint,
            manifest=str(manifest),
            slab_name=slab.name,
            total_slots=slab.total_slots,
            slot_bytes=slab.slot_bytes,
            handshake_timeout=5.0,
            **options,
        )
        self.worker = spawn_child("I/O worker 0", child_command(IO_WORKER_MODULE, io_worker_argv(config)))
        self.identity = b""
        self.pending: list[bytes] = []  # replies of a message not yet returned by recv()
        self.messages = 0  # messages received

    def recv(self, timeout: float = 10.0):
        """The next reply; a message of several frames (replies ready at once) is several replies."""
        if not self.pending:
            if not self.sock.poll(timeout * 1000):
                raise TimeoutError(f"no reply within {timeout} s; {self.worker.describe()}")
            self.identity, *self.pending = self.sock.recv_multipart()
            self.messages += 1
        return decode(self.pending.pop(0), WORKER_REPLIES)

    def send(self, message) -> None:
        self.send_raw(encode(message))

    def send_raw(self, frame: bytes) -> None:
        self.sock.send_multipart([self.identity, frame])

    def handshake(self) -> Ready:
        hello = self.recv()
        assert isinstance(hello, Hello) and hello.index == 0 and hello.pid == self.worker.pid
        self.send(Welcome(index=0))
        ready = self.recv()
        assert isinstance(ready, Ready), ready
        self.modes = ready.modes
        return ready

    def expect(self, kind, timeout: float = 10.0):
        """The next reply of `kind`, skipping hint progress reports."""
        while True:
            reply = self.recv(timeout)
            if isinstance(reply, kind):
                return reply
            assert isinstance(reply, HintStatus), f"expected {kind.__name__}, got {reply!r}"

    def close(self) -> int:
        if self.worker.exit_code is None and self.identity:
            self.send(Shutdown())
        try:
            self.worker.process.wait(timeout=10)
        finally:
            stop_children([self.worker], timeout=5.0)
            code = self.worker.process.returncode
            self.sock.close()
            self.context.term()
            Path(self.endpoint.removeprefix("ipc://")).unlink(missing_ok=True)
        return code


@pytest.fixture()
def files(tmp_path):
    paths, blobs = [], []
    for index in range(2):
        blob = os.urandom(FILE_SIZE)
        path = tmp_path / f"f{index}.bin"
        path.write_bytes(blob)
        paths.append(path)
        blobs.append(blob)
    return paths, blobs


@pytest.fixture()
def slab():
    with Slab.create(total_slots=4, slot_bytes=SLOT) as created:
        yield created


@pytest.fixture()
def coordinator(tmp_path, files, slab):
    made = []

    def start(**options) -> Coordinator:
        coord = Coordinator(tmp_path, files[0], slab, **options)
        made.append(coord)
        coord.handshake()
        return coord

    yield start
    for coord in made:
        coord.close()


def assert_landed(slab: Slab, slot: int, segments, blobs) -> None:
    """Every segment's file bytes sit at its destination in `slot`."""
    base = slab.slot_offset(slot)
    for s in segments:
        landed = slab.buffer[base + s.destination : base + s.destination + s.length]
        assert landed == blobs[s.file][s.offset : s.offset + s.length]


def good_load(slot: int, generation: int) -> Load:
    return Load(slot=slot, generation=generation, segments=(ExpertIOSegment(1, 4096 + 7, 1000, 7),))


def test_loads_land_exactly_and_telemetry_counts(coordinator, files, slab):
    coord = coordinator()
    _, blobs = files
    segments = (
        ExpertIOSegment(0, 12345, 20000, 12345 % 4096),
        ExpertIOSegment(1, 77, 5, 40960 + 77),
        ExpertIOSegment(1, FILE_SIZE - 3, 3, 50000 - 50000 % 4096 + (FILE_SIZE - 3) % 4096),
    )
    coord.send(Load(slot=2, generation=5, segments=segments))
    reply = coord.expect(Loaded)
    assert (reply.slot, reply.generation, reply.ok, reply.bytes) == (2, 5, True, 20008)
    assert reply.service_ms > 0
    assert_landed(slab, 2, segments, blobs)
    coord.send(TelemetryRequest())
    telemetry = coord.expect(WorkerTelemetry)
    assert (telemetry.loads, telemetry.bytes, telemetry.read_ops, telemetry.files) == (1, 20008, 3, 2)
    assert telemetry.bypass_files == 2 and telemetry.fallback_files == 0
    # A load's direct ranges go to the kernel together (Linux AIO); elsewhere the worker says why not.
    assert telemetry.aio == HAVE_AIO and (telemetry.aio_reason == "") == HAVE_AIO
    direct = all(mode == "direct" for mode in coord.modes)
    assert telemetry.aio_ranges == (3 if HAVE_AIO and direct else 0)
    assert telemetry.aio_reread == telemetry.aio_refused == telemetry.aio_busy == 0


@pytest.mark.skipif(
    not hasattr(os, "SCHED_BATCH") or len(os.sched_getaffinity(0)) < 2, reason="Linux scheduling, 2+ CPUs"
)
@pytest.mark.parametrize("scheduling", ["batch", "last-cpu", "normal"])
def test_every_thread_of_a_worker_runs_in_its_scheduling_class(coordinator, scheduling):
    """Set before any thread starts, so the readers and ZeroMQ's I/O thread have it too (shared/scheduling.py)."""
    coord = coordinator(scheduling=scheduling)
    coord.send(good_load(0, 1))
    assert coord.expect(Loaded).ok  # the readers have started
    coord.send(TelemetryRequest())
    assert coord.expect(WorkerTelemetry).scheduling == scheduling
    threads = [int(tid) for tid in os.listdir(f"/proc/{coord.worker.pid}/task")]
    policy = os.SCHED_BATCH if scheduling == "batch" else os.SCHED_OTHER
    assert len(threads) > 3 and {os.sched_getscheduler(tid) for tid in threads} == {policy}
    allowed = os.sched_getaffinity(0)
    cpus = {max(allowed)} if scheduling == "last-cpu" else allowed
    assert {frozenset(os.sched_getaffinity(tid)) for tid in threads} == {frozenset(cpus)}


def test_forced_fallback_is_reported(coordinator, files, slab):
    coord = coordinator(io_mode="dontneed")
    coord.send(good_load(0, 1))
    assert coord.expect(Loaded).ok
    coord.send(TelemetryRequest())
    telemetry = coord.expect(WorkerTelemetry)
    assert telemetry.bypass_files == 0 and telemetry.read_ops == 1


@pytest.mark.parametrize("staging", ["on", "off", "auto"])
def test_staging_lands_the_same_bytes_and_telemetry_says_what_ran(coordinator, files, slab, staging):
    coord = coordinator(staging=staging)
    _, blobs = files
    segments = (ExpertIOSegment(0, 12345, 40000, 12345 % 4096), ExpertIOSegment(1, 5, 100, 49152 + 5))
    coord.send(Load(slot=1, generation=3, segments=segments))
    assert coord.expect(Loaded).ok
    assert_landed(slab, 1, segments, blobs)
    coord.send(TelemetryRequest())
    telemetry = coord.expect(WorkerTelemetry)
    assert telemetry.staging_reason
    expected = choose_staging([str(p) for p in files[0]], largest_read=SLOT, requested=staging)
    assert telemetry.staging == expected.enabled and telemetry.staging_reason == expected.reason
    if staging == "on":
        assert telemetry.staging and telemetry.staged_reads == 2 and telemetry.staged_bytes == telemetry.read_bytes
        assert telemetry.staging_bytes == 8 * (2 << 20)  # queue depth 8 x one 2 MiB stride for 64 KiB slots
        assert telemetry.staging_copy_ms > 0
    elif not expected.enabled:
        assert not telemetry.staging and telemetry.staged_reads == 0 and telemetry.staging_bytes == 0


@pytest.mark.parametrize(
    ("frame", "code", "fragment"),
    [
        (b"\x93garbage", "bad_frame", "not msgpack"),
        (msgpack.packb([1, 2, 3]), "bad_message", "must be a map"),
        (msgpack.packb({"op": "format_disk"}), "unknown_op", "format_disk"),
        (msgpack.packb({"op": "cancel", "slot": "x", "generation": 1}), "bad_field", "'x'"),
        (encode(Hint(segments=(ExpertIOHintSegment(9, 0, 10),))), "bad_request", "file index 9"),
    ],
)
def test_bad_frames_get_an_error_and_the_worker_keeps_serving(coordinator, frame, code, fragment):
    coord = coordinator()
    coord.send_raw(frame)
    error = coord.expect(ErrorReply)
    assert error.code == code and fragment in error.message
    coord.send(good_load(1, 1))
    assert coord.expect(Loaded).ok


@pytest.mark.parametrize(
    ("segment", "slot", "fragment"),
    [
        (ExpertIOSegment(2, 0, 10, 0), 0, "file index 2 is not in the manifest of 2 files"),
        (ExpertIOSegment(0, 0, -5, 0), 0, "length -5 must be positive"),
        (ExpertIOSegment(0, 0, 0, 0), 0, "length 0 must be positive"),
        (ExpertIOSegment(0, -4096, 10, 0), 0, "offset -4096 is negative"),
        (ExpertIOSegment(0, FILE_SIZE - 10, 11, 0), 0, f"[{FILE_SIZE - 10}, {FILE_SIZE + 1}) of file 0"),
        (ExpertIOSegment(0, 0, 10, SLOT - 5), 0, f"destination [{SLOT - 5}, {SLOT + 5}) is outside the slot"),
        (ExpertIOSegment(0, 0, 10, -4096), 0, "destination [-4096"),
        (ExpertIOSegment(0, 0, 10, 0), 4, "slot 4 is outside the slab's 4 slots"),
        (ExpertIOSegment(0, 1, 10, 2), 0, "not congruent"),
    ],
)
def test_bad_loads_get_an_error_naming_the_value(coordinator, segment, slot, fragment):
    coord = coordinator()
    coord.send(Load(slot=slot, generation=3, segments=(segment,)))
    reply = coord.expect(Loaded)
    assert (reply.slot, reply.generation, reply.ok, reply.code) == (slot, 3, False, "bad_request")
    assert fragment in reply.error
    coord.send(good_load(1, 4))
    assert coord.expect(Loaded).ok


def test_truncated_file_is_a_read_error_naming_file_and_offset(coordinator, files):
    coord = coordinator()
    paths, _ = files
    os.truncate(paths[1], 8192)  # after startup: the worker still believes FILE_SIZE
    coord.send(Load(slot=0, generation=1, segments=(ExpertIOSegment(1, 100_000, 5000, 100_000 % 4096),)))
    reply = coord.expect(Loaded)
    assert not reply.ok and reply.code == "short_read"
    assert (reply.file, reply.offset) == (1, 100_000)
    assert str(paths[1]) in reply.error and "offset 100000" in reply.error
    coord.send(good_load(1, 2))  # inside the remaining 8192 bytes
    assert coord.expect(Loaded).ok
    coord.send(Load(slot=1, generation=3, segments=(ExpertIOSegment(0, 0, 10, 0),)))
    assert coord.expect(Loaded).ok


def test_cancel_drops_a_queued_load_and_in_flight_ones_still_reply(coordinator):
    coord = coordinator(queue_depth=1, test_read_delay_ms=1000)
    coord.send(good_load(0, 1))  # starts at once and stays in flight
    coord.send(good_load(1, 2))  # queued behind it
    time.sleep(0.1)
    coord.send(Cancel(slot=1, generation=2))
    cancelled = coord.expect(Loaded, timeout=0.8)  # answered while load 1 is still reading
    assert (cancelled.slot, cancelled.generation, cancelled.ok, cancelled.error) == (1, 2, False, "cancelled")
    coord.send(TelemetryRequest())
    telemetry = coord.expect(WorkerTelemetry, timeout=0.8)
    assert telemetry.in_flight == 1 and telemetry.cancelled == 1
    coord.send(Cancel(slot=0, generation=1))  # in flight: the reply still comes when it finishes
    coord.send(Load(slot=0, generation=7, segments=good_load(0, 7).segments))  # slot busy: refused
    refused = coord.expect(Loaded)
    assert (refused.generation, refused.ok) == (7, False) and "already has load generation 1" in refused.error
    done = coord.expect(Loaded, timeout=5)
    assert (done.slot, done.generation, done.ok) == (0, 1, True)


def test_a_message_of_several_commands_serves_each_and_replies_ready_together_go_as_one(coordinator):
    """A prefetch wave's loads come as one message; a bad frame in it is refused on its own."""
    coord = coordinator(queue_depth=1, test_read_delay_ms=1000)
    loads = [good_load(slot, 10 + slot) for slot in range(3)]
    coord.send(loads[0])  # slot 0 reads; the next message's loads queue behind it
    coord.sock.send_multipart([coord.identity, encode(loads[1]), b"\x93garbage", encode(loads[2])])
    refused = coord.expect(ErrorReply, timeout=0.8)
    assert refused.code == "bad_frame" and "not msgpack" in refused.message
    time.sleep(0.1)
    before = coord.messages
    coord.sock.send_multipart(
        [coord.identity, encode(Cancel(slot=1, generation=11)), encode(Cancel(slot=2, generation=12))]
    )
    cancelled = [coord.expect(Loaded, timeout=0.8) for _ in range(2)]
    assert [(r.slot, r.ok, r.error) for r in cancelled] == [(1, False, "cancelled"), (2, False, "cancelled")]
    assert coord.messages == before + 1  # both answers in one message
    done = coord.expect(Loaded, timeout=5)
    assert (done.slot, done.generation, done.ok) == (0, 10, True)
    coord.sock.send_multipart([coord.identity, *[encode(TelemetryRequest())] * (MAX_FRAMES + 1)])
    too_many = coord.expect(ErrorReply)
    assert too_many.code == "bad_frame" and f"at most {MAX_FRAMES} frames" in too_many.message
    coord.send(good_load(1, 20))  # and it serves on
    assert coord.expect(Loaded).ok


def test_the_loads_of_one_message_are_one_read_answered_together(coordinator, files, slab):
    """One reader, one native call (a load's ranges and its neighbours' go to the kernel at once),
    the replies in one message; a load the native layer refuses is refused alone."""
    coord = coordinator(queue_depth=2)
    _, blobs = files
    spread = [
        Load(slot=3, generation=3, segments=(ExpertIOSegment(0, 12345, 20000, 12345 % 4096),)),
        Load(slot=0, generation=4, segments=(ExpertIOSegment(1, 77, 5, 40960 + 77), ExpertIOSegment(0, 9, 9, 9))),
        Load(slot=2, generation=5, segments=(ExpertIOSegment(1, FILE_SIZE - 3, 3, (FILE_SIZE - 3) % 4096),)),
    ]
    coord.sock.send_multipart([coord.identity, *map(encode, spread)])
    before = coord.messages
    replies = [coord.expect(Loaded) for _ in spread]
    assert coord.messages == before + 1
    assert [(r.slot, r.generation, r.ok, r.bytes) for r in replies] == [
        (3, 3, True, 20000),
        (0, 4, True, 14),
        (2, 5, True, 3),
    ]
    assert len({r.service_ms for r in replies}) == 1  # one read
    for load in spread:
        assert_landed(slab, load.slot, load.segments, blobs)
    coord.send(TelemetryRequest())
    telemetry = coord.expect(WorkerTelemetry)
    assert (telemetry.loads, telemetry.read_ops, telemetry.bytes) == (3, 4, 20017)
    if HAVE_AIO and all(mode == "direct" for mode in coord.modes):
        assert telemetry.aio_ranges == 4 and telemetry.aio_busy == 0
    # Rounded to whole blocks, the first segment would overwrite the second's bytes: the native
    # layer refuses the call, and each load is read again on its own.
    clash = Load(slot=1, generation=6, segments=(ExpertIOSegment(0, 0, 10, 0), ExpertIOSegment(1, 100, 10, 100)))
    coord.sock.send_multipart([coord.identity, encode(good_load(0, 7)), encode(clash), encode(good_load(3, 8))])
    replies = sorted((coord.expect(Loaded) for _ in range(3)), key=lambda r: r.slot)
    assert [(r.slot, r.ok, r.code) for r in replies] == [(0, True, None), (1, False, "bad_request"), (3, True, None)]
    assert "segment layout refused" in replies[1].error and "overlap" in replies[1].error
    assert_landed(slab, 3, good_load(3, 8).segments, blobs)


@pytest.mark.parametrize("slots_of_16k, reads", [(4, 1), (3, 2)])
def test_slots_no_multiple_of_the_block_are_read_one_load_at_a_time(files, caplog, slots_of_16k, reads):
    """Rounded to a block of 32 KiB, a range near the end of a 48 KiB slot reaches into the next
    slot: read alone, the slot bounds it (the native layer refuses it); read with its neighbour,
    the region would not. So such slots are read one load at a time, and the worker says so."""
    paths, _ = files
    opened = [BypassFile.open(path, mode="buffered") for path in paths]
    done = __import__("threading").Event()
    with Slab.create(total_slots=2, slot_bytes=slots_of_16k * SLOT_ALIGNMENT) as slab:
        engine = LoadEngine(files=opened, slab=slab, block_size=32768, queue_depth=2, notify=done.set)
        try:
            assert engine.reads_together == (reads == 1)
            assert ("read one at a time" in caplog.text) == (reads == 2)
            near_the_end = (ExpertIOSegment(0, 40960, 100, 40960),)
            loads = [Load(slot=slot, generation=1, segments=near_the_end) for slot in (0, 1)]
            assert engine.submit_many(loads) == []
            replies = engine.completions()  # one read of both is small enough to be read inline
            while len(replies) < 2:
                assert done.wait(5)
                done.clear()
                replies += engine.completions()
            assert engine.counters.reads == reads
            # The mapping is page aligned, seldom 32 KiB aligned: these reads are mostly refused
            # (the region's address); what matters here is how many reads there were.
            assert sorted(reply.slot for reply in replies) == [0, 1]
        finally:
            engine.close()
            for file in opened:
                file.close()


def test_a_small_read_that_finds_the_readers_idle_is_read_on_the_calling_thread(files, slab, monkeypatch):
    """No hand-off to a reader and no wake-up back (0.5 ms of a small expert's miss): the replies
    are ready when `submit_many` returns. A larger read, or one that finds another load queued or
    running, goes to a reader as before."""
    paths, blobs = files
    opened = [BypassFile.open(path, mode="buffered") for path in paths]
    notified = __import__("threading").Event()
    engine = LoadEngine(files=opened, slab=slab, block_size=4096, queue_depth=2, notify=notified.set)
    try:
        small = [
            Load(slot=slot, generation=1, segments=(ExpertIOSegment(slot % 2, 4096 * slot, 300, 0),)) for slot in (0, 1)
        ]
        assert engine.submit_many(small) == []
        replies = engine.completions()
        assert sorted((r.slot, r.ok, r.bytes) for r in replies) == [(0, True, 300), (1, True, 300)]
        assert (engine.counters.reads, engine.counters.inline_reads) == (1, 1) and not notified.is_set()
        for load in small:
            assert_landed(slab, load.slot, load.segments, blobs)
        # Loads a command follows in their message (a cancel may name one) go to a reader.
        assert (
            engine.submit_many([Load(slot=3, generation=9, segments=(ExpertIOSegment(0, 0, 10, 0),))], inline=False)
            == []
        )
        assert notified.wait(5) and [(r.slot, r.ok) for r in engine.completions()] == [(3, True)]
        assert (engine.counters.reads, engine.counters.inline_reads) == (2, 1)
        notified.clear()

        monkeypatch.setattr("ioworker.engine.INLINE_READ_BYTES", 299)  # now too large: a reader reads it
        assert engine.submit_many([Load(slot=2, generation=2, segments=(ExpertIOSegment(0, 0, 300, 0),))]) == []
        assert notified.wait(5) and [(r.slot, r.ok) for r in engine.completions()] == [(2, True)]
        assert (engine.counters.reads, engine.counters.inline_reads) == (3, 1)
        monkeypatch.undo()

        # A small read behind a running one is queued too: the socket thread stays free for it.
        release, entered = __import__("threading").Event(), __import__("threading").Event()
        pool_read = engine._pool.read

        def held_read(*args, **kwargs):
            entered.set()
            assert release.wait(5)
            return pool_read(*args, **kwargs)

        monkeypatch.setattr(engine._pool, "read", held_read)
        notified.clear()
        monkeypatch.setattr("ioworker.engine.INLINE_READ_BYTES", 299)
        assert engine.submit_many([Load(slot=3, generation=3, segments=(ExpertIOSegment(1, 0, 300, 0),))]) == []
        assert entered.wait(5)
        monkeypatch.setattr("ioworker.engine.INLINE_READ_BYTES", 1 << 20)
        assert engine.submit_many([Load(slot=0, generation=4, segments=(ExpertIOSegment(0, 0, 10, 0),))]) == []
        assert engine.counters.inline_reads == 1 and engine.depth() == (1, 1)
        release.set()
        replies = []
        while len(replies) < 2:
            assert notified.wait(5)
            notified.clear()
            replies += engine.completions()
        assert sorted((r.slot, r.ok) for r in replies) == [(0, True), (3, True)]
    finally:
        engine.close()
        for file in opened:
            file.close()


def test_hints_are_served_and_reported(coordinator):
    coord = coordinator()
    coord.send(Hint(segments=(ExpertIOHintSegment(0, 0, 65536), ExpertIOHintSegment(1, 4096, 10))))
    status = coord.recv()
    while isinstance(status, HintStatus) and not status.completed:  # progress may come in steps
        status = coord.recv()
    assert isinstance(status, HintStatus)
    assert (status.submitted, status.completed, status.operations, status.bytes) == (1, 1, 2, 65546)


def test_hint_queue_drops_when_full(files):
    paths, _ = files
    entered, proceed = __import__("threading").Event(), __import__("threading").Event()

    def notify() -> None:  # holds the hint thread after its first message
        entered.set()
        proceed.wait(5)

    opened = [BypassFile.open(p) for p in paths]
    queue = HintQueue(files=opened, capacity=1, notify=notify)
    try:
        one = (ExpertIOHintSegment(0, 0, 10),)
        assert queue.offer(one)
        assert entered.wait(5)
        assert queue.offer(one)  # fills the queue
        assert not queue.offer(one)  # dropped
        status = queue.status()
        assert (status.submitted, status.dropped, status.queue_depth) == (3, 1, 1)
    finally:
        proceed.set()
        queue.close()
        for f in opened:
            f.close()


def test_worker_exits_when_the_parent_death_pipe_closes(tmp_path, files, slab):
    coord = Coordinator(tmp_path, files[0], slab)
    coord.handshake()
    coord.worker.close_death_pipe()
    coord.worker.process.wait(timeout=10)
    assert coord.worker.exit_code == 0
    assert any("parent process is gone" in line for line in coord.worker.stderr_tail())
    coord.close()


def test_worker_exits_cleanly_on_sigterm(tmp_path, files, slab):
    coord = Coordinator(tmp_path, files[0], slab)
    coord.handshake()
    coord.worker.process.send_signal(signal.SIGTERM)
    assert coord.worker.process.wait(timeout=10) == 0
    assert any("stopping on signal" in line for line in coord.worker.stderr_tail())
    coord.close()


def test_setup_failure_is_reported_fast(tmp_path, files, slab):
    paths, _ = files
    coord = Coordinator(tmp_path, [paths[0], tmp_path / "missing.bin"], slab)
    hello = coord.recv()
    assert isinstance(hello, Hello)
    coord.send(Welcome(index=0))
    error = coord.expect(ErrorReply)
    assert error.code == "setup_failed" and "missing.bin" in error.message
    assert coord.worker.process.wait(timeout=10) == 1
    coord.identity = b""
    coord.close()


def test_manifest_and_arguments_are_validated(tmp_path):
    bad = tmp_path / "manifest.json"
    bad.write_text(json.dumps(["relative/path.bin"]))
    with pytest.raises(ValueError, match="absolute path"):
        load_manifest(bad)
    bad.write_text("{}")
    with pytest.raises(ValueError, match="non-empty JSON array"):
        load_manifest(bad)
    config = IOWorkerArgs(
        index=2,
        endpoint="ipc:///x",
        manifest="/m.json",
        slab_name="/moeslab-0",
        total_slots=3,
        slot_bytes=SLOT,
        death_fd=7,
        test_read_delay_ms=5.0,
        staging="off",
        scheduling="normal",
    )
    assert parse_io_worker_argv(io_worker_argv(config)) == config
    with pytest.raises(SystemExit):
        parse_io_worker_argv([*io_worker_argv(config), "--block-size", "1000"])
    with pytest.raises(SystemExit):
        parse_io_worker_argv([*io_worker_argv(config), "--staging", "always"])
    with pytest.raises(SystemExit):
        parse_io_worker_argv([*io_worker_argv(config), "--scheduling", "idle"])
