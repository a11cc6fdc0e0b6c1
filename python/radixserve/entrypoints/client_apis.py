"""The APIs of other client families, each a translation layer onto the native paths: Anthropic
Messages (anthropic/) and Ollama (ollama/). http_server.create_app adds them with one call."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI
from pydantic import BaseModel

from radixserve.entrypoints.anthropic import protocol as anthropic
from radixserve.entrypoints.anthropic.serving import add_anthropic_routes
from radixserve.entrypoints.error_dialects import ErrorDialectMiddleware, is_anthropic_path, is_ollama_path
from radixserve.entrypoints.ollama import protocol as ollama
from radixserve.entrypoints.ollama.routes import NDJSON, add_ollama_routes
from radixserve.entrypoints.openai.serving_chat import ChatHandler

if TYPE_CHECKING:
    from radixserve.entrypoints.http_server import ServerState


def add_client_api_routes(app: FastAPI, state: ServerState) -> None:
    chat = ChatHandler(state.tm, state.served_names)
    add_anthropic_routes(app, state.tm, chat)
    add_ollama_routes(app, state, chat)
    # Added after the app's own middleware, so outermost: it reshapes every error, 500s included.
    app.add_middleware(ErrorDialectMiddleware)


# What openapi_spec.py declares for these routes: bodies, answers, streams and error shapes.
OPENAPI_BODIES: dict[str, type[BaseModel]] = {
    "/v1/messages": anthropic.MessagesRequest,
    "/v1/messages/count_tokens": anthropic.CountTokensRequest,
    "/api/chat": ollama.ChatRequest,
    "/api/generate": ollama.GenerateRequest,
    "/api/embed": ollama.EmbedRequest,
    "/api/show": ollama.ShowRequest,
}
OPENAPI_JSON_ANSWERS: dict[str, type[BaseModel]] = {
    "/v1/messages": anthropic.MessagesResponse,
    "/v1/messages/count_tokens": anthropic.CountTokensResponse,
    "/api/chat": ollama.ChatChunk,
    "/api/generate": ollama.GenerateChunk,
    "/api/embed": ollama.EmbedResponse,
    "/api/tags": ollama.TagsResponse,
    "/api/show": ollama.ShowResponse,
    "/api/version": ollama.VersionResponse,
}
OPENAPI_SSE_EVENTS: dict[str, type[BaseModel]] = {"/v1/messages": anthropic.StreamEvent}
NDJSON_MEDIA_TYPE = NDJSON
OPENAPI_NDJSON_LINES: dict[str, type[BaseModel]] = {
    "/api/chat": ollama.ChatChunk,
    "/api/generate": ollama.GenerateChunk,
}
OPENAPI_ERRORS: dict[str, tuple[int, ...]] = {
    "/v1/messages": (404, 503),
    "/v1/messages/count_tokens": (404,),
    "/api/chat": (404, 503),
    "/api/generate": (404, 503),
    "/api/embed": (404, 503),
    "/api/show": (404,),
}
ERROR_MODELS = (anthropic.AnthropicErrorResponse, ollama.OllamaErrorResponse)


def error_model(path: str) -> type[BaseModel] | None:
    """The error shape of `path` when it is not OpenAI's envelope (error_dialects.py)."""
    if is_anthropic_path(path):
        return anthropic.AnthropicErrorResponse
    if is_ollama_path(path):
        return ollama.OllamaErrorResponse
    return None
