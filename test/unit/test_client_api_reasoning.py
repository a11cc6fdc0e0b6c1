"""Reasoning through the Anthropic and Ollama routes, in process: the app over a scripted
TokenizerManager whose "model" reasons (`<think>...</think>` then an answer), with
--reasoning-parser qwen3. The built-in model never reasons, so the server tests cannot show
thinking blocks; here the whole HTTP path does (the `anthropic` client included)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from radixserve.entrypoints.http_server import ServerState, create_app
from radixserve.managers.input_validation import ModelLimits
from radixserve.server_args import ServerArgs

anthropic = pytest.importorskip("anthropic", reason="the anthropic client is a [test] extra")

OUTPUT = "<think>Paris is the capital.</think>\n\nIt is Paris."
PIECES = ["<thi", "nk>Paris is ", "the capital.</th", "ink>\n\nIt is", " Paris."]  # cumulative steps


class ChatTemplateTokenizer:
    chat_template = "{{ messages }}"  # only its presence is read

    def apply_chat_template(self, messages: list[dict], **kwargs: Any) -> str:  # noqa: ANN401
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]  # one token per character, as the scripted outputs count


class ReasoningTokenizerManager:
    """What the chat path uses of a TokenizerManager; every request "generates" OUTPUT."""

    def __init__(self) -> None:
        self.server_args = ServerArgs(model_path="/models/tiny", reasoning_parser="qwen3")
        self.model_path = "/models/tiny"
        self.served_model_name = "tiny"
        self.context_len = 128
        self.limits = ModelLimits(vocab_size=0x110000, context_len=128, max_req_input_len=127)  # text only
        self.metrics = None
        self.is_generation = True
        self.tokenizer = ChatTemplateTokenizer()

    async def run_blocking(self, fn: Callable[..., Any], *args: Any) -> Any:  # noqa: ANN401
        return fn(*args)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    @staticmethod
    def _output(text: str, finished: bool, prompt_len: int) -> dict[str, Any]:
        reason = {"type": "stop", "matched": 0} if finished else None
        meta = {
            "finish_reason": reason,
            "prompt_tokens": prompt_len,
            "completion_tokens": len(text),
            "cached_tokens": 0,
        }
        return {"text": text, "output_ids": [ord(c) for c in text], "meta_info": meta, "index": 0}

    def abort_request(self, rid: str) -> None:  # a Responses cancel: nothing runs here
        pass

    async def generate(self, obj: Any, request: Any) -> dict[str, Any]:  # noqa: ANN401
        return self._output(OUTPUT, True, len(obj.input_ids))

    async def stream(self, obj: Any, request: Any) -> AsyncIterator[dict[str, Any]]:  # noqa: ANN401
        async def outputs() -> AsyncIterator[dict[str, Any]]:
            text = ""
            for i, piece in enumerate(PIECES):
                text += piece
                yield self._output(text, i == len(PIECES) - 1, len(obj.input_ids))
                await asyncio.sleep(0)

        return outputs()


@pytest.fixture(scope="module")
def http() -> TestClient:
    app = create_app(ServerState(tm=ReasoningTokenizerManager(), ready=True))  # type: ignore[arg-type]
    return TestClient(app, base_url="http://127.0.0.1:30000")


def test_anthropic_thinking_blocks_whole_and_streamed(http: TestClient) -> None:
    client = anthropic.Anthropic(
        base_url="http://127.0.0.1:30000", api_key="x", http_client=http, max_retries=0
    )
    kwargs = {"model": "tiny", "max_tokens": 64, "messages": [{"role": "user", "content": "Capital?"}]}
    msg = client.messages.create(**kwargs)
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert (msg.content[0].thinking, msg.content[1].text) == ("Paris is the capital.", "It is Paris.")
    assert msg.stop_reason == "end_turn"
    events = list(client.messages.create(stream=True, **kwargs))
    deltas = [(e.index, e.delta.type) for e in events if e.type == "content_block_delta"]
    assert {d for d in deltas} == {(0, "thinking_delta"), (1, "text_delta")}
    thinking = "".join(e.delta.thinking for e in events if e.type == "content_block_delta" and e.index == 0)
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.index == 1)
    assert (thinking, text) == ("Paris is the capital.", "It is Paris.")
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text"]
    # thinking "disabled": the reasoning stays in the text, tags and all.
    inline = client.messages.create(thinking={"type": "disabled"}, **kwargs)
    assert [b.type for b in inline.content] == ["text"] and inline.content[0].text == OUTPUT


def test_ollama_think_whole_and_streamed(http: TestClient) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Capital?"}], "think": True}
    whole = http.post("/api/chat", json={**body, "stream": False}).json()
    assert (
        whole["message"]["thinking"] == "Paris is the capital."
        and whole["message"]["content"] == "It is Paris."
    )
    lines = [json.loads(line) for line in http.post("/api/chat", json=body).text.splitlines()]
    assert "".join(line["message"].get("thinking", "") for line in lines) == "Paris is the capital."
    assert "".join(line["message"]["content"] for line in lines) == "It is Paris."
    assert lines[-1]["done"] is True and lines[-1]["done_reason"] == "stop"
    generated = http.post(
        "/api/generate", json={"model": "tiny", "prompt": "Capital?", "stream": False}
    ).json()
    assert (generated["thinking"], generated["response"]) == ("Paris is the capital.", "It is Paris.")
    inline = http.post("/api/chat", json={**body, "think": False, "stream": False}).json()
    assert inline["message"]["content"] == OUTPUT and "thinking" not in inline["message"]


REASONING_TOKENS = len("<think>Paris is the capital.</think>")  # one token per character here


def test_usage_counts_reasoning_tokens(http: TestClient) -> None:
    """OpenAI's reasoning_tokens: chat's usage.completion_tokens_details (whole and in the stream's
    usage chunk) and Responses' usage.output_tokens_details."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Capital of France?"}]}
    whole = http.post("/v1/chat/completions", json=body).json()
    assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": REASONING_TOKENS}
    streamed = http.post(
        "/v1/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert chunks[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": REASONING_TOKENS}
    response = http.post("/v1/responses", json={"model": "tiny", "input": "Capital of France?"}).json()
    assert response["usage"]["output_tokens_details"] == {"reasoning_tokens": REASONING_TOKENS}


def test_reasoning_token_count_reads_a_single_end_token() -> None:
    """Where </think> is one token (Qwen3, DeepSeek-R1), the count runs through it exactly."""
    from radixserve.entrypoints.openai.reasoning import reasoning_token_count

    class OneTokenEnd:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [7] if text == "</think>" else [1] * len(text)

    text = "<think>abc</think>answer"
    assert reasoning_token_count(text, [5, 6, 8, 7, 9, 9], "qwen3", OneTokenEnd()) == 4
    assert reasoning_token_count("<think>still thinking", [5, 6, 8], "qwen3", OneTokenEnd()) == 3
    assert reasoning_token_count("just an answer", [5, 6], "qwen3", OneTokenEnd()) == 0
