"""The FastAPI app: native SGLang routes, the OpenAI-compatible routes, health and metrics.

Every error leaves in OpenAI's envelope `{"error": {...}}`: 400 for validation (FastAPI's 422
is overridden) and a Host that is not allowed, 401 for a wrong API key, 404 for unknown routes and
models, 405 (with Allow) for a wrong method, 413 for a body over the size limit, 415 for a POST
or PUT whose body is not JSON, 503 when the server cannot take the request (starting, a child
died, queue full), and 500 for anything unforeseen (logged with its traceback). The error
handlers are in http_errors.py, the guards in http_guards.py; the OpenAPI document
(/openapi.json) is completed in openapi_spec.py.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from radixserve.entrypoints.client_apis import add_client_api_routes
from radixserve.entrypoints.control_routes import add_control_routes
from radixserve.entrypoints.dashboard.routes import add_dashboard_routes
from radixserve.entrypoints.embedding_routes import add_embedding_routes
from radixserve.entrypoints.health import generation_failure
from radixserve.entrypoints.http_errors import CatchAllMiddleware, add_error_handlers
from radixserve.entrypoints.http_guards import (
    GuardMiddleware,
    allowed_host_names,
    error_response,
    json_body,
    require_json_body,
)
from radixserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from radixserve.entrypoints.openai.serving_chat import ChatHandler
from radixserve.entrypoints.openai.serving_common import (
    SSE_DONE,
    ModelNotFoundError,
    check_model,
    first_output_checked,
    raise_if_failed,
    sse_errors,
)
from radixserve.entrypoints.openai.serving_completions import CompletionsHandler
from radixserve.entrypoints.openapi_spec import AbortRequestBody, install_openapi
from radixserve.managers.generate_request import GenerateReqInput
from radixserve.managers.tokenizer_manager import (
    InvalidRequestError,
    RequestAbortedError,
    TokenizerManager,
)
from radixserve.utils.expert_metrics import render_expert_load
from radixserve.utils.hicache_metrics import render_hicache
from radixserve.utils.tracing import TraceMiddleware

logger = logging.getLogger(__name__)

Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]


@dataclass
class ServerState:
    """What the routes need; `ready` flips after the warm-up, `dead` when a child process died,
    `restarting` while --restart-on-failure replaces the children (503s then carry Retry-After)."""

    tm: TokenizerManager
    ready: bool = False
    dead: bool = False
    restarting: bool = False
    retry_after_s: int = 1

    @property
    def served_names(self) -> tuple[str, ...]:
        return (self.tm.served_model_name, self.tm.model_path)


def restarting_response(state: ServerState) -> Response:
    resp = error_response(503, "The server is restarting after a child process died.")
    resp.headers["Retry-After"] = str(state.retry_after_s)
    return resp


def _text(content: str = "") -> PlainTextResponse:
    """Every answer names its Content-Type, the empty ones included."""
    return PlainTextResponse(content, status_code=200)


def _sse_stream(chunks: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _native_chunks(outputs: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    async for out in outputs:
        yield b"data: " + orjson.dumps(out) + b"\n\n"


def _add_native_routes(app: FastAPI, state: ServerState) -> None:
    _add_health_routes(app, state)
    _add_generate_route(app, state.tm)
    _add_info_routes(app, state)
    _add_cache_routes(app, state.tm)
    if state.tm.metrics is not None:
        _add_metrics_route(app, state)


def _add_health_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> Response:
        if state.dead:
            return error_response(503, "A server process died.")
        if state.restarting:
            return restarting_response(state)
        if not state.ready:
            return error_response(503, "The server is starting.")
        return _text()

    @app.get("/health_generate")
    async def health_generate() -> Response:
        if state.restarting:
            return restarting_response(state)
        if state.dead or not state.ready:
            return error_response(503, "The server is not ready.")
        failure = await generation_failure(state.tm)
        return _text() if failure is None else error_response(503, failure)


def _add_generate_route(app: FastAPI, tm: TokenizerManager) -> None:
    @app.post("/generate")
    @app.put("/generate")  # as SGLang; PUT is never a simple cross-site request
    async def generate(request: Request) -> Response:
        obj = await json_body(GenerateReqInput, request)
        if obj.stream:
            outputs = await first_output_checked(await tm.stream(obj, request))
            return _sse_stream(sse_errors(_native_chunks(outputs)))
        result = await tm.generate(obj, request)
        for out in [result] if isinstance(result, dict) else result:
            raise_if_failed(out)  # an abort with an HTTP status (queue full, dead child) is an error
        return Response(orjson.dumps(result), media_type="application/json")


def _add_info_routes(app: FastAPI, state: ServerState) -> None:
    tm = state.tm

    @app.get("/get_model_info")
    @app.get("/model_info")  # the name the SGLang Model Gateway asks first
    async def get_model_info() -> dict[str, Any]:
        tokenizer_path = tm.server_args.tokenizer_path or tm.model_path
        return {
            "model_path": tm.model_path,
            "tokenizer_path": tokenizer_path,
            "is_generation": tm.is_generation,
            "weight_version": tm.weight_version,
            # SGLang's names: the model takes images (docs/multimodal.md); no model takes audio.
            "has_image_understanding": tm.images is not None,
            "has_audio_understanding": False,
        }

    @app.get("/get_server_info")
    @app.get("/server_info")  # the name the SGLang Model Gateway asks first
    async def get_server_info() -> dict[str, Any]:
        info: dict[str, Any] = dataclasses.asdict(tm.server_args)
        if info.get("api_key"):
            info["api_key"] = "<redacted>"  # never echo a secret, even to its holders
        info["internal_states"] = await tm.get_internal_states()
        info["max_total_num_tokens"] = tm.max_total_num_tokens
        info["context_len"] = tm.context_len
        info["ranks"] = tm.ranks
        return info

    @app.get("/get_load")
    async def get_load() -> Response:
        """SGLang's answer: one {dp_rank, num_reqs, num_waiting_reqs, num_tokens} per replica."""
        if state.dead:
            return error_response(503, "A server process died.")
        if state.restarting:
            return restarting_response(state)
        return JSONResponse(await tm.get_load())


