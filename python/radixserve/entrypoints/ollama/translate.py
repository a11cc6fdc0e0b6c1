"""Ollama requests -> the chat and completions requests that run them.

/api/chat and /api/generate (unless raw) render the chat template through the chat path, so
tools and reasoning are parsed as in /v1/chat/completions; /api/generate with raw: true sends
the prompt as it is, through the completions path. `format` ("json" or a JSON schema) becomes a
grammar; `think` keeps the reasoning apart (needs --reasoning-parser), `think: false` leaves it
in the content.
"""

from __future__ import annotations

import json
from typing import Any

from radixserve.entrypoints.ollama.options import sampling_fields
from radixserve.entrypoints.ollama.protocol import ChatRequest, FormatParam, GenerateRequest, Message
from radixserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    FunctionCall,
    ToolCall,
)
from radixserve.managers.input_validation import InvalidRequestError

LATEST_TAG = ":latest"


def model_name(name: str) -> str:
    """Ollama's clients name models `name:tag`; `:latest` is the tag of an untagged name."""
    return name.removesuffix(LATEST_TAG)


def _grammar(fmt: FormatParam) -> dict[str, Any]:
    if fmt == "json":
        return {"json_schema": '{"type": "object"}'}
    if isinstance(fmt, dict):
        return {"json_schema": json.dumps(fmt)}
    return {}


def _reasoning(think: object, reasoning_parser: str | None) -> dict[str, Any]:
    if think not in (None, False) and not reasoning_parser:
        raise InvalidRequestError("think: this server was started without --reasoning-parser.")
    return {"separate_reasoning": think is not False}


def _chat_message(i: int, m: Message) -> ChatMessage:
    if m.images:
        raise InvalidRequestError(
            f"messages.{i}.images: images need a vision model; this server serves text only."
        )
    calls = [
        ToolCall(
            id=f"call_{i}_{j}",
            function=FunctionCall(name=c.function.name, arguments=json.dumps(c.function.arguments)),
        )
        for j, c in enumerate(m.tool_calls or [])
    ]
    # A tool result names its tool (tool_name); the template sees it as the message's name.
    return ChatMessage(role=m.role, content=m.content, name=m.tool_name, tool_calls=calls or None)


def chat_request(req: ChatRequest, reasoning_parser: str | None) -> ChatCompletionRequest:
    return ChatCompletionRequest(
        model=model_name(req.model),
        messages=[_chat_message(i, m) for i, m in enumerate(req.messages)],
        tools=req.tools or None,
        **sampling_fields(req.options),
        **_grammar(req.format),
        **_reasoning(req.think, reasoning_parser),
    )


def check_generate(req: GenerateRequest) -> None:
    for name in ("suffix", "template", "context", "images"):
        if getattr(req, name):
            raise InvalidRequestError(f"{name}: not supported by this server.")


def generate_chat_request(req: GenerateRequest, reasoning_parser: str | None) -> ChatCompletionRequest:
    """A prompt that is not raw is the user turn of a chat, after the system prompt if any."""
    messages = [ChatMessage(role="system", content=req.system)] if req.system else []
    messages.append(ChatMessage(role="user", content=req.prompt))
    return ChatCompletionRequest(
        model=model_name(req.model),
        messages=messages,
        **sampling_fields(req.options),
        **_grammar(req.format),
        **_reasoning(req.think, reasoning_parser),
    )


def raw_completion_request(
    req: GenerateRequest, prompt_ids: list[int], context_len: int
) -> CompletionRequest:
    """raw: true: the prompt as it is (its token ids), no template; no limit means the context."""
    if req.think not in (None, False):
        raise InvalidRequestError("think: not available with raw: true (no template to reason in).")
    if req.system:
        raise InvalidRequestError("system: not available with raw: true (no template to put it in).")
    fields = sampling_fields(req.options)
    if fields["max_tokens"] is None:
        fields["max_tokens"] = max(context_len - len(prompt_ids), 0)
    return CompletionRequest(model=model_name(req.model), prompt=prompt_ids, **fields, **_grammar(req.format))
