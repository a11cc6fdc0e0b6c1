"""The Files and Batch routes (OpenAI's names): POST/GET /v1/files, GET/DELETE /v1/files/{id},
GET /v1/files/{id}/content, POST/GET /v1/batches, GET /v1/batches/{id}, POST
/v1/batches/{id}/cancel. Errors are OpenAI's envelope; unknown ids are 404."""

from __future__ import annotations

from typing import Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import Response

from radixserve.entrypoints.batch.expiry import form_expires_after
from radixserve.entrypoints.batch.multipart import parse_form
from radixserve.entrypoints.batch.protocol import BatchCreateRequest, FileDeleted
from radixserve.entrypoints.batch.service import BatchService
from radixserve.entrypoints.http_guards import json_body, read_body
from radixserve.entrypoints.responses.routes import json_answer
from radixserve.managers.input_validation import InvalidRequestError

MAX_FILE_LIST = 10_000  # OpenAI's largest page of files
MAX_BATCH_LIST = 100


def add_batch_routes(app: FastAPI, service: BatchService) -> None:
    _add_file_routes(app, service)
    _add_batches_routes(app, service)


def _add_file_routes(app: FastAPI, service: BatchService) -> None:
    @app.post("/v1/files")
    async def v1_upload_file(request: Request) -> Response:
        body = await read_body(request, request.app.state.max_body_bytes)
        form = parse_form(request.headers.get("content-type", ""), body)
        file, purpose = form.get("file"), form.get("purpose")
        if file is None or file.filename is None:
            raise InvalidRequestError("file: a file part (with a filename) is required.")
        if purpose is None:
            raise InvalidRequestError("purpose: required ('batch').")
        expires_s = form_expires_after(form)
        purpose_text = purpose.value.decode("utf-8", "replace")
        return json_answer(await service.upload(file.filename, purpose_text, file.value, expires_s))

    @app.get("/v1/files")
    async def v1_files(
        purpose: str | None = None,
        after: str | None = None,
        limit: int = Query(default=MAX_FILE_LIST, ge=1, le=MAX_FILE_LIST),
        order: Literal["asc", "desc"] = "desc",
    ) -> Response:
        return json_answer((await service.files(purpose, after, limit, order)).model_dump(mode="json"))

    @app.get("/v1/files/{file_id}")
    async def v1_file(file_id: str) -> Response:
        return json_answer(await service.file(file_id))

    @app.delete("/v1/files/{file_id}")
    async def v1_delete_file(file_id: str) -> Response:
        await service.delete_file(file_id)
        return json_answer(FileDeleted(id=file_id).model_dump())

    @app.get("/v1/files/{file_id}/content")
    async def v1_file_content(file_id: str) -> Response:
        return Response(await service.content(file_id), media_type="application/octet-stream")


def _add_batches_routes(app: FastAPI, service: BatchService) -> None:
    @app.post("/v1/batches")
    async def v1_create_batch(request: Request) -> Response:
        req = await json_body(BatchCreateRequest, request)
        return json_answer(await service.create(req))

    @app.get("/v1/batches")
    async def v1_batches(
        after: str | None = None, limit: int = Query(default=20, ge=1, le=MAX_BATCH_LIST)
    ) -> Response:
        return json_answer((await service.batches(after, limit)).model_dump(mode="json"))

    @app.get("/v1/batches/{batch_id}")
    async def v1_batch(batch_id: str) -> Response:
        return json_answer(await service.batch(batch_id))

    @app.post("/v1/batches/{batch_id}/cancel")
    async def v1_cancel_batch(batch_id: str) -> Response:
        return json_answer(await service.cancel(batch_id))