def _add_cache_routes(app: FastAPI, tm: TokenizerManager) -> None:
    # POST only (SGLang also answers GET): any page can make a browser GET a URL (an <img> tag).
    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        if tm.num_in_flight > 0 or not await tm.flush_cache():
            return error_response(400, "Cannot flush the cache while requests are running.")
        return _text("Cache flushed.")

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await json_body(AbortRequestBody, request)
        if not body.rid and not body.abort_all:
            return error_response(400, "Give 'rid' or 'abort_all'.")
        tm.abort_request(body.rid or None, abort_all=body.abort_all)
        return _text()


def _add_metrics_route(app: FastAPI, state: ServerState) -> None:
    tm, metrics = state.tm, state.tm.metrics
    assert metrics is not None

    @app.get("/metrics")
    async def get_metrics() -> Response:
        if metrics.dp_size > 1 and not (state.dead or state.restarting):
            # Each replica reports its own queue, as each SGLang scheduler exports its gauges.
            try:
                metrics.set_replica_loads(await tm.get_load())
            except RequestAbortedError as exc:  # a replica is stuck: serve the last gauges
                logger.warning("/metrics: no load report from every replica (%s)", exc)
        text = metrics.render()
        args = tm.server_args
        if (args.enable_hierarchical_cache or args.enable_expert_distribution_metrics) and not (
            state.dead or state.restarting
        ):
            try:  # the scheduler owns the tiers and the expert counts
                states = await tm.get_internal_states()
                text += render_hicache(states, metrics.model_name)
                text += render_expert_load(states, metrics.model_name)
            except RequestAbortedError as exc:
                logger.warning("/metrics: no scheduler report from every replica (%s)", exc)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")


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
            return _sse_stream(await completions.stream(req, request))
        return JSONResponse((await completions.create(req, request)).model_dump())

    @app.post("/v1/chat/completions")
    async def v1_chat(request: Request) -> Response:
        req = await json_body(ChatCompletionRequest, request)
        if req.stream:
            return _sse_stream(await chat.stream(req, request))
        return JSONResponse((await chat.create(req, request)).model_dump())

    @app.get("/v1/models")
    async def v1_models() -> dict[str, Any]:
        # The base model, then each loaded LoRA adapter (SGLang lists them the same way).
        adapters = [
            ModelCard(id=name, root=path, parent=tm.served_model_name, max_model_len=tm.context_len)
            for name, path in tm.lora.loaded().items()
        ]
        return ModelList(data=[card(), *adapters]).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def v1_model(model_id: str) -> dict[str, Any]:
        if model_id not in state.served_names and model_id != "default":  # as check_model accepts
            raise ModelNotFoundError(f"The model `{model_id}` does not exist.")
        return card().model_dump()

    # Read-only routes; the tokenizer work runs off the event loop.
    @app.post("/v1/tokenize")
    async def v1_tokenize(request: Request) -> dict[str, Any]:
        req = await json_body(TokenizeRequest, request)
        check_model(req.model, state.served_names)
        return (await tm.run_blocking(_tokenize, tm, req)).model_dump()

    @app.post("/v1/detokenize")
    async def v1_detokenize(request: Request) -> dict[str, Any]:
        req = await json_body(DetokenizeRequest, request)
        check_model(req.model, state.served_names)
        return (await tm.run_blocking(_detokenize, tm, req)).model_dump()


