"""Routes of models that do not generate (docs/embeddings.md): /encode and /classify (SGLang's
native shapes), /v1/embeddings (OpenAI's), /v1/rerank and /v1/score (SGLang's), /v1/classify.

All of them run prefill-only requests (TokenizerManager.encode_items). Asking a generation model
for embeddings, or an embedding model for label scores, is a 400 with the reason."""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response

from radixserve.entrypoints.http_guards import json_body
from radixserve.entrypoints.openai.embedding_protocol import (
    ClassifyData,
    ClassifyRequest,
    ClassifyResponse,
    EmbeddingInput,
    EmbeddingRequest,
    RerankRequest,
    RerankResult,
    ScoringRequest,
    ScoringResponse,
)
from radixserve.entrypoints.openai.protocol import UsageInfo
from radixserve.entrypoints.openai.serving_common import check_model
from radixserve.managers import scoring
from radixserve.managers.embedding_request import EmbeddingReqInput, EmbedItem, make_item
from radixserve.managers.input_validation import InvalidRequestError

if TYPE_CHECKING:
    from radixserve.entrypoints.http_server import ServerState


def _json(payload: Any) -> Response:  # noqa: ANN401 - any JSON-able value
    # The vectors are numpy float32 arrays: written at float32 precision, straight from memory.
    return Response(orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json")


def embedding_items(value: EmbeddingInput, truncate: int | None = None) -> list[EmbedItem]:
    """OpenAI's `input`: a string, a list of strings, token ids, or a list of token-id lists."""
    if isinstance(value, str):
        return [make_item(value, truncate=truncate)]
    if value and all(isinstance(v, int) for v in value):
        return [make_item(list(value), truncate=truncate)]  # one input of token ids
    return [make_item(v, truncate=truncate) for v in value]


def _usage(outputs: list[dict[str, Any]]) -> UsageInfo:
    prompt = sum(o["meta_info"]["prompt_tokens"] for o in outputs)
    return UsageInfo(prompt_tokens=prompt, total_tokens=prompt)


def _encode_vector(vector: Any, fmt: str) -> np.ndarray | str:  # noqa: ANN401 - array or floats
    """A float32 array (orjson writes each value at float32 precision) or, for base64, what
    OpenAI's client asks for by default: its little-endian float32 bytes."""
    array = np.ascontiguousarray(vector, dtype="<f4")
    if fmt == "base64":
        return base64.b64encode(array.tobytes()).decode("ascii")
    return array


def embeddings_body(outputs: list[dict[str, Any]], encoding_format: str, model: str) -> bytes:
    """The /v1/embeddings answer as JSON bytes: OpenAI's EmbeddingResponse (embedding_protocol.py,
    the documented schema), written directly rather than through the pydantic models, which would
    turn every value of every vector into a Python float and back."""
    data = [
        {"object": "embedding", "embedding": _encode_vector(o["embedding"], encoding_format), "index": i}
        for i, o in enumerate(outputs)
    ]
    body = {"object": "list", "data": data, "model": model, "usage": _usage(outputs).model_dump()}
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


def _require_classifier(state: ServerState) -> dict[str, Any]:
    info = state.tm.embedding_info or {}
    if not info.get("is_classifier"):
        raise InvalidRequestError("Classification needs a sequence-classification model.")
    return info


def add_embedding_routes(app: FastAPI, state: ServerState) -> None:
    _add_native_routes(app, state)
    _add_openai_routes(app, state)


def _add_native_routes(app: FastAPI, state: ServerState) -> None:
    """SGLang's /encode and /classify: the native request, outputs in its shape."""
    tm = state.tm

    @app.post("/encode")
    async def encode(request: Request) -> Response:
        obj = await json_body(EmbeddingReqInput, request)
        outputs = await scoring.embed(tm, obj.items(), obj.dimensions, request)
        return _json(outputs[0] if obj.is_single else outputs)

    @app.post("/classify")
    async def classify_native(request: Request) -> Response:
        obj = await json_body(EmbeddingReqInput, request)
        _require_classifier(state)
        outputs = await scoring.embed(tm, obj.items(), None, request)
        return _json(outputs[0] if obj.is_single else outputs)


def _add_openai_routes(app: FastAPI, state: ServerState) -> None:
    """/v1/embeddings (OpenAI's), /v1/rerank and /v1/score (SGLang's), /v1/classify."""
    tm = state.tm

    @app.post("/v1/embeddings")
    async def v1_embeddings(request: Request) -> Response:
        req = await json_body(EmbeddingRequest, request)
        check_model(req.model, state.served_names)
        outputs = await scoring.embed(
            tm, embedding_items(req.input, req.truncate_prompt_tokens), req.dimensions, request
        )
        body = embeddings_body(outputs, req.encoding_format, req.model or tm.served_model_name)
        return Response(body, media_type="application/json")

    @app.post("/v1/rerank")
    async def v1_rerank(request: Request) -> Response:
        req = await json_body(RerankRequest, request)
        check_model(req.model, state.served_names)
        scored = await scoring.rerank(tm, req.query, req.documents, req.instruct, request)
        results = [
            RerankResult(
                score=s, document=req.documents[i] if req.return_documents else None, index=i, meta_info=m
            )
            for i, (s, m) in enumerate(scored)
        ]
        results.sort(key=lambda r: -r.score)
        return _json([r.model_dump() for r in results[: req.top_n or len(results)]])

    @app.post("/v1/score")
    async def v1_score(request: Request) -> Response:
        req = await json_body(ScoringRequest, request)
        check_model(req.model, state.served_names)
        scores, prompt_tokens = await scoring.score(
            tm, req.query, req.items, req.label_token_ids, req.apply_softmax, req.item_first, request
        )
        usage = UsageInfo(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens)
        body = ScoringResponse(scores=scores, model=req.model or tm.served_model_name, usage=usage)
        return _json(body.model_dump())

    @app.post("/v1/classify")
    async def v1_classify(request: Request) -> Response:
        req = await json_body(ClassifyRequest, request)
        check_model(req.model, state.served_names)
        info = _require_classifier(state)
        outputs = await scoring.run(tm, embedding_items(req.input), request)
        labels = {int(k): v for k, v in (info.get("id2label") or {}).items()}
        data = [
            ClassifyData(index=i, **scoring.classification(o["embedding"], labels))
            for i, o in enumerate(outputs)
        ]
        body = ClassifyResponse(model=req.model or tm.served_model_name, data=data, usage=_usage(outputs))
        return _json(body.model_dump())
