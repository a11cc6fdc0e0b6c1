"""Waiting for a generate call's progress, with a stall deadline that costs no timer per chunk.

Why: a streaming request wakes once per token. `asyncio.wait_for(event.wait(), timeout)` around
each wake creates a task, a future and a timer (and cancels them) on every chunk, only so that a
request that stalls can ask the HTTP server whether its client went away. `ProgressWaiter` keeps
one timer per call instead: when it fires it rearms if progress came since the previous firing,
and only when none did (a stall of one to two periods) does it wake the waiter with "poll now".
It uses call_later and Event only, so it behaves alike on Python 3.10 to 3.12.

The waiter may return without progress (a poll): callers re-check their states after every
return, so a spurious wake costs one loop turn and never loses progress (the event stays the
single source of wake-ups, set by progress and by the timer alike).
"""

from __future__ import annotations

import asyncio


class ProgressWaiter:
    def __init__(self, event: asyncio.Event, poll_s: float) -> None:
        self.event = event
        self.poll_s = poll_s
        self._timer: asyncio.TimerHandle | None = None
        self._waiting = False
        self._progressed = False  # a wake-up by progress since the timer last fired
        self._stalled = False  # the timer fired with no progress in its period

    async def wait(self) -> bool:
        """Wait until the event is set, then clear it. True: woken by progress (or it was already
        set); False: a period passed with no progress while waiting, time to poll the client."""
        if not self.event.is_set():
            if self._timer is None:
                self._timer = asyncio.get_running_loop().call_later(self.poll_s, self._fire)
            self._waiting = True
            try:
                await self.event.wait()
            finally:
                self._waiting = False
        self.event.clear()
        if self._stalled:
            self._stalled = False
            return False
        self._progressed = True
        return True

    def _fire(self) -> None:
        self._timer = None
        if not self._waiting:
            return  # the caller is busy (sending a chunk); its next wait arms a new period
        if self._progressed:
            self._progressed = False
            self._timer = asyncio.get_running_loop().call_later(self.poll_s, self._fire)
            return
        self._stalled = True
        self.event.set()

    def close(self) -> None:
        """Cancel the pending timer (the call is over); safe to call twice."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
