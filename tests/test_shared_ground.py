"""The ground floor's shared pieces: the child skeleton, the socket factory, segment checks, the wave rule,
and the command lines built and parsed in one place."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import stat
import threading
import time

import numpy as np
import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

from shared.commands import CoordinatorArgs, coordinator_argv, parse_coordinator_argv
from shared.process import HandshakeError, ProcessLife, handshake
from shared.segments import ExpertIOHintSegment, ExpertIOSegment, SegmentError, check_segments
from shared.sockets import bound_endpoint, open_socket, remove_ipc_file
from shared.waves import build_expert_batch_union, wave_partition

# ---------------------------------------------------------------- ProcessLife


def test_a_stop_signal_is_recorded_and_wakes_a_poll():
    with ProcessLife(death_fd=None, watch_parent=False) as life:
        poller = zmq.Poller()
        life.register(poller)
        assert not life.stop_requested and dict(poller.poll(0)) == {}
        os.kill(os.getpid(), signal.SIGTERM)  # the handler records it; the process lives on
        events = dict(poller.poll(1000))
        assert life.wake_fd in events and life.stop_requested and life.stop_signal == signal.SIGTERM
        life.drain(events)
        assert dict(poller.poll(0)) == {}
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored on exit


def test_the_parent_is_gone_when_its_death_pipe_reports_end_of_file():
    death_r, death_w = os.pipe()
    try:
        with ProcessLife(death_fd=death_r) as life:
            assert not life.parent_gone()
            os.close(death_w)
            death_w = -1
            assert life.parent_gone()
    finally:
        os.close(death_r)
        if death_w >= 0:
            os.close(death_w)


def test_being_re_parented_counts_as_the_parents_death_unless_not_watched():
    life = ProcessLife(death_fd=None)
    try:
        assert not life.parent_gone()
        life.parent_pid = -1  # what a re-parented child sees: another parent than it started with
        assert life.parent_gone()
    finally:
        life.close()
    unwatched = ProcessLife(death_fd=None, watch_parent=False)
    try:
        assert not unwatched.parent_gone()
    finally:
        unwatched.close()


def test_watch_loop_calls_on_stop_for_the_parents_death_and_for_signals():
    async def scenario() -> list[str]:
        reasons: list[str] = []
        death_r, death_w = os.pipe()
        life = ProcessLife(death_fd=death_r)
        life.watch_loop(asyncio.get_running_loop(), reasons.append)
        try:
            os.kill(os.getpid(), signal.SIGINT)
            await asyncio.sleep(0.1)
            os.close(death_w)
            for _ in range(100):
                if len(reasons) == 2:
                    break
                await asyncio.sleep(0.01)
        finally:
            life.close()
            os.close(death_r)
        return reasons

    assert asyncio.run(scenario()) == [f"signal {int(signal.SIGINT)}", "parent process is gone"]


# ---------------------------------------------------------------- handshake


@pytest.fixture()
def pair(tmp_path):
    context = zmq.Context()
    endpoint = f"ipc://{tmp_path}/hs"
    router = open_socket(context, zmq.ROUTER, bind=endpoint)
    dealer = open_socket(context, zmq.DEALER, connect=endpoint)
    yield router, dealer, endpoint
    router.close(0)
    dealer.close(0)
    context.term()


def test_handshake_returns_the_answer_to_hello(pair):
    router, dealer, _ = pair
    with ProcessLife(death_fd=None, watch_parent=False) as life:

        def peer() -> None:
            identity, hello = router.recv_multipart()
            router.send_multipart([identity, hello.upper()])

        thread = threading.Thread(target=peer)
        thread.start()
        got = handshake(dealer, b"hello", life=life, timeout=5, waiting_for="welcome", answer=lambda f: f[0])
        thread.join()
    assert got == b"HELLO"


def test_handshake_times_out_naming_what_it_waited_for_and_whom(pair):
    _, dealer, endpoint = pair
    with ProcessLife(death_fd=None, watch_parent=False) as life:
        started = time.monotonic()
        with pytest.raises(HandshakeError, match=re.escape(f"no welcome from {endpoint} within 0.3 s")) as caught:
            handshake(dealer, b"hello", life=life, timeout=0.3, waiting_for="welcome", answer=lambda f: f)
    assert not caught.value.answered and time.monotonic() - started < 3


def test_handshake_ends_with_none_when_asked_to_stop(pair):
    _, dealer, _ = pair
    with ProcessLife(death_fd=None, watch_parent=False) as life:
        life.stop_signal = signal.SIGTERM
        assert handshake(dealer, b"hello", life=life, timeout=5, waiting_for="welcome", answer=lambda f: f) is None


# ---------------------------------------------------------------- sockets


def test_a_bound_ipc_socket_is_private_and_its_file_removable(tmp_path):
    context = zmq.Context()
    sock = open_socket(context, zmq.ROUTER, bind=f"ipc://{tmp_path}/private")
    try:
        path = tmp_path / "private"
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert sock.getsockopt(zmq.LINGER) == 0 and sock.getsockopt(zmq.SNDHWM) == 0
    finally:
        sock.close(0)
        context.term()
    assert path.exists()  # libzmq leaves it behind
    remove_ipc_file(f"ipc://{tmp_path}/private")
    assert not path.exists()
    remove_ipc_file(f"ipc://{tmp_path}/private")  # gone already: fine


def test_a_client_socket_keeps_zeromqs_high_water_marks_and_a_tcp_bind_resolves_its_port():
    context = zmq.Context()
    server = open_socket(context, zmq.ROUTER, bind="tcp://127.0.0.1:*")
    client = open_socket(context, zmq.DEALER, connect=bound_endpoint(server), unbounded=False)
    try:
        assert bound_endpoint(server).startswith("tcp://127.0.0.1:") and not bound_endpoint(server).endswith(":*")
        assert client.getsockopt(zmq.SNDHWM) == 1000
    finally:
        client.close(0)
        server.close(0)
        context.term()


def test_a_socket_that_cannot_bind_is_closed_and_the_error_raised():
    context = zmq.Context()
    try:
        with pytest.raises(zmq.ZMQError):
            open_socket(context, zmq.ROUTER, bind="tcp://256.0.0.1:1")
    finally:
        context.term()  # would hang on a socket left open


# ---------------------------------------------------------------- segments


class _File:
    def __init__(self, path: str, size: int) -> None:
        self.path, self.size = path, size


@pytest.mark.parametrize(
    ("segment", "message"),
    [
        (ExpertIOSegment(2, 0, 10, 0), "segment 0: file index 2 is not in the manifest of 2 files"),
        (ExpertIOSegment(-1, 0, 10, 0), "segment 0: file index -1 is not in the manifest of 2 files"),
        (ExpertIOSegment(0, -4096, 10, 0), "segment 0: offset -4096 is negative"),
        (ExpertIOSegment(0, 0, 0, 0), "segment 0: length 0 must be positive"),
        (ExpertIOSegment(1, 95, 10, 0), "segment 0: range [95, 105) of file 1 (/b) is beyond its size 100"),
        (ExpertIOSegment(0, 0, 10, 60), "segment 0: destination [60, 70) is outside the slot of 64 bytes"),
        (ExpertIOSegment(0, 0, 10, -1), "segment 0: destination [-1, 9) is outside the slot of 64 bytes"),
    ],
)
def test_a_bad_segment_is_named_with_its_value(segment, message):
    files = [_File("/a", 100), _File("/b", 100)]
    with pytest.raises(SegmentError) as caught:
        check_segments([segment], slot_bytes=64, manifest=files)
    assert str(caught.value) == message


def test_segment_checks_refuse_wrong_types_and_empty_loads_and_pass_good_ones():
    good = (ExpertIOSegment(0, 0, 10, 0), ExpertIOSegment(1, 5, 4, 16))
    assert check_segments(list(good), slot_bytes=64, manifest=2) == good
    with pytest.raises(SegmentError, match="no segments"):
        check_segments([], slot_bytes=64, manifest=2)
    with pytest.raises(TypeError, match=r"segment 0 offset must be an integer, got 1\.5"):
        check_segments([ExpertIOSegment(0, 1.5, 10, 0)], slot_bytes=64, manifest=2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="segment 1 must be an ExpertIOSegment"):
        check_segments([good[0], ExpertIOHintSegment(0, 0, 1)], slot_bytes=64, manifest=2)
    hints = (ExpertIOHintSegment(0, 0, 1),)
    assert check_segments(hints, slot_bytes=None, manifest=None) == hints
    with pytest.raises(TypeError, match="must be an ExpertIOHintSegment"):
        check_segments(good, slot_bytes=None, manifest=2)


# ---------------------------------------------------------------- waves


def _naive_waves(flat: list[int], size: int) -> list[tuple[int, ...]]:
    seen: list[int] = []
    for expert in flat:
        if expert not in seen:
            seen.append(expert)
    return [tuple(seen[i : i + size]) for i in range(0, len(seen), size)]


@given(
    rows=st.integers(0, 6),
    top_k=st.integers(1, 8),
    size=st.integers(1, 9),
    data=st.data(),
)
def test_the_wave_rule_is_first_seen_order_in_working_bank_chunks(rows, top_k, size, data):
    routes = np.array(
        data.draw(st.lists(st.lists(st.integers(0, 20), min_size=top_k, max_size=top_k), min_size=rows, max_size=rows)),
        dtype=np.int64,
    ).reshape(rows, top_k)
    want = _naive_waves(routes.reshape(-1).tolist(), size)
    assert wave_partition(routes, size) == want
    assert [wave.expert_ids for wave in build_expert_batch_union(routes, size)] == want


# ---------------------------------------------------------------- command lines


@pytest.mark.parametrize(
    "args", [CoordinatorArgs(config="/run/config.json"), CoordinatorArgs(config="/c", death_fd=7, log_level="DEBUG")]
)
def test_the_coordinators_command_line_round_trips(args):
    assert parse_coordinator_argv(coordinator_argv(args)) == args
