"""The APIs of other client families, each a translation layer onto the native paths: Anthropic
Messages (anthropic/), Ollama (ollama/) and OpenAI Responses (responses/). http_server.create_app
adds them with one call."""

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
from radixserve.entrypoints.responses import protocol as responses
from radixserve.entrypoints.responses.routes import add_responses_routes
from radixserve.entrypoints.responses.serving import ResponsesHandler
from radixserve.entrypoints.responses.store import ResponseStore

if TYPE_CHECKING:
    from radixserve.entrypoints.http_server import ServerState


def add_client_api_routes(app: FastAPI, state: ServerState) -> None:
    chat = ChatHandler(state.tm, state.served_names)
    add_anthropic_routes(app, state.tm, chat)
    add_ollama_routes(app, state, chat)
    store = ResponseStore(state.tm.server_args.storage_dir)
    add_responses_routes(app, ResponsesHandler(state.tm, chat, store))
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
    "/v1/responses": responses.ResponsesRequest,
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
    "/v1/responses": responses.ResponseObject,
    "/v1/responses/{response_id}": responses.ResponseObject,
    "/v1/responses/{response_id}/cancel": responses.ResponseObject,
    "/v1/responses/{response_id}/input_items": responses.InputItemList,
}
# Where two methods of one path answer different bodies: (method, path) -> the answer.
OPENAPI_METHOD_JSON_ANSWERS: dict[tuple[str, str], type[BaseModel]] = {
    ("delete", "/v1/responses/{response_id}"): responses.DeletedResponse,
}
OPENAPI_SSE_EVENTS: dict[str, type[BaseModel]] = {
    "/v1/messages": anthropic.StreamEvent,
    "/v1/responses": responses.StreamEvent,
    "/v1/responses/{response_id}": responses.StreamEvent,  # GET ?stream=true (background responses)
}
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
    "/v1/responses": (404, 503),
    "/v1/responses/{response_id}": (404,),
    "/v1/responses/{response_id}/cancel": (404,),
    "/v1/responses/{response_id}/input_items": (404,),
}
ERROR_MODELS = (anthropic.AnthropicErrorResponse, ollama.OllamaErrorResponse)


def error_model(path: str) -> type[BaseModel] | None:
    """The error shape of `path` when it is not OpenAI's envelope (error_dialects.py)."""
    if is_anthropic_path(path):
        return anthropic.AnthropicErrorResponse
    if is_ollama_path(path):
        return ollama.OllamaErrorResponse
    return None
