"""The real GPU worker process (`python -m gpuworker`) against a small fake coordinator.

The fake coordinator is a ROUTER in the test thread that owns a real slab:
it answers `routes` with the waves of `build_expert_batch_union` over a
working bank of exactly top_k slots (so prefill needs several waves), reads
each leased expert into its slots from the checkpoint with the store's
segments, and overwrites the slots with NaN bytes right after every fence, so
a worker that read a slot after fencing it could not stay token-exact. The
oracle is mlx-lm's `generate_step` on the fully loaded model, with every
router selection recorded (tests/helpers/oracle.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

from gpuworker.channel import Channel, LeaseError, WorkerStopping
from shared.demo_model import EOS_TOKEN_ID
from shared.gpu_messages import (
    COORDINATOR_ACCEPTS_FROM_GPU,
    Fence,
    Fenced,
    GpuGoodbye,
    GpuHello,
    GpuReady,
    GpuWelcome,
    Job,
    JobCancel,
    JobDone,
    JobError,
    Lease,
    Routes,
    Token,
)
from shared.process import ProcessLife
from shared.protocol import ErrorReply, decode, encode, error_frame
from shared.slab import Slab
from shared.store import ExpertStore
from shared.waves import build_expert_batch_union
from tests.helpers.models import write_tiny_model
from tests.helpers.oracle import oracle, relative_difference

ROOT = Path(__file__).resolve().parents[1]
PROMPT = list(b"The quick brown fox jumps over the lazy dog.")
GENERATED = 10
RTOL = 1e-4
GARBAGE = 0xFF  # NaN in every float format


# ------------------------------------------------------------------------------ the coordinator


class FakeCoordinator:
    """The coordinator's side of the GPU protocol, by hand, with fault injection."""

    def __init__(self, directory: Path, model_dir: Path, *, working_slots: int, spare_slots: int = 5) -> None:
        self.store = ExpertStore.open(model_dir, block_size=4096)
        self.working_slots = working_slots
        self.slab = Slab.create(total_slots=working_slots + spare_slots, slot_bytes=self.store.slot_bytes)
        self.view = np.frombuffer(self.slab.buffer, dtype=np.uint8)
        self.view[:] = GARBAGE
        self.files = [os.open(path, os.O_RDONLY) for path in self.store.manifest]
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, 16 << 20)
        self.endpoint = f"ipc://{directory}/gpu.sock"
        self.sock.bind(self.endpoint)
        self.identity = b""
        self.log_path = directory / "worker.log"
        self.process: subprocess.Popen | None = None
        self.next_lease = 1
        self.next_slot = 0
        self.active: dict | None = None  # the leased wave: id, layer, waves, index, slots
        self.faults: list[str] = []  # applied to the next leases, one each
        self.refuse_routes = 0  # refuse this many routes that carry a fence
        self.events: list[tuple] = []
        self.leased_bytes = 0
        self.violations: list[str] = []

    # -- process ----------------------------------------------------------------------------------

    def spawn(self, model_dir: Path, *extra: str) -> subprocess.Popen:
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child writes to it; closed once it has it
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gpuworker",
                "--model",
                str(model_dir),
                "--endpoint",
                self.endpoint,
                "--log-level",
                "DEBUG",
                "--reply-timeout",
                "20",
                *extra,
            ],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )
        log.close()
        return self.process

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.sock.close()
        self.context.term()
        for fd in self.files:
            os.close(fd)
        del self.view
        self.slab.close()
        self.slab.unlink()

    # -- wire -------------------------------------------------------------------------------------

    def recv(self, timeout: float = 30.0):
        if not self.sock.poll(timeout * 1000):
            raise AssertionError(f"no message from the worker within {timeout} s; its log:\n{self.log_tail()}")
        self.identity, payload = self.sock.recv_multipart()
        return decode(payload, COORDINATOR_ACCEPTS_FROM_GPU)

    def send(self, message) -> None:
        self.send_raw(encode(message))

    def send_raw(self, frame: bytes) -> None:
        self.sock.send_multipart([self.identity, frame])

    def handshake(self) -> GpuReady:
        hello = self.recv()
        assert isinstance(hello, GpuHello) and hello.pid == self.process.pid
        self.send(
            GpuWelcome(
                slab_name=self.slab.name,
                total_slots=self.slab.total_slots,
                slot_bytes=self.slab.slot_bytes,
                working_slots=self.working_slots,
                block_size=4096,
            )
        )
        ready = self.recv(timeout=60)
        assert isinstance(ready, GpuReady), ready
        return ready

    # -- serving ----------------------------------------------------------------------------------

    def run_job(self, job: Job, *, on_token=None, timeout: float = 60.0) -> tuple[list[Token], object]:
        """Send `job`, serve its leases, collect its tokens until job_done / job_error."""
        self.send(job)
        self.leased_bytes = 0
        return self.serve_until([job.job_id], on_token=on_token, timeout=timeout)[job.job_id]

    def serve_until(self, job_ids, *, on_token=None, timeout: float = 60.0) -> dict[int, tuple[list[Token], object]]:
        """Serve leases and collect tokens until every job of `job_ids` has ended."""
        results: dict[int, tuple[list[Token], object]] = {}
        tokens: dict[int, list[Token]] = {job_id: [] for job_id in job_ids}
        deadline = time.monotonic() + timeout
        while len(results) < len(tokens):
            message = self.recv(timeout=max(0.1, deadline - time.monotonic()))
            if isinstance(message, (Routes, Fence)):
                self.serve(message)
            elif isinstance(message, Token):
                if self.active is not None:
                    self.violations.append(f"token {message.index} sent while lease {self.active['id']} is active")
                self.events.append(("token", message.index))
                tokens[message.job_id].append(message)
                if on_token is not None:
                    on_token(message)
            elif isinstance(message, (JobDone, JobError)):
                if self.active is not None:
                    self.violations.append(f"{message.OP} sent while lease {self.active['id']} is active")
                results[message.job_id] = (tokens[message.job_id], message)
            else:
                raise AssertionError(f"unexpected {message!r}")
        return results

    def serve(self, message) -> None:
        if isinstance(message, Routes):
            self.events.append(("routes", message.layer, message.fence, message.routes.array.copy()))
            if self.refuse_routes and message.fence is not None:
                self.refuse_routes -= 1  # refused before anything changed: the fence is not applied
                self.send_raw(error_frame("bad_request", "routes refused (test)"))
                return
            if message.fence is not None:
                if (
                    self.active is None
                    or self.active["id"] != message.fence
                    or self.active["index"] != len(self.active["waves"]) - 1
                ):
                    self.violations.append(f"routes piggyback a fence of {message.fence}; active {self.active}")
                self._release()
            if self.active is not None:
                self.violations.append(f"routes of layer {message.layer} while lease {self.active['id']} is active")
                self.send_raw(error_frame("bad_request", "a wave is active"))
                return
            waves = [wave.expert_ids for wave in build_expert_batch_union(message.routes.array, self.working_slots)]
            self._lease(message.layer, waves, 0)
        else:
            self.events.append(("fence", message.lease_id, message.next))
            if self.active is None or self.active["id"] != message.lease_id:
                self.violations.append(f"fence of {message.lease_id}; active {self.active}")
                self.send_raw(error_frame("bad_request", "stale fence"))
                return
            layer, waves, index = self.active["layer"], self.active["waves"], self.active["index"]
            self._release()
            if message.next:
                if index + 1 >= len(waves):
                    self.violations.append(f"fence(next) of the last wave {message.lease_id}")
                    self.send_raw(error_frame("bad_request", "no next wave"))
                    return
                self._lease(layer, waves, index + 1)
            else:
                self.send(Fenced(lease_id=message.lease_id))

    def _lease(self, layer: int, waves: list[tuple[int, ...]], index: int) -> None:
        experts = waves[index]
        slots = []
        for expert in experts:
            slot = self.next_slot
            self.next_slot = (self.next_slot + 1) % self.slab.total_slots
            self._load(layer, expert, slot)
            slots.append(slot)
        self.leased_bytes += sum(t.nbytes for e in experts for t in self.store.layout(layer, e))
        lease_id = self.next_lease
        self.next_lease += 1
        self.active = {"id": lease_id, "layer": layer, "waves": waves, "index": index, "slots": slots}
        reply = Lease(
            lease_id=lease_id,
            layer=layer,
            wave=index,
            waves=len(waves),
            experts=tuple(experts),
            slots=tuple(slots),
            generations=tuple(range(1, len(slots) + 1)),
        )
        fault = self.faults.pop(0) if self.faults else None
        if fault == "wrong_layer":
            reply = replace(reply, layer=layer + 1)
        elif fault == "unknown_slot":
            reply = replace(reply, slots=(self.slab.total_slots + 3, *slots[1:]))
        elif fault == "wrong_experts":
            reply = replace(reply, experts=tuple(e + 1 for e in experts))
        elif fault == "no_generations":
            reply = replace(reply, generations=())
        self.send(reply)

    def _load(self, layer: int, expert: int, slot: int) -> None:
        base = slot * self.slab.slot_bytes
        for segment in self.store.locate(layer, expert).segments:
            data = os.pread(self.files[segment.file], segment.length, segment.offset)
            start = base + segment.destination
            self.view[start : start + len(data)] = np.frombuffer(data, dtype=np.uint8)

    def _release(self) -> None:
        """The fence arrived: the slots are free, so scribble over them at once."""
        for slot in self.active["slots"]:
            base = slot * self.slab.slot_bytes
            self.view[base : base + self.slab.slot_bytes] = GARBAGE
        self.active = None


