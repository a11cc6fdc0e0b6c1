"""Streaming Messages: chat steps -> Anthropic's server-sent events.

The order is Anthropic's: message_start, ping, then per content block content_block_start,
content_block_delta..., content_block_stop (one block open at a time: thinking, text, each
tool_use), then message_delta (stop_reason, usage) and message_stop. Each event is sent as
`event: <type>` plus `data: <json>`. A failure after the stream started is an `error` event in
Anthropic's error shape, and the stream ends.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson

from radixserve.entrypoints.anthropic.translate import stop_reason, tool_use_id
from radixserve.entrypoints.chat_steps import ChatStep
from radixserve.entrypoints.error_dialects import anthropic_error
from radixserve.entrypoints.openai.protocol import DeltaMessage
from radixserve.entrypoints.openai.serving_common import in_band_errors

Event = dict[str, Any]


class BlockEvents:
    """Chat deltas -> content-block events; a new kind of piece closes the open block."""

    def __init__(self) -> None:
        self.index = -1
        self.open_kind: str | None = None

    def feed(self, delta: DeltaMessage) -> list[Event]:
        events: list[Event] = []
        if delta.reasoning_content:
            if self.open_kind != "thinking":
                events += self._start({"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning_content}))
        if delta.content:
            if self.open_kind != "text":
                events += self._start({"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta.content}))
        for call in delta.tool_calls or []:
            if call.function.name is not None:  # a call's first piece names it
                block = {
                    "type": "tool_use",
                    "id": tool_use_id(call.id),
                    "name": call.function.name,
                    "input": {},
                }
                events += self._start(block)
            if call.function.arguments:
                events.append(
                    self._delta({"type": "input_json_delta", "partial_json": call.function.arguments})
                )
        return events

    def finish(self) -> list[Event]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [{"type": "content_block_stop", "index": self.index}]

    def _start(self, block: Event) -> list[Event]:
        events = self.finish()
        self.index += 1
        self.open_kind = block["type"]
        return [*events, {"type": "content_block_start", "index": self.index, "content_block": block}]

    def _delta(self, delta: Event) -> Event:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}


def usage_fields(meta: dict[str, Any]) -> dict[str, int]:
    cached = meta.get("cached_tokens", 0)
    return {
        "input_tokens": meta["prompt_tokens"] - cached,
        "output_tokens": meta["completion_tokens"],
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


async def message_events(steps: AsyncIterator[ChatStep], message_id: str, model: str) -> AsyncIterator[Event]:
    blocks = BlockEvents()
    started = False
    async for step in steps:
        if not started:
            started = True
            usage = {**usage_fields(step.output["meta_info"]), "output_tokens": 0}
            message = {
                "id": message_id,
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": usage,
            }
            yield {"type": "message_start", "message": message}
            yield {"type": "ping"}
        for event in blocks.feed(step.delta) if step.delta is not None else []:
            yield event
        if step.finished:
            for event in blocks.finish():
                yield event
            reason, sequence = stop_reason(step.output, step.has_tool_calls)
            yield {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": usage_fields(step.output["meta_info"]),
            }
            yield {"type": "message_stop"}


def sse_event(event: Event) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


def anthropic_sse(events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
    """The events as SSE; an error after the stream started is an `error` event."""
    chunks = (sse_event(event) async for event in events)
    return in_band_errors(
        chunks, lambda status, message: sse_event(anthropic_error(status, message)), "a Messages stream"
    )
