"""IOWorkerBackend over real I/O worker processes, and over a scripted fake worker."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import msgpack
import pytest
import zmq
import zmq.asyncio

from coordinator.backend import IOWorkerBackend
from coordinator.io_pool import IOWorkerPool
from coordinator.io_results import BackendStateError, ExpertLoadError, IOWorkerStartError, StaleGenerationError
from coordinator.io_sessions import WATCH_INTERVAL_S
from coordinator.residency import ExpertResidencyManager
from coordinator.residency_backend import ExpertResidencyBackend
from shared.io_messages import WORKER_COMMANDS, Cancel, Hello, HintStatus, Load, Loaded, Ready, Welcome
from shared.plan import plan_expert_residency
from shared.protocol import decode, encode
from shared.segments import ExpertIOHintSegment, ExpertIOSegment, ExpertResidencyLocation
from shared.slab import SLOT_ALIGNMENT, Slab

SLOT = 4 * SLOT_ALIGNMENT
FILE_SIZE = 512 * 1024
BLOCK = 4096


def run(coro, timeout: float = 30.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def write_files(directory: Path, count: int = 2) -> tuple[list[Path], list[bytes]]:
    paths, blobs = [], []
    for index in range(count):
        blob = os.urandom(FILE_SIZE)
        path = directory / f"experts-{index}.bin"
        path.write_bytes(blob)
        paths.append(path)
        blobs.append(blob)
    return paths, blobs


def expert_segments(seed: int) -> tuple[ExpertIOSegment, ...]:
    """Three tensors at unaligned offsets of two files, laid out with slack as a store would."""
    offsets = [(seed * 7919 + 13) % (FILE_SIZE - 30000), (seed * 104729 + 4095) % (FILE_SIZE - 30000), FILE_SIZE - 5]
    lengths = [20000 + seed, 333, 5]
    segments, cursor = [], 0
    for index, (offset, length) in enumerate(zip(offsets, lengths)):
        destination = cursor + offset % BLOCK
        segments.append(ExpertIOSegment(index % 2, offset, length, destination))
        cursor = -(-(destination + length) // BLOCK) * BLOCK
    return tuple(segments)


@pytest.fixture()
def tmpfs_dir():
    directory = tempfile.mkdtemp(dir="/dev/shm", prefix="moeslab-test-")
    yield Path(directory)
    shutil.rmtree(directory)


@pytest.mark.parametrize(
    ("where", "io_mode", "expected_mode"), [("disk", "auto", "direct"), ("tmpfs", "dontneed", "dontneed")]
)
def test_bytes_land_exactly_across_workers(request, tmp_path, where, io_mode, expected_mode):
    directory = tmp_path if where == "disk" else request.getfixturevalue("tmpfs_dir")
    paths, blobs = write_files(directory)

    async def scenario() -> str:
        with Slab.create(total_slots=8, slot_bytes=SLOT) as slab:
            async with IOWorkerPool(slab=slab, manifest=paths, workers=2, queue_depth=2, io_mode=io_mode) as pool:
                backend = pool.backend
                assert isinstance(backend, ExpertResidencyBackend)
                assert backend.slots == 8
                assert all(set(modes) == {expected_mode} for modes in backend.worker_modes().values())
                used_workers = set()
                for round_ in range(2):
                    loads = {slot: expert_segments(slot + 8 * round_) for slot in range(8)}
                    generation = 100 * (round_ + 1)
                    for slot, segments in loads.items():
                        backend.submit_segments(slot, generation + slot, segments)
                    await asyncio.gather(*(backend.wait(slot, generation + slot) for slot in loads))
                    for slot, segments in loads.items():
                        base = slab.slot_offset(slot)
                        for s in segments:
                            landed = slab.buffer[base + s.destination : base + s.destination + s.length]
                            assert landed == blobs[s.file][s.offset : s.offset + s.length]
                        completion = backend.completion(slot)
                        assert completion is not None and completion.bytes == sum(s.length for s in segments)
                        used_workers.add(completion.worker)
                        backend.discard(slot, generation + slot)
                assert used_workers == {0, 1}
                assert 0 < backend.physical_footprint() <= slab.size
                telemetry = backend.telemetry()
                assert (telemetry.completed, telemetry.failed, telemetry.in_flight) == (16, 0, 0)
                run_dir = pool.run_dir
                assert run_dir is not None and os.path.exists(os.path.join(run_dir, "io.sock"))
            return run_dir

    run_dir = run(scenario())
    assert not os.path.exists(run_dir)  # socket file, manifest and directory are gone


def test_cancel_and_in_flight_loads(tmp_path):
    paths, _ = write_files(tmp_path, 1)
    segments = (ExpertIOSegment(0, 0, 100, 0),)

    async def scenario() -> None:
        with Slab.create(total_slots=3, slot_bytes=SLOT) as slab:
            async with IOWorkerPool(
                slab=slab, manifest=paths, workers=1, queue_depth=1, test_read_delay_ms=1000
            ) as pool:
                backend = pool.backend
                backend.submit_segments(0, 1, segments)  # in flight for a second
                await asyncio.sleep(0.05)  # a load of the same turn would go in the same message: one read
                backend.submit_segments(1, 2, segments)  # queued behind it
                await asyncio.sleep(0.05)
                backend.cancel(1, 2)
                with pytest.raises(ExpertLoadError, match="cancelled") as caught:
                    await backend.wait(1, 2)
                assert (caught.value.slot, caught.value.generation, caught.value.code) == (1, 2, "cancelled")
                assert backend.phase(0) == "loading"  # the cancellation did not wait for the read
                backend.cancel(0, 1)  # in flight: it still completes
                await backend.wait(0, 1)
                assert backend.phase(0) == "ready"
                backend.discard(1, 2)  # a failed slot can be reused
                backend.submit_segments(1, 3, segments)
                await backend.wait(1, 3)

    run(scenario())


def test_failed_read_names_slot_generation_file_and_offset(tmp_path):
    paths, _ = write_files(tmp_path, 2)

    async def scenario() -> None:
        with Slab.create(total_slots=2, slot_bytes=SLOT) as slab:
            async with IOWorkerPool(slab=slab, manifest=paths, workers=1) as pool:
                backend = pool.backend
                os.truncate(paths[1], 4096)
                backend.submit_segments(1, 7, (ExpertIOSegment(0, 0, 10, 0), ExpertIOSegment(1, 9000, 50, 9000)))
                with pytest.raises(ExpertLoadError) as caught:
                    await backend.wait(1, 7)
                error = caught.value
                where = (error.slot, error.generation, error.file, error.offset, error.code)
                assert where == (1, 7, 1, 9000, "short_read")
                for fragment in ("slot 1", "generation 7", str(paths[1]), "offset 9000"):
                    assert fragment in str(error)
                assert backend.phase(1) == "failed"
                with pytest.raises(BackendStateError):
                    backend.lease(1, 7)
                backend.discard(1, 7)

    run(scenario())


def test_a_lost_worker_fails_its_loads(tmp_path):
    paths, _ = write_files(tmp_path, 1)

    async def scenario() -> None:
        with Slab.create(total_slots=2, slot_bytes=SLOT) as slab:
            async with IOWorkerPool(slab=slab, manifest=paths, workers=1, test_read_delay_ms=5000) as pool:
                pool.backend.submit_segments(0, 1, (ExpertIOSegment(0, 0, 10, 0),))
                await asyncio.sleep(0.1)
                pool.processes[0].process.kill()
                with pytest.raises(ExpertLoadError, match="was lost") as caught:
                    await pool.backend.wait(0, 1)
                assert caught.value.code == "worker_lost"
                with pytest.raises(BackendStateError, match="no I/O worker"):
                    pool.backend.submit_segments(1, 2, (ExpertIOSegment(0, 0, 10, 0),))

    run(scenario())


def test_workers_told_to_shut_down_are_not_reported_lost(tmp_path, caplog):
    paths, _ = write_files(tmp_path, 1)

    async def scenario() -> None:
        with Slab.create(total_slots=2, slot_bytes=SLOT) as slab:
            async with IOWorkerPool(slab=slab, manifest=paths, workers=2) as pool:
                pool.backend.shutdown_workers()
                for worker in pool.processes:
                    await asyncio.to_thread(worker.process.wait, 10)
                await asyncio.sleep(5 * WATCH_INTERVAL_S)  # the backend's watchdog has looked
                assert pool.backend.telemetry().workers_lost == 0

    with caplog.at_level("INFO", logger="coordinator.backend"):
        run(scenario())
    assert not [r for r in caplog.records if "lost" in r.getMessage()]


def test_start_failure_reports_exit_code_and_stderr(tmp_path):
    paths, _ = write_files(tmp_path, 1)

    async def scenario() -> str | None:
        with Slab.create(total_slots=1, slot_bytes=SLOT) as slab:
            pool = IOWorkerPool(slab=slab, manifest=[paths[0], tmp_path / "gone.bin"], workers=2, start_timeout=20)
            with pytest.raises(IOWorkerStartError) as caught:
                await pool.start()
            message = str(caught.value)
            assert "setup_failed" in message and "gone.bin" in message
            assert "exited with code 1" in message and "last stderr lines" in message
            return pool.run_dir

    assert run(scenario()) is None  # closed and cleaned up on failure


def test_hints_reach_the_workers(tmp_path):
    paths, _ = write_files(tmp_path, 2)

    async def scenario() -> None:
        with Slab.create(total_slots=1, slot_bytes=SLOT) as slab:
            async with IOWorkerPool(slab=slab, manifest=paths, workers=2) as pool:
                backend = pool.backend
                assert backend.hint_segments([ExpertIOHintSegment(0, 0, 8192), ExpertIOHintSegment(1, 4096, 10)])
                for _ in range(200):
                    snapshot = backend.hint_telemetry()
                    if snapshot.completed:
                        break
                    await asyncio.sleep(0.01)
                assert (snapshot.submitted, snapshot.completed, snapshot.operations, snapshot.bytes) == (1, 1, 2, 8202)
                assert (snapshot.dropped, snapshot.queue_depth, snapshot.in_flight) == (0, 0, 0)
                with pytest.raises(ValueError, match="not in the manifest"):
                    backend.hint_segments([ExpertIOHintSegment(5, 0, 10)])
                telemetry = await backend.request_telemetry()
                assert sorted(t.index for t in telemetry) == [0, 1]

    run(scenario())


def test_the_residency_managers_hints_reach_the_workers(tmp_path):
    """hint_experts over the real backend: a location without hint segments is warmed whole."""
    paths, _ = write_files(tmp_path, 2)

    def locate(layer: int, expert: int) -> ExpertResidencyLocation:
        return ExpertResidencyLocation(layer, expert, expert_segments(expert))

    async def scenario() -> None:
        plan = plan_expert_residency(
            budget_bytes=2 * SLOT, fixed_bytes=0, slot_bytes=SLOT, sparse_layers=1, working_slots=1
        )
        with Slab.create(total_slots=plan.total_slots, slot_bytes=SLOT) as slab:
            async with IOWorkerPool(slab=slab, manifest=paths, workers=1) as pool:
                manager = ExpertResidencyManager(plan=plan, sparse_layer_ids=[0], backend=pool.backend, locate=locate)
                manager.hint_experts(0, [1, 2])
                for _ in range(200):
                    snapshot = pool.backend.hint_telemetry()
                    if snapshot.completed == 2:
                        break
                    await asyncio.sleep(0.01)
                telemetry = manager.drain_hint_telemetry()
                assert (telemetry.candidates, telemetry.submit_errors, telemetry.submitted) == (2, 0, 2)
                want = sum(segment.length for expert in (1, 2) for segment in expert_segments(expert))
                assert (snapshot.completed, snapshot.bytes) == (2, want)

    run(scenario())


class FakeWorker:
    """A scripted DEALER standing in for worker 0, to send what a real one never would."""

    def __init__(self, endpoint: str, index: int = 0) -> None:
        self.sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.index = index

    async def handshake(self) -> None:
        await self.sock.send(encode(Hello(index=self.index, pid=os.getpid())))
        assert decode(await self.sock.recv(), WORKER_COMMANDS) == Welcome(index=self.index)
        await self.sock.send(encode(Ready(index=self.index, pid=os.getpid(), block_size=BLOCK, modes=("direct",))))

    async def command(self):
        """The next command (a message of several frames is several commands)."""
        return decode(await asyncio.wait_for(self.sock.recv(), 5), WORKER_COMMANDS)

    async def message(self) -> list:
        """The commands of the next message, in order."""
        frames = await asyncio.wait_for(self.sock.recv_multipart(), 5)
        return [decode(frame, WORKER_COMMANDS) for frame in frames]

    async def reply(self, message) -> None:
        await self.sock.send(encode(message))
        await asyncio.sleep(0.05)  # let the backend's receive loop run


async def fake_backend(tmp_path: Path, slab: Slab, **options) -> tuple[IOWorkerBackend, FakeWorker]:
    backend = IOWorkerBackend(slab=slab, endpoint=f"ipc://{tmp_path}/fake.sock", workers=1, files=2, **options)
    worker = FakeWorker(backend.endpoint)
    await asyncio.gather(backend.start(timeout=5), worker.handshake())
    return backend, worker


@contextlib.asynccontextmanager
async def faked_backend(tmp_path: Path, *, slots: int, **options):
    """(backend, fake worker) over a new slab of `slots`; the worker's socket and the backend closed after."""
    with Slab.create(total_slots=slots, slot_bytes=SLOT) as slab:
        backend, worker = await fake_backend(tmp_path, slab, **options)
        try:
            yield backend, worker
        finally:
            worker.sock.close()
            await backend.aclose()