# ------------------------------------------------------------------------------ what the oracle says


def _until_eos(tokens: list[int]) -> list[int]:
    """The oracle's tokens as the worker emits them: EOS ends the job and is not emitted."""
    return tokens[: tokens.index(EOS_TOKEN_ID)] if EOS_TOKEN_ID in tokens else tokens


# ------------------------------------------------------------------------------ fixtures


def _start_gpu_worker(tmp_path_factory, name: str, family: str, quantized: bool):
    directory = tmp_path_factory.mktemp(name)
    model_dir = write_tiny_model(directory / "model", family=family, quantized=quantized)
    top_k = ExpertStore.open(model_dir).top_k
    coordinator = FakeCoordinator(directory, model_dir, working_slots=top_k)
    coordinator.spawn(model_dir)
    try:
        ready = coordinator.handshake()
    except BaseException:
        coordinator.close()
        raise
    return coordinator, model_dir, ready


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    coordinator, model_dir, ready = _start_gpu_worker(tmp_path_factory, "fp32", "qwen3_moe", False)
    yield coordinator, model_dir, ready, oracle(model_dir, PROMPT, GENERATED, routes=True)
    coordinator.close()


@pytest.fixture(scope="module")
def q4(tmp_path_factory):
    coordinator, model_dir, ready = _start_gpu_worker(tmp_path_factory, "q4", "mixtral", True)
    yield coordinator, model_dir, ready
    coordinator.close()


