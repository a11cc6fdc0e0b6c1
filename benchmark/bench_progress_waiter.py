"""CPU time per streamed chunk of the tokenizer manager's wait for progress: asyncio.wait_for
around the event (what _wait did) against managers/progress_waiter.py's ProgressWaiter.

    python benchmark/bench_progress_waiter.py               # 20000 wakes, 5 rounds alternating

Each wake is one event.set from a loop callback, as the socket reader's message does at one
stream; thread CPU time (time.thread_time) per wake is printed for each way, alternating rounds,
so that the numbers hold on a loaded machine. The difference is what a chunk saves.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from radixserve.managers.progress_waiter import ProgressWaiter

POLL_S = 0.5


async def _wait_for_way(n: int) -> float:
    loop = asyncio.get_running_loop()
    event = asyncio.Event()
    start = time.thread_time()
    for _ in range(n):
        loop.call_soon(event.set)
        while not event.is_set():
            try:
                await asyncio.wait_for(event.wait(), timeout=POLL_S)
            except asyncio.TimeoutError:
                pass
        event.clear()
    return (time.thread_time() - start) / n


async def _waiter_way(n: int) -> float:
    loop = asyncio.get_running_loop()
    event = asyncio.Event()
    waiter = ProgressWaiter(event, POLL_S)
    start = time.thread_time()
    for _ in range(n):
        loop.call_soon(event.set)
        await waiter.wait()
    waiter.close()
    return (time.thread_time() - start) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wakes", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    for r in range(args.rounds):
        old = asyncio.run(_wait_for_way(args.wakes))
        new = asyncio.run(_waiter_way(args.wakes))
        print(f"round {r}: wait_for {old * 1e6:.1f} us/chunk, ProgressWaiter {new * 1e6:.1f} us/chunk")


if __name__ == "__main__":
    main()