SEGMENTS = (ExpertIOSegment(0, 0, 10, 0),)


def test_stale_and_bad_replies_are_counted_never_applied(tmp_path):
    async def scenario() -> None:
        async with faked_backend(tmp_path, slots=2) as (backend, worker):
            backend.submit_segments(0, 5, SEGMENTS)
            load = await worker.command()
            assert isinstance(load, Load) and load.generation == 5
            await worker.reply(Loaded(slot=0, generation=4, ok=True, bytes=10))  # stale generation
            await worker.reply(Loaded(slot=1, generation=5, ok=True, bytes=10))  # never submitted
            await worker.reply(Loaded(slot=99, generation=5, ok=True))  # no such slot
            await worker.sock.send(b"\xc1 not msgpack")
            await worker.reply(HintStatus(completed=0))
            assert backend.phase(0) == "loading" and backend.phase(1) == "idle"
            telemetry = backend.telemetry()
            assert (telemetry.stale_completions, telemetry.bad_replies) == (3, 1)
            await worker.reply(Loaded(slot=0, generation=5, ok=True, bytes=10))
            await backend.wait(0, 5)
            assert backend.phase(0) == "ready"
            await worker.reply(Loaded(slot=0, generation=5, ok=False, error="late duplicate"))
            assert backend.phase(0) == "ready" and backend.telemetry().stale_completions == 4
        assert not (tmp_path / "fake.sock").exists()  # the backend removes its ipc socket file

    run(scenario())


