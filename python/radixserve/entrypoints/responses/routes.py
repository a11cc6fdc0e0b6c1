"""The Responses routes (OpenAI's names): POST /v1/responses, GET and DELETE /v1/responses/{id},
POST /v1/responses/{id}/cancel, GET /v1/responses/{id}/input_items. Errors are OpenAI's envelope."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import Response, StreamingResponse

from radixserve.entrypoints.http_guards import error_response, json_body
from radixserve.entrypoints.openai.serving_common import internal_error_message
from radixserve.entrypoints.responses.events import Event
from radixserve.entrypoints.responses.protocol import DeletedResponse, InputItemList, ResponsesRequest
from radixserve.entrypoints.responses.serving import ResponseNotFoundError, ResponsesHandler
from radixserve.managers.errors import ClientDisconnected, RequestAbortedError

logger = logging.getLogger(__name__)

MAX_LIST_LIMIT = 100


def sse_event(event: Event) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + json.dumps(event).encode() + b"\n\n"


def json_answer(data: object) -> Response:
    """ASCII JSON from the stdlib encoder: a response echoes request fields (tools, schemas,
    metadata), which may hold integers past 64 bits or lone surrogates that orjson and
    Starlette's UTF-8 JSONResponse cannot encode."""
    return Response(json.dumps(data).encode(), media_type="application/json")


async def responses_sse(events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
    """Failures inside a run are response.failed events already; what is left (the store failing,
    a bug) is said in-band as an `error` event, the status being sent."""
    seq = -1
    try:
        async for event in events:
            seq = event["sequence_number"]
            yield sse_event(event)
    except ClientDisconnected:
        return
    except (ValueError, RequestAbortedError) as exc:
        yield sse_event(
            {"type": "error", "code": None, "message": str(exc), "param": None, "sequence_number": seq + 1}
        )
    except Exception as exc:
        logger.exception("Unhandled %s in a Responses stream", type(exc).__name__)
        message = internal_error_message(exc)
        yield sse_event(
            {
                "type": "error",
                "code": "server_error",
                "message": message,
                "param": None,
                "sequence_number": seq + 1,
            }
        )


def _sse(events: AsyncIterator[Event]) -> StreamingResponse:
    return StreamingResponse(
        responses_sse(events), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


def _not_found(exc: ResponseNotFoundError) -> Response:
    return error_response(404, str(exc), "not_found")


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
        try:
            if stream:
                return _sse(await handler.replay(response_id, starting_after))
            return json_answer(await handler.retrieve(response_id))
        except ResponseNotFoundError as exc:
            return _not_found(exc)

    @app.delete("/v1/responses/{response_id}")
    async def v1_delete_response(response_id: str) -> Response:
        try:
            await handler.delete(response_id)
        except ResponseNotFoundError as exc:
            return _not_found(exc)
        return json_answer(DeletedResponse(id=response_id).model_dump())

    @app.post("/v1/responses/{response_id}/cancel")
    async def v1_cancel_response(response_id: str) -> Response:
        try:
            return json_answer(await handler.cancel(response_id))
        except ResponseNotFoundError as exc:
            return _not_found(exc)

    @app.get("/v1/responses/{response_id}/input_items")
    async def v1_response_input_items(
        response_id: str,
        after: str | None = None,
        limit: int = Query(default=20, ge=1, le=MAX_LIST_LIMIT),
        order: Literal["asc", "desc"] = "desc",
    ) -> Response:
        try:
            items = await handler.input_items(response_id)
        except ResponseNotFoundError as exc:
            return _not_found(exc)
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
    return InputItemList(
        data=data,
        first_id=data[0]["id"] if data else None,
        last_id=data[-1]["id"] if data else None,
        has_more=len(ordered) > limit,
    )
