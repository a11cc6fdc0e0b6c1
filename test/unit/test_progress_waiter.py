"""ProgressWaiter (managers/progress_waiter.py): progress wakes the waiter at once, a stall wakes
it with "poll" after one to two periods, progress never goes unseen, and no timer outlives a call."""

from __future__ import annotations

import asyncio

from radixserve.managers.progress_waiter import ProgressWaiter

POLL_S = 0.05


def _timers(loop: asyncio.AbstractEventLoop) -> int:
    return sum(1 for h in loop._scheduled if not h.cancelled())  # type: ignore[attr-defined]


def test_progress_wakes_with_true_and_clears_the_event() -> None:
    async def main() -> list[bool]:
        event = asyncio.Event()
        waiter = ProgressWaiter(event, POLL_S)
        got = []
        for _ in range(5):
            asyncio.get_running_loop().call_soon(event.set)
            got.append(await waiter.wait())
            assert not event.is_set()
        waiter.close()
        return got

    assert asyncio.run(main()) == [True] * 5


def test_an_event_already_set_returns_without_arming_a_timer() -> None:
    async def main() -> tuple[bool, int]:
        event = asyncio.Event()
        event.set()
        waiter = ProgressWaiter(event, POLL_S)
        return await waiter.wait(), _timers(asyncio.get_running_loop())

    assert asyncio.run(main()) == (True, 0)


def test_a_stall_wakes_with_false_then_waiting_goes_on() -> None:
    async def main() -> list[bool]:
        event = asyncio.Event()
        waiter = ProgressWaiter(event, POLL_S)
        got = [await waiter.wait(), await waiter.wait()]  # no progress at all: two polls
        asyncio.get_running_loop().call_soon(event.set)
        got.append(await waiter.wait())
        waiter.close()
        return got

    assert asyncio.run(main()) == [False, False, True]


def test_steady_progress_keeps_one_timer_and_never_polls() -> None:
    # Progress every 0.2 periods for ~6 periods: no poll, and at most one live timer throughout.
    async def main() -> tuple[list[bool], int]:
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        waiter = ProgressWaiter(event, POLL_S)
        got, most = [], 0
        for _ in range(30):
            loop.call_later(POLL_S / 5, event.set)
            got.append(await waiter.wait())
            most = max(most, _timers(loop))
        waiter.close()
        return got, most

    got, most = asyncio.run(main())
    assert all(got)
    assert most <= 1


def test_progress_arriving_with_a_stall_wake_is_still_seen() -> None:
    # The caller re-checks its states after every return, so progress set on the same event as
    # the timer's wake is found on that return: here the state flag stands for the states.
    async def main() -> bool:
        event = asyncio.Event()
        waiter = ProgressWaiter(event, POLL_S)
        progressed = False

        def progress() -> None:
            nonlocal progressed
            progressed = True
            event.set()

        asyncio.get_running_loop().call_later(POLL_S * 1.01, progress)
        while not progressed:
            await waiter.wait()
        waiter.close()
        return progressed

    assert asyncio.run(main())


def test_close_cancels_the_pending_timer() -> None:
    async def main() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        waiter = ProgressWaiter(event, POLL_S)
        loop.call_soon(event.set)
        await waiter.wait()
        armed = _timers(loop)
        waiter.close()
        waiter.close()
        return armed, _timers(loop)

    assert asyncio.run(main()) == (1, 0)


def test_a_cancelled_wait_leaves_no_waiting_flag() -> None:
    async def main() -> bool:
        event = asyncio.Event()
        waiter = ProgressWaiter(event, POLL_S)
        task = asyncio.ensure_future(waiter.wait())
        await asyncio.sleep(0)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        waiter.close()
        return waiter._waiting

    assert asyncio.run(main()) is False
