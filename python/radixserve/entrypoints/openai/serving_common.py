"""Pieces shared by the completions and chat handlers: OpenAI -> native params, usage, SSE."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import orjson
from pydantic import BaseModel

from radixserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionTokensDetails,
    PromptTokensDetails,
    SamplingExtras,
    UsageInfo,
    error_body,
    error_type,
)
from radixserve.managers.tokenizer_manager import ClientDisconnected, InvalidRequestError, RequestAbortedError

logger = logging.getLogger(__name__)

# Fields copied verbatim (OpenAI name == SGLang name) when the client set them.
_PASS_THROUGH = tuple(
    "n temperature top_p top_k min_p seed frequency_penalty presence_penalty repetition_penalty "
    "ignore_eos stop_token_ids skip_special_tokens spaces_between_special_tokens no_stop_trim "
    "regex ebnf json_schema structural_tag logit_bias stop_regex".split()
)


class ModelNotFoundError(LookupError):
    """The request names a model this server does not serve (HTTP 404)."""


def check_model(name: str | None, served_names: tuple[str, ...]) -> None:
    # "default" is what many clients send when they do not care; accept it like an omitted name.
    if name is not None and name not in served_names and name != "default":
        raise ModelNotFoundError(f"The model `{name}` does not exist.")


def model_lora(name: str | None, served_names: tuple[str, ...]) -> str | None:
    """check_model, also for SGLang's "base:adapter" form: the LoRA adapter it names (None: the
    base model). Whether that adapter is loaded is the TokenizerManager's check (a 400)."""
    if name is not None and name not in served_names and ":" in name:
        base, _, adapter = name.rpartition(":")
        check_model(base, served_names)
        return adapter
    check_model(name, served_names)
    return None


def native_fields(req: SamplingExtras, served_names: tuple[str, ...], stream: bool) -> dict[str, Any]:
    """The GenerateReqInput fields completions and chat fill alike: the adapter `req.model` names,
    the request's id, replica and PD routing, and the extras passed through under their names."""
    passed = ("rid", "routed_dp_rank", "data_parallel_rank", "bootstrap_host", "bootstrap_port")
    passed += ("bootstrap_room", "disagg_prefill_dp_rank", "return_hidden_states", "cache_salt")
    return {
        **{name: getattr(req, name) for name in passed},
        "lora_path": model_lora(req.model, served_names),
        "stream": stream,
        "return_text_in_logprobs": True,  # the OpenAI logprobs name each token
    }


def sampling_params(req: SamplingExtras, max_new_tokens: int | None) -> dict[str, Any]:
    """Map an OpenAI request onto SGLang sampling parameters (unset fields keep their defaults)."""
    params: dict[str, Any] = {k: getattr(req, k) for k in _PASS_THROUGH if getattr(req, k) is not None}
    if req.stop is not None:
        params["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    if req.min_tokens is not None:
        params["min_new_tokens"] = req.min_tokens
    if max_new_tokens is not None:
        params["max_new_tokens"] = max_new_tokens
    if isinstance(req, ChatCompletionRequest) and req.response_format is not None:
        params.update(_response_format(req))
    return params


def _response_format(req: ChatCompletionRequest) -> dict[str, Any]:
    fmt = req.response_format
    assert fmt is not None
    if fmt.type == "json_object":
        return {"json_schema": '{"type": "object"}'}
    if fmt.type == "json_schema":
        schema = (fmt.json_schema or {}).get("schema")
        if schema is None:
            raise InvalidRequestError("response_format.json_schema.schema is required.")
        return {"json_schema": json.dumps(schema)}
    if fmt.type == "structural_tag":  # SGLang's extension: its structures and triggers
        if fmt.structures is None and fmt.format is None:
            raise InvalidRequestError("response_format of type structural_tag needs structures or format.")
        return {"structural_tag": fmt.model_dump_json(exclude_none=True)}
    return {}


def finish_reason(output: dict[str, Any]) -> tuple[str | None, int | str | None]:
    """OpenAI finish_reason and matched stop from a native output (None while unfinished)."""
    reason = output["meta_info"]["finish_reason"]
    if reason is None:
        return None, None
    kind = reason.get("type")
    if kind == "abort":
        return "abort", None
    return kind, reason.get("matched")


def choice_hidden_states(output: dict[str, Any], asked: bool) -> list[float] | None:
    """SGLang's choice field: the final hidden state of the last generated token ([] when the
    prompt's rows are all there is); None (left out) unless asked and finished."""
    states = output["meta_info"].get("hidden_states") if asked else None
    if states is None:
        return None
    return states[-1] if len(states) > 1 else []


def raise_if_failed(output: dict[str, Any]) -> None:
    """An abort with an HTTP status (queue full, server failure) becomes an error response."""
    reason = output["meta_info"]["finish_reason"] or {}
    if reason.get("type") == "abort" and reason.get("status_code"):
        raise RequestAbortedError(reason.get("message", "Request aborted."), int(reason["status_code"]))


def usage(outputs: list[dict[str, Any]], n: int, reasoning_tokens: int | None = None) -> UsageInfo:
    """Prompt tokens count once per prompt (the n samples share it); completions count per sample.
    `reasoning_tokens` (with a reasoning parser): the completions' tokens spent reasoning."""
    firsts = outputs[::n]
    prompt = sum(o["meta_info"]["prompt_tokens"] for o in firsts)
    completion = sum(o["meta_info"]["completion_tokens"] for o in outputs)
    cached = sum(o["meta_info"]["cached_tokens"] for o in firsts)
    details = None if reasoning_tokens is None else CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        completion_tokens_details=details,
    )