def test_the_loads_of_one_turn_go_as_one_message_and_a_cancel_keeps_its_place(tmp_path):
    async def scenario() -> None:
        async with faked_backend(tmp_path, slots=3) as (backend, worker):
            for slot in range(3):  # a prefetch wave: queued, sent after this turn of the loop
                backend.submit_segments(slot, 1, SEGMENTS)
            assert await worker.message() == [Load(slot=slot, generation=1, segments=SEGMENTS) for slot in range(3)]
            await worker.sock.send_multipart(  # replies ready together: one message
                [encode(Loaded(slot=slot, generation=1, ok=True, bytes=10)) for slot in (0, 2)]
            )
            await asyncio.gather(backend.wait(0, 1), backend.wait(2, 1))
            backend.discard(0, 1)
            backend.submit_segments(0, 2, SEGMENTS)
            backend.cancel(1, 1)  # sent at once, after (and with) the load queued before it
            assert await worker.message() == [
                Load(slot=0, generation=2, segments=SEGMENTS),
                Cancel(slot=1, generation=1),
            ]
            assert backend.telemetry().bad_replies == 0

    run(scenario())


def test_loads_a_live_worker_could_not_be_sent_go_to_another(tmp_path, caplog):
    """A send that fails (host unreachable) while the worker's process still runs: only its
    undelivered loads avoid it; it is not lost."""

    async def scenario() -> None:
        with Slab.create(total_slots=2, slot_bytes=SLOT) as slab:
            backend = IOWorkerBackend(slab=slab, endpoint=f"ipc://{tmp_path}/fake.sock", workers=2, files=2)
            workers = [FakeWorker(backend.endpoint, index) for index in range(2)]
            await asyncio.gather(backend.start(timeout=5), *(worker.handshake() for worker in workers))
            try:
                workers[0].sock.close()  # this process (its pid) still runs
                await asyncio.sleep(0.2)  # ZeroMQ's I/O thread sees the connection close
                for slot in range(2):  # one turn each: the second goes to the worker the first did not
                    backend.submit_segments(slot, 1, SEGMENTS)
                    await asyncio.sleep(0.01)
                got = await workers[1].message()
                got += [] if len(got) == 2 else await workers[1].message()
                assert sorted(load.slot for load in got) == [0, 1]
                telemetry = backend.telemetry()
                assert (telemetry.workers_lost, telemetry.failed) == (0, 0)
            finally:
                workers[1].sock.close()
                await backend.aclose()

    caplog.set_level("WARNING", logger="coordinator.backend")
    run(scenario())
    assert "I/O worker 0" in caplog.text and "unreachable" in caplog.text


