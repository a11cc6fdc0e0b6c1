"""Pydantic models of OpenAI's Responses API (POST /v1/responses and the stored-response routes).

Unlike the chat routes, a Responses request is strict about its fields: an unknown field, and a
known one this server cannot honour (hosted tools, images, `include`, `truncation: "auto"`, ...),
is a 400 naming it, so that a client never believes something was done that was not. The fields
accepted and ignored are those OpenAI defines as identifiers or hints (docs/http_api.md).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, model_validator

from radixserve.entrypoints.openai.protocol import ListPage, RequestModel


class StrictModel(RequestModel):
    """A request part whose unknown fields are refused (400 naming the field)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# Known OpenAI request fields that this server cannot honour: a 400 with a clearer message
# than "extra inputs are not permitted".
UNSUPPORTED_FIELDS = {
    "conversation": "conversations are not served; chain responses with previous_response_id",
    "prompt": "prompt templates are not served",
    "top_logprobs": "logprobs are not returned on this route (use /v1/chat/completions)",
    "max_tool_calls": "built-in tools are not served",
    "context_management": "context management is not served",
    "service_tier": "there is one service tier",
    "prompt_cache_retention": "the radix cache keeps prefixes by its own eviction policy",
}


# ----------------------------------------------------------------------------- input items
class InputText(StrictModel):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # on output_text parts sent back from an earlier answer
    logprobs: list[Any] | None = None


class RefusalPart(StrictModel):
    type: Literal["refusal"]
    refusal: str


class ReasoningText(StrictModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class InputImage(StrictModel):
    """An image by URL (data:, http(s):// or file://, as chat's image_url); file_id is not served."""

    type: Literal["input_image"]
    image_url: str
    detail: Literal["auto", "low", "high"] = "auto"


ContentPart = Annotated[InputText | RefusalPart | InputImage, Field(discriminator="type")]


class MessageItem(StrictModel):
    """A message; `type` may be left out (OpenAI's EasyInputMessage)."""

    type: Literal["message"] = "message"
    id: str | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(
            p.text if isinstance(p, InputText) else p.refusal
            for p in self.content
            if not isinstance(p, InputImage)
        )


class FunctionCallItem(StrictModel):
    type: Literal["function_call"]
    id: str | None = None
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    id: str | None = None
    call_id: str
    output: str | list[InputText]
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningItem(StrictModel):
    """An earlier turn's reasoning: accepted, and not sent back to the model (reasoning templates
    drop it too)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def _item_kind(value: Any) -> str | None:  # noqa: ANN401 - a raw JSON value or a model
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if isinstance(kind, str) else None


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind),
]


# ----------------------------------------------------------------------------- tools, text, reasoning
class FunctionTool(StrictModel):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # a grammar forces the calls' shape only with tool_choice required


class FunctionToolChoice(StrictModel):
    type: Literal["function"]
    name: str


class TextFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(StrictModel):
    format: TextFormat | None = None


class ReasoningConfig(StrictModel):
    # Hints: the reasoning parser separates whatever the model reasons; nothing sets its length.
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class StreamOptions(StrictModel):
    include_obfuscation: bool | None = None  # no obfuscation is added: the opt-out is always in force


class ResponsesRequest(StrictModel):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    store: bool = True
    background: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    metadata: dict[str, str] | None = None
    include: list[str] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    # Identifiers OpenAI uses for abuse monitoring and cache routing: nothing to honour here.
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # SGLang's sampling extras, as on the chat route.
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:  # noqa: ANN401 - the raw body
        if isinstance(data, dict):
            for name, why in UNSUPPORTED_FIELDS.items():
                if data.get(name) is not None:
                    raise ValueError(f"{name}: not supported here; {why}.")
        return data

    @model_validator(mode="after")
    def _check_combinations(self) -> ResponsesRequest:
        if self.include:
            raise ValueError(f"include: {self.include[0]!r} is not supported (nothing extra is returned).")
        if self.truncation == "auto":
            raise ValueError("truncation: 'auto' is not supported; a prompt over the context is a 400.")
        if self.background and not self.store:
            raise ValueError("background: a background response needs store (true).")
        return self


# ----------------------------------------------------------------------------- output
class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: str
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: str


class OutputReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[OutputReasoningText]
    status: str


OutputItem = Annotated[OutputMessage | OutputFunctionCall | OutputReasoning, Field(discriminator="type")]
OUTPUT_ITEMS: TypeAdapter[list[OutputItem]] = TypeAdapter(list[OutputItem])


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens read from the radix cache


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseErrorInfo(BaseModel):
    code: str
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


Status = Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]


class ResponseObject(BaseModel):
    """The response: also what the store keeps and the stream's lifecycle events carry."""

    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["response"] = "response"
    created_at: float
    completed_at: float | None = None
    status: Status
    background: bool = False
    error: ResponseErrorInfo | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"  # noqa: ANN401 - a string or {"type": "function", "name"}
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: float | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None


class InputItemList(ListPage):
    """GET /v1/responses/{id}/input_items: the request's input items, each with an id."""

    data: list[dict[str, Any]]


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


class StreamEvent(BaseModel):
    """One server-sent event's data: `type` names it (response.created, ...), `sequence_number`
    counts from 0 within the response."""

    model_config = ConfigDict(extra="allow")

    type: str
    sequence_number: int
