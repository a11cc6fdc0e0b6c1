"""Runs batches in the server's idle capacity, and resumes them after a restart.

Every line is submitted with BATCH_PRIORITY (lines.py) through the route's own handler. At most
`max_concurrent` lines of all batches together are in flight (--batch-max-concurrent-requests),
so a batch never floods the waiting queue; with --enable-priority-scheduling the scheduler also
serves interactive requests first and preempts batch lines for them (docs/http_api.md, "Batch").

A batch's object is kept in `live` while it runs (GET answers from there) and written to the
store with each finished line. When the server stops, its tasks are cancelled without touching
the store: the lines without a result run again at the next start (`start`).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any

from radixserve.entrypoints.batch.lines import RETRY_STATUSES, LineRunner, output_line, unrun_line
from radixserve.entrypoints.batch.protocol import BatchError, BatchErrors, BatchUsage, file_object
from radixserve.entrypoints.batch.store import BatchStore
from radixserve.entrypoints.openai.serving_common import internal_error_message
from radixserve.entrypoints.sqlite_store import dumps

logger = logging.getLogger(__name__)

RETRY_MAX_S = 5.0  # the longest wait before a refused (503) line is tried again
Batch = dict[str, Any]
Pending = Iterator[tuple[int, dict[str, Any]]]


class BatchRunner:
    def __init__(
        self,
        store: BatchStore,
        lines: LineRunner,
        max_concurrent: int,
        clock: Callable[[], float] = time.time,  # a test's fake clock (expiries), shared with the service
    ) -> None:
        self.store = store
        self.lines = lines
        self.max_concurrent = max_concurrent
        self.clock = clock
        self.live: dict[str, Batch] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._slots: asyncio.Semaphore | None = None  # made on the serving loop, in start()

    async def start(self) -> None:
        """On the serving loop, once the TokenizerManager runs: resume what was running."""
        self._slots = asyncio.Semaphore(self.max_concurrent)
        for batch in await self.store.run(self.store.db.active_batches):
            logger.info("Resuming batch %s (%s)", batch["id"], batch["status"])
            self.launch(batch)

    async def close(self) -> None:
        """Stop every batch where it is; the store keeps what is needed to resume it."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def launch(self, batch: Batch) -> None:
        self.live[batch["id"]] = batch
        self._tasks[batch["id"]] = asyncio.create_task(self._drive(batch))

    async def cancel(self, batch_id: str) -> Batch:
        """Mark the batch cancelling (durably: a restart finishes the cancel), stop its lines in
        flight (aborted in the scheduler), then write what finished to its files."""
        batch, task = self.live[batch_id], self._tasks.get(batch_id)
        # Finalizing: the lines are all done and the files being written; let it complete.
        if batch["status"] in ("validating", "in_progress"):
            batch.update(status="cancelling", cancelling_at=int(self.clock()))
            await self.store.run(self.store.db.update_batch, _snapshot(batch))
            if task is not None:
                task.cancel()
        if task is not None:
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                if not task.cancelled():
                    raise  # this call itself was cancelled
            if task.cancelled():  # cancelled before it started: _drive never ran
                self._tasks.pop(batch_id, None)
                await self._finish(batch, "cancelled")
                self.live.pop(batch_id, None)
        return batch

    async def _drive(self, batch: Batch) -> None:
        try:
            if batch["status"] == "validating":
                batch.update(status="in_progress", in_progress_at=int(self.clock()))
                await self.store.run(self.store.db.update_batch, _snapshot(batch))
            if batch["status"] == "in_progress":
                expired = await self._run_lines(batch)
                await self._finish(batch, "expired" if expired else "completed")
            elif batch["status"] == "finalizing":
                await self._finish(batch, "completed")
            else:  # cancelling when the server stopped
                await self._finish(batch, "cancelled")
        except asyncio.CancelledError:
            if batch["status"] != "cancelling":
                raise  # the server is stopping: resumed at the next start
            await self._finish(batch, "cancelled")
        except Exception as exc:  # noqa: BLE001 - a bug or a failing store: this batch fails, not the server
            logger.exception("Batch %s failed", batch["id"])
            await self._fail(batch, internal_error_message(exc))
        finally:
            self._tasks.pop(batch["id"], None)
            self.live.pop(batch["id"], None)

    async def _run_lines(self, batch: Batch) -> bool:
        """Run the lines without a result, `max_concurrent` at a time; True if the batch expired."""
        pending = iter(await self.store.run(self.store.db.pending_lines, batch["id"]))
        expired = False

        async def worker() -> None:
            nonlocal expired
            for line, request in pending:  # one iterator shared by the workers: each line runs once
                if self.clock() >= batch["expires_at"]:
                    expired = True
                    return
                await self._line(batch, line, request)

        async with asyncio.TaskGroup() as group:
            for _ in range(self.max_concurrent):
                group.create_task(worker())
        return expired

    async def _line(self, batch: Batch, line: int, request: dict[str, Any]) -> None:
        assert self._slots is not None, "start() first"
        wait_s = 0.25
        async with self._slots:
            outcome = await self.lines.run(request["url"], request["body"])
            while outcome.status_code in RETRY_STATUSES:  # refused for now: not the line's fault
                await asyncio.sleep(wait_s)
                wait_s = min(2 * wait_s, RETRY_MAX_S)
                outcome = await self.lines.run(request["url"], request["body"])
        batch["request_counts"]["completed" if outcome.ok else "failed"] += 1
        if outcome.ok:
            add_usage(batch, outcome.body.get("usage") or {})
        result = output_line(request["custom_id"], outcome)
        await self.store.run(self.store.db.finish_line, _snapshot(batch), line, result, not outcome.ok)

    async def _finish(self, batch: Batch, final: str) -> None:
        """Write the output and error files, then the batch's last state. Lines that never ran
        (expired, cancelled) go to the error file with code batch_<final>, counted as failed."""
        db, now = self.store.db, int(self.clock())
        if final == "completed" and batch["status"] != "finalizing":
            batch.update(status="finalizing", finalizing_at=now)
            await self.store.run(db.update_batch, _snapshot(batch))
        unrun = [
            unrun_line(req["custom_id"], f"batch_{final}", f"The batch was {final} before this request ran.")
            for _, req in await self.store.run(db.pending_lines, batch["id"])
        ]
        # Built apart and applied last: a _finish interrupted before its write counts nothing twice.
        ended = _snapshot(batch)
        ended["request_counts"]["failed"] += len(unrun)
        files = []
        for key, failed, name in (("output_file_id", False, "output"), ("error_file_id", True, "error")):
            content = "".join(f"{text}\n" for text in await self.store.run(db.results, batch["id"], failed))
            data = content.encode() + (b"".join(_jsonl(u) for u in unrun) if failed else b"")
            if data:
                file_id, filename = f"file-{secrets.token_hex(12)}", f"{batch['id']}_{name}.jsonl"
                file = file_object(file_id, filename, "batch_output", data, now)
                files.append((file, data))
                ended[key] = file["id"]
        ended.update({"status": final, f"{final}_at": now})
        await self.store.run(db.finalize, ended, files)
        batch.update(ended)

    async def _fail(self, batch: Batch, message: str) -> None:
        error = BatchError(code="server_error", message=message)
        batch.update(
            status="failed", failed_at=int(self.clock()), errors=BatchErrors(data=[error]).model_dump()
        )
        try:
            await self.store.run(self.store.db.update_batch, _snapshot(batch))
        except Exception:  # noqa: BLE001 - the store itself failed: said in the log, kept in memory
            logger.exception("Could not store the failure of batch %s", batch["id"])


def _snapshot(batch: Batch) -> Batch:
    """What the store thread writes: a copy, since the loop goes on changing the live object."""
    return {
        **batch,
        "request_counts": dict(batch["request_counts"]),
        "usage": copy.deepcopy(batch.get("usage")),
    }


def add_usage(batch: Batch, line: dict[str, Any]) -> None:
    """Add one completed line's usage (chat/completions' or embeddings' field names) to the batch's
    (the Responses API's names, as OpenAI's batch object has them)."""
    total = batch.get("usage") or BatchUsage().model_dump()
    prompt, completion = line.get("prompt_tokens", 0), line.get("completion_tokens", 0)
    total["input_tokens"] += prompt
    total["output_tokens"] += completion
    total["total_tokens"] += prompt + completion
    cached = (line.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    total["input_tokens_details"]["cached_tokens"] += cached
    reasoning = (line.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
    total["output_tokens_details"]["reasoning_tokens"] += reasoning
    batch["usage"] = total


def _jsonl(value: dict[str, Any]) -> bytes:
    return (dumps(value) + "\n").encode()
