"""POST /v1/completions: OpenAI completion requests mapped onto the native generate request."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from radixserve.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
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


class CompletionsHandler:
    def __init__(self, tm: TokenizerManager, served_names: tuple[str, ...]) -> None:
        self.tm = tm
        self.served_names = served_names

    def to_native(self, req: CompletionRequest, stream: bool) -> GenerateReqInput:
        fields = native_fields(req, self.served_names, stream)
        if req.suffix:
            raise InvalidRequestError("suffix is not supported.")
        if req.best_of is not None and req.best_of != req.n:
            raise InvalidRequestError("best_of must equal n.")
        prompt = req.prompt
        if isinstance(prompt, list) and not prompt:
            raise InvalidRequestError("prompt must not be empty.")
        is_ids = isinstance(prompt, list) and isinstance(prompt[0], (int, list))
        return GenerateReqInput(
            text=None if is_ids else prompt,
            input_ids=prompt if is_ids else None,
            sampling_params=sampling_params(req, req.max_tokens),
            return_logprob=req.logprobs is not None,
            top_logprobs_num=req.logprobs or 0,
            logprob_start_len=0 if req.echo and req.logprobs is not None else -1,
            **fields,
        )

    def _prompt_texts(self, obj: GenerateReqInput) -> list[str]:
        if obj.text is not None:
            return [obj.text] if isinstance(obj.text, str) else list(obj.text)
        ids = obj.input_ids or []
        batches = [ids] if obj.is_single else ids
        return [self.tm.detokenize(b) for b in batches]  # type: ignore[arg-type]

    async def create(
        self, req: CompletionRequest, request: ClientRequest | None, priority: int | None = None
    ) -> CompletionResponse:
        """`priority`: set by the server's own callers (a batch line runs below every client)."""
        obj = self.to_native(req, stream=False)
        if priority is not None:
            obj.priority = priority
        result = await self.tm.generate(obj, request)
        outputs = [result] if isinstance(result, dict) else result
        for out in outputs:
            raise_if_failed(out)
        prompts = self._prompt_texts(obj) if req.echo else None
        choices = []
        for i, out in enumerate(outputs):
            reason, matched = finish_reason(out)
            text = out["text"]
            if prompts is not None:
                text = prompts[i // req.n] + text
            choices.append(
                CompletionChoice(
                    index=i,
                    text=text,
                    logprobs=self._logprobs(out, req.echo) if req.logprobs is not None else None,
                    finish_reason=reason,
                    matched_stop=matched,
                    hidden_states=choice_hidden_states(out, req.return_hidden_states),
                )
            )
        model = req.model or self.served_names[0]
        return CompletionResponse(
            id=random_id("cmpl"), model=model, choices=choices, usage=usage(outputs, req.n)
        )

    async def stream(self, req: CompletionRequest, request: ClientRequest | None) -> AsyncIterator[bytes]:
        obj = self.to_native(req, stream=True)
        # Validates and waits for the first output: a 400 or a refusal (503) is answered as such.
        outputs = await first_output_checked(await self.tm.stream(obj, request))
        return sse_errors(self._stream_chunks(req, obj, outputs))

    async def _stream_chunks(
        self, req: CompletionRequest, obj: GenerateReqInput, outputs: AsyncIterator[dict[str, Any]]
    ) -> AsyncIterator[bytes]:
        rid, model = random_id("cmpl"), req.model or self.served_names[0]
        prompts = self._prompt_texts(obj) if req.echo else None
        sent: dict[int, int] = {}  # index -> chars of text already streamed
        finals: dict[int, dict[str, Any]] = {}
        async for out in outputs:
            idx = out["index"]
            delta = out["text"][sent.get(idx, 0) :]
            if prompts is not None and idx not in sent:
                delta = prompts[idx // req.n] + delta
            sent[idx] = len(out["text"])
            reason, matched = finish_reason(out)
            if reason is not None:
                finals[idx] = out
            choice = CompletionChoice(
                index=idx,
                text=delta,
                finish_reason=reason,
                matched_stop=matched,
                hidden_states=choice_hidden_states(out, req.return_hidden_states),
            )
            yield sse(CompletionResponse(id=rid, model=model, choices=[choice]))
            # A failed choice (aborted at shutdown, a dead child) first ends with finish_reason
            # "abort" like any other choice, then sse_errors sends the error event and [DONE].
            raise_if_failed(out)
        if req.stream_options is not None and req.stream_options.include_usage:
            ordered = [finals[i] for i in sorted(finals)]
            yield sse(CompletionResponse(id=rid, model=model, choices=[], usage=usage(ordered, req.n)))

    def _logprobs(self, out: dict[str, Any], echo: bool) -> CompletionLogprobs:
        meta = out["meta_info"]
        entries = (meta.get("input_token_logprobs", []) if echo else []) + meta.get(
            "output_token_logprobs", []
        )
        prompt_tops = meta.get("input_top_logprobs") or [None] * len(meta.get("input_token_logprobs", []))
        tops = (prompt_tops if echo else []) + meta.get("output_top_logprobs", [])
        result = CompletionLogprobs()
        offset = 0
        for i, (lp, tok, text) in enumerate(entries):
            token = text if text is not None else self.tm.detokenize([tok])
            result.tokens.append(token)
            result.token_logprobs.append(lp)
            result.text_offset.append(offset)
            offset += len(token)
            top = tops[i] if i < len(tops) else None
            result.top_logprobs.append(None if top is None else _top_dict(top, self.tm))
        return result


def _top_dict(top: list[list[Any]], tm: TokenizerManager) -> dict[str, float]:
    """Keyed by token text (OpenAI's shape). Tokens that decode alike (partial UTF-8 bytes) share
    a key: the most likely one keeps it (`top` is sorted by logprob, descending)."""
    out: dict[str, float] = {}
    for lp, tok, text in top:
        out.setdefault(text if text is not None else tm.detokenize([tok]), lp)
    return out