def test_a_tuple_of_segments_is_checked_once_and_a_bad_one_every_time(tmp_path, monkeypatch):
    """The store hands out the same location tuples again and again: checked once, they stay checked."""
    import coordinator.backend as backend_module

    calls = []
    real = backend_module.check_segments
    monkeypatch.setattr(backend_module, "check_segments", lambda *a, **k: calls.append(a[0]) or real(*a, **k))

    async def scenario() -> None:
        async with faked_backend(tmp_path, slots=5) as (backend, _):
            backend.submit_segments(0, 1, SEGMENTS)
            backend.submit_segments(1, 2, SEGMENTS)
            backend.submit_segments(2, 3, list(SEGMENTS))  # a list may change: checked each time
            backend.submit_segments(3, 4, list(SEGMENTS))
            assert [type(s) for s in calls] == [tuple, list, list]
            bad = (ExpertIOSegment(5, 0, 10, 0),)  # no file 5 in a manifest of 2
            for _ in range(2):
                with pytest.raises(ValueError, match="file index 5"):
                    backend.submit_segments(4, 9, bad)
            assert calls[3:] == [bad, bad]

    run(scenario())


def test_slot_phases_refuse_writes_to_leased_or_loading_slots(tmp_path):
    async def scenario() -> None:
        async with faked_backend(tmp_path, slots=2, hint_capacity=1) as (backend, worker):
            backend.submit_segments(0, 1, SEGMENTS)
            await worker.command()
            with pytest.raises(BackendStateError, match="slot 0 refused: it is loading"):
                backend.submit_segments(0, 2, SEGMENTS)
            with pytest.raises(BackendStateError, match="in flight"):
                backend.discard(0, 1)
            with pytest.raises(BackendStateError, match="it is loading"):
                backend.lease(0, 1)
            with pytest.raises(StaleGenerationError):
                await backend.wait(0, 2)
            await worker.reply(Loaded(slot=0, generation=1, ok=True, bytes=10))
            await backend.wait(0, 1)
            with pytest.raises(StaleGenerationError):
                backend.lease(0, 2)
            backend.lease(0, 1)
            with pytest.raises(BackendStateError, match="it is leased"):
                backend.submit_segments(0, 3, SEGMENTS)
            with pytest.raises(BackendStateError, match="leased"):
                backend.discard(0, 1)
            backend.release_gpu_fenced(0, 1)
            with pytest.raises(BackendStateError, match="it is ready"):
                backend.release_gpu_fenced(0, 1)
            backend.discard(0, 1)
            assert backend.phase(0) == "idle"
            with pytest.raises(StaleGenerationError, match="not newer"):
                backend.submit_segments(0, 1, SEGMENTS)
            with pytest.raises(StaleGenerationError):
                backend.cancel(0, 9)
            for bad, error in (
                ((), ValueError),
                ((ExpertIOSegment(0, 0, 10, SLOT - 5),), ValueError),
                ((ExpertIOSegment(2, 0, 10, 0),), ValueError),
                ((ExpertIOSegment(0, 0, 0, 0),), ValueError),
                (("nope",), TypeError),
            ):
                with pytest.raises(error):
                    backend.submit_segments(1, 10, bad)
            assert backend.phase(1) == "idle"  # refused submits change nothing
            with pytest.raises(ValueError, match="outside the slab"):
                backend.submit_segments(2, 10, SEGMENTS)
            # The fake worker never reports hint progress: the second hint finds its queue full.
            assert backend.hint_segments([ExpertIOHintSegment(0, 0, 10)])
            assert not backend.hint_segments([ExpertIOHintSegment(0, 0, 10)])
            snapshot = backend.hint_telemetry()
            assert (snapshot.submitted, snapshot.dropped, snapshot.queue_depth) == (1, 1, 1)

    run(scenario())


