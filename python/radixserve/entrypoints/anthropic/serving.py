"""POST /v1/messages and /v1/messages/count_tokens: Anthropic requests run as chat requests
(translate.py), answered as Anthropic messages or its event stream (stream.py). Errors leave in
Anthropic's shape (error_dialects.py)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from radixserve.entrypoints.anthropic.protocol import (
    CountTokensRequest,
    CountTokensResponse,
    MessagesRequest,
    MessagesResponse,
    Usage,
)
from radixserve.entrypoints.anthropic.stream import anthropic_sse, message_events, usage_fields
from radixserve.entrypoints.anthropic.translate import content_blocks, stop_reason, to_chat_request
from radixserve.entrypoints.chat_steps import chat_steps
from radixserve.entrypoints.http_guards import json_body
from radixserve.entrypoints.openai.chat_tools import ChatPlan, split_output
from radixserve.entrypoints.openai.serving_chat import ChatHandler
from radixserve.entrypoints.openai.serving_common import raise_if_failed
from radixserve.managers.generate_request import GenerateReqInput
from radixserve.managers.tokenizer_manager import ClientRequest, TokenizerManager


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


class MessagesHandler:
    def __init__(self, tm: TokenizerManager, chat: ChatHandler) -> None:
        self.tm = tm
        self.chat = chat

    def plan(self, req: CountTokensRequest, stream: bool) -> tuple[GenerateReqInput, ChatPlan]:
        """Runs on the tokenizer threads (the template and the tokenizer are CPU work)."""
        chat_req = to_chat_request(req, self.tm.server_args.reasoning_parser)
        return self.chat.plan(chat_req, stream)

    async def create(self, req: MessagesRequest, request: ClientRequest | None) -> MessagesResponse:
        native, plan = await self.tm.run_blocking(self.plan, req, False)
        out = await self.tm.generate(native, request)
        assert isinstance(out, dict)  # one prompt, n == 1
        raise_if_failed(out)
        parts = split_output(out["text"], plan)
        reason, sequence = stop_reason(out, bool(parts.tool_calls))
        return MessagesResponse(
            id=new_message_id(),
            model=req.model,
            content=content_blocks(parts),
            stop_reason=reason,
            stop_sequence=sequence,
            usage=Usage(**usage_fields(out["meta_info"])),
        )

    async def stream(self, req: MessagesRequest, request: ClientRequest | None) -> AsyncIterator[bytes]:
        native, plan = await self.tm.run_blocking(self.plan, req, True)
        steps = await chat_steps(self.tm, native, plan, request)
        return anthropic_sse(message_events(steps, new_message_id(), req.model))

    async def count_tokens(self, req: CountTokensRequest) -> CountTokensResponse:
        native, _ = await self.tm.run_blocking(self.plan, req, False)
        return CountTokensResponse(input_tokens=len(native.input_ids or []))


def add_anthropic_routes(app: FastAPI, tm: TokenizerManager, chat: ChatHandler) -> None:
    handler = MessagesHandler(tm, chat)

    @app.post("/v1/messages")
    async def v1_messages(request: Request) -> Response:
        req = await json_body(MessagesRequest, request)
        if req.stream:
            chunks = await handler.stream(req, request)
            return StreamingResponse(
                chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        return JSONResponse((await handler.create(req, request)).model_dump())

    @app.post("/v1/messages/count_tokens")
    async def v1_messages_count_tokens(request: Request) -> Response:
        req = await json_body(CountTokensRequest, request)
        return JSONResponse((await handler.count_tokens(req)).model_dump())
