"""What the Files and Batch routes do, apart from HTTP: every refusal is raised here (400 as a
ValueError, 404 as NotFoundError) before anything is stored."""

from __future__ import annotations

import secrets
from typing import Any

from radixserve.entrypoints.batch.expiry import DEFAULT_BATCH_FILE_EXPIRES_S
from radixserve.entrypoints.batch.jsonl import parse_batch_file, supported_endpoints
from radixserve.entrypoints.batch.protocol import (
    COMPLETION_WINDOW_S,
    BatchCreateRequest,
    BatchList,
    BatchObject,
    BatchRequestCounts,
    FileList,
    FileObject,
    file_object,
)
from radixserve.entrypoints.batch.runner import BatchRunner
from radixserve.entrypoints.batch.store import BatchStore
from radixserve.managers.errors import StoredObjectNotFound
from radixserve.managers.input_validation import InvalidRequestError


class NotFoundError(StoredObjectNotFound):
    """No file or batch has this id (HTTP 404)."""


class BatchService:
    def __init__(
        self,
        store: BatchStore,
        runner: BatchRunner,
        is_generation: bool,
        model: str,
    ) -> None:
        self.store = store
        self.db = store.db
        self.runner = runner
        self.is_generation = is_generation
        self.model = model
        self.clock = runner.clock  # one clock for creation times and expiries

    # ------------------------------------------------------------------ files
    async def upload(
        self, filename: str, purpose: str, content: bytes, expires_s: int | None = None
    ) -> dict[str, Any]:
        if purpose != "batch":
            raise InvalidRequestError(
                f"purpose: {purpose!r} is not accepted here; this server stores files with purpose 'batch'."
            )
        parse_batch_file(content, self.is_generation)  # refused now rather than when a batch runs
        expires_s = DEFAULT_BATCH_FILE_EXPIRES_S if expires_s is None else expires_s
        now = await self._purge_expired()
        file = file_object(f"file-{secrets.token_hex(12)}", filename, purpose, content, now, expires_s)
        await self.store.run(self.db.put_file, file, content)
        return file

    async def _purge_expired(self) -> int:
        """Delete the files past their expiry before any file is read or listed; the time now."""
        now = int(self.clock())
        await self.store.run(self.db.purge_expired, now)
        return now

    async def file(self, file_id: str) -> dict[str, Any]:
        await self._purge_expired()
        found = await self.store.run(self.db.get_file, file_id)
        if found is None:
            raise NotFoundError(f"No file with id {file_id!r}.")
        return found

    async def content(self, file_id: str) -> bytes:
        await self._purge_expired()
        found = await self.store.run(self.db.file_content, file_id)
        if found is None:
            raise NotFoundError(f"No file with id {file_id!r}.")
        return found

    async def delete_file(self, file_id: str) -> None:
        await self._purge_expired()
        if not await self.store.run(self.db.delete_file, file_id):
            raise NotFoundError(f"No file with id {file_id!r}.")

    async def files(self, purpose: str | None, after: str | None, limit: int, order: str) -> FileList:
        await self._purge_expired()
        data, more = await self.store.run(self.db.list_files, purpose, after, limit, order == "desc")
        files = [FileObject.model_validate(f) for f in data]
        return FileList.of(files, [f.id for f in files], more)

    # ------------------------------------------------------------------ batches
    async def create(self, req: BatchCreateRequest) -> dict[str, Any]:
        endpoints = supported_endpoints(self.is_generation)
        if req.endpoint not in endpoints:
            raise InvalidRequestError(
                f"endpoint: {req.endpoint!r} is not supported by this server's model; use one of "
                f"{', '.join(endpoints)}."
            )
        file = await self.file(req.input_file_id)
        if file["purpose"] != "batch":
            raise InvalidRequestError(
                f"input_file_id: file {req.input_file_id!r} has purpose {file['purpose']!r}, not 'batch'."
            )
        lines = parse_batch_file(await self.content(req.input_file_id), self.is_generation)
        for n, line in enumerate(lines, start=1):
            if line.url != req.endpoint:
                raise InvalidRequestError(
                    f"Line {n}: url {line.url!r} differs from the batch's endpoint {req.endpoint!r}."
                )
        now = int(self.clock())
        batch = BatchObject(
            id=f"batch_{secrets.token_hex(12)}",
            endpoint=req.endpoint,
            input_file_id=req.input_file_id,
            completion_window=req.completion_window,
            status="validating",
            created_at=now,
            expires_at=now + COMPLETION_WINDOW_S,
            request_counts=BatchRequestCounts(total=len(lines)),
            metadata=req.metadata,
            model=self.model,
        ).model_dump(mode="json")
        expiry = req.output_expires_after
        requests = [line.model_dump() for line in lines]
        await self.store.run(self.db.put_batch, batch, requests, expiry.seconds if expiry else None)
        self.runner.launch(batch)
        return dict(batch)

    async def batch(self, batch_id: str) -> dict[str, Any]:
        live = self.runner.live.get(batch_id)
        if live is not None:
            return dict(live)
        found = await self.store.run(self.db.get_batch, batch_id)
        if found is None:
            raise NotFoundError(f"No batch with id {batch_id!r}.")
        return found

    async def cancel(self, batch_id: str) -> dict[str, Any]:
        """A batch that already ended is returned as it is: cancelling changes nothing."""
        if batch_id in self.runner.live:
            return dict(await self.runner.cancel(batch_id))
        return await self.batch(batch_id)

    async def batches(self, after: str | None, limit: int) -> BatchList:
        data, more = await self.store.run(self.db.list_batches, after, limit)
        batches = [BatchObject.model_validate(self.runner.live.get(b["id"], b)) for b in data]
        return BatchList.of(batches, [b.id for b in batches], more)