def test_a_second_worker_cannot_take_a_live_index(tmp_path):
    async def scenario() -> None:
        with Slab.create(total_slots=1, slot_bytes=SLOT) as slab:
            backend, worker = await fake_backend(tmp_path, slab)
            intruder = FakeWorker(backend.endpoint)
            try:
                await intruder.sock.send(encode(Hello(index=0, pid=1)))
                refusal = msgpack.unpackb(await asyncio.wait_for(intruder.sock.recv(), 5))
                assert refusal["op"] == "error" and refusal["code"] == "duplicate_index"
                backend.submit_segments(0, 1, SEGMENTS)
                assert isinstance(await worker.command(), Load)  # still routed to the first worker
                assert backend.telemetry().bad_replies == 1
            finally:
                intruder.sock.close()
                worker.sock.close()
                await backend.aclose()

    run(scenario())


def test_send_submitted_sends_the_turns_loads_before_the_loop_turns(tmp_path):
    """Loads are queued for the turn's end (one message); a demand wave about to wait sends them now."""

    async def scenario() -> None:
        async with faked_backend(tmp_path, slots=2) as (backend, worker):
            backend.submit_segments(0, 5, SEGMENTS)
            backend.submit_segments(1, 6, SEGMENTS)
            assert len(backend._sessions.workers[0].outbox) == 2  # queued, not sent yet
            backend.send_submitted()
            assert backend._sessions.workers[0].outbox == []
            loads = await worker.message()
            assert [(load.slot, load.generation) for load in loads] == [(0, 5), (1, 6)]  # one message

    run(scenario())
