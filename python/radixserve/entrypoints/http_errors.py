"""How every error leaves the HTTP server: as OpenAI's envelope `{"error": {...}}`, with a status
that says whose fault it is (4xx: the request's, 5xx: the server's).

The handlers below turn the known exceptions into their status. Anything else is a bug or an
unforeseen failure: `CatchAllMiddleware` logs it with its traceback and answers 500 in the same
envelope, never Starlette's plain-text "Internal Server Error".
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixserve.entrypoints.http_guards import error_response
from radixserve.entrypoints.openai.serving_common import ModelNotFoundError, internal_error_message
from radixserve.managers.errors import ClientDisconnected, RequestAbortedError, StoredObjectNotFound

logger = logging.getLogger(__name__)

# Status of a call whose client went away (nginx's "client closed request"); nobody reads it.
CLIENT_CLOSED_STATUS = 499


class CatchAllMiddleware:
    """Pure ASGI, outside the routes and their handlers: an exception that nothing else turned
    into an answer is logged once (with the request's method and path) and answered with a 500
    envelope, or, when the answer has already started (a stream), logged and the answer cut."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            logger.exception(
                "Unhandled %s in %s %s", type(exc).__name__, scope.get("method"), scope.get("path")
            )
            if not started:
                await error_response(500, internal_error_message(exc))(scope, receive, send)


def allowed_methods(request: Request) -> list[str]:
    """Every method some route answers at this path."""
    methods: set[str] = set()
    for route in request.app.routes:
        if isinstance(route, BaseRoute) and route.matches(request.scope)[0] == Match.PARTIAL:
            methods |= getattr(route, "methods", None) or set()
    return sorted(methods)


def validation_message(exc: RequestValidationError | ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "; ".join(parts) or "Invalid request."


def add_error_handlers(app: FastAPI) -> None:
    """The known exceptions' statuses (the rest: CatchAllMiddleware, added outermost)."""

    @app.exception_handler(RequestValidationError)
    @app.exception_handler(ValidationError)
    async def on_validation(_: Request, exc: RequestValidationError | ValidationError) -> JSONResponse:
        return error_response(400, validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        resp = error_response(
            exc.status_code, str(exc.detail), "not_found" if exc.status_code == 404 else None
        )
        resp.headers.update(exc.headers or {})
        if exc.status_code == 405:  # Starlette names one route's methods; POST and PUT /generate are two
            resp.headers["Allow"] = ", ".join(allowed_methods(request))
        return resp

    @app.exception_handler(ValueError)
    async def on_value(_: Request, exc: ValueError) -> JSONResponse:
        return error_response(400, str(exc))

    @app.exception_handler(ModelNotFoundError)
    async def on_model(_: Request, exc: ModelNotFoundError) -> JSONResponse:
        return error_response(404, str(exc.args[0]), "model_not_found")

    @app.exception_handler(StoredObjectNotFound)
    async def on_not_found(_: Request, exc: StoredObjectNotFound) -> JSONResponse:
        return error_response(404, str(exc), "not_found")

    @app.exception_handler(RequestAbortedError)
    async def on_aborted(request: Request, exc: RequestAbortedError) -> JSONResponse:
        resp = error_response(exc.status_code, str(exc))
        state = getattr(request.app.state, "server", None)
        if exc.status_code == 503 and getattr(state, "restarting", False):
            # --restart-on-failure: the request failed or was refused because the children are
            # restarting; the header says when to retry (the last restart's duration).
            resp.headers["Retry-After"] = str(state.retry_after_s)  # type: ignore[union-attr]
        return resp

    @app.exception_handler(ClientDisconnected)
    async def on_disconnect(_: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=CLIENT_CLOSED_STATUS)  # already logged and aborted; nobody reads it
