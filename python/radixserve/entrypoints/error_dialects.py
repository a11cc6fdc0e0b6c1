"""Errors in each client family's own shape.

Every handler, guard and the catch-all answer errors in OpenAI's envelope (http_errors.py). An
Anthropic or Ollama client reads another shape, so this middleware, outermost, rewrites the
envelope of an error answer (status >= 400, JSON) under their paths:

- Anthropic (`/v1/messages...`): `{"type": "error", "error": {"type": <kind>, "message": ...}}`
  with Anthropic's kind for the status (invalid_request_error, not_found_error, ...).
- Ollama (`/api/...`): `{"error": <message>}`.

Rewriting the one envelope, rather than a second set of handlers, keeps every status the same
on every route: a 401 from the API-key guard, a 413, a 415 and a 500 included.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

Reshape = Callable[[int, str], dict[str, Any]]

ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_type(status: int) -> str:
    if status in ANTHROPIC_ERROR_TYPES:
        return ANTHROPIC_ERROR_TYPES[status]
    return "invalid_request_error" if status < 500 else "api_error"


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}


def ollama_error(status: int, message: str) -> dict[str, Any]:
    return {"error": message}


def is_anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def is_ollama_path(path: str) -> bool:
    return path.startswith("/api/")


def dialect_for(path: str) -> Reshape | None:
    if is_anthropic_path(path):
        return anthropic_error
    if is_ollama_path(path):
        return ollama_error
    return None


def _message(body: bytes) -> str | None:
    """The message of an OpenAI error envelope, None when the body is something else."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"]
    return None


class ErrorDialectMiddleware:
    """Pure ASGI: answers below 400 (streams included) pass untouched; an error answer under a
    dialect's path is buffered (it is small) and its envelope rewritten."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        reshape = dialect_for(scope.get("path", "")) if scope["type"] == "http" else None
        if reshape is None:
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        chunks: list[bytes] = []

        async def reshaping_send(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message  # held until the body is complete
                return
            if start is None:
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                await self._send_reshaped(start, b"".join(chunks), reshape, send)

        await self.app(scope, receive, reshaping_send)

    @staticmethod
    async def _send_reshaped(start: Message, body: bytes, reshape: Reshape, send: Send) -> None:
        message = _message(body)
        if message is not None:
            body = orjson.dumps(reshape(start["status"], message))
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            start = {**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        await send(start)
        await send({"type": "http.response.body", "body": body, "more_body": False})
