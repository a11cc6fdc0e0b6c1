"""The APIs of other client families, each a translation layer onto the native paths: Anthropic
Messages (anthropic/) and Ollama (ollama/). http_server.create_app adds them with one call."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI

from radixserve.entrypoints.anthropic.serving import add_anthropic_routes
from radixserve.entrypoints.error_dialects import ErrorDialectMiddleware
from radixserve.entrypoints.ollama.routes import add_ollama_routes
from radixserve.entrypoints.openai.serving_chat import ChatHandler

if TYPE_CHECKING:
    from radixserve.entrypoints.http_server import ServerState


def add_client_api_routes(app: FastAPI, state: ServerState) -> None:
    chat = ChatHandler(state.tm, state.served_names)
    add_anthropic_routes(app, state.tm, chat)
    add_ollama_routes(app, state, chat)
    # Added after the app's own middleware, so outermost: it reshapes every error, 500s included.
    app.add_middleware(ErrorDialectMiddleware)
