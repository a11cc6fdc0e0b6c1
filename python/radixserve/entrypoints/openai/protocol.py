"""Pydantic models of the OpenAI-compatible API (requests, responses, the error envelope).

Requests accept the OpenAI fields plus the SGLang sampling extras (top_k, min_p, ignore_eos, ...)
that clients pass through `extra_body`. Unknown fields are ignored, as OpenAI's server does, but
a known field of the wrong type fails validation and becomes a 400 error envelope: HTTP bodies are
validated strictly ("yes" is no bool, "10" no int) and NaN/Infinity are refused in float fields.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt

from radixserve.managers.generate_request import MAX_N, MAX_RID_LEN, MAX_TOP_LOGPROBS_NUM

PromptType = str | list[str] | list[int] | list[list[int]]
StopType = str | list[str] | None


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ----------------------------------------------------------------------------- errors
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error envelope: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorInfo


def error_body(
    message: str, err_type: str, code: str | int | None, param: str | None = None
) -> dict[str, Any]:
    return ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param, code=code)).model_dump()


def error_type(status: int) -> str:
    """OpenAI's error `type` for an HTTP status: the client's fault (4xx) or the server's."""
    return "invalid_request_error" if 400 <= status < 500 else "server_error"


# ----------------------------------------------------------------------------- shared pieces
class RequestModel(BaseModel):
    """Base of every request-side model: unknown fields ignored, no NaN/Infinity in floats."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    # With --reasoning-parser (chat): the output tokens spent reasoning; left out otherwise.
    completion_tokens_details: CompletionTokensDetails | None = Field(
        default=None, exclude_if=lambda value: value is None
    )


class SamplingExtras(RequestModel):
    """Fields shared by completions and chat: OpenAI sampling options and SGLang extras."""

    model: str | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopType = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    user: str | None = None
    # SGLang extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: NonNegativeInt | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | None = None
    structural_tag: str | None = None
    # The last generated token's final hidden state on each choice (--enable-return-hidden-states).
    return_hidden_states: bool = False
    # Only requests with the same salt share cached prefixes (vLLM's and SGLang's extension).
    cache_salt: str | None = None
    rid: str | None = Field(default=None, max_length=MAX_RID_LEN)
    # With --dp-size > 1: the replica to serve the request (the Gateway's --dp-aware sends it).
    routed_dp_rank: NonNegativeInt | None = None
    data_parallel_rank: NonNegativeInt | None = None
    # Prefill/decode disaggregation: set by the load balancer (docs/disaggregation.md).
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    disagg_prefill_dp_rank: NonNegativeInt | None = None


class ChoiceBase(BaseModel):
    """What every completion and chat choice (and stream chunk choice) carries."""

    index: int
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    # SGLang's `hidden_states`: left out of the JSON unless the request asked.
    hidden_states: list[float] | None = Field(default=None, exclude_if=lambda value: value is None)


class ListPage(BaseModel):
    """OpenAI's cursor list: one page of `data` (each subclass types it), the ids at its ends,
    whether more follow."""

    object: Literal["list"] = "list"
    data: list[Any]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False

    @classmethod
    def of(cls, data: list[Any], ids: list[str], has_more: bool) -> Self:
        """The page of `data`, whose ids are `ids`."""
        return cls(
            data=data, first_id=ids[0] if ids else None, last_id=ids[-1] if ids else None, has_more=has_more
        )


class ResponseEnvelope(BaseModel):
    """What every completion answer (and stream chunk) carries around its choices; each answer
    narrows `object` and `choices`."""

    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[Any]
    usage: UsageInfo | None = None


# ----------------------------------------------------------------------------- completions
class CompletionRequest(SamplingExtras):
    prompt: PromptType
    max_tokens: NonNegativeInt | None = 16
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS_NUM)
    suffix: str | None = None
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(ChoiceBase):
    text: str
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(ResponseEnvelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


# ----------------------------------------------------------------------------- chat
class TextContentPart(RequestModel):
    type: Literal["text"]
    text: str


class ImageURL(RequestModel):
    url: str  # data:image/...;base64,..., http(s):// (--allowed-media-domains) or file://
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the processor's limits decide


class ImageUrlContentPart(RequestModel):
    type: Literal["image_url"]
    image_url: ImageURL


ChatContentPart = Annotated[TextContentPart | ImageUrlContentPart, Field(discriminator="type")]


class FunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None  # a JSON object as text (OpenAI's shape)


class ToolCall(BaseModel):
    """A call in an assistant message, or a streamed piece of one (then only `index` is certain)."""

    index: int | None = None
    id: str | None = None
    type: Literal["function"] | None = "function"
    function: FunctionCall


class FunctionDefinition(RequestModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedToolChoice(RequestModel):
    type: Literal["function"] = "function"
    function: dict[str, str]  # {"name": ...}


class ChatMessage(RequestModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ChatContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an earlier assistant turn that called tools
    tool_call_id: str | None = None  # a tool result answers this call

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextContentPart))

    def image_urls(self) -> list[str]:
        if not isinstance(self.content, list):
            return []
        return [p.image_url.url for p in self.content if isinstance(p, ImageUrlContentPart)]


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: dict[str, Any] | None = None
    # type structural_tag (SGLang's): [{"begin", "schema", "end"}] and the strings that start them,
    # or xgrammar's own `format` object.
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None
    format: dict[str, Any] | None = None


class ChatCompletionRequest(SamplingExtras):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: NonNegativeInt | None = None
    max_completion_tokens: NonNegativeInt | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS_NUM)
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    logit_bias: dict[str, float] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    separate_reasoning: bool = True  # with --reasoning-parser: reasoning_content apart from content


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatCompletionChoice(ChoiceBase):
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(ResponseEnvelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatCompletionChoice]


class DeltaMessage(ChatResponseMessage):
    role: str | None = None  # the first chunk of a choice only


class ChatStreamChoice(ChoiceBase):
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None


class ChatCompletionStreamResponse(ResponseEnvelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]


# ----------------------------------------------------------------------------- models, tokenize
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "radixserve"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (SGLang's field)
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str | list[str]
    add_special_tokens: bool = True


class TokenizeResponse(BaseModel):
    tokens: list[int] | list[list[int]]
    count: int | list[int]
    max_model_len: int


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int] | list[list[int]]


class DetokenizeResponse(BaseModel):
    text: str | list[str]