@pytest.fixture(autouse=True)
def no_violations(request):
    yield
    for name in ("fp32", "q4"):
        if name in request.fixturenames:
            coordinator = request.getfixturevalue(name)[0]
            found, coordinator.violations = coordinator.violations, []
            assert not found, f"protocol violations: {found}"


# ------------------------------------------------------------------------------ tests


def test_channel_keeps_what_arrives_while_it_waits():
    context = zmq.Context()
    router, dealer = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
    life = ProcessLife(death_fd=None, watch_parent=False)
    try:
        router.bind("inproc://channel")
        dealer.connect("inproc://channel")
        channel = Channel(dealer, life=life, stop_grace_s=0.1)
        channel.send(GpuHello(pid=1))
        identity, _ = router.recv_multipart()
        for message in (Job(job_id=5, prompt="x"), JobCancel(job_id=5), JobCancel(job_id=6)):
            router.send_multipart([identity, encode(message)])
        router.send_multipart([identity, b"\xc1"])
        router.send_multipart([identity, encode(Fenced(lease_id=3))])
        assert channel.wait_reply("fence of lease 3", timeout_s=5) == Fenced(lease_id=3)
        assert [job.job_id for job in channel.backlog] == [5]
        assert channel.cancel_requested(5) and not channel.cancel_requested(6)  # 6 never ran here
        _, frame = router.recv_multipart()
        assert decode(frame, COORDINATOR_ACCEPTS_FROM_GPU).code == "bad_frame"
        with pytest.raises(LeaseError, match=r"no reply to routes of layer 2 within 0\.2 s"):
            channel.wait_reply("routes of layer 2", timeout_s=0.2)
        router.send_multipart([identity, error_frame("load_failed", "disk on fire")])
        with pytest.raises(LeaseError, match="refused routes of layer 2: load_failed: disk on fire"):
            channel.wait_reply("routes of layer 2", timeout_s=5)
        life.stop_signal = signal.SIGTERM  # what the handler records
        with pytest.raises(WorkerStopping):
            channel.wait_reply("routes of layer 2", timeout_s=5)
    finally:
        life.close()
        router.close()
        dealer.close()
        context.term()


def test_handshake_reports_the_dense_model(fp32):
    coordinator, _model_dir, ready, _ = fp32
    store = coordinator.store
    assert ready.pid == coordinator.process.pid
    assert ready.sparse_layers == store.sparse_layers
    assert ready.dense_bytes == store.dense_bytes
    assert ready.wrap_path == "copy"  # CPU: every path into MLX copies


