"""The OpenAPI document at /openapi.json: FastAPI's, completed with what the routes really exchange.

The routes read their bodies themselves (strict JSON, a size limit, a Content-Type rule), so FastAPI
cannot see their request models; this module declares them, every answer's Content-Type (JSON,
text/plain, text/event-stream), the error envelope for each error status a route can answer, and
the server-sent events of each streaming route. OpenAPI 3.1 (FastAPI's version) has the `schema`
of text/event-stream describe one event, `{"event", "data", "id", "retry"}`; `data` is JSON (an
output chunk, or an error envelope after the stream started) with `contentSchema`, except for
the final `[DONE]`. Clients and test/server/test_http_fuzz.py (schemathesis) read the document.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict
from pydantic.json_schema import models_json_schema

from radixserve.entrypoints import client_apis
from radixserve.entrypoints.control_routes import (
    CONTROL_BODIES,
    CONTROL_LORA_ANSWERS,
    CONTROL_OUTCOME_ANSWERS,
    CONTROL_TEXT_ANSWERS,
)
from radixserve.entrypoints.http_guards import PUBLIC_PATHS
from radixserve.entrypoints.openai.embedding_protocol import (
    ClassifyRequest,
    ClassifyResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    RerankRequest,
    RerankResult,
    ScoringRequest,
    ScoringResponse,
)
from radixserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from radixserve.managers.embedding_request import EmbeddingReqInput
from radixserve.managers.generate_request import GenerateReqInput

REF = "#/components/schemas/{model}"


class AbortRequestBody(BaseModel):
    """POST /abort_request: one request (and its n > 1 samples) or everything."""

    rid: str = ""
    abort_all: bool = False


# meta_info of every output (managers/req_state.request_meta); a generation's adds to it.
class EncodeMetaInfo(BaseModel):
    id: str
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    e2e_latency: float


class GenerateMetaInfo(EncodeMetaInfo):
    model_config = ConfigDict(extra="allow")  # the logprob lists with return_logprob

    weight_version: str  # the weights that served it (--weight-version, then each update's)


class GenerateOutput(BaseModel):
    """One output of /generate (also one streamed event: cumulative text and ids so far)."""

    text: str
    output_ids: list[int]
    meta_info: GenerateMetaInfo
    index: int


class EncodeOutput(BaseModel):
    """One output of /encode or /classify: the vector (a classifier's logits) and meta_info."""

    embedding: list[float]
    meta_info: EncodeMetaInfo
    index: int


# Request bodies (validation mode) and answers (serialization mode) by route.
_BODIES: dict[str, type[BaseModel]] = {
    "/generate": GenerateReqInput,
    "/abort_request": AbortRequestBody,
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/tokenize": TokenizeRequest,
    "/v1/detokenize": DetokenizeRequest,
    **CONTROL_BODIES,
    "/encode": EmbeddingReqInput,
    "/classify": EmbeddingReqInput,
    "/v1/embeddings": EmbeddingRequest,
    "/v1/rerank": RerankRequest,
    "/v1/score": ScoringRequest,
    "/v1/classify": ClassifyRequest,
    **client_apis.OPENAPI_BODIES,
}
_JSON_ANSWERS: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionResponse,
    "/v1/chat/completions": ChatCompletionResponse,
    "/v1/tokenize": TokenizeResponse,
    "/v1/detokenize": DetokenizeResponse,
    "/v1/models": ModelList,
    "/v1/models/{model_id}": ModelCard,
    "/v1/embeddings": EmbeddingResponse,
    "/v1/score": ScoringResponse,
    "/v1/classify": ClassifyResponse,
    **client_apis.OPENAPI_JSON_ANSWERS,
}
# Answers that are one object for a single input and an array for a batch, and plain arrays.
_ONE_OR_MANY: dict[str, type[BaseModel]] = {
    "/generate": GenerateOutput,
    "/encode": EncodeOutput,
    "/classify": EncodeOutput,
}
_ARRAY_ANSWERS: dict[str, type[BaseModel]] = {"/v1/rerank": RerankResult}
_STREAM_EVENTS: dict[str, type[BaseModel]] = {
    "/generate": GenerateOutput,
    "/v1/completions": CompletionResponse,
    "/v1/chat/completions": ChatCompletionStreamResponse,
    **client_apis.OPENAPI_SSE_EVENTS,
}
_TEXT_ANSWERS = frozenset(
    {"/health", "/health_generate", "/flush_cache", "/abort_request", "/metrics", *CONTROL_TEXT_ANSWERS}
)
_OBJECT_ANSWERS = frozenset({"/get_model_info", "/get_server_info", "/model_info", "/server_info"})
# The control routes' own answers: SGLang's bodies (control_routes.py).
_OUTCOME = {
    "type": "object",
    "required": ["success", "message"],
    "properties": {
        "success": {"type": "boolean"},
        "message": {"type": "string"},
        "num_paused_requests": {"type": "integer"},
    },
}
_INTERNAL_STATE = {
    "type": "object",
    "required": ["updated", "server_args"],
    "properties": {
        "updated": {"type": "boolean"},
        "server_args": {"type": "object"},
        "message": {"type": "string"},
    },
}
_LORA_UPDATE = {
    "type": "object",
    "required": ["success", "error_message", "loaded_adapters"],
    "properties": {
        "success": {"type": "boolean"},
        "error_message": {"type": "string"},
        "loaded_adapters": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}
_CONTROL_ANSWERS: dict[str, dict[str, Any]] = {
    **{path: _LORA_UPDATE for path in CONTROL_LORA_ANSWERS},
    **{path: _OUTCOME for path in CONTROL_OUTCOME_ANSWERS},
    "/set_internal_state": _INTERNAL_STATE,
    "/open_session": {"type": "string"},  # the session id as a bare JSON string, as SGLang
    # The first truncate_size rows (one such array per replica with --dp-size > 1); a 0-d weight
    # is one number.
    "/get_weights_by_name": {"anyOf": [{"type": "array"}, {"type": "number"}]},
}

# Error statuses per route, beyond those every route can answer: 400 (the Host check, bad
# bodies), 401 (with --api-key, except PUBLIC_PATHS), 415 on POST/PUT and 413 where a body is read.
_SCHEDULER = (503,)  # a child died, or the scheduler did not answer in time
_GENERATING = (404, 503)
_ERRORS: dict[str, tuple[int, ...]] = {
    "/health": (503,),
    "/health_generate": (503,),
    "/get_load": (503,),
    "/get_server_info": _SCHEDULER,
    "/server_info": _SCHEDULER,
    "/generate": (503,),
    "/flush_cache": _SCHEDULER,
    "/v1/completions": _GENERATING,
    "/v1/chat/completions": _GENERATING,
    "/v1/tokenize": (404,),
    "/v1/detokenize": (404,),
    "/v1/models/{model_id}": (404,),
    "/encode": (503,),
    "/classify": (503,),
    "/v1/embeddings": _GENERATING,
    "/v1/rerank": _GENERATING,
    "/v1/score": _GENERATING,
    "/v1/classify": _GENERATING,
    **{path: _SCHEDULER for path in (*CONTROL_BODIES, *CONTROL_TEXT_ANSWERS, *CONTROL_OUTCOME_ANSWERS)},
    **client_apis.OPENAPI_ERRORS,
}


def install_openapi(app: FastAPI) -> None:
    """Make `app.openapi()` (served at /openapi.json) return the completed document."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def build_openapi(app: FastAPI) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    refs, defs = models_json_schema(
        [(m, "validation") for m in _BODIES.values()]
        + [
            (m, "serialization")
            for m in {
                *_JSON_ANSWERS.values(),
                *_STREAM_EVENTS.values(),
                *_ONE_OR_MANY.values(),
                *_ARRAY_ANSWERS.values(),
                *client_apis.OPENAPI_NDJSON_LINES.values(),
                *client_apis.OPENAPI_METHOD_JSON_ANSWERS.values(),
                *client_apis.ERROR_MODELS,
                ErrorResponse,
            }
        ],
        ref_template=REF,
    )
    doc.setdefault("components", {})["schemas"] = defs.get("$defs", {})
    error = refs[(ErrorResponse, "serialization")]
    for path, item in doc["paths"].items():
        for method, op in item.items():
            if method in ("post", "put") and path in _BODIES:
                schema = refs[(_BODIES[path], "validation")]
                op["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
            elif method == "post" and path in client_apis.OPENAPI_MULTIPART_BODIES:
                form = client_apis.OPENAPI_MULTIPART_BODIES[path]
                op["requestBody"] = {"required": True, "content": {"multipart/form-data": {"schema": form}}}
            dialect = client_apis.error_model(path)  # Anthropic's and Ollama's own error shapes
            op["responses"] = _responses(
                path, method, refs, error if dialect is None else refs[(dialect, "serialization")]
            )
    return doc


def sse_event_schema(chunk: dict[str, Any], error: dict[str, Any]) -> dict[str, Any]:
    """One event of a stream: `data: <chunk or error JSON>`, and last `data: [DONE]`."""
    json_data = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [chunk, error]},
    }
    return {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"anyOf": [{"const": "[DONE]"}, json_data]}},
    }


def _responses(path: str, method: str, refs: dict[Any, Any], error: dict[str, Any]) -> dict[str, Any]:
    ok: dict[str, Any] = {}
    by_method = client_apis.OPENAPI_METHOD_JSON_ANSWERS.get((method, path))
    if by_method is not None:
        ok["application/json"] = {"schema": refs[(by_method, "serialization")]}
        return _with_errors(path, method, ok, error)
    if path in _TEXT_ANSWERS:
        ok["text/plain"] = {"schema": {"type": "string"}}
    elif path in client_apis.OPENAPI_BINARY_ANSWERS:
        ok["application/octet-stream"] = {"schema": {"type": "string", "format": "binary"}}
    elif path in _JSON_ANSWERS:
        ok["application/json"] = {"schema": refs[(_JSON_ANSWERS[path], "serialization")]}
    elif path in _ONE_OR_MANY:
        one = refs[(_ONE_OR_MANY[path], "serialization")]
        ok["application/json"] = {"schema": {"anyOf": [one, {"type": "array", "items": one}]}}
    elif path in _ARRAY_ANSWERS:
        ok["application/json"] = {
            "schema": {"type": "array", "items": refs[(_ARRAY_ANSWERS[path], "serialization")]}
        }
    elif path in _CONTROL_ANSWERS:
        ok["application/json"] = {"schema": _CONTROL_ANSWERS[path]}
    elif path in _OBJECT_ANSWERS:
        ok["application/json"] = {"schema": {"type": "object"}}
    elif path == "/get_load":
        ok["application/json"] = {"schema": {"type": "array", "items": {"type": "object"}}}
    if path in client_apis.OPENAPI_NDJSON_LINES:  # one JSON object per line (a line may be an error)
        line = refs[(client_apis.OPENAPI_NDJSON_LINES[path], "serialization")]
        ok[client_apis.NDJSON_MEDIA_TYPE] = {"schema": {"anyOf": [line, error]}}
    if path in _STREAM_EVENTS:
        ok["text/event-stream"] = {
            "schema": sse_event_schema(refs[(_STREAM_EVENTS[path], "serialization")], error)
        }
    return _with_errors(path, method, ok, error)


def _with_errors(path: str, method: str, ok: dict[str, Any], error: dict[str, Any]) -> dict[str, Any]:
    responses: dict[str, Any] = {"200": {"description": "OK", "content": ok}}
    for status in _error_statuses(path, method):
        responses[str(status)] = _error(error, _CONTROL_ANSWERS.get(path) if status == 400 else None)
    return responses


def _error_statuses(path: str, method: str) -> list[int]:
    statuses = {400, *_ERRORS.get(path, ())}
    if path not in PUBLIC_PATHS:
        statuses.add(401)
    if method in ("post", "put"):
        statuses.add(415)  # JSON only, or a form upload (http_guards.require_json_body)
        if path in _BODIES or path in client_apis.OPENAPI_MULTIPART_BODIES:
            statuses.add(413)  # a body is read up to --max-request-body-bytes
    return sorted(statuses)


def _error(error: dict[str, Any], answer: dict[str, Any] | None) -> dict[str, Any]:
    """The error envelope; a control route's refusal also carries SGLang's fields beside it."""
    schema = error
    if answer is not None and answer.get("type") == "object":
        schema = {"allOf": [error, {"type": "object", "properties": answer["properties"]}]}
    return {"description": "Error (the error envelope)", "content": {"application/json": {"schema": schema}}}