def sse(payload: BaseModel | dict[str, Any]) -> bytes:
    data = payload.model_dump(exclude_none=False) if isinstance(payload, BaseModel) else payload
    return b"data: " + orjson.dumps(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


async def in_band_errors(
    chunks: AsyncIterator[bytes], error_chunk: Callable[[int, str], bytes], what: str, last: bytes = b""
) -> AsyncIterator[bytes]:
    """Once streaming has started the status is sent, so errors go in-band: the chunk
    `error_chunk(status, message)` in the client family's shape, then `last` (if any). Every
    streaming route (OpenAI, Anthropic, Ollama) ends its stream here; `what` names it in the log."""
    try:
        async for chunk in chunks:
            yield chunk
    except ClientDisconnected:
        return  # logged and aborted where it was noticed; nobody is left to read anything
    except (ValueError, RequestAbortedError) as exc:
        yield error_chunk(getattr(exc, "status_code", 400), str(exc))
    except Exception as exc:  # unforeseen: the server's fault, said in-band like the others
        logger.exception("Unhandled %s in %s", type(exc).__name__, what)
        yield error_chunk(500, internal_error_message(exc))
    if last:
        yield last


def sse_errors(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """OpenAI's streams: an error in the error envelope, then [DONE]."""
    return in_band_errors(chunks, _sse_error, "a stream", SSE_DONE)


def internal_error_message(exc: BaseException) -> str:
    """A 500's text: the exception's type only (its message may hold internals), and where to look."""
    return f"Internal server error ({type(exc).__name__}); the server log has the details."


def _sse_error(code: int, message: str) -> bytes:
    return b"data: " + orjson.dumps(error_body(message, error_type(code), code)) + b"\n\n"


async def first_output_checked(outputs: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    """Wait for a stream's first output before any header is sent, so a request refused outright
    (queue full, waiting timeout, a dead child) answers its HTTP status (503) as a non-streaming
    call does, instead of a 200 stream with an in-band error. Failures later, or of another
    item of a batch, still arrive in-band."""
    try:
        first = await anext(outputs)
    except StopAsyncIteration:
        return _chain([], outputs)
    except BaseException:
        await outputs.aclose()  # aborts the call's requests
        raise
    try:
        raise_if_failed(first)
    except RequestAbortedError:
        await outputs.aclose()
        raise
    return _chain([first], outputs)


async def _chain(
    head: Iterable[dict[str, Any]], rest: AsyncIterator[dict[str, Any]]
) -> AsyncIterator[dict[str, Any]]:
    try:
        for out in head:
            yield out
        async for out in rest:
            yield out
    finally:
        await rest.aclose()  # type: ignore[attr-defined]
