"""The APIs of other client families, each a translation layer onto the native paths: Anthropic
Messages (anthropic/), Ollama (ollama/), OpenAI Responses (responses/) and OpenAI Files and Batch
(batch/). http_server.create_app adds them with one call."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import FastAPI
from pydantic import BaseModel

from radixserve.entrypoints.anthropic import protocol as anthropic
from radixserve.entrypoints.anthropic.serving import add_anthropic_routes
from radixserve.entrypoints.batch import protocol as batch
from radixserve.entrypoints.batch.lines import LineRunner
from radixserve.entrypoints.batch.routes import add_batch_routes
from radixserve.entrypoints.batch.runner import BatchRunner
from radixserve.entrypoints.batch.service import BatchService
from radixserve.entrypoints.batch.store import BatchStore
from radixserve.entrypoints.error_dialects import ErrorDialectMiddleware, is_anthropic_path, is_ollama_path
from radixserve.entrypoints.ollama import protocol as ollama
from radixserve.entrypoints.ollama.routes import NDJSON, add_ollama_routes
from radixserve.entrypoints.openai.serving_chat import ChatHandler
from radixserve.entrypoints.openai.serving_completions import CompletionsHandler
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
    _add_batch_api(app, state, chat)
    # Added after the app's own middleware, so outermost: it reshapes every error, 500s included.
    app.add_middleware(ErrorDialectMiddleware)


def _add_batch_api(app: FastAPI, state: ServerState, chat: ChatHandler) -> None:
    """The Files and Batch routes, and the runner of batches: started (resuming what a restart
    interrupted) once the app's own lifespan has started the TokenizerManager, stopped before it
    closes."""
    tm, args = state.tm, state.tm.server_args
    lines = LineRunner(tm, chat, CompletionsHandler(tm, state.served_names), state.served_names)
    store = BatchStore(args.storage_dir)
    # Unset only where the args were not resolved (in-process test apps): resolve()'s default
    # without priority scheduling.
    runner = BatchRunner(store, lines, args.batch_max_concurrent_requests or 2)
    add_batch_routes(app, BatchService(store, runner, tm.is_generation, tm.served_model_name))
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(app_: FastAPI) -> AsyncIterator[None]:
        async with inner(app_):
            await runner.start()
            try:
                yield
            finally:
                # The store stays open: an app's lifespan may run again (in-process test apps).
                await runner.close()

    app.router.lifespan_context = lifespan


# What openapi_spec.py declares for these routes: bodies, answers, streams and error shapes.
OPENAPI_BODIES: dict[str, type[BaseModel]] = {
    "/v1/messages": anthropic.MessagesRequest,
    "/v1/messages/count_tokens": anthropic.CountTokensRequest,
    "/api/chat": ollama.ChatRequest,
    "/api/generate": ollama.GenerateRequest,
    "/api/embed": ollama.EmbedRequest,
    "/api/show": ollama.ShowRequest,
    "/v1/responses": responses.ResponsesRequest,
    "/v1/batches": batch.BatchCreateRequest,
}
# Bodies that are multipart/form-data (http_guards.MULTIPART_PATHS): the JSON Schema of the form.
OPENAPI_MULTIPART_BODIES: dict[str, dict] = {
    "/v1/files": {
        "type": "object",
        "required": ["file", "purpose"],
        "properties": {
            "file": {"type": "string", "format": "binary", "description": "The JSONL batch input."},
            "purpose": {"type": "string", "enum": ["batch"]},
        },
    },
}
# Answers that are the stored bytes of a file.
OPENAPI_BINARY_ANSWERS = frozenset({"/v1/files/{file_id}/content"})
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
    "/v1/files/{file_id}": batch.FileObject,
    "/v1/batches/{batch_id}": batch.BatchObject,
    "/v1/batches/{batch_id}/cancel": batch.BatchObject,
}
# Where two methods of one path answer different bodies: (method, path) -> the answer.
OPENAPI_METHOD_JSON_ANSWERS: dict[tuple[str, str], type[BaseModel]] = {
    ("delete", "/v1/responses/{response_id}"): responses.DeletedResponse,
    ("post", "/v1/files"): batch.FileObject,
    ("get", "/v1/files"): batch.FileList,
    ("delete", "/v1/files/{file_id}"): batch.FileDeleted,
    ("post", "/v1/batches"): batch.BatchObject,
    ("get", "/v1/batches"): batch.BatchList,
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
    "/v1/files/{file_id}": (404,),
    "/v1/files/{file_id}/content": (404,),
    "/v1/batches": (404,),  # POST: no such input file
    "/v1/batches/{batch_id}": (404,),
    "/v1/batches/{batch_id}/cancel": (404,),
}
ERROR_MODELS = (anthropic.AnthropicErrorResponse, ollama.OllamaErrorResponse)


def error_model(path: str) -> type[BaseModel] | None:
    """The error shape of `path` when it is not OpenAI's envelope (error_dialects.py)."""
    if is_anthropic_path(path):
        return anthropic.AnthropicErrorResponse
    if is_ollama_path(path):
        return ollama.OllamaErrorResponse
    return None
