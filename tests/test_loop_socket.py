"""shared/loop_socket.py: a plain ZeroMQ socket served from an asyncio loop hands on every message, in
order, including one whose descriptor signal a send consumed, and gives the loop a turn between batches."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import zmq
import zmq.asyncio

from shared import loop_socket
from shared.loop_socket import DRAIN_BATCH, LoopSocket, plain_context


@pytest.fixture
def pair(tmp_path):
    """(context, ROUTER, DEALER) over ipc; the DEALER has said hello, so the ROUTER knows its identity."""
    context = zmq.Context()
    router, dealer = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
    for sock in (router, dealer):
        sock.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.ROUTING_ID, b"peer")
    router.bind(f"ipc://{tmp_path}/s")
    dealer.connect(f"ipc://{tmp_path}/s")
    yield context, router, dealer
    for sock in (router, dealer):
        sock.close(linger=0)
    context.term()


async def _until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def test_every_message_is_handed_on_in_order(pair):
    _, router, dealer = pair
    got: list[list[bytes]] = []

    async def main():
        served = LoopSocket(router, got.append)
        served.start()
        for i in range(500):
            dealer.send(b"%d" % i)
        await _until(lambda: len(got) == 500)
        served.close()

    asyncio.run(main())
    assert got == [[b"peer", b"%d" % i] for i in range(500)]


def test_the_inbox_gives_messages_to_recv_in_order(pair):
    _, router, dealer = pair

    async def main():
        served = LoopSocket(router)
        served.start()
        dealer.send(b"a")
        first = await asyncio.wait_for(served.recv_multipart(), 5)
        dealer.send_multipart([b"b", b"c"])
        dealer.send(b"d")
        rest = [await asyncio.wait_for(served.recv_multipart(), 5) for _ in range(2)]
        served.close()
        return [first, *rest]

    assert asyncio.run(main()) == [[b"peer", b"a"], [b"peer", b"b", b"c"], [b"peer", b"d"]]


def test_a_message_whose_signal_a_send_took_is_still_handed_on(pair):
    """The descriptor is edge-triggered and a send processes the socket's pending commands: a message
    that arrived before the send would wait for the next one's signal, were the state not looked at
    again after every send."""
    _, router, dealer = pair
    got: list[list[bytes]] = []

    async def main():
        served = LoopSocket(router, got.append)
        served.start()
        dealer.send(b"hello")
        await _until(lambda: len(got) == 1)
        dealer.send(b"arrived")
        time.sleep(0.1)  # it is in the ROUTER's queue; the loop has not run since
        served.send_multipart([b"peer", b"reply"])  # takes the descriptor's signal
        await asyncio.sleep(0.3)
        served.close()

    asyncio.run(main())
    assert got == [[b"peer", b"hello"], [b"peer", b"arrived"]]
    assert dealer.recv() == b"reply"


def test_a_full_batch_lets_the_loops_other_callbacks_run(pair):
    _, router, dealer = pair
    order: list[str] = []

    async def main():
        for i in range(4 * DRAIN_BATCH):
            dealer.send(b"%d" % i)
        time.sleep(0.2)  # all of them queued before the first drain

        def handed(frames):
            if len(order) == 0:
                asyncio.get_running_loop().call_soon(order.append, "other")
            order.append("message")

        served = LoopSocket(router, handed)
        served.start()
        await _until(lambda: order.count("message") == 4 * DRAIN_BATCH)
        served.close()

    asyncio.run(main())
    # After a batch (two, when the descriptor's reader was queued beside the first drain), not after all.
    assert DRAIN_BATCH <= order.index("other") <= 2 * DRAIN_BATCH


def test_a_failing_handler_is_logged_and_the_next_messages_still_come(pair, caplog):
    _, router, dealer = pair
    got: list[bytes] = []

    def handed(frames):
        if frames[1] == b"bad":
            raise RuntimeError("boom")
        got.append(frames[1])

    async def main():
        served = LoopSocket(router, handed)
        served.start()
        for payload in (b"a", b"bad", b"b"):
            dealer.send(payload)
        await _until(lambda: len(got) == 2)
        served.close()

    caplog.set_level(logging.ERROR, logger=loop_socket.__name__)
    asyncio.run(main())
    assert got == [b"a", b"b"] and "a received message's handler failed" in caplog.text


def test_a_send_to_a_gone_peer_raises_and_the_socket_keeps_serving(pair):
    _, router, dealer = pair
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)

    async def main():
        served = LoopSocket(router)
        served.start()
        with pytest.raises(zmq.ZMQError):
            served.send_multipart([b"nobody", b"x"])
        dealer.send(b"still")
        frames = await asyncio.wait_for(served.recv_multipart(), 5)
        served.close()
        return frames

    assert asyncio.run(main()) == [b"peer", b"still"]


def test_close_stops_the_watch_and_closes_the_socket_once(pair):
    _, router, _ = pair

    async def main():
        served = LoopSocket(router)
        with pytest.raises(RuntimeError, match="start"):
            await served.recv_multipart()
        served.start()
        loop = asyncio.get_running_loop()
        served.close()
        served.close()
        assert router.closed and not loop.remove_reader(served._fd)  # nothing was left watching

    asyncio.run(main())


def test_a_zmq_asyncio_socket_is_refused_and_a_plain_context_shares_the_underlying_one():
    context = zmq.asyncio.Context()
    sock = context.socket(zmq.ROUTER)
    try:
        with pytest.raises(TypeError, match=r"plain zmq\.Socket"):
            LoopSocket(sock)
        plain = plain_context(context)
        assert plain.underlying == context.underlying
        other = plain.socket(zmq.DEALER)
        assert not isinstance(other, zmq.asyncio.Socket)
        other.close(linger=0)
    finally:
        sock.close(linger=0)
        context.term()
