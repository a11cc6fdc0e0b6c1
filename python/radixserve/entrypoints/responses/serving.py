"""The Responses handler: a request runs as a chat request (translate.py) whose steps become
Responses events (events.py, run.py); stored responses live in the store (store.py).

- Foreground (background false): the answer, or its event stream, is produced while the client
  waits; with store true the finished response is stored before its last event is sent.
- Background: stored at once as queued, then run by a task of this process; its events are kept
  (EventLog) for GET ?stream=true&starting_after=N, and stored with the response when it ends.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from radixserve.entrypoints.chat_steps import ChatStep, chat_steps
from radixserve.entrypoints.openai.chat_tools import ChatPlan
from radixserve.entrypoints.openai.serving_chat import ChatHandler
from radixserve.entrypoints.responses.events import Event, numbered
from radixserve.entrypoints.responses.protocol import ResponseObject, ResponsesRequest
from radixserve.entrypoints.responses.run import EventLog, ResponseRun, Steps
from radixserve.entrypoints.responses.store import ResponseStore
from radixserve.entrypoints.responses.translate import input_items, new_id, parse_items, to_chat_request
from radixserve.managers.errors import StoredObjectNotFound
from radixserve.managers.generate_request import GenerateReqInput
from radixserve.managers.input_validation import InvalidRequestError
from radixserve.managers.tokenizer_manager import ClientRequest, TokenizerManager


class ResponseNotFoundError(StoredObjectNotFound):
    """No stored response has this id (HTTP 404)."""


@dataclass
class Job:
    run: ResponseRun
    log: EventLog
    task: asyncio.Task[None] | None = None


class ResponsesHandler:
    def __init__(self, tm: TokenizerManager, chat: ChatHandler, store: ResponseStore) -> None:
        self.tm = tm
        self.chat = chat
        self.store = store
        self.db = store.db
        self.jobs: dict[str, Job] = {}  # background responses still running

    # ------------------------------------------------------------------ create
    def _plan(
        self, req: ResponsesRequest, history: list[dict[str, Any]], rid: str
    ) -> tuple[GenerateReqInput, ChatPlan]:
        """Runs on the tokenizer threads (the template and the tokenizer are CPU work)."""
        chat_req = to_chat_request(req, parse_items(history), self.tm.server_args.reasoning_parser)
        chat_req.rid = rid
        return self.chat.plan(chat_req, True)

    async def prepare(self, req: ResponsesRequest) -> tuple[ResponseRun, GenerateReqInput, ChatPlan]:
        """Everything that can refuse the request (400, 404) happens here, before any answer."""
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            found = await self.store.run(self.db.history, req.previous_response_id)
            if found is None:
                raise InvalidRequestError(
                    f"previous_response_id: no stored response {req.previous_response_id!r}."
                )
            history = found
        rid = new_id("resp")
        native, plan = await self.tm.run_blocking(self._plan, req, history, rid)
        run = ResponseRun(self._initial(req, rid), input_items(req), self.tm.abort_request)
        return run, native, plan

    def _initial(self, req: ResponsesRequest, rid: str) -> ResponseObject:
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
        choice = req.tool_choice if req.tool_choice is not None else "auto"
        return ResponseObject(
            id=rid,
            created_at=time.time(),
            status="queued" if req.background else "in_progress",
            background=req.background,
            instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            metadata=req.metadata or {},
            model=req.model or self.chat.served_names[0],
            parallel_tool_calls=req.parallel_tool_calls is not False,
            previous_response_id=req.previous_response_id,
            reasoning=req.reasoning.model_dump(exclude_none=True) if req.reasoning is not None else None,
            store=req.store,
            temperature=req.temperature,
            text=_text_config(req),
            tool_choice=choice if isinstance(choice, str) else choice.model_dump(),
            tools=tools,
            top_p=req.top_p,
            user=req.user,
        )

    def _steps(self, native: GenerateReqInput, plan: ChatPlan, request: ClientRequest | None) -> Steps:
        async def start() -> AsyncIterator[ChatStep]:
            return await chat_steps(self.tm, native, plan, request)

        return start

    async def create(self, req: ResponsesRequest, request: ClientRequest | None) -> ResponseObject:
        run, native, plan = await self.prepare(req)
        async for _ in run.events(self._steps(native, plan, request), in_band=False):
            pass
        if req.store:
            await self.store.run(self.db.put, run.dump(), run.input_items)
        return run.response

    async def stream(self, req: ResponsesRequest, request: ClientRequest | None) -> AsyncIterator[Event]:
        """The event stream; the request is submitted (and refusals raised) before it starts."""
        run, native, plan = await self.prepare(req)
        steps = await chat_steps(self.tm, native, plan, request)

        async def started() -> AsyncIterator[ChatStep]:
            return steps

        return numbered(self._stored_at_end(run, run.events(started, in_band=True), req.store))

    async def _stored_at_end(
        self, run: ResponseRun, events: AsyncIterator[Event], store: bool
    ) -> AsyncIterator[Event]:
        async for event in events:
            if store and event["type"] in ("response.completed", "response.incomplete", "response.failed"):
                await self.store.run(
                    self.db.put, run.dump(), run.input_items
                )  # retrievable once the client knows
            yield event

    # ------------------------------------------------------------------ background
    async def start_background(self, req: ResponsesRequest) -> Job:
        run, native, plan = await self.prepare(req)
        await self.store.run(self.db.put, run.dump(), run.input_items)
        job = Job(run, EventLog())
        self.jobs[run.rid] = job
        job.task = asyncio.create_task(self._run_job(job, self._steps(native, plan, None)))
        return job

    async def _run_job(self, job: Job, start: Steps) -> None:
        try:
            async for event in numbered(job.run.events(start, in_band=True)):
                job.log.append(event)
                if event["type"] == "response.in_progress":
                    await self.store.run(self.db.update, job.run.dump())
        finally:
            job.log.close()
            self.jobs.pop(job.run.rid, None)
            await self.store.run(self.db.update, job.run.dump(), job.log.events)

    async def cancel(self, rid: str) -> dict[str, Any]:
        stored = await self.retrieve(rid)
        if not stored.get("background"):
            raise InvalidRequestError("Only responses created with background true can be cancelled.")
        job = self.jobs.get(rid)
        if job is None:
            return stored  # already finished: cancelling changes nothing
        job.run.cancel()
        assert job.task is not None
        await asyncio.shield(job.task)
        return job.run.dump()

    # ------------------------------------------------------------------ stored responses
    async def retrieve(self, rid: str) -> dict[str, Any]:
        job = self.jobs.get(rid)
        if job is not None:
            return job.run.dump()
        found = await self.store.run(self.db.get, rid)
        if found is None:
            raise ResponseNotFoundError(f"No response with id {rid!r} is stored.")
        return found

    async def replay(self, rid: str, starting_after: int) -> AsyncIterator[Event]:
        """GET ?stream=true: a background response's events after `starting_after`."""
        stored = await self.retrieve(rid)
        if not stored.get("background"):
            raise InvalidRequestError("Only responses created with background true can be streamed again.")
        job = self.jobs.get(rid)
        if job is not None:
            return job.log.follow(starting_after)
        events = await self.store.run(self.db.events, rid)
        if events is None:  # it stopped with the server: only its final state is known
            events = [{"type": "response.failed", "response": stored, "sequence_number": 0}]
        return _from_list([e for e in events if e["sequence_number"] > starting_after])

    async def delete(self, rid: str) -> None:
        job = self.jobs.get(rid)
        if job is not None:
            await self.cancel(rid)
        if not await self.store.run(self.db.delete, rid):
            raise ResponseNotFoundError(f"No response with id {rid!r} is stored.")

    async def input_items(self, rid: str) -> list[dict[str, Any]]:
        items = await self.store.run(self.db.input_items, rid)
        if items is None:
            raise ResponseNotFoundError(f"No response with id {rid!r} is stored.")
        return items


def _text_config(req: ResponsesRequest) -> dict[str, Any]:
    if req.text is None or req.text.format is None:
        return {"format": {"type": "text"}}
    return req.text.model_dump(exclude_none=True, by_alias=True)


async def _from_list(events: list[Event]) -> AsyncIterator[Event]:
    for event in events:
        yield event
