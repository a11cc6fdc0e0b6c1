"""SocketReader (managers/socket_reader.py) against the plain blocking receive it replaces: every
message, in order, through bursts longer than one callback's share, a failing handler, and stop."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterator

import pytest
import zmq

from radixserve.managers import socket_reader
from radixserve.managers.socket_reader import SocketReader


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    ctx = zmq.Context(1)
    addr = f"inproc://socket-reader-{uuid.uuid4().hex}"
    pull = ctx.socket(zmq.PULL)
    pull.bind(addr)
    push = ctx.socket(zmq.PUSH)
    push.connect(addr)
    yield push, pull
    push.close(linger=0)
    pull.close(linger=0)
    ctx.term()


async def _until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        assert loop.time() < deadline, "the reader did not deliver in time"
        await asyncio.sleep(0.001)


def test_every_message_in_order_across_bursts(pair: tuple[zmq.Socket, zmq.Socket]) -> None:
    push, pull = pair
    got: list[object] = []
    n_before = 3 * socket_reader.MAX_PER_CALL + 5  # queued before start: no edge will announce them

    async def main() -> None:
        for i in range(n_before):
            push.send_pyobj(("before", i))
        reader = SocketReader(pull, got.append)
        reader.start(asyncio.get_running_loop())
        await _until(lambda: len(got) == n_before)
        for i in range(50):  # one at a time, each announced by its own edge
            push.send_pyobj(("after", i))
            await asyncio.sleep(0)
        await _until(lambda: len(got) == n_before + 50)
        reader.stop()

    asyncio.run(main())
    assert got == [("before", i) for i in range(n_before)] + [("after", i) for i in range(50)]


def test_a_failing_handler_does_not_stop_reading(pair: tuple[zmq.Socket, zmq.Socket]) -> None:
    push, pull = pair
    got: list[object] = []

    def handle(msg: object) -> None:
        if msg == "bad":
            raise ValueError("boom")
        got.append(msg)

    async def main() -> None:
        reader = SocketReader(pull, handle)
        reader.start(asyncio.get_running_loop())
        for msg in ("a", "bad", "b"):
            push.send_pyobj(msg)
        await _until(lambda: len(got) == 2)
        reader.stop()

    asyncio.run(main())
    assert got == ["a", "b"]


def test_stop_leaves_later_messages_queued(pair: tuple[zmq.Socket, zmq.Socket]) -> None:
    push, pull = pair
    got: list[object] = []

    async def main() -> None:
        reader = SocketReader(pull, got.append)
        reader.start(asyncio.get_running_loop())
        push.send_pyobj(1)
        await _until(lambda: got == [1])
        reader.stop()
        reader.stop()  # idempotent
        push.send_pyobj(2)
        await asyncio.sleep(0.05)

    asyncio.run(main())
    assert got == [1]
    assert pull.recv_pyobj() == 2  # still there for whoever reads next
