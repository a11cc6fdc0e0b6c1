"""OpenAI protocol models, the OpenAI -> native mapping, and the 400 error envelope."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from radixserve.entrypoints.http_server import ServerState, create_app
from radixserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from radixserve.entrypoints.openai.serving_common import (
    ModelNotFoundError,
    check_model,
    sampling_params,
    usage,
)
from radixserve.managers.input_validation import InvalidRequestError
from radixserve.server_args import ServerArgs


class StubTokenizerManager:
    """Just what create_app reads; requests that pass validation never reach it in these tests."""

    def __init__(self) -> None:
        self.server_args = ServerArgs(model_path="/models/tiny", api_key=None)
        self.model_path = "/models/tiny"
        self.served_model_name = "tiny"
        self.context_len = 128
        self.metrics = None
        self.is_generation = True  # the Batch API's routes ask which endpoints the model serves


@pytest.fixture(scope="module")
def client() -> TestClient:
    # The Host check accepts the loopback names of the default bind address (127.0.0.1).
    app = create_app(ServerState(tm=StubTokenizerManager()))  # type: ignore[arg-type]
    return TestClient(app, base_url="http://localhost")


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", b"{broken"),
        ("/v1/completions", b'{"prompt": {"a": 1}}'),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": "many"}'),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": -1}'),
        ("/v1/completions", b'{"prompt": "x", "logprobs": 99}'),
        ("/v1/chat/completions", b'{"messages": []}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "x"}]}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "temperature": [1]}'),
        ("/v1/tokenize", b'{"prompt": 3}'),
        ("/generate", b'{"text": 1}'),
        ("/generate", b"not json"),
    ],
)
def test_validation_errors_are_400_envelopes(client: TestClient, path: str, body: bytes) -> None:
    resp = client.post(path, content=body, headers={"Content-Type": "application/json"})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == 400 and err["message"]
    assert set(err) == {"message", "type", "param", "code"}


def test_unknown_route_and_model_are_404(client: TestClient) -> None:
    assert client.get("/nope").json()["error"]["code"] == "not_found"
    resp = client.get("/v1/models/other")
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
    assert client.get("/v1/models/tiny").json()["id"] == "tiny"


@pytest.mark.parametrize("prompt", ["a", ["a", "b"], [1, 2], [[1], [2, 3]]])
def test_completion_prompt_forms(prompt: object) -> None:
    assert CompletionRequest(prompt=prompt).prompt == prompt


def test_sampling_params_mapping() -> None:
    req = ChatCompletionRequest(
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        temperature=0.5,
        top_p=0.9,
        seed=3,
        stop="END",
        min_tokens=2,
        top_k=5,
        ignore_eos=True,
        frequency_penalty=0.1,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
    )
    params = sampling_params(req, 7)
    assert params["max_new_tokens"] == 7 and params["stop"] == ["END"] and params["min_new_tokens"] == 2
    assert params["temperature"] == 0.5 and params["top_k"] == 5 and params["ignore_eos"] is True
    assert params["json_schema"] == '{"type": "object"}'
    assert "presence_penalty" not in params  # unset fields keep the native defaults
    assert req.messages[0].text() == "hi"
    assert sampling_params(CompletionRequest(prompt="x", logit_bias={"1": 2.0}), 1)["logit_bias"] == {
        "1": 2.0
    }


def test_structural_tag_response_format_and_field() -> None:
    """SGLang's response_format {"type": "structural_tag", structures, triggers} becomes the
    structural_tag sampling parameter; the extension field passes through as given."""
    fmt = {
        "type": "structural_tag",
        "structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}],
        "triggers": ["<f>"],
    }
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], response_format=fmt)
    assert json.loads(sampling_params(req, 4)["structural_tag"]) == fmt
    raw = '{"type": "structural_tag", "format": {"type": "const_string", "value": "x"}}'
    assert sampling_params(CompletionRequest(prompt="x", structural_tag=raw), 1)["structural_tag"] == raw
    empty = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}], response_format={"type": "structural_tag"}
    )
    with pytest.raises(InvalidRequestError, match="structures or format"):
        sampling_params(empty, 4)


def test_usage_counts_prompt_once_per_prompt() -> None:
    def out(prompt: int, completion: int, cached: int) -> dict:
        return {
            "meta_info": {"prompt_tokens": prompt, "completion_tokens": completion, "cached_tokens": cached}
        }

    u = usage([out(10, 3, 0), out(10, 4, 9), out(5, 1, 2), out(5, 2, 4)], n=2)
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (15, 10, 25)
    assert u.prompt_tokens_details.cached_tokens == 2


def test_check_model() -> None:
    check_model(None, ("tiny",))
    check_model("default", ("tiny",))
    with pytest.raises(ModelNotFoundError):
        check_model("gpt-9", ("tiny",))
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=[{"role": "user"}], n="x")
