"""The TokenizerManager's part of a restart of the children (--restart-on-failure).

In-flight requests end with a retryable error rather than being re-run: the request that crashed
the scheduler is among them and would crash the new one at once, a sampled continuation cannot be
re-run to the same tokens without the dead scheduler's random state, and a client that is told
(503 + Retry-After, or a stream's final abort event with status_code 503) decides for itself. The
quarantine counts the crash against each of them first (managers/quarantine.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from radixserve.managers.crash_dump import write_crash_dump
from radixserve.managers.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)


def restarting_message(reason: str) -> str:
    return f"The server is restarting ({reason}); retry the request."


class RestartHandler:
    """A SupervisorListener: each call comes on the supervisor's thread and is carried out on
    the TokenizerManager's event loop, in the order the calls came."""

    def __init__(
        self,
        tm: TokenizerManager,
        loop: asyncio.AbstractEventLoop,
        give_up: Callable[[str], None],
        set_restarting: Callable[[bool], None] = lambda _: None,
    ) -> None:
        self.tm = tm
        self.loop = loop
        self._give_up = give_up
        self._set_restarting = set_restarting

    def on_down(self, reason: str, blame_requests: bool) -> None:
        self._set_restarting(True)  # at once: /health must not answer 200 for a moment longer
        self.loop.call_soon_threadsafe(self._down, reason, blame_requests)

    def on_up(self, info: dict[str, Any]) -> None:
        self.loop.call_soon_threadsafe(self._up, info)

    def on_give_up(self, reason: str) -> None:
        self._give_up(reason)

    def _down(self, reason: str, blame_requests: bool) -> None:
        write_crash_dump(self.tm, reason)  # --crash-dump-folder: while the requests are in flight
        if self.tm.quarantine is not None:
            if blame_requests:
                self.tm.quarantine.on_crash()  # before fail_all, which forgets what was in flight
            else:
                logger.warning("%s: killed from outside, no quarantine strike for any request", reason)
        self.tm.fail_all(restarting_message(reason), 503)
        self.tm.reconnect_scheduler()

    def _up(self, info: dict[str, Any]) -> None:
        self.tm.ranks = info.get("ranks") or [
            {"rank": 0, "tp_rank": 0, "pp_rank": 0, "node_rank": 0, "pid": info.get("pid")}
        ]
        started = self.tm.server_args.weight_version
        if self.tm.weight_version != started:
            # The new scheduler loaded --model-path: weights updated at run time are gone.
            logger.warning(
                "The restart reloaded --model-path: weight version %r is back to %r",
                self.tm.weight_version,
                started,
            )
            self.tm.weight_version = started
        self.tm.dead_reason = None  # fail_all's refusal of new requests ends
        self._set_restarting(False)
