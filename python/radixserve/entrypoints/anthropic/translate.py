"""Anthropic Messages <-> the chat path: a Messages request becomes a ChatCompletionRequest (so
the chat template, the tool-call and reasoning parsers are /v1/chat/completions' own), and a
chat output becomes Anthropic content blocks and a stop_reason.

- system (text or text blocks) -> a leading system message.
- user text blocks -> a user message; tool_result blocks -> tool messages (in block order).
- assistant text -> content; tool_use blocks -> tool_calls; thinking blocks of earlier turns are
  not sent back to the model (reasoning templates drop them too).
- A final assistant message is a prefill: the answer continues it.
- tool_choice auto / any / tool / none -> auto / required / the named function / none.
"""

from __future__ import annotations

import json
from typing import Any

from radixserve.entrypoints.anthropic.protocol import (
    ContentBlock,
    CountTokensRequest,
    ImageBlockParam,
    MessageParam,
    MessagesRequest,
    StopReason,
    TextBlock,
    TextBlockParam,
    ThinkingBlock,
    ToolResultBlockParam,
    ToolUseBlock,
    ToolUseBlockParam,
)
from radixserve.entrypoints.chat_steps import tool_input
from radixserve.entrypoints.openai.chat_tools import ChoiceResult
from radixserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionDefinition,
    NamedToolChoice,
    ResponseFormat,
    Tool,
    ToolCall,
)
from radixserve.entrypoints.openai.serving_common import finish_reason
from radixserve.managers.input_validation import InvalidRequestError


def to_chat_request(req: CountTokensRequest, reasoning_parser: str | None) -> ChatCompletionRequest:
    """The equivalent chat request (count_tokens passes a CountTokensRequest: no sampling)."""
    thinking = req.thinking.type if req.thinking is not None else None
    if thinking == "enabled" and not reasoning_parser:
        raise InvalidRequestError("thinking: this server was started without --reasoning-parser.")
    messages = _system_messages(req.system)
    for i, message in enumerate(req.messages):
        messages.extend(_chat_messages(message, f"messages.{i}"))
    fields: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "continue_final_message": req.messages[-1].role == "assistant",
        # With a reasoning parser the reasoning becomes thinking blocks; "disabled" leaves it inline.
        "separate_reasoning": thinking != "disabled",
    }
    fields.update(_tool_fields(req))
    if isinstance(req, MessagesRequest):
        fields.update(
            max_tokens=req.max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            stop=req.stop_sequences,
        )
        output_format = req.output_config.format if req.output_config is not None else None
        if output_format is not None:
            fields["response_format"] = ResponseFormat(
                type="json_schema", json_schema={"name": "output", "schema": output_format.schema_}
            )
    return ChatCompletionRequest(**fields)


def _system_messages(system: str | list[TextBlockParam] | None) -> list[ChatMessage]:
    if system is None:
        return []
    text = system if isinstance(system, str) else "\n".join(b.text for b in system)
    return [ChatMessage(role="system", content=text)]


def _chat_messages(message: MessageParam, where: str) -> list[ChatMessage]:
    if isinstance(message.content, str):
        return [ChatMessage(role=message.role, content=message.content)]
    for j, block in enumerate(message.content):
        if isinstance(block, ImageBlockParam) or (
            isinstance(block, ToolResultBlockParam)
            and isinstance(block.content, list)
            and any(isinstance(b, ImageBlockParam) for b in block.content)
        ):
            raise InvalidRequestError(
                f"{where}.content.{j}: image and document blocks need a vision model; "
                "this server serves text only."
            )
    if message.role == "assistant":
        return [_assistant_message(message)]
    return _user_messages(message, where)


def _assistant_message(message: MessageParam) -> ChatMessage:
    blocks = message.content
    assert isinstance(blocks, list)
    text = "".join(b.text for b in blocks if isinstance(b, TextBlockParam))
    calls = [
        ToolCall(id=b.id, function=FunctionCall(name=b.name, arguments=json.dumps(b.input)))
        for b in blocks
        if isinstance(b, ToolUseBlockParam)
    ]
    return ChatMessage(role="assistant", content=text, tool_calls=calls or None)


def _user_messages(message: MessageParam, where: str) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    text: list[str] = []
    for j, block in enumerate(message.content):
        if isinstance(block, ToolResultBlockParam):
            if text:  # text before a result stays before it
                out.append(ChatMessage(role="user", content="".join(text)))
                text = []
            result = block.text()
            if block.is_error:  # the model is told the call failed, as the client meant
                result = f"Error: {result}"
            out.append(ChatMessage(role="tool", content=result, tool_call_id=block.tool_use_id))
        elif isinstance(block, TextBlockParam):
            text.append(block.text)
        else:  # tool_use or thinking from a user: not a block users send
            raise InvalidRequestError(
                f"{where}.content.{j}: a {block.type} block belongs to an assistant turn."
            )
    if text or not out:
        out.append(ChatMessage(role="user", content="".join(text)))
    return out


def _tool_fields(req: CountTokensRequest) -> dict[str, Any]:
    choice = req.tool_choice
    if not req.tools:
        if choice is not None and choice.type in ("any", "tool"):
            raise InvalidRequestError(f"tool_choice: type {choice.type!r} needs 'tools'.")
        return {}
    tools = [
        Tool(function=FunctionDefinition(name=t.name, description=t.description, parameters=t.input_schema))
        for t in req.tools
    ]
    fields: dict[str, Any] = {"tools": tools}
    if choice is None:
        return fields
    if choice.type == "tool":
        if not choice.name:
            raise InvalidRequestError("tool_choice: type 'tool' needs 'name'.")
        fields["tool_choice"] = NamedToolChoice(function={"name": choice.name})
    else:
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return fields


# ----------------------------------------------------------------------------- response side
def tool_use_id(call_id: str | None) -> str:
    """Anthropic's tool_use ids start with toolu_; the chat path's call ids with call_."""
    return "toolu_" + (call_id or "").removeprefix("call_")


def content_blocks(parts: ChoiceResult) -> list[ContentBlock]:
    blocks: list[ContentBlock] = []
    if parts.reasoning_content:
        blocks.append(ThinkingBlock(thinking=parts.reasoning_content))
    if parts.content:
        blocks.append(TextBlock(text=parts.content))
    for call in parts.tool_calls or []:
        blocks.append(
            ToolUseBlock(
                id=tool_use_id(call.id),
                name=call.function.name or "",
                input=tool_input(call.function.arguments),
            )
        )
    return blocks


def stop_reason(output: dict[str, Any], has_tool_calls: bool) -> tuple[StopReason, str | None]:
    """(stop_reason, stop_sequence) of a finished native output."""
    kind, matched = finish_reason(output)
    if kind == "length":
        return "max_tokens", None
    if has_tool_calls:
        return "tool_use", None
    if isinstance(matched, str):  # a stop string (a stop token id is the end of the turn)
        return "stop_sequence", matched
    return "end_turn", None
