"""One response being generated: its object, its output items, and the event stream that builds
them. Foreground, background, streamed or not, every response is produced by `ResponseRun.events`,
so a streamed answer and a non-streamed one cannot disagree."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from radixserve.entrypoints.chat_steps import ChatStep
from radixserve.entrypoints.openai.serving_common import finish_reason, internal_error_message
from radixserve.entrypoints.responses.events import Event, OutputEvents
from radixserve.entrypoints.responses.protocol import (
    OUTPUT_ITEMS,
    IncompleteDetails,
    InputTokensDetails,
    OutputTokensDetails,
    ResponseErrorInfo,
    ResponseObject,
    ResponseUsage,
)
from radixserve.managers.errors import RequestAbortedError

Steps = Callable[[], Awaitable[AsyncIterator[ChatStep]]]
Cancel = Callable[[str], None]


@dataclass
class ResponseRun:
    response: ResponseObject
    input_items: list[dict[str, Any]]
    on_cancel: Cancel  # aborts the generation of this response's rid
    output: OutputEvents = field(default_factory=OutputEvents)
    cancelled: bool = False
    _submitted: bool = False  # the generate request reached the TokenizerManager
    _reasoning_tokens: int = 0  # of the finished output (chat_steps)

    @property
    def rid(self) -> str:
        return self.response.id

    def dump(self) -> dict[str, Any]:
        return self.response.model_dump(mode="json")

    def cancel(self) -> None:
        """Stop the generation; before the request is submitted, `events` aborts it once it is."""
        if not self.cancelled:
            self.cancelled = True
            if self._submitted:
                self.on_cancel(self.rid)

    async def events(self, start: Steps, in_band: bool) -> AsyncIterator[Event]:
        """The response's events, without sequence numbers. `start()` submits the request (a
        refusal raises there). `in_band`: a failure becomes response.failed (a started stream, a
        background job); otherwise it raises, for the caller to answer with its status."""
        yield {"type": "response.created", "response": self.dump()}
        self.response.status = "in_progress"
        yield {"type": "response.in_progress", "response": self.dump()}
        last: dict[str, Any] | None = None
        self._reasoning_tokens = 0
        try:
            steps = await start()
            self._submitted = True
            if self.cancelled:  # cancelled while it was being submitted
                self.on_cancel(self.rid)
            async for step in steps:
                for event in self.output.feed(step.delta) if step.delta is not None else []:
                    yield event
                last = step.output
                self._reasoning_tokens = step.reasoning_tokens
        except (ValueError, RequestAbortedError) as exc:
            if not in_band:
                raise
            self._fail(getattr(exc, "status_code", 400), str(exc))
        except Exception as exc:  # noqa: BLE001 - unforeseen: the server's fault, said in-band
            if not in_band:
                raise
            self._fail(500, internal_error_message(exc))
        if self.response.status == "failed":
            for event in self.output.finish("incomplete"):
                yield event
            self.response.output = OUTPUT_ITEMS.validate_python(self.output.items)
            yield {"type": "response.failed", "response": self.dump()}
            return
        for event in self.output.finish("incomplete" if _cut(last) else "completed"):
            yield event
        self._complete(last)
        yield {"type": f"response.{_terminal_event(self.response.status)}", "response": self.dump()}

    def _fail(self, status: int, message: str) -> None:
        self.response.status = "failed"
        code = "server_error" if status >= 500 else "invalid_prompt"
        self.response.error = ResponseErrorInfo(code=code, message=message)

    def _complete(self, last: dict[str, Any] | None) -> None:
        resp = self.response
        resp.output = OUTPUT_ITEMS.validate_python(self.output.items)
        resp.completed_at = time.time()
        if self.cancelled:
            resp.status = "cancelled"
        elif _cut(last):
            resp.status = "incomplete"
            resp.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        else:
            resp.status = "completed"
        if last is not None:
            meta = last["meta_info"]
            resp.usage = ResponseUsage(
                input_tokens=meta["prompt_tokens"],
                input_tokens_details=InputTokensDetails(cached_tokens=meta.get("cached_tokens", 0)),
                output_tokens=meta["completion_tokens"],
                output_tokens_details=OutputTokensDetails(reasoning_tokens=self._reasoning_tokens),
                total_tokens=meta["prompt_tokens"] + meta["completion_tokens"],
            )


def _cut(last: dict[str, Any] | None) -> bool:
    return last is not None and finish_reason(last)[0] == "length"


def _terminal_event(status: str) -> str:
    """OpenAI has no response.cancelled event: a cancelled response's stream ends with
    response.incomplete carrying the response (status cancelled)."""
    return {"completed": "completed", "failed": "failed"}.get(status, "incomplete")


class EventLog:
    """A background response's events, kept for streaming and for resuming (starting_after)."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.closed = False
        self._changed = asyncio.Event()

    def append(self, event: Event) -> None:
        self.events.append(event)
        self._wake()

    def close(self) -> None:
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self, after: int) -> AsyncIterator[Event]:
        """Events with sequence_number > `after` (their index), live until the log is closed."""
        i = max(after + 1, 0)
        while True:
            changed = self._changed
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if self.closed:
                return
            await changed.wait()