def test_greedy_generation_is_mlx_lm_token_for_token(fp32):
    coordinator, _, _, (want_tokens, want_lp, want_routes) = fp32
    coordinator.events.clear()
    tokens, done = coordinator.run_job(
        Job(job_id=1, prompt_tokens=tuple(PROMPT), max_tokens=GENERATED, return_logprobs=True)
    )
    assert isinstance(done, JobDone), done
    expected = _until_eos(want_tokens)
    assert [t.token for t in tokens] == expected and list(done.tokens) == expected
    assert done.finish_reason == ("stop" if len(expected) < GENERATED else "length")
    assert [t.index for t in tokens] == list(range(len(expected)))
    for token, lp in zip(tokens, want_lp):
        got = np.frombuffer(token.logprobs, dtype="<f4")
        assert got.shape == lp.shape and relative_difference(lp, got) <= RTOL
    assert done.prompt_tokens == len(PROMPT) and done.prefill_ms > 0 and done.lease_wait_ms > 0
    # Every slot byte leased was copied once into MLX (CPU), and said so.
    assert done.wrap_path == "copy" and done.bytes_copied == coordinator.leased_bytes > 0 and done.copy_ms > 0

    routes = [event for event in coordinator.events if event[0] == "routes"]
    fences = [event for event in coordinator.events if event[0] == "fence"]
    # Every router selection (rows x top-k, before dedup), in mlx-lm's order, layer by layer.
    for layer, seen in want_routes.items():
        sent = [event[3] for event in routes if event[1] == layer]
        assert len(sent) == len(seen)
        assert all(np.array_equal(a, b) for a, b in zip(sent, seen))
    # Prefill needed several waves (bank = top_k): fence(next) leased them one at a time.
    assert any(next_ for _, _, next_ in fences)
    # Decode: one round trip per sparse layer (the previous layer's fence rides on routes),
    # plus one fence(next=False) per token, so nothing is leased between tokens.
    layers = len(coordinator.store.sparse_layers)
    steps = _forward_passes(coordinator.events)
    assert len(steps) == len(next(iter(want_routes.values())))  # one per forward pass of mlx-lm
    for step in steps[1:]:
        kinds = [event[0] for event in step]
        assert kinds == ["routes"] * layers + ["fence"], kinds
        assert step[0][2] is None and all(event[2] is not None for event in step[1:layers])
        assert step[-1][2] is False


def _forward_passes(events: list[tuple]) -> list[list[tuple]]:
    """The lease traffic of each forward pass: a routes of the first sparse layer without a
    piggybacked fence starts one (between passes, nothing is leased)."""
    passes: list[list[tuple]] = []
    for event in events:
        if event[0] == "routes" and event[2] is None:
            passes.append([])
        if event[0] != "token":
            passes[-1].append(event)
    return passes


def test_text_prompt_is_raw_text_and_streams_text(fp32):
    coordinator, _model_dir, _, (want_tokens, _, _) = fp32
    text = bytes(PROMPT).decode()
    tokens, done = coordinator.run_job(Job(job_id=2, prompt=text, max_tokens=GENERATED))
    assert isinstance(done, JobDone), done
    assert list(done.tokens) == _until_eos(want_tokens)  # byte tokenizer, no chat template
    assert done.prompt_tokens == len(PROMPT)
    streamed = "".join(t.text for t in tokens)
    assert done.text.startswith(streamed) and streamed
    assert all(t.logprobs is None for t in tokens)


@pytest.mark.parametrize("fault", ["wrong_layer", "unknown_slot", "wrong_experts", "no_generations"])
def test_a_bad_lease_fails_the_job_and_the_next_job_runs(fp32, fault):
    coordinator, _, _, (want_tokens, _, _) = fp32
    coordinator.faults = [fault]
    tokens, error = coordinator.run_job(Job(job_id=10, prompt_tokens=tuple(PROMPT), max_tokens=3))
    assert isinstance(error, JobError) and error.code == "worker_failed", error
    assert "LeaseError" in error.message and not tokens
    # The refused lease was fenced unread: nothing is active, and the worker serves on.
    assert coordinator.active is None
    _, done = coordinator.run_job(Job(job_id=11, prompt_tokens=tuple(PROMPT), max_tokens=3))
    assert isinstance(done, JobDone) and list(done.tokens) == _until_eos(want_tokens)[:3]


