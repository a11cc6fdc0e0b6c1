"""CPU time per received message on the tokenizer manager's side of its PULL socket: pyzmq's
asyncio recv (what the tokenizer manager used) against managers/socket_reader.py's SocketReader.

    python benchmark/bench_socket_reader.py                 # 3000 messages, one every 0.5 ms
    python benchmark/bench_socket_reader.py --messages 10000 --interval-ms 0.2

A sender process pushes small pickled messages (the size of one stream's BatchStrOut) at a fixed
interval, as the detokenizer does at one stream; the receiving event loop's thread CPU time
(time.thread_time) per message is printed for each way, alternating, --rounds times. Thread CPU
time, not wall time: the number holds on a loaded machine, where wall times do not.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import tempfile
import time
from pathlib import Path

import zmq
import zmq.asyncio

from radixserve.managers.socket_reader import SocketReader

PAYLOAD = ("r" * 32, [1234], " word", None, 128)  # ~ one stream's BatchStrOut fields


def _send(addr: str, n: int, interval_s: float) -> None:
    ctx = zmq.Context(1)
    sock = ctx.socket(zmq.PUSH)
    sock.connect(addr)
    time.sleep(0.3)  # the receiver is bound and reading
    for _ in range(n):
        sock.send_pyobj(PAYLOAD)
        time.sleep(interval_s)
    sock.send_pyobj(None)
    sock.close(linger=-1)
    ctx.term()


def _sender(addr: str, n: int, interval_s: float) -> mp.Process:
    proc = mp.get_context("spawn").Process(target=_send, args=(addr, n, interval_s), daemon=True)
    proc.start()
    return proc


async def via_zmq_asyncio(addr: str, n: int, interval_s: float) -> float:
    ctx = zmq.asyncio.Context(1)
    sock = ctx.socket(zmq.PULL)
    sock.bind(addr)
    proc = _sender(addr, n, interval_s)
    start, count = time.thread_time(), 0
    while await sock.recv_pyobj() is not None:
        count += 1
    spent = time.thread_time() - start
    proc.join()
    sock.close(linger=0)
    ctx.term()
    return spent / count


async def via_socket_reader(addr: str, n: int, interval_s: float) -> float:
    ctx = zmq.Context(1)
    sock = ctx.socket(zmq.PULL)
    sock.bind(addr)
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    count = [0]

    def handle(msg: object) -> None:
        if msg is None:
            done.set_result(None)
        else:
            count[0] += 1

    reader = SocketReader(sock, handle)
    proc = _sender(addr, n, interval_s)
    start = time.thread_time()
    reader.start(loop)
    await done
    spent = time.thread_time() - start
    reader.stop()
    proc.join()
    sock.close(linger=0)
    ctx.term()
    return spent / count[0]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--interval-ms", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    addr = f"ipc://{Path(tempfile.gettempdir()) / f'bench_socket_reader_{time.time_ns()}'}"
    interval = args.interval_ms / 1e3
    for r in range(args.rounds):
        a = asyncio.run(via_zmq_asyncio(addr, args.messages, interval))
        b = asyncio.run(via_socket_reader(addr, args.messages, interval))
        print(f"round {r}: zmq.asyncio recv {a * 1e6:.1f} us/message, SocketReader {b * 1e6:.1f} us/message")


if __name__ == "__main__":
    main()
