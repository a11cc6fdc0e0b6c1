"""The TokenizerManager's side of the control plane: one coroutine per control request, shared by
the HTTP routes and the Engine. Each sends its message to the scheduler and awaits the reply its
class declares (`reply_type`, managers/control_messages.py); the scheduler decides when it takes
effect (scheduler/control_plane.py). The TokenizerManager hands every message it receives to
`deliver` first: the replies someone waits for stop there. Waiters are keyed by the reply's type,
or for the shared ControlOutcome by the name of the request class it `answers`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Callable
from typing import Any

from radixserve.managers import io_struct as io
from radixserve.managers.errors import RequestAbortedError
from radixserve.managers.input_validation import InvalidRequestError

CONTROL_TIMEOUT_S = 30.0
# A weight update waits for in-flight requests to finish (or for a trainer's broadcast); memory
# resume reloads the checkpoint: these may take long, unlike a query.
LONG_CONTROL_TIMEOUT_S = 1800.0


class ControlClient:
    def __init__(
        self,
        send: Callable[[object], None],  # to the scheduler (or the DataParallelController)
        dp_size: int,  # replicas that each answer
        check_alive: Callable[[], None],  # raises when the server can no longer answer
        on_new_weights: Callable[[str | None, str | None], None],  # (weight_version, model_path)
    ) -> None:
        self._send = send
        self._dp_size = dp_size
        self._check_alive = check_alive
        self._on_new_weights = on_new_weights
        # By reply type, or by request class name for ControlOutcome replies.
        self._waiters: dict[type | str, list[asyncio.Future[Any]]] = {}
        self._locks: dict[type | str, asyncio.Lock] = {}

    # ------------------------------------------------------------------ plumbing
    async def ask_all(self, msg: io.ControlReq, timeout: float | None = None) -> list[Any]:
        """Send a control request and await every replica's reply (one per data-parallel replica:
        with --dp-size > 1 the DataParallelController fans the request out). One call at a time
        per kind of request (replies of one type come back in order; different kinds never wait
        on each other)."""
        assert msg.reply_type is not None, f"{type(msg).__name__} has no reply to wait for"
        key = type(msg).__name__ if msg.reply_type is io.ControlOutcome else msg.reply_type
        limit = timeout or CONTROL_TIMEOUT_S
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            loop = asyncio.get_running_loop()
            futures: list[asyncio.Future[Any]] = [loop.create_future() for _ in range(self._dp_size)]
            waiters = self._waiters.setdefault(key, [])
            waiters.extend(futures)
            self._send(msg)
            try:
                return list(await asyncio.wait_for(asyncio.gather(*futures), limit))
            except asyncio.TimeoutError:
                raise RequestAbortedError(
                    f"The scheduler did not answer {type(msg).__name__} within {limit:.0f} s.", 503
                ) from None
            finally:  # a reply that never came must not be handed to the next caller's future
                for future in futures:
                    if future in waiters:
                        waiters.remove(future)

    def deliver(self, msg: object) -> bool:
        """Hand `msg` to the oldest call waiting for its type (for a ControlOutcome: for the
        request it answers); False when it is no control reply (no call ever waited for it)."""
        waiters = self._waiters.get(msg.answers if isinstance(msg, io.ControlOutcome) else type(msg))
        if waiters is None:
            return False
        if waiters:
            future = waiters.pop(0)
            if not future.done():
                future.set_result(msg)
        return True

    async def ask(self, msg: io.ControlReq) -> Any:  # noqa: ANN401 - msg.reply_type
        """Send a control request and return its reply: the first refusal among the replicas', else
        the first reply. New weights a reply reports (and a checkpoint loaded) are noted."""
        self._check_alive()
        replies = await self.ask_all(msg, LONG_CONTROL_TIMEOUT_S if msg.long_running else None)
        # Every replica applied the request; a replica that refused it speaks for all of them.
        failed = [r for r in replies if getattr(r, "success", True) is False]
        out = failed[0] if failed else replies[0]
        version, model_path = getattr(out, "weight_version", None), getattr(msg, "model_path", None)
        if not failed and (version is not None or model_path is not None):
            self._on_new_weights(version, model_path)
        return out

    async def open_session(self, obj: io.OpenSessionReqInput) -> str:
        session_id = uuid.uuid4().hex if obj.session_id is None else obj.session_id
        out = await self.ask(dataclasses.replace(obj, session_id=session_id))
        if not out.success:
            raise InvalidRequestError(out.message or "Failed to open the session.")
        return session_id

    async def get_weights_by_name(self, obj: io.GetWeightsByNameReqInput) -> io.GetWeightsByNameReqOutput:
        self._check_alive()
        replies = await self.ask_all(obj)
        failed = [r for r in replies if not r.success]
        if failed or len(replies) == 1:
            return failed[0] if failed else replies[0]
        # SGLang's answer with --dp-size > 1: one parameter per replica, as the replies arrive.
        return dataclasses.replace(replies[0], parameter=[r.parameter for r in replies])
