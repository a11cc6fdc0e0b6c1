"""POST /api/chat and /api/generate: Ollama requests run on the chat or completions path
(translate.py), answered as one JSON object or, by default (`stream` is true unless the client
says false), as NDJSON lines: one per new piece of text, then a last line with done: true,
done_reason and the counts and durations (nanoseconds).

Both modes run the request as a stream inside, so the durations are measured the same way:
prompt_eval_duration is the time to the first output token (queueing included), eval_duration
the time after it. An empty prompt (no messages) loads nothing and answers done_reason "load",
as Ollama does for a model that is always loaded.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from radixserve.entrypoints.chat_steps import ChatStep, chat_steps, tool_input
from radixserve.entrypoints.ollama.protocol import (
    ChatRequest,
    GenerateRequest,
    Timings,
    ToolCallFunction,
    ToolCallOut,
)
from radixserve.entrypoints.ollama.translate import (
    chat_request,
    check_generate,
    generate_chat_request,
    raw_completion_request,
)
from radixserve.entrypoints.openai.chat_tools import ChatPlan, ChoiceResult, split_output
from radixserve.entrypoints.openai.serving_chat import ChatHandler
from radixserve.entrypoints.openai.serving_common import finish_reason
from radixserve.entrypoints.openai.serving_completions import CompletionsHandler
from radixserve.managers.generate_request import GenerateReqInput
from radixserve.managers.tokenizer_manager import ClientRequest, TokenizerManager


def created_at() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


@dataclass(frozen=True)
class Final:
    """How a generation ended: its whole output split, done_reason, the counts and durations."""

    parts: ChoiceResult
    done_reason: str
    timings: Timings

    def tool_calls(self) -> list[ToolCallOut] | None:
        calls = [
            ToolCallOut(
                function=ToolCallFunction(
                    name=c.function.name or "", arguments=tool_input(c.function.arguments)
                )
            )
            for c in self.parts.tool_calls or []
        ]
        return calls or None


@dataclass(frozen=True)
class Piece:
    """New text of a running generation; the last piece has `final` set."""

    content: str = ""
    thinking: str = ""
    final: Final | None = None


class OllamaGenerator:
    def __init__(self, tm: TokenizerManager, chat: ChatHandler, completions: CompletionsHandler) -> None:
        self.tm = tm
        self.chat = chat
        self.completions = completions

    def plan_chat(self, req: ChatRequest) -> tuple[GenerateReqInput, ChatPlan]:
        """Runs on the tokenizer threads (the template and the tokenizer are CPU work)."""
        return self.chat.plan(chat_request(req, self.tm.server_args.reasoning_parser), True)

    def plan_generate(self, req: GenerateRequest) -> tuple[GenerateReqInput, ChatPlan]:
        check_generate(req)
        parser = self.tm.server_args.reasoning_parser
        if not req.raw:
            return self.chat.plan(generate_chat_request(req, parser), True)
        ids = self.tm.tokenize(req.prompt)
        completion = raw_completion_request(req, ids, self.tm.context_len)
        return self.completions.to_native(completion, stream=True), ChatPlan(input_ids=ids)

    async def run(
        self, native: GenerateReqInput, plan: ChatPlan, request: ClientRequest | None
    ) -> AsyncIterator[Piece]:
        start = time.perf_counter_ns()
        steps = await chat_steps(self.tm, native, plan, request)
        return _pieces(steps, plan, start)


async def _pieces(steps: AsyncIterator[ChatStep], plan: ChatPlan, start: int) -> AsyncIterator[Piece]:
    first: int | None = None
    async for step in steps:
        first = first or time.perf_counter_ns()
        delta = step.delta
        final = _final(step.output, plan, start, first) if step.finished else None
        if delta is not None or final is not None:
            yield Piece(
                content=(delta.content or "") if delta else "",
                thinking=(delta.reasoning_content or "") if delta else "",
                final=final,
            )


def _final(output: dict[str, Any], plan: ChatPlan, start: int, first: int) -> Final:
    end = time.perf_counter_ns()
    meta = output["meta_info"]
    kind, _ = finish_reason(output)
    timings = Timings(
        total_duration=end - start,
        prompt_eval_count=meta["prompt_tokens"],
        prompt_eval_duration=first - start,
        eval_count=meta["completion_tokens"],
        eval_duration=end - first,
    )
    return Final(split_output(output["text"], plan), "length" if kind == "length" else "stop", timings)


async def collect(pieces: AsyncIterator[Piece]) -> Final:
    """The last piece's summary: a non-streaming answer is the whole output, split once."""
    final = None
    async for piece in pieces:
        final = piece.final or final
    assert final is not None  # the steps end with a finished output
    return final
