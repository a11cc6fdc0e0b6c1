"""The FastAPI app: native SGLang routes, the OpenAI-compatible routes, health and metrics.

Every error leaves in OpenAI's envelope `{"error": {...}}`: 400 for validation (FastAPI's 422
is overridden), 401 for a wrong API key, 404 for unknown routes and models, 503 when the
server cannot take the request (starting, a child died, queue full).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    error_body,
    error_type,
)
from radixserve.entrypoints.openai.serving_chat import ChatHandler
from radixserve.entrypoints.openai.serving_common import (
    SSE_DONE,
    ModelNotFoundError,
    raise_if_failed,
    sse_errors,
)
from radixserve.entrypoints.openai.serving_completions import CompletionsHandler
from radixserve.managers.generate_request import GenerateReqInput
from radixserve.managers.tokenizer_manager import (
    InvalidRequestError,
    RequestAbortedError,
    TokenizerManager,
)

logger = logging.getLogger(__name__)
BodyT = TypeVar("BodyT", bound=BaseModel)

Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]
HEALTH_GENERATE_TIMEOUT_S = 20.0
_PUBLIC_PATHS = ("/health", "/metrics")


@dataclass
class ServerState:
    """What the routes need; `ready` flips after the warm-up, `dead` when a child process died."""

    tm: TokenizerManager
    ready: bool = False
    dead: bool = False

    @property
    def served_names(self) -> tuple[str, ...]:
        return (self.tm.served_model_name, self.tm.model_path)


def error_response(status: int, message: str, code: str | int | None = None) -> JSONResponse:
    return JSONResponse(
        error_body(message, error_type(status), code if code is not None else status), status_code=status
    )


async def json_body(model: type[BodyT], request: Request) -> BodyT:
    """The request body parsed as `model` whatever its Content-Type says: `curl -d` sends JSON as a
    form, which FastAPI's body parameters reject. Bad JSON or fields raise ValidationError (400)."""
    return model.model_validate_json(await request.body())


