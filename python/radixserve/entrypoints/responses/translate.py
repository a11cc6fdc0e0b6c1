"""Responses <-> the chat path: a Responses request (and the stored conversation it continues)
becomes a ChatCompletionRequest, so the chat template, the tool-call and the reasoning parsers are
/v1/chat/completions' own.

- instructions -> a leading system message (not carried over by previous_response_id: OpenAI's rule).
- message items -> chat messages of their role (developer stays developer, as on the chat route).
- function_call items -> tool_calls of the assistant turn they follow; function_call_output ->
  tool messages (tool_call_id = call_id).
- reasoning items of earlier turns are not sent back to the model (reasoning templates drop them).
- text.format json_schema / json_object -> response_format (the chat route's structured output).
"""

from __future__ import annotations

import uuid
from typing import Any

from radixserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatContentPart,
    ChatMessage,
    FunctionCall,
    FunctionDefinition,
    ImageURL,
    ImageUrlContentPart,
    NamedToolChoice,
    ResponseFormat,
    TextContentPart,
    Tool,
    ToolCall,
)
from radixserve.entrypoints.responses.protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionToolChoice,
    InputImage,
    InputItem,
    InputText,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
)
from radixserve.managers.input_validation import InvalidRequestError

ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as stored items (GET .../input_items): each with its type and an id."""
    items = req.input if isinstance(req.input, list) else [MessageItem(role="user", content=req.input)]
    out = []
    for item in items:
        data = item.model_dump(exclude_none=True, by_alias=True)
        data.setdefault("id", new_id(ITEM_ID_PREFIXES[item.type]))
        if isinstance(item, MessageItem) and isinstance(item.content, str):  # OpenAI lists parts
            kind = "output_text" if item.role == "assistant" else "input_text"
            data["content"] = [{"type": kind, "text": item.content}]
        out.append(data)
    return out


def parse_items(items: list[dict[str, Any]]) -> list[InputItem]:
    """Stored items (input or output) back as request items; the history of a chain."""
    parsed: list[InputItem] = []
    for data in items:
        kind = data.get("type", "message")
        if kind == "message":
            parts = (
                [{k: v for k, v in p.items() if k in ("type", "text", "refusal")} for p in data["content"]]
                if isinstance(data["content"], list)
                else data["content"]
            )
            parsed.append(MessageItem(role=data["role"], content=parts))
        elif kind == "function_call":
            parsed.append(
                FunctionCallItem(
                    type="function_call",
                    call_id=data["call_id"],
                    name=data["name"],
                    arguments=data["arguments"],
                )
            )
        elif kind == "function_call_output":
            parsed.append(
                FunctionCallOutputItem(
                    type="function_call_output", call_id=data["call_id"], output=data["output"]
                )
            )
        else:
            parsed.append(ReasoningItem(type="reasoning"))
    return parsed


def to_chat_request(
    req: ResponsesRequest, history: list[InputItem], reasoning_parser: str | None
) -> ChatCompletionRequest:
    """The chat request equivalent to `req` continuing `history` (the chain's items, oldest first)."""
    if req.reasoning is not None and not reasoning_parser:
        raise InvalidRequestError("reasoning: this server was started without --reasoning-parser.")
    messages: list[ChatMessage] = []
    if req.instructions:
        messages.append(ChatMessage(role="system", content=req.instructions))
    own = req.input if isinstance(req.input, list) else [MessageItem(role="user", content=req.input)]
    messages.extend(chat_messages([*history, *own]))
    if not messages:
        raise InvalidRequestError("input: give at least one message.")
    fields: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "repetition_penalty": req.repetition_penalty,
        "separate_reasoning": True,
    }
    fields.update(_tool_fields(req))
    response_format = _response_format(req)
    if response_format is not None:
        fields["response_format"] = response_format
    return ChatCompletionRequest(**fields)


def chat_messages(items: list[InputItem]) -> list[ChatMessage]:
    messages: list[ChatMessage] = []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append(ChatMessage(role=item.role, content=_message_content(item)))
        elif isinstance(item, FunctionCallItem):
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]  # calls of the same turn
            else:
                messages.append(ChatMessage(role="assistant", content="", tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(ChatMessage(role="tool", content=item.text(), tool_call_id=item.call_id))
    return messages


def _message_content(item: MessageItem) -> str | list[ChatContentPart]:
    """Text, or (with input_image parts) chat's parts in order: the chat route renders and
    fetches the images."""
    if isinstance(item.content, str) or not any(isinstance(p, InputImage) for p in item.content):
        return item.text()
    return [
        ImageUrlContentPart(type="image_url", image_url=ImageURL(url=p.image_url, detail=p.detail))
        if isinstance(p, InputImage)
        else TextContentPart(type="text", text=p.text if isinstance(p, InputText) else p.refusal)
        for p in item.content
    ]


def _tool_fields(req: ResponsesRequest) -> dict[str, Any]:
    choice = req.tool_choice
    if not req.tools:
        if choice is not None and choice != "none" and choice != "auto":
            raise InvalidRequestError("tool_choice: forcing a call needs 'tools'.")
        return {}
    tools = [
        Tool(function=FunctionDefinition(name=t.name, description=t.description, parameters=t.parameters))
        for t in req.tools
    ]
    fields: dict[str, Any] = {"tools": tools}
    if isinstance(choice, FunctionToolChoice):
        fields["tool_choice"] = NamedToolChoice(function={"name": choice.name})
    elif choice is not None:
        fields["tool_choice"] = choice
    if req.parallel_tool_calls is not None:
        fields["parallel_tool_calls"] = req.parallel_tool_calls
    return fields


def _response_format(req: ResponsesRequest) -> ResponseFormat | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.schema_ is None:
        raise InvalidRequestError("text.format.schema: required for type 'json_schema'.")
    return ResponseFormat(
        type="json_schema", json_schema={"name": fmt.name or "output", "schema": fmt.schema_}
    )
