"""Pydantic models of Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens).

Requests are validated as the OpenAI ones are (protocol.RequestModel: strict JSON types, no
NaN/Infinity, unknown fields ignored). A content block of a type this server cannot honour
(image, document, a server tool) is a 400 naming it; see docs/http_api.md.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from radixserve.entrypoints.openai.protocol import RequestModel


# ----------------------------------------------------------------------------- request blocks
class TextBlockParam(RequestModel):
    type: Literal["text"]
    text: str


class ImageBlockParam(RequestModel):
    """Accepted by validation only to be refused with a clear message (no vision model)."""

    type: Literal["image", "document"]


class ToolUseBlockParam(RequestModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlockParam(RequestModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlockParam | ImageBlockParam, Field(discriminator="type")]] | None = (
        None
    )
    is_error: bool = False

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(b.text for b in self.content if isinstance(b, TextBlockParam))


class ThinkingBlockParam(RequestModel):
    type: Literal["thinking", "redacted_thinking"]


ContentBlockParam = Annotated[
    TextBlockParam | ImageBlockParam | ToolUseBlockParam | ToolResultBlockParam | ThinkingBlockParam,
    Field(discriminator="type"),
]


class MessageParam(RequestModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlockParam]


# ----------------------------------------------------------------------------- tools, thinking
class ToolParam(RequestModel):
    """A client tool; Anthropic's server tools (web search, code execution, ...) have other types."""

    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoiceParam(RequestModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingParam(RequestModel):
    # "adaptive" and "between_tools" leave the choice to the model: as "enabled", but a server
    # without a reasoning parser answers them (its model does not reason apart).
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(default=None, ge=1)


class OutputFormatParam(RequestModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfigParam(RequestModel):
    format: OutputFormatParam | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # a hint: not honoured


class CountTokensRequest(RequestModel):
    """POST /v1/messages/count_tokens: what a Messages request would put in the prompt."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlockParam] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    metadata: dict[str, Any] | None = None  # informational (user_id): nothing to honour
    output_config: OutputConfigParam | None = None


# ----------------------------------------------------------------------------- responses
class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingBlock(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # reasoning is not signed here; the field is required by the clients


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = Annotated[TextBlock | ThinkingBlock | ToolUseBlock, Field(discriminator="type")]
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Usage(BaseModel):
    """input_tokens excludes the prompt tokens read from the radix cache (cache_read_input_tokens),
    as Anthropic counts its own prompt cache; nothing is written to a cache on request."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessagesResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    usage: Usage


class CountTokensResponse(BaseModel):
    input_tokens: int


class StreamEvent(BaseModel):
    """One server-sent event's data: `type` names it (message_start, content_block_delta, ...)."""

    model_config = ConfigDict(extra="allow")

    type: str


class AnthropicErrorInfo(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error shape: `{"type": "error", "error": {"type", "message"}}`."""

    type: Literal["error"] = "error"
    error: AnthropicErrorInfo