def _validation_message(exc: RequestValidationError | ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "; ".join(parts) or "Invalid request."


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, _validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(
            exc.status_code, str(exc.detail), "not_found" if exc.status_code == 404 else None
        )

    @app.exception_handler(ValidationError)
    async def on_pydantic(_: Request, exc: ValidationError) -> JSONResponse:
        return error_response(400, _validation_message(exc))

    @app.exception_handler(ValueError)
    async def on_value(_: Request, exc: ValueError) -> JSONResponse:
        return error_response(400, str(exc))

    @app.exception_handler(ModelNotFoundError)
    async def on_model(_: Request, exc: ModelNotFoundError) -> JSONResponse:
        return error_response(404, str(exc.args[0]), "model_not_found")

    @app.exception_handler(RequestAbortedError)
    async def on_aborted(_: Request, exc: RequestAbortedError) -> JSONResponse:
        return error_response(exc.status_code, str(exc))


def _add_auth(app: FastAPI, api_key: str | None) -> None:
    if not api_key:
        return

    @app.middleware("http")
    async def check_api_key(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        if (
            request.url.path not in _PUBLIC_PATHS
            and request.headers.get("authorization") != f"Bearer {api_key}"
        ):
            return error_response(401, "Incorrect API key provided.", "invalid_api_key")
        return await call_next(request)


def _sse_stream(chunks: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _native_chunks(outputs: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    async for out in outputs:
        yield b"data: " + orjson.dumps(out) + b"\n\n"


def _add_native_routes(app: FastAPI, state: ServerState) -> None:
    tm = state.tm

    @app.get("/health")
    async def health() -> Response:
        if state.dead:
            return error_response(503, "A server process died.")
        if not state.ready:
            return error_response(503, "The server is starting.")
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        if state.dead or not state.ready:
            return error_response(503, "The server is not ready.")
        probe = GenerateReqInput(input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0})
        try:
            out = await asyncio.wait_for(tm.generate(probe), HEALTH_GENERATE_TIMEOUT_S)
            raise_if_failed(out)  # refused (queue full, waiting timeout) is not healthy either
        except (asyncio.TimeoutError, RequestAbortedError) as exc:
            return error_response(503, f"Generation failed: {exc!r}")
        return Response(status_code=200)

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        obj = await json_body(GenerateReqInput, request)
        if obj.stream:
            return _sse_stream(sse_errors(_native_chunks(tm.stream(obj, request))))
        result = await tm.generate(obj, request)
        for out in [result] if isinstance(result, dict) else result:
            raise_if_failed(out)  # an abort with an HTTP status (queue full, dead child) is an error
        return Response(orjson.dumps(result), media_type="application/json")

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        tokenizer_path = tm.server_args.tokenizer_path or tm.model_path
        return {"model_path": tm.model_path, "tokenizer_path": tokenizer_path, "is_generation": True}

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        info: dict[str, Any] = dataclasses.asdict(tm.server_args)
        if info.get("api_key"):
            info["api_key"] = "<redacted>"  # never echo a secret, even to its holders
        info["internal_states"] = await tm.get_internal_states()
        info["max_total_num_tokens"] = tm.max_total_num_tokens
        info["context_len"] = tm.context_len
        info["ranks"] = tm.ranks
        return info

    @app.api_route("/flush_cache", methods=["POST", "GET"])
    async def flush_cache() -> Response:
        if tm.num_in_flight > 0 or not await tm.flush_cache():
            return error_response(400, "Cannot flush the cache while requests are running.")
        return Response("Cache flushed.", status_code=200)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await json_body(AbortRequestBody, request)
        if not body.rid and not body.abort_all:
            return error_response(400, "Give 'rid' or 'abort_all'.")
        tm.abort_request(body.rid or None, abort_all=body.abort_all)
        return Response(status_code=200)

    if tm.metrics is not None:
        metrics = tm.metrics

        @app.get("/metrics")
        async def get_metrics() -> Response:
            return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


class AbortRequestBody(BaseModel):
    rid: str = ""
    abort_all: bool = False


def _add_openai_routes(app: FastAPI, state: ServerState) -> None:
    tm = state.tm
    completions = CompletionsHandler(tm, state.served_names)
    chat = ChatHandler(tm, state.served_names)

    def card() -> ModelCard:
        return ModelCard(id=tm.served_model_name, root=tm.model_path, max_model_len=tm.context_len)

    @app.post("/v1/completions")
    async def v1_completions(request: Request) -> Response:
        req = await json_body(CompletionRequest, request)
        if req.stream:
            return _sse_stream(completions.stream(req, request))
        return JSONResponse((await completions.create(req, request)).model_dump())

    @app.post("/v1/chat/completions")
    async def v1_chat(request: Request) -> Response:
        req = await json_body(ChatCompletionRequest, request)
        if req.stream:
            return _sse_stream(chat.stream(req, request))
        return JSONResponse((await chat.create(req, request)).model_dump())

    @app.get("/v1/models")
    async def v1_models() -> dict[str, Any]:
        return ModelList(data=[card()]).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def v1_model(model_id: str) -> dict[str, Any]:
        if model_id not in state.served_names and model_id != "default":  # as check_model accepts
            raise ModelNotFoundError(f"The model `{model_id}` does not exist.")
        return card().model_dump()

    @app.post("/v1/tokenize")
    async def v1_tokenize(request: Request) -> dict[str, Any]:
        req = await json_body(TokenizeRequest, request)
        if isinstance(req.prompt, str):
            tokens: Any = tm.tokenize(req.prompt, req.add_special_tokens)
            count: Any = len(tokens)
        else:
            tokens = [tm.tokenize(p, req.add_special_tokens) for p in req.prompt]
            count = [len(t) for t in tokens]
        return TokenizeResponse(tokens=tokens, count=count, max_model_len=tm.context_len).model_dump()

    @app.post("/v1/detokenize")
    async def v1_detokenize(request: Request) -> dict[str, Any]:
        req = await json_body(DetokenizeRequest, request)
        tokens = req.tokens
        flat = [t for seq in tokens for t in seq] if tokens and isinstance(tokens[0], list) else tokens
        if any(not 0 <= t < tm.vocab_size for t in flat):  # type: ignore[operator]
            raise InvalidRequestError(f"Token ids must be in [0, {tm.vocab_size}).")
        if tokens and isinstance(tokens[0], list):
            return DetokenizeResponse(text=[tm.detokenize(t) for t in tokens]).model_dump()  # type: ignore[arg-type]
        return DetokenizeResponse(text=tm.detokenize(tokens)).model_dump()  # type: ignore[arg-type]


def create_app(state: ServerState, lifespan: Lifespan | None = None) -> FastAPI:
    """The app; `lifespan` (start the TokenizerManager on the serving loop, ...) wraps serving."""
    app = FastAPI(title="radixserve", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    _add_error_handlers(app)
    _add_auth(app, state.tm.server_args.api_key)
    _add_native_routes(app, state)
    _add_openai_routes(app, state)
    app.state.server = state
    return app


__all__ = ["SSE_DONE", "ServerState", "create_app", "error_response"]
