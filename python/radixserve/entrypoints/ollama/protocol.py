"""Pydantic models of Ollama's API (/api/chat, /api/generate, /api/embed, /api/show, ...).

Validated as the OpenAI requests are (strict JSON types, no NaN/Infinity, unknown fields
ignored). `stream` defaults to true, as in Ollama. `options` is a free mapping, as Ollama's;
options.py maps it onto sampling parameters.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from radixserve.entrypoints.openai.protocol import RequestModel, Tool

FormatParam = Literal["", "json"] | dict[str, Any] | None


class ToolCallFunction(RequestModel):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class ToolCallParam(RequestModel):
    function: ToolCallFunction


class Message(RequestModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: str | None = None  # an earlier turn's reasoning: not sent back to the model
    images: list[str] | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_name: str | None = None


class _GenerationBase(RequestModel):
    model: str = Field(min_length=1)
    format: FormatParam = None
    options: dict[str, Any] | None = None
    stream: bool = True
    keep_alive: float | str | None = None  # the model stays loaded for the server's life
    think: bool | Literal["low", "medium", "high"] | None = None


class ChatRequest(_GenerationBase):
    messages: list[Message] = Field(default_factory=list)
    tools: list[Tool] | None = None


class GenerateRequest(_GenerationBase):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None
    images: list[str] | None = None


class EmbedRequest(RequestModel):
    model: str = Field(min_length=1)
    input: str | list[str]
    truncate: bool = True
    dimensions: int | None = Field(default=None, ge=1)
    options: dict[str, Any] | None = None
    keep_alive: float | str | None = None


class ShowRequest(RequestModel):
    model: str = Field(min_length=1)
    verbose: bool = False


# ----------------------------------------------------------------------------- responses
class Timings(BaseModel):
    """Ollama's counts and durations (nanoseconds), on a final answer or a stream's last line."""

    total_duration: int
    load_duration: int = 0  # the model is loaded at start-up, never per request
    prompt_eval_count: int
    prompt_eval_duration: int
    eval_count: int
    eval_duration: int


class ToolCallOut(BaseModel):
    function: ToolCallFunction


class MessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str = ""
    thinking: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChunk(BaseModel):
    """A /api/chat answer, or one line of its stream (the last has done: true and the timings)."""

    model_config = ConfigDict(extra="allow")  # the timings, on the last line

    model: str
    created_at: str
    message: MessageOut
    done: bool
    done_reason: str | None = None


class GenerateChunk(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    created_at: str
    response: str
    thinking: str | None = None
    done: bool
    done_reason: str | None = None


class EmbedResponse(BaseModel):
    model: str
    embeddings: list[list[float]]
    total_duration: int
    load_duration: int = 0
    prompt_eval_count: int


class ModelDetails(BaseModel):
    parent_model: str = ""
    format: str
    family: str
    families: list[str]
    parameter_size: str
    quantization_level: str


class ModelEntry(BaseModel):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: ModelDetails


class TagsResponse(BaseModel):
    models: list[ModelEntry]


class ShowResponse(BaseModel):
    modelfile: str
    parameters: str
    template: str
    details: ModelDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class VersionResponse(BaseModel):
    version: str


class OllamaErrorResponse(BaseModel):
    """Ollama's error shape: `{"error": <message>}`."""

    error: str
