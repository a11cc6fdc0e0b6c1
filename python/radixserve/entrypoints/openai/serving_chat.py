"""POST /v1/chat/completions: chat template -> token ids -> native generate request."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from radixserve.entrypoints.openai.chat_images import chat_images
from radixserve.entrypoints.openai.chat_tools import (
    ChatPlan,
    ChoiceStream,
    choice_reasoning_tokens,
    plan_chat,
    split_output,
)
from radixserve.entrypoints.openai.protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    ChatTopLogprob,
    DeltaMessage,
    random_id,
)
from radixserve.entrypoints.openai.serving_common import (
    choice_hidden_states,
    finish_reason,
    first_output_checked,
    native_fields,
    raise_if_failed,
    sampling_params,
    sse,
    sse_errors,
    usage,
)
from radixserve.managers.generate_request import GenerateReqInput
from radixserve.managers.tokenizer_manager import ClientRequest, InvalidRequestError, TokenizerManager


class ChatHandler:
    def __init__(self, tm: TokenizerManager, served_names: tuple[str, ...]) -> None:
        self.tm = tm
        self.served_names = served_names

    def to_native(self, req: ChatCompletionRequest, stream: bool) -> GenerateReqInput:
        return self.plan(req, stream)[0]

    def plan(self, req: ChatCompletionRequest, stream: bool) -> tuple[GenerateReqInput, ChatPlan]:
        """Runs on the tokenizer threads (the template and the tokenizer are CPU work)."""
        fields = native_fields(req, self.served_names, stream)
        if req.top_logprobs is not None and not req.logprobs:
            raise InvalidRequestError("top_logprobs is only allowed when logprobs is true.")
        images = chat_images(req, self.tm.limits.image_refusal)
        # Tools (prompt + forcing grammar) and reasoning are decided in chat_tools.
        prompt, plan = plan_chat(req, self.tm.tokenizer, self.tm.server_args)
        # The template already holds BOS and friends; adding them again would duplicate them.
        input_ids = self.tm.tokenize(prompt, add_special_tokens=False)
        max_new = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_new is None:
            # OpenAI's chat semantics: no limit but the context (the native default is 128 tokens).
            max_new = max(self.tm.context_len - len(input_ids), 0)
        params = {**sampling_params(req, max_new), **plan.sampling_overrides}
        native = GenerateReqInput(
            input_ids=input_ids,
            sampling_params=params,
            return_logprob=req.logprobs,
            top_logprobs_num=req.top_logprobs or 0,
            image_data=images,
            **fields,
        )
        return native, plan

    async def create(
        self, req: ChatCompletionRequest, request: ClientRequest | None, priority: int | None = None
    ) -> ChatCompletionResponse:
        """`priority`: set by the server's own callers (a batch line runs below every client)."""
        native, plan = await self.tm.run_blocking(self.plan, req, False)
        if priority is not None:
            native.priority = priority
        result = await self.tm.generate(native, request)
        outputs = [result] if isinstance(result, dict) else result
        choices = []
        for i, out in enumerate(outputs):
            raise_if_failed(out)
            reason, matched = finish_reason(out)
            parts = split_output(out["text"], plan)
            if parts.tool_calls and reason == "stop":
                reason = "tool_calls"
            choices.append(
                ChatCompletionChoice(
                    index=i,
                    message=ChatResponseMessage(
                        content=parts.content,
                        reasoning_content=parts.reasoning_content,
                        tool_calls=parts.tool_calls,
                    ),
                    logprobs=self._logprobs(out) if req.logprobs else None,
                    finish_reason=reason,
                    matched_stop=matched,
                    hidden_states=choice_hidden_states(out, req.return_hidden_states),
                )
            )
        model = req.model or self.served_names[0]
        return ChatCompletionResponse(
            id=random_id("chatcmpl"),
            model=model,
            choices=choices,
            usage=usage(outputs, req.n, self._reasoning_tokens(outputs, plan)),
        )

    async def stream(self, req: ChatCompletionRequest, request: ClientRequest | None) -> AsyncIterator[bytes]:
        native, plan = await self.tm.run_blocking(self.plan, req, True)
        # Validates and waits for the first output: a 400 or a refusal (503) is answered as such.
        outputs = await first_output_checked(await self.tm.stream(native, request))
        return sse_errors(self._stream_chunks(req, outputs, plan))

    async def _stream_chunks(
        self, req: ChatCompletionRequest, outputs: AsyncIterator[dict[str, Any]], plan: ChatPlan
    ) -> AsyncIterator[bytes]:
        rid, model = random_id("chatcmpl"), req.model or self.served_names[0]

        def chunk(choice: ChatStreamChoice) -> bytes:
            return sse(ChatCompletionStreamResponse(id=rid, model=model, choices=[choice]))

        streams: dict[int, ChoiceStream] = {}  # index -> its reasoning/content/tool-call splitter
        lp_sent: dict[int, int] = {}  # index -> logprob entries already streamed
        finals: dict[int, dict[str, Any]] = {}
        async for out in outputs:
            idx = out["index"]
            if idx not in streams:  # the first chunk of each choice announces the role
                streams[idx] = ChoiceStream(plan)
                yield chunk(ChatStreamChoice(index=idx, delta=DeltaMessage(role="assistant", content="")))
            logprobs = None
            if req.logprobs:
                logprobs = self._logprobs(out, start=lp_sent.get(idx, 0))
                lp_sent[idx] = lp_sent.get(idx, 0) + len(logprobs.content)
            reason, matched = finish_reason(out)
            delta = streams[idx].feed(out["text"], final=reason is not None)
            if reason is not None:
                finals[idx] = out
                if reason == "stop" and streams[idx].has_tool_calls:
                    reason = "tool_calls"
            elif delta is None:
                continue
            choice = ChatStreamChoice(
                index=idx,
                delta=delta or DeltaMessage(),
                logprobs=logprobs,
                finish_reason=reason,
                matched_stop=matched,
                hidden_states=choice_hidden_states(out, req.return_hidden_states),
            )
            yield chunk(choice)
            raise_if_failed(out)  # after its finish_reason "abort" chunk, as in completions
        if req.stream_options is not None and req.stream_options.include_usage:
            ordered = [finals[i] for i in sorted(finals)]
            counted = usage(ordered, req.n, self._reasoning_tokens(ordered, plan))
            final = ChatCompletionStreamResponse(id=rid, model=model, choices=[], usage=counted)
            yield sse(final)

    def _reasoning_tokens(self, outputs: list[dict[str, Any]], plan: ChatPlan) -> int | None:
        if plan.reasoning_parser is None:
            return None
        return sum(choice_reasoning_tokens(out, plan, self.tm.tokenizer) for out in outputs)

    def _logprobs(self, out: dict[str, Any], start: int = 0) -> ChatLogprobs:
        meta = out["meta_info"]
        tokens = meta.get("output_token_logprobs", [])[start:]
        tops = meta.get("output_top_logprobs", [])[start:]
        content = []
        for i, (lp, tok, text) in enumerate(tokens):
            top = tops[i] if i < len(tops) else None
            content.append(
                ChatTokenLogprob(
                    token=self._text(tok, text),
                    logprob=lp,
                    bytes=list(self._text(tok, text).encode("utf-8")),
                    top_logprobs=[
                        ChatTopLogprob(token=self._text(t, tt), logprob=tl) for tl, t, tt in (top or [])
                    ],
                )
            )
        return ChatLogprobs(content=content)

    def _text(self, tok: int, text: str | None) -> str:
        return text if text is not None else self.tm.detokenize([tok])