def test_a_bad_later_wave_fails_the_job(fp32):
    coordinator, _, _, (want_tokens, _, _) = fp32
    coordinator.faults = ["ok", "wrong_layer"]  # wave 1 of the first prefill layer
    _, error = coordinator.run_job(Job(job_id=12, prompt_tokens=tuple(PROMPT), max_tokens=3))
    assert isinstance(error, JobError) and "wave 1" in error.message, error
    assert coordinator.active is None
    _, done = coordinator.run_job(Job(job_id=13, prompt_tokens=tuple(PROMPT), max_tokens=2))
    assert isinstance(done, JobDone) and list(done.tokens) == _until_eos(want_tokens)[:2]


def test_a_refused_piggyback_is_settled_by_a_fence(fp32):
    coordinator, _, _, (want_tokens, _, _) = fp32
    coordinator.events.clear()
    coordinator.refuse_routes = 1  # the second sparse layer's routes, which carry layer 0's fence
    _, error = coordinator.run_job(Job(job_id=15, prompt_tokens=tuple(PROMPT), max_tokens=2))
    assert isinstance(error, JobError) and "routes refused (test)" in error.message, error
    last = [event for event in coordinator.events if event[0] != "token"][-2:]
    assert last[0][0] == "routes" and last[0][2] is not None
    assert last[1] == ("fence", last[0][2], False)  # the fence the refused routes carried, alone
    assert coordinator.active is None
    _, done = coordinator.run_job(Job(job_id=16, prompt_tokens=tuple(PROMPT), max_tokens=2))
    assert isinstance(done, JobDone) and list(done.tokens) == _until_eos(want_tokens)[:2]


def test_jobs_queue_and_a_queued_job_can_be_cancelled(fp32):
    coordinator, _, _, (want_tokens, _, _) = fp32
    for job in (
        Job(job_id=17, prompt_tokens=tuple(PROMPT), max_tokens=3),
        Job(job_id=18, prompt_tokens=tuple(PROMPT), max_tokens=3),
        Job(job_id=19, prompt_tokens=tuple(PROMPT), max_tokens=3),
    ):
        coordinator.send(job)
    coordinator.send(JobCancel(job_id=18))  # still queued behind 17
    results = coordinator.serve_until([17, 18, 19])
    for job_id in (17, 19):
        assert list(results[job_id][1].tokens) == _until_eos(want_tokens)[:3]
    tokens, done = results[18]
    assert isinstance(done, JobDone) and done.finish_reason == "cancelled" and not tokens and not done.tokens


def test_an_error_reply_to_routes_fails_the_job(fp32):
    coordinator, _, _, _ = fp32
    coordinator.send(Job(job_id=14, prompt_tokens=tuple(PROMPT), max_tokens=2))
    routes = coordinator.recv()
    assert isinstance(routes, Routes)
    coordinator.send_raw(error_frame("bad_request", "not today"))
    done = coordinator.recv()
    assert isinstance(done, JobError) and "not today" in done.message


def test_cancel_between_tokens(fp32):
    coordinator, _, _, (want_tokens, _, _) = fp32

    def cancel(token: Token) -> None:
        if token.index == 0:
            coordinator.send(JobCancel(job_id=20))  # arrives while the worker waits for leases

    tokens, done = coordinator.run_job(Job(job_id=20, prompt_tokens=tuple(PROMPT), max_tokens=40), on_token=cancel)
    assert isinstance(done, JobDone) and done.finish_reason == "cancelled", done
    assert 1 <= len(tokens) < 40 and list(done.tokens) == [t.token for t in tokens]
    assert list(done.tokens) == want_tokens[: len(tokens)]


def test_prompt_too_long_names_both_numbers(fp32):
    coordinator, _, _, _ = fp32
    _, error = coordinator.run_job(Job(job_id=30, prompt_tokens=(65,) * 131073, max_tokens=1))
    assert isinstance(error, JobError) and error.code == "prompt_too_long"
    assert "131073" in error.message and "131072" in error.message


