"""The Responses routes (OpenAI's names): POST /v1/responses, GET and DELETE /v1/responses/{id},
POST /v1/responses/{id}/cancel, GET /v1/responses/{id}/input_items. Errors are OpenAI's envelope."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import Response, StreamingResponse

from radixserve.entrypoints.http_guards import json_body
from radixserve.entrypoints.openai.serving_common import in_band_errors
from radixserve.entrypoints.responses.events import Event
from radixserve.entrypoints.responses.protocol import DeletedResponse, InputItemList, ResponsesRequest
from radixserve.entrypoints.responses.serving import ResponsesHandler

MAX_LIST_LIMIT = 100


def sse_event(event: Event) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + json.dumps(event).encode() + b"\n\n"


def json_answer(data: object) -> Response:
    """ASCII JSON from the stdlib encoder: a response echoes request fields (tools, schemas,
    metadata), which may hold integers past 64 bits or lone surrogates that orjson and
    Starlette's UTF-8 JSONResponse cannot encode."""
    return Response(json.dumps(data).encode(), media_type="application/json")


def responses_sse(events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
    """Failures inside a run are response.failed events already; what is left (the store failing,
    a bug) is said in-band as an `error` event numbered after the last one sent, the status being
    sent (the streaming routes' one policy, serving_common.in_band_errors)."""
    last_seq = -1

    async def chunks() -> AsyncIterator[bytes]:
        nonlocal last_seq
        async for event in events:
            last_seq = event["sequence_number"]
            yield sse_event(event)

    def error_chunk(status: int, message: str) -> bytes:
        code = "server_error" if status >= 500 else None
        error = {"type": "error", "code": code, "message": message, "param": None}
        return sse_event({**error, "sequence_number": last_seq + 1})

    return in_band_errors(chunks(), error_chunk, "a Responses stream")


def _sse(events: AsyncIterator[Event]) -> StreamingResponse:
    return StreamingResponse(
        responses_sse(events), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


def add_responses_routes(app: FastAPI, handler: ResponsesHandler) -> None:
    @app.post("/v1/responses")
    async def v1_responses(request: Request) -> Response:
        req = await json_body(ResponsesRequest, request)
        if req.background:
            job = await handler.start_background(req)
            if req.stream:
                return _sse(job.log.follow(-1))
            return json_answer(job.run.dump())
        if req.stream:
            return _sse(await handler.stream(req, request))
        return json_answer((await handler.create(req, request)).model_dump(mode="json"))

    @app.get("/v1/responses/{response_id}")
    async def v1_response(
        response_id: str, stream: bool = False, starting_after: int = Query(default=-1, ge=-1)
    ) -> Response:
        if stream:
            return _sse(await handler.replay(response_id, starting_after))
        return json_answer(await handler.retrieve(response_id))

    @app.delete("/v1/responses/{response_id}")
    async def v1_delete_response(response_id: str) -> Response:
        await handler.delete(response_id)
        return json_answer(DeletedResponse(id=response_id).model_dump())

    @app.post("/v1/responses/{response_id}/cancel")
    async def v1_cancel_response(response_id: str) -> Response:
        return json_answer(await handler.cancel(response_id))

    @app.get("/v1/responses/{response_id}/input_items")
    async def v1_response_input_items(
        response_id: str,
        after: str | None = None,
        limit: int = Query(default=20, ge=1, le=MAX_LIST_LIMIT),
        order: Literal["asc", "desc"] = "desc",
    ) -> Response:
        items = await handler.input_items(response_id)
        return json_answer(page(items, after, limit, order).model_dump())


def page(items: list[dict], after: str | None, limit: int, order: str) -> InputItemList:
    """One page of a cursor list, OpenAI's way: `after` is the id of the last item seen."""
    ordered = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise ValueError(f"after: no input item {after!r} in this response.")
        ordered = ordered[ids.index(after) + 1 :]
    data = ordered[:limit]
    return InputItemList.of(data, [item["id"] for item in data], len(ordered) > limit)
