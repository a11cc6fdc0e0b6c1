"""Chat steps -> Responses output items and their server-sent events.

One output item is open at a time, in the order the model writes them: a reasoning item (with
--reasoning-parser), a message, then one function_call item per parsed call. Each item opens with
response.output_item.added (and response.content_part.added for a message or reasoning), grows
with its delta events, and closes with its done events and response.output_item.done. The
non-streamed answer is built by the same code (serving.py drains the events), so the two agree.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from radixserve.entrypoints.openai.protocol import DeltaMessage
from radixserve.entrypoints.responses.translate import new_id

Event = dict[str, Any]


@dataclass
class OpenItem:
    kind: str  # message | reasoning | function_call
    item: dict[str, Any]  # the item as output_item.added announced it
    text: str = ""  # the text, reasoning text or arguments so far


@dataclass
class OutputEvents:
    """Feeds chat deltas; `items` holds the finished output items."""

    items: list[dict[str, Any]] = field(default_factory=list)
    open: OpenItem | None = None

    @property
    def index(self) -> int:
        return len(self.items)

    def feed(self, delta: DeltaMessage) -> list[Event]:
        events: list[Event] = []
        if delta.reasoning_content:
            if self.open is None or self.open.kind != "reasoning":
                events += self._start("reasoning", {"type": "reasoning", "summary": [], "content": []})
            events.append(self._text_delta("response.reasoning_text.delta", delta.reasoning_content))
        if delta.content:
            if self.open is None or self.open.kind != "message":
                events += self._start("message", {"type": "message", "role": "assistant", "content": []})
            events.append({**self._text_delta("response.output_text.delta", delta.content), "logprobs": []})
        for call in delta.tool_calls or []:
            if call.function.name is not None:  # a call's first piece names it
                item = {
                    "type": "function_call",
                    "call_id": call.id,
                    "name": call.function.name,
                    "arguments": "",
                }
                events += self._start("function_call", item)
            if call.function.arguments and self.open is not None:
                self.open.text += call.function.arguments
                events.append(
                    {
                        "type": "response.function_call_arguments.delta",
                        "item_id": self.open.item["id"],
                        "output_index": self.index,
                        "delta": call.function.arguments,
                    }
                )
        return events

    def finish(self, status: str = "completed") -> list[Event]:
        """Close the open item; `status` is "incomplete" when the answer was cut (max tokens)."""
        if self.open is None:
            return []
        opened, self.open = self.open, None
        where = {"item_id": opened.item["id"], "output_index": self.index}
        events: list[Event] = []
        if opened.kind == "function_call":
            item = {**opened.item, "arguments": opened.text, "status": status}
            done = {"type": "response.function_call_arguments.done", **where, "arguments": opened.text}
            events.append({**done, "name": item["name"]})
        else:
            part = _part(opened.kind, opened.text)
            item = {**opened.item, "content": [part], "status": status}
            kind = "output_text" if opened.kind == "message" else "reasoning_text"
            text_done = {"type": f"response.{kind}.done", **where, "content_index": 0, "text": opened.text}
            if opened.kind == "message":
                text_done["logprobs"] = []
            part_done = {"type": "response.content_part.done", **where, "content_index": 0, "part": part}
            events += [text_done, part_done]
        self.items.append(item)
        events.append(
            {"type": "response.output_item.done", "output_index": where["output_index"], "item": item}
        )
        return events

    def _start(self, kind: str, item: dict[str, Any]) -> list[Event]:
        events = self.finish()
        prefix = {"message": "msg", "reasoning": "rs", "function_call": "fc"}[kind]
        item = {"id": new_id(prefix), **item, "status": "in_progress"}
        self.open = OpenItem(kind, item)
        events.append({"type": "response.output_item.added", "output_index": self.index, "item": item})
        if kind != "function_call":
            events.append(
                {
                    "type": "response.content_part.added",
                    "item_id": item["id"],
                    "output_index": self.index,
                    "content_index": 0,
                    "part": _part(kind, ""),
                }
            )
        return events

    def _text_delta(self, event_type: str, delta: str) -> Event:
        assert self.open is not None
        self.open.text += delta
        return {
            "type": event_type,
            "item_id": self.open.item["id"],
            "output_index": self.index,
            "content_index": 0,
            "delta": delta,
        }


def _part(kind: str, text: str) -> dict[str, Any]:
    if kind == "message":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "reasoning_text", "text": text}


async def numbered(events: AsyncIterator[Event], start: int = 0) -> AsyncIterator[Event]:
    """Each event with its sequence_number, counting from `start`."""
    seq = start
    async for event in events:
        yield {**event, "sequence_number": seq}
        seq += 1