def test_malformed_frames_get_error_replies_and_the_worker_serves_on(fp32):
    coordinator, _, _, (want_tokens, _, _) = fp32
    bad = [
        b"\xc1not msgpack",
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"op": "no_such_op"}),
        msgpack.packb({"op": "job", "job_id": -1}),
        msgpack.packb({"op": "job", "job_id": 1, "max_tokens": 0}),
        encode(Fenced(lease_id=99)),  # nothing is outstanding
        encode(GpuWelcome(slab_name="/x", total_slots=1, slot_bytes=1, working_slots=1, block_size=1)),
    ]
    for frame in bad:
        coordinator.send_raw(frame)
        reply = coordinator.recv()
        assert isinstance(reply, ErrorReply) and reply.code and reply.message, reply
    coordinator.sock.send_multipart([coordinator.identity, b"one", b"two"])
    assert coordinator.recv().code == "bad_frame"
    _, done = coordinator.run_job(Job(job_id=31, prompt_tokens=tuple(PROMPT), max_tokens=2))
    assert isinstance(done, JobDone) and list(done.tokens) == _until_eos(want_tokens)[:2]


def test_quantized_family_is_token_exact(q4, tmp_path):
    coordinator, model_dir, _ready = q4
    want_tokens, want_lp, _ = oracle(model_dir, PROMPT, 6)
    tokens, done = coordinator.run_job(Job(job_id=40, prompt_tokens=tuple(PROMPT), max_tokens=6, return_logprobs=True))
    assert isinstance(done, JobDone), done
    assert list(done.tokens) == _until_eos(want_tokens)
    for token, lp in zip(tokens, want_lp):
        assert relative_difference(lp, np.frombuffer(token.logprobs, dtype="<f4")) <= RTOL


def test_sigterm_mid_job_fences_and_exits_zero(q4):
    coordinator, _, _ = q4
    process = coordinator.process

    def stop(token: Token) -> None:
        if token.index == 1:
            process.send_signal(signal.SIGTERM)

    started = time.monotonic()
    tokens, end = coordinator.run_job(Job(job_id=41, prompt_tokens=tuple(PROMPT), max_tokens=200), on_token=stop)
    assert isinstance(end, JobError) and end.code == "worker_stopping", end
    assert len(tokens) < 200 and coordinator.active is None
    # After its fences and the job's error: it says it is leaving, so its exit is not a loss.
    goodbye = coordinator.recv(timeout=10)
    assert isinstance(goodbye, GpuGoodbye) and goodbye.pid == process.pid and goodbye.reason == "signal 15"
    assert process.wait(timeout=10) == 0
    assert time.monotonic() - started < 15
    assert "stopping on signal" in coordinator.log_tail()


# ------------------------------------------------------------------------------ startup failures


def _bare_worker(tmp_path: Path, *extra: str, pass_fds=()) -> subprocess.Popen:
    model_dir = tmp_path / "no-model-needed"
    model_dir.mkdir()
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpuworker",
            "--model",
            str(model_dir),
            "--endpoint",
            f"ipc://{tmp_path}/none.sock",
            *extra,
        ],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        pass_fds=pass_fds,
    )


def test_no_welcome_exits_nonzero_with_a_clear_line(tmp_path):
    process = _bare_worker(tmp_path, "--handshake-timeout", "1")
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 1
    assert "no gpu_welcome from ipc://" in stderr.decode() and "within 1 s" in stderr.decode()


def test_parent_death_pipe_ends_the_worker(tmp_path):
    read_end, write_end = os.pipe()
    process = _bare_worker(tmp_path, "--death-fd", str(read_end), "--handshake-timeout", "60", pass_fds=(read_end,))
    os.close(read_end)
    time.sleep(1.0)
    os.close(write_end)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 0, stderr.decode()


def test_setup_failure_is_reported_to_the_coordinator(tmp_path):
    model_dir = write_tiny_model(tmp_path / "model", family="qwen3_moe")
    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{tmp_path}/gpu.sock"
    sock.bind(endpoint)
    process = subprocess.Popen(
        [sys.executable, "-m", "gpuworker", "--model", str(model_dir), "--endpoint", endpoint],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert sock.poll(30_000)
        identity, frame = sock.recv_multipart()
        assert isinstance(decode(frame, COORDINATOR_ACCEPTS_FROM_GPU), GpuHello)
        welcome = GpuWelcome(
            slab_name="/moeslab-000000000000", total_slots=4, slot_bytes=16384, working_slots=2, block_size=4096
        )  # no such segment
        sock.send_multipart([identity, encode(welcome)])
        assert sock.poll(30_000)
        _, frame = sock.recv_multipart()
        reply = decode(frame, COORDINATOR_ACCEPTS_FROM_GPU)
        assert isinstance(reply, ErrorReply) and reply.code == "setup_failed"
        assert "attaching slab /moeslab-000000000000" in reply.message
        process.wait(timeout=20)
        assert process.returncode == 1
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        sock.close()
        context.term()
