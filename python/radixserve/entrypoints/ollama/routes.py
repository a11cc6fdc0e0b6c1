"""Ollama's routes: /api/chat, /api/generate (serving.py), /api/embed, /api/tags, /api/show,
/api/version (models.py). Errors leave as `{"error": <message>}` (error_dialects.py); a failure
after a stream started is such a line, and the stream ends."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from radixserve.entrypoints.error_dialects import ollama_error
from radixserve.entrypoints.http_guards import json_body
from radixserve.entrypoints.ollama import models
from radixserve.entrypoints.ollama.protocol import (
    ChatChunk,
    ChatRequest,
    EmbedRequest,
    GenerateChunk,
    GenerateRequest,
    MessageOut,
    ShowRequest,
    TagsResponse,
    VersionResponse,
)
from radixserve.entrypoints.ollama.serving import Final, OllamaGenerator, Piece, collect, created_at
from radixserve.entrypoints.ollama.translate import model_name
from radixserve.entrypoints.openai.serving_chat import ChatHandler
from radixserve.entrypoints.openai.serving_common import check_model, in_band_errors
from radixserve.entrypoints.openai.serving_completions import CompletionsHandler
from radixserve.managers import scoring
from radixserve.managers.embedding_request import make_item

if TYPE_CHECKING:
    from radixserve.entrypoints.http_server import ServerState


NDJSON = "application/x-ndjson"
Line = Callable[[Piece], BaseModel | None]


def _json(body: BaseModel) -> Response:
    return JSONResponse(body.model_dump(exclude_none=True))


def _line(body: BaseModel | dict[str, Any]) -> bytes:
    data = body.model_dump(exclude_none=True) if isinstance(body, BaseModel) else body
    return orjson.dumps(data) + b"\n"


def ndjson_lines(pieces: AsyncIterator[Piece], line: Line) -> AsyncIterator[bytes]:
    """The pieces' lines; an error after the stream started is a line `{"error": ...}`."""
    return in_band_errors(
        _lines(pieces, line), lambda status, message: _line(ollama_error(status, message)), "an Ollama stream"
    )


async def _lines(pieces: AsyncIterator[Piece], line: Line) -> AsyncIterator[bytes]:
    async for piece in pieces:
        body = line(piece)
        if body is not None:
            yield _line(body)


def _chat_line(model: str, piece: Piece) -> ChatChunk | None:
    if piece.final is None:
        if not (piece.content or piece.thinking):
            return None
        message = MessageOut(content=piece.content, thinking=piece.thinking or None)
        return ChatChunk(model=model, created_at=created_at(), message=message, done=False)
    return _chat_final(model, piece.final, MessageOut(content=piece.content, thinking=piece.thinking or None))


def _chat_final(model: str, final: Final, message: MessageOut) -> ChatChunk:
    message.tool_calls = final.tool_calls()
    return ChatChunk(
        model=model,
        created_at=created_at(),
        message=message,
        done=True,
        done_reason=final.done_reason,
        **final.timings.model_dump(),
    )


def _generate_line(model: str, piece: Piece) -> GenerateChunk | None:
    if piece.final is None and not (piece.content or piece.thinking):
        return None
    fields: dict[str, Any] = {"done": False}
    if piece.final is not None:
        fields = {"done": True, "done_reason": piece.final.done_reason, **piece.final.timings.model_dump()}
    thinking = piece.thinking or None
    return GenerateChunk(
        model=model, created_at=created_at(), response=piece.content, thinking=thinking, **fields
    )


def _loaded(model: str, chat: bool) -> Response:
    """An empty request only asks to load the model, which is always loaded."""
    out: dict[str, Any] = {"model": model, "created_at": created_at(), "done": True, "done_reason": "load"}
    out.update({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})
    return JSONResponse(out)


def _stream(chunks: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(chunks, media_type=NDJSON)


def add_ollama_routes(app: FastAPI, state: ServerState, chat: ChatHandler) -> None:
    tm = state.tm
    generator = OllamaGenerator(tm, chat, CompletionsHandler(tm, state.served_names))

    @app.post("/api/chat")
    async def api_chat(request: Request) -> Response:
        req = await json_body(ChatRequest, request)
        if not req.messages:
            check_model(model_name(req.model), state.served_names)
            return _loaded(req.model, chat=True)
        native, plan = await tm.run_blocking(generator.plan_chat, req)
        pieces = await generator.run(native, plan, request)
        if req.stream:
            return _stream(ndjson_lines(pieces, lambda p: _chat_line(req.model, p)))
        final = await collect(pieces)
        message = MessageOut(content=final.parts.content or "", thinking=final.parts.reasoning_content)
        return _json(_chat_final(req.model, final, message))

    @app.post("/api/generate")
    async def api_generate(request: Request) -> Response:
        req = await json_body(GenerateRequest, request)
        if not req.prompt:
            check_model(model_name(req.model), state.served_names)
            return _loaded(req.model, chat=False)
        native, plan = await tm.run_blocking(generator.plan_generate, req)
        pieces = await generator.run(native, plan, request)
        if req.stream:
            return _stream(ndjson_lines(pieces, lambda p: _generate_line(req.model, p)))
        final = await collect(pieces)
        whole = Piece(
            content=final.parts.content or "", thinking=final.parts.reasoning_content or "", final=final
        )
        body = _generate_line(req.model, whole)
        assert body is not None
        return _json(body)

    _add_model_routes(app, state)


def _add_model_routes(app: FastAPI, state: ServerState) -> None:
    tm = state.tm

    @app.post("/api/embed")
    async def api_embed(request: Request) -> Response:
        start = time.perf_counter_ns()
        req = await json_body(EmbedRequest, request)
        check_model(model_name(req.model), state.served_names)
        texts = [req.input] if isinstance(req.input, str) else req.input
        items = [make_item(t, truncate=-1 if req.truncate else None) for t in texts]
        outputs = await scoring.embed(tm, items, req.dimensions, request)
        # Ollama's embeddings are unit vectors, whatever the model's own pooling normalises.
        vectors = [np.asarray(o["embedding"], dtype=np.float32) for o in outputs]
        body = {
            "model": req.model,
            "embeddings": [v / max(float(np.linalg.norm(v)), 1e-12) for v in vectors],
            "total_duration": time.perf_counter_ns() - start,
            "load_duration": 0,
            "prompt_eval_count": sum(o["meta_info"]["prompt_tokens"] for o in outputs),
        }
        return Response(orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json")

    @app.get("/api/tags")
    async def api_tags() -> Response:
        return _json(TagsResponse(models=[await tm.run_blocking(models.model_entry, tm)]))

    @app.post("/api/show")
    async def api_show(request: Request) -> Response:
        req = await json_body(ShowRequest, request)
        check_model(model_name(req.model), state.served_names)
        return _json(await tm.run_blocking(models.show, tm))

    @app.get("/api/version")
    async def api_version() -> Response:
        return _json(VersionResponse(version=models.version()))
