"""Run a chat request planned by ChatHandler.plan and split its output as it grows: what the
client families that translate onto chat (Anthropic Messages, Ollama) share with
/v1/chat/completions, so that tools and reasoning are parsed by the same code for all of them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from radixserve.entrypoints.openai.chat_tools import ChatPlan, ChoiceStream, choice_reasoning_tokens
from radixserve.entrypoints.openai.protocol import DeltaMessage
from radixserve.entrypoints.openai.serving_common import finish_reason, first_output_checked, raise_if_failed
from radixserve.managers.generate_request import GenerateReqInput
from radixserve.managers.tokenizer_manager import ClientRequest, TokenizerManager


@dataclass(frozen=True)
class ChatStep:
    """One native output of a streamed chat request, split into its new pieces."""

    delta: DeltaMessage | None  # new reasoning / content / tool-call pieces; None: nothing new
    output: dict[str, Any]  # the native output: cumulative text, meta_info
    finished: bool
    has_tool_calls: bool  # some tool call has started so far
    reasoning_tokens: int = 0  # on the finished step, with a reasoning parser: see reasoning.py


async def chat_steps(
    tm: TokenizerManager, native: GenerateReqInput, plan: ChatPlan, request: ClientRequest | None
) -> AsyncIterator[ChatStep]:
    """Submit `native` (a streaming request) and yield its steps. The first output is awaited
    here, before any answer starts, so a refusal (400, 503) is answered with its status."""
    outputs = await first_output_checked(await tm.stream(native, request))
    return _steps(outputs, plan, tm.tokenizer)


async def _steps(
    outputs: AsyncIterator[dict[str, Any]],
    plan: ChatPlan,
    tokenizer: Any,  # noqa: ANN401
) -> AsyncIterator[ChatStep]:
    splitter = ChoiceStream(plan)
    async for out in outputs:
        reason, _ = finish_reason(out)
        delta = splitter.feed(out["text"], final=reason is not None)
        raise_if_failed(out)  # an abort with a status ends the answer as an error
        counted = reason is not None and plan.reasoning_parser is not None
        thought = choice_reasoning_tokens(out, plan, tokenizer) if counted else 0
        yield ChatStep(delta, out, reason is not None, splitter.has_tool_calls, thought)


def tool_input(arguments: str | None) -> dict[str, Any]:
    """A parsed call's arguments as the object Anthropic and Ollama answer with."""
    value = json.loads(arguments or "{}")  # the tool-call parser kept only JSON arguments
    return value if isinstance(value, dict) else {"value": value}