def _tokenize(tm: TokenizerManager, req: TokenizeRequest) -> TokenizeResponse:
    if isinstance(req.prompt, str):
        tokens: Any = tm.tokenize(req.prompt, req.add_special_tokens)
        count: Any = len(tokens)
    else:
        tokens = [tm.tokenize(p, req.add_special_tokens) for p in req.prompt]
        count = [len(t) for t in tokens]
    return TokenizeResponse(tokens=tokens, count=count, max_model_len=tm.context_len)


def _detokenize(tm: TokenizerManager, req: DetokenizeRequest) -> DetokenizeResponse:
    tokens = req.tokens
    nested = bool(tokens) and isinstance(tokens[0], list)
    flat = [t for seq in tokens for t in seq] if nested else tokens  # type: ignore[union-attr]
    if any(not 0 <= t < tm.vocab_size for t in flat):  # type: ignore[operator]
        raise InvalidRequestError(f"Token ids must be in [0, {tm.vocab_size}).")
    if nested:
        return DetokenizeResponse(text=[tm.detokenize(t) for t in tokens])  # type: ignore[arg-type]
    return DetokenizeResponse(text=tm.detokenize(tokens))  # type: ignore[arg-type]


def create_app(state: ServerState, lifespan: Lifespan | None = None) -> FastAPI:
    """The app; `lifespan` (start the TokenizerManager on the serving loop, ...) wraps serving."""
    args = state.tm.server_args
    # /openapi.json as SGLang serves it (no /docs: the Swagger page would load scripts from a CDN).
    # require_json_body on the app, not on each route: a route added later cannot leave it out.
    app = FastAPI(
        title="radixserve",
        docs_url=None,
        redoc_url=None,
        lifespan=lifespan,
        dependencies=[Depends(require_json_body)],
    )
    add_error_handlers(app)
    app.add_middleware(
        GuardMiddleware, allowed_hosts=allowed_host_names(args.host, args.allowed_hosts), api_key=args.api_key
    )
    app.add_middleware(CatchAllMiddleware)  # added last = outermost: it also covers the guards
    if args.enable_trace:  # outermost: the HTTP span holds the guards' work too
        app.add_middleware(TraceMiddleware, tracer=state.tm.tracer)
    _add_native_routes(app, state)
    add_control_routes(app, state.tm)
    _add_openai_routes(app, state)
    add_embedding_routes(app, state)
    add_client_api_routes(app, state)  # Anthropic Messages, Ollama
    add_dashboard_routes(app, state)  # /dashboard, unless --disable-dashboard
    install_openapi(app)
    app.state.server = state
    app.state.max_body_bytes = args.max_request_body_bytes
    return app


__all__ = ["SSE_DONE", "ServerState", "create_app", "error_response"]
