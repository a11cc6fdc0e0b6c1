"""One HTTP request per benchmark prompt, for the native /generate and the OpenAI-compatible APIs.

Every backend streams Server-Sent Events ("data: {...}" lines, ending with "data: [DONE]") and
the client times each chunk that carries output: the first gives TTFT, the gaps between the
rest give ITL. Output token counts come from the server (meta_info / usage) when it reports them,
because counting chunks is wrong whenever a chunk carries several tokens.
"""

from __future__ import annotations

import json
import os
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from radixserve.benchmark_utils.datasets import Prompt
from radixserve.benchmark_utils.metrics import RequestFuncOutput


@dataclass
class RequestFuncInput:
    api_url: str
    prompt: Prompt
    prompt_len: int
    output_len: int
    model: str = ""
    stream: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)


@dataclass
class StreamState:
    """What has arrived so far on one stream."""

    text: str = ""
    chunks: int = 0  # output-carrying chunks
    server_tokens: int | None = None  # cumulative completion tokens, when the server reports them


class ServerError(RuntimeError):
    """The server answered 200 but put an error object in the body or stream."""


def merge_body(body: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`extra` on top of `body`; nested dicts (sampling_params, stream_options) merge one level."""
    out = dict(body)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def _raise_on_error(data: dict[str, Any]) -> None:
    if "error" in data and data["error"]:
        raise ServerError(json.dumps(data["error"])[:500])


class Backend(ABC):
    """Request shape and response parsing of one API; subclasses fill in the three methods."""

    name: str = ""
    path: str = ""
    accepts_token_ids: bool = True

    @abstractmethod
    def build_body(self, inp: RequestFuncInput) -> dict[str, Any]:
        """The JSON body of one request."""

    @abstractmethod
    def parse_chunk(self, data: dict[str, Any], state: StreamState) -> bool:
        """Fold one streamed JSON object into `state`; True if it carried new output."""

    @abstractmethod
    def parse_final(self, data: dict[str, Any], state: StreamState) -> None:
        """Fold a whole non-streamed response into `state`."""


class RadixServeBackend(Backend):
    """POST /generate; each chunk carries the cumulative text and meta_info.completion_tokens."""

    name = "radixserve"
    path = "/generate"

    def build_body(self, inp: RequestFuncInput) -> dict[str, Any]:
        key = "text" if isinstance(inp.prompt, str) else "input_ids"
        body = {
            key: inp.prompt,
            "sampling_params": {"max_new_tokens": inp.output_len, "temperature": 0.0, "ignore_eos": True},
            "stream": inp.stream,
        }
        return merge_body(body, inp.extra_body)

    def parse_chunk(self, data: dict[str, Any], state: StreamState) -> bool:
        _raise_on_error(data)
        text = data.get("text", "")
        count = (data.get("meta_info") or {}).get("completion_tokens")
        grew = len(text) > len(state.text)
        if count is not None:
            grew = count > (state.server_tokens or 0)
            state.server_tokens = count
        state.text = text
        return grew

    def parse_final(self, data: dict[str, Any], state: StreamState) -> None:
        self.parse_chunk(data, state)


class OpenAICompletionsBackend(Backend):
    """POST /v1/completions with stream_options.include_usage for an exact token count."""

    name = "openai"
    path = "/v1/completions"

    def _prompt_fields(self, inp: RequestFuncInput) -> dict[str, Any]:
        return {"prompt": inp.prompt}

    def build_body(self, inp: RequestFuncInput) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": inp.model,
            **self._prompt_fields(inp),
            "max_tokens": inp.output_len,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": inp.stream,
        }
        if inp.stream:
            body["stream_options"] = {"include_usage": True}
        return merge_body(body, inp.extra_body)

    def _piece(self, choice: dict[str, Any]) -> str:
        return choice.get("text") or ""

    def _final_piece(self, choice: dict[str, Any]) -> str:
        return choice.get("text") or ""

    def _read_usage(self, data: dict[str, Any], state: StreamState) -> None:
        usage = data.get("usage") or {}
        if usage.get("completion_tokens") is not None:
            state.server_tokens = int(usage["completion_tokens"])

    def parse_chunk(self, data: dict[str, Any], state: StreamState) -> bool:
        _raise_on_error(data)
        self._read_usage(data, state)
        choices = data.get("choices") or []
        piece = self._piece(choices[0]) if choices else ""
        state.text += piece
        return bool(piece)

    def parse_final(self, data: dict[str, Any], state: StreamState) -> None:
        _raise_on_error(data)
        self._read_usage(data, state)
        choices = data.get("choices") or []
        state.text = self._final_piece(choices[0]) if choices else ""


class OpenAIChatBackend(OpenAICompletionsBackend):
    """POST /v1/chat/completions; the prompt is one user message, so it must be text."""

    name = "openai-chat"
    path = "/v1/chat/completions"
    accepts_token_ids = False

    def _prompt_fields(self, inp: RequestFuncInput) -> dict[str, Any]:
        if not isinstance(inp.prompt, str):
            raise TypeError("openai-chat needs text prompts")
        return {"messages": [{"role": "user", "content": inp.prompt}]}

    def _piece(self, choice: dict[str, Any]) -> str:
        delta = choice.get("delta") or {}
        # Reasoning models stream thinking tokens separately; they are output tokens all the same.
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")

    def _final_piece(self, choice: dict[str, Any]) -> str:
        message = choice.get("message") or {}
        return (message.get("content") or "") + (message.get("reasoning_content") or "")


BACKENDS: dict[str, type[Backend]] = {
    "radixserve": RadixServeBackend,
    "sglang": RadixServeBackend,  # same native API
    "openai": OpenAICompletionsBackend,
    "openai-chat": OpenAIChatBackend,
}


def get_backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise ValueError(f"Unknown backend {name!r}; choose from {sorted(BACKENDS)}")
    return BACKENDS[name]()


def _sse_payloads(buffer: bytearray) -> tuple[list[str], bytearray]:
    """Complete "data:" payloads in `buffer`, and the unfinished tail to keep for the next read."""
    *lines, tail = bytes(buffer).split(b"\n")
    payloads = []
    for raw in lines:
        line = raw.strip()
        if line.startswith(b"data:"):
            payloads.append(line[len(b"data:") :].strip().decode("utf-8"))
    return payloads, bytearray(tail)


async def _read_stream(
    resp: aiohttp.ClientResponse, backend: Backend, out: RequestFuncOutput, start: float
) -> StreamState:
    state = StreamState()
    last = start
    buffer = bytearray()
    # Our own line splitting: aiohttp's readline caps line length, and cumulative-text chunks of a
    # long generation can exceed it.
    async for block in resp.content.iter_any():
        now = time.perf_counter()
        buffer += block
        payloads, buffer = _sse_payloads(buffer)
        for payload in payloads:
            if payload == "[DONE]":
                return state
            if not payload or not backend.parse_chunk(json.loads(payload), state):
                continue
            if state.chunks == 0:
                out.ttft = now - start
            else:
                out.itl.append(now - last)
            state.chunks += 1
            last = now
    return state


def _auth_headers() -> dict[str, str]:
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


async def send_request(
    session: aiohttp.ClientSession, backend: Backend, inp: RequestFuncInput
) -> RequestFuncOutput:
    """Send one request and time it; never raises, a failure is reported in the output."""
    out = RequestFuncOutput(prompt_len=inp.prompt_len)
    start = time.perf_counter()
    try:
        body = backend.build_body(inp)
        async with session.post(inp.api_url, json=body, headers=_auth_headers()) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return out
            if inp.stream:
                state = await _read_stream(resp, backend, out, start)
            else:
                state = StreamState()
                backend.parse_final(await resp.json(content_type=None), state)
        out.latency = time.perf_counter() - start
    except Exception as e:  # any failure of one request must not stop the run
        out.error = f"{type(e).__name__}: {e}"
        return out
    if not inp.stream:
        out.ttft = out.latency  # the whole answer is the first token's arrival
    out.generated_text = state.text
    out.output_len = _output_len(state, inp)
    if out.output_len <= 0:
        out.error = "the server returned no output tokens"
        return out
    out.success = True
    return out


def _output_len(state: StreamState, inp: RequestFuncInput) -> int:
    if state.server_tokens is not None:
        return state.server_tokens
    if inp.stream:
        return state.chunks  # one token per chunk is all we can assume without a count
    # Non-streamed and uncounted: ignore_eos makes the server produce exactly what was asked.
    return inp.output_len if state.text else 0
